// GptModel: its parameters and their initialisation, the workspace of one
// (B, T) shape and its byte count, and loading a micro-batch.
#include "server/engine/model/gpt/gpt_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_workspace.h"
#include "server/engine/model/init.h"
#include "server/engine/model/lm_head.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

namespace {

constexpr float kInitStddev = 0.02f;

// (B, T) with B >= 1 and 1 <= T <= context_length.
absl::Status CheckInputShape(const GptSpec& gpt, const kernels::Shape& shape) {
  if (shape.size() != 2 || shape[0] < 1 || shape[1] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: a GPT takes (B, T) token ids with B, T >= 1, got ",
                     kernels::ShapeToString(shape)));
  }
  if (shape[1] > gpt.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: T = ", shape[1], " exceeds context_length ", gpt.context_length));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> GptWorkspaceBytes(const ModelSpec& spec, Precision precision,
                                          const kernels::Shape& input_shape,
                                          int64_t lm_head_chunk_bytes) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (!spec.gpt.has_value()) return absl::InvalidArgumentError("gpt: not set");
  const GptSpec& g = *spec.gpt;
  AMPD_RETURN_IF_ERROR(CheckInputShape(g, input_shape));
  const int64_t b = input_shape[0];
  const int64_t t = input_shape[1];
  const int64_t c = g.d_model;
  const int64_t h = g.mlp_ratio * c;  // validated: no overflow
  const auto w = static_cast<int64_t>(kernels::SizeOf(WorkingDType(precision)));
  bool ok = true;
  // a * b * c * d, remembering any overflow.
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = product({b, t});
  const int64_t chunk_rows = LmHeadChunkRows(g.vocab_size, precision, n, lm_head_chunk_bytes);
  // The F32 sum of a 16-bit head's chunks (gpt_lm_head.cc); one chunk, or
  // an fp32 head, adds straight into the gradient.
  const bool head_sum = w != 4 && chunk_rows < n;
  // Per block: ln_1, attn_y, resid, ln_2 (4 N C), qkv (3 N C), fc pre/post
  // (2 N H), the attention's lse (B, n_head, T) F32, and four (N) F32
  // statistics.
  int64_t block = 0;
  for (int64_t part : {product({7, n, c, w}), product({2, n, h, w}), product({b, g.n_head, t, 4}),
                       product({4, n, 4})}) {
    ok = ok && CheckedAdd(block, part, &block);
  }
  int64_t total = product({g.n_layer, block});
  for (int64_t part : {
           product({g.n_layer + 2, n, c, w}),             // x_0..x_L and ln_f's output
           product({2, n, 4}),                            // ln_f's mean and rstd
           product({6, n, c, w}),                         // d_res, d_tmp, d_ln, d_qkv (3 N C)
           product({n, h, w}),                            // d_pre
           product({chunk_rows, g.vocab_size, w}),        // one chunk of logits
           head_sum ? product({g.vocab_size, c, 4}) : 0,  // the LM head's F32 gradient sum
           product({2, n, 8}),                            // ids and targets, I64 at most
           product({5, n, 4}),  // a token loss's per-token inputs, log-probs, losses (lm_head.h)
       }) {
    ok = ok && CheckedAdd(total, part, &total);
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batches: inputs ", kernels::ShapeToString(input_shape),
                     " through this model need more than 2^63 bytes"));
  }
  return total;
}

kernels::ScratchExtents GptScratchExtents(const ModelSpec& spec, Precision precision,
                                          const kernels::Shape& input_shape, bool backward,
                                          int64_t lm_head_chunk_bytes) {
  const GptSpec& g = *spec.gpt;
  kernels::ScratchExtents e;
  e.dtype = WorkingDType(precision);
  const int64_t n = SaturatingMul(input_shape[0], input_shape[1]);
  const int64_t c = g.d_model;
  const int64_t h = SaturatingMul(g.mlp_ratio, c);
  const int64_t widest = std::max({SaturatingMul(3, c), h});  // a block's widest activation
  const int64_t activations = SaturatingMul(n, widest);
  const int64_t block_weights = SaturatingMul(c, widest);
  // The blocks' GEMMs: activations times weights into activations, and
  // backward activations times activations into weight gradients.
  e.gemm_a = activations;
  e.gemm_b = std::max(backward ? activations : 0, block_weights);
  e.gemm_c = std::max(activations, backward ? block_weights : 0);
  e.bias_activation_c = activations;
  e.activation_backward_c = backward ? SaturatingMul(n, h) : 0;  // d of GELU(c_fc)
  AddLmHeadExtents(g.vocab_size, c, precision, n, lm_head_chunk_bytes, backward, e);
  e.attention_seq = input_shape[1];
  e.head_dim = c / g.n_head;
  return e;
}

GptModel::GptModel(const ModelSpec& spec, Precision precision, kernels::Backend& backend,
                   int64_t lm_head_chunk_bytes)
    : Network(spec, precision, backend),
      lm_head_chunk_bytes_(lm_head_chunk_bytes),
      residual_grad_scale_(static_cast<size_t>(spec.gpt->n_layer), 1.0f) {
  for (int64_t l = 0; l < spec.gpt->n_layer; ++l) {
    block_group_.push_back(static_cast<int>(GptBlockScaleGroup(l, spec.gpt->n_layer)));
  }
}

std::vector<int> GptModel::ParamScaleGroups() const {
  const int last = block_group_.back();
  std::vector<int> groups(params().size(), last);  // ln_f, an untied head
  groups[static_cast<size_t>(wte_)] = 0;
  groups[static_cast<size_t>(wpe_)] = 0;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (const int index : blocks_[l].All()) {
      groups[static_cast<size_t>(index)] = block_group_[l];
    }
  }
  return groups;
}

absl::Status GptModel::SetGroupScales(absl::Span<const float> scales) {
  AMPD_RETURN_IF_ERROR(CheckGroupScaleCount(scales));
  // Ratios of powers of two: exact in double and in float while they are
  // normal floats.
  auto ratio = [](float to, float from) {
    return static_cast<float>(static_cast<double>(to) / static_cast<double>(from));
  };
  residual_grad_scale_[0] = 1.0f;
  for (size_t l = 1; l < residual_grad_scale_.size(); ++l) {
    residual_grad_scale_[l] = ratio(scales[static_cast<size_t>(block_group_[l - 1])],
                                    scales[static_cast<size_t>(block_group_[l])]);
  }
  head_grad_alpha_ = gpt().tie_embeddings ? ratio(scales.front(), scales.back()) : 1.0f;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GptModel>> GptModel::Create(const ModelSpec& spec,
                                                           Precision precision, uint64_t seed,
                                                           kernels::Backend& backend,
                                                           int64_t lm_head_chunk_bytes) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (!spec.gpt.has_value()) return absl::InvalidArgumentError("gpt: not set");
  if (lm_head_chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head_chunk_bytes: must be >= 1, got ", lm_head_chunk_bytes));
  }
  std::unique_ptr<GptModel> m(new GptModel(spec, precision, backend, lm_head_chunk_bytes));
  const GptSpec& g = *spec.gpt;
  const int64_t c = g.d_model;
  const int64_t h = g.mlp_ratio * c;
  const ParamInit normal{true, NormalInit(seed, 0, kInitStddev)};
  const ParamInit residual{
      true, NormalInit(
                seed, 0,
                static_cast<float>(kInitStddev / std::sqrt(2.0 * static_cast<double>(g.n_layer))))};
  ParamInit zeros;
  ParamInit ones;
  ones.value = 1.0f;
  // Gradients that only accumulate (+=): the embeddings (scatter-add, and
  // the tied LM head), the position table (only its first T rows are
  // written), LayerNorms and an untied LM head (its GEMM adds into it, in
  // one rounding per micro-batch: gpt_lm_head.cc).
  const bool kPlusEqual = true;
  const bool kGemm = false;
  auto add = [&](const std::string& name, const kernels::Shape& shape, const ParamInit& init,
                 bool plus_equal) { return m->AddParameter(name, shape, init, plus_equal); };
  AMPD_ASSIGN_OR_RETURN(m->wte_,
                        add("transformer.wte.weight", {g.vocab_size, c}, normal, kPlusEqual));
  AMPD_ASSIGN_OR_RETURN(m->wpe_,
                        add("transformer.wpe.weight", {g.context_length, c}, normal, kPlusEqual));
  for (int64_t i = 0; i < g.n_layer; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i, ".");
    BlockParams b{};
    AMPD_ASSIGN_OR_RETURN(b.ln_1_weight, add(p + "ln_1.weight", {c}, ones, kPlusEqual));
    AMPD_ASSIGN_OR_RETURN(b.ln_1_bias, add(p + "ln_1.bias", {c}, zeros, kPlusEqual));
    AMPD_ASSIGN_OR_RETURN(b.c_attn_weight,
                          add(p + "attn.c_attn.weight", {c, 3 * c}, normal, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.c_attn_bias, add(p + "attn.c_attn.bias", {3 * c}, zeros, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.attn_proj_weight,
                          add(p + "attn.c_proj.weight", {c, c}, residual, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.attn_proj_bias, add(p + "attn.c_proj.bias", {c}, zeros, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.ln_2_weight, add(p + "ln_2.weight", {c}, ones, kPlusEqual));
    AMPD_ASSIGN_OR_RETURN(b.ln_2_bias, add(p + "ln_2.bias", {c}, zeros, kPlusEqual));
    AMPD_ASSIGN_OR_RETURN(b.c_fc_weight, add(p + "mlp.c_fc.weight", {c, h}, normal, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.c_fc_bias, add(p + "mlp.c_fc.bias", {h}, zeros, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.mlp_proj_weight, add(p + "mlp.c_proj.weight", {h, c}, residual, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.mlp_proj_bias, add(p + "mlp.c_proj.bias", {c}, zeros, kGemm));
    m->blocks_.push_back(b);
  }
  AMPD_ASSIGN_OR_RETURN(m->ln_f_weight_, add("transformer.ln_f.weight", {c}, ones, kPlusEqual));
  AMPD_ASSIGN_OR_RETURN(m->ln_f_bias_, add("transformer.ln_f.bias", {c}, zeros, kPlusEqual));
  if (!g.tie_embeddings) {
    AMPD_ASSIGN_OR_RETURN(m->lm_head_,
                          add("lm_head.weight", {g.vocab_size, c}, normal, kPlusEqual));
  }
  AMPD_RETURN_IF_ERROR(m->CastWorking());
  return m;
}

absl::StatusOr<int64_t> GptModel::BytesFor(const kernels::Shape& input_shape) const {
  return GptWorkspaceBytes(spec(), precision(), input_shape, lm_head_chunk_bytes_);
}

absl::StatusOr<std::unique_ptr<Workspace>> GptModel::NewWorkspace(
    const kernels::Shape& input_shape) {
  AMPD_RETURN_IF_ERROR(CheckInputShape(gpt(), input_shape));
  const GptSpec& g = gpt();
  auto owned = std::make_unique<GptWorkspace>();
  GptWorkspace& ws = *owned;
  ws.batch = input_shape[0];
  ws.seq = input_shape[1];
  ws.rows = ws.batch * ws.seq;  // BytesFor checked every product first
  ws.chunk_rows = LmHeadChunkRows(g.vocab_size, precision(), ws.rows, lm_head_chunk_bytes_);
  const int64_t n = ws.rows;
  const int64_t c = g.d_model;
  const int64_t h = g.mlp_ratio * c;
  const DType w = working_dtype();
  auto alloc = [&](DType dtype, const kernels::Shape& shape, Tensor& t) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(t, backend_.Allocate(dtype, shape));
    return absl::OkStatus();
  };
  ws.x.resize(static_cast<size_t>(g.n_layer + 1));
  for (Tensor& t : ws.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, t));
  ws.blocks.resize(static_cast<size_t>(g.n_layer));
  for (GptWorkspace::Block& b : ws.blocks) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, b.ln_1));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.mean_1));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_1));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * c}, b.qkv));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {ws.batch, g.n_head, ws.seq}, b.lse));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, b.attn_y));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, b.resid));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, b.ln_2));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.mean_2));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_2));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, h}, b.fc_pre));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, h}, b.fc_post));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, ws.ln_f));
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, ws.mean_f));
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, ws.rstd_f));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, ws.d_res));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, ws.d_tmp));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, ws.d_ln));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, h}, ws.d_pre));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * c}, ws.d_qkv));
  AMPD_RETURN_IF_ERROR(alloc(w, {ws.chunk_rows, g.vocab_size}, ws.logits));
  if (w != DType::kF32 && ws.chunk_rows < n) {
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {g.vocab_size, c}, ws.head_grad));
  }
  return std::unique_ptr<Workspace>(std::move(owned));
}

absl::Status GptModel::LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                                 const TokenLossInputs& tokens, Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * ws, Own<GptWorkspace>(any));
  return LoadTokenBatch(backend_, inputs, targets, tokens, *ws);
}

}  // namespace ampd::engine::model
