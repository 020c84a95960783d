// TransformerModel: its parameters and their initialisation, the workspace
// of one (B, T) shape and its byte count, and loading a micro-batch.
#include "server/engine/model/transformer/transformer_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "kernels/float16.h"
#include "server/engine/model/init.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

namespace {

// (B, T) with B >= 1 and 1 <= T <= the longest sequence.
absl::Status CheckInputShape(const TransformerParts& p, const kernels::Shape& shape) {
  if (shape.size() != 2 || shape[0] < 1 || shape[1] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: a transformer takes (B, T) token ids with B, T >= 1, got ",
                     kernels::ShapeToString(shape)));
  }
  if (shape[1] > p.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: T = ", shape[1], " exceeds ", p.names.max_positions_field, " ", p.max_positions));
  }
  return absl::OkStatus();
}

// PEFT's name of block l's adapter matrix ("lora_A" or "lora_B") on
// kLoraModules[module].
std::string AdapterName(int64_t l, int module, const char* matrix) {
  const char* branch = module <= 3 ? "self_attn" : "mlp";
  return absl::StrCat("base_model.model.model.layers.", l, ".", branch, ".", kLoraModules[module],
                      ".", matrix, ".weight");
}

}  // namespace

absl::StatusOr<int64_t> TransformerWorkspaceBytes(const ModelSpec& spec, Precision precision,
                                                  const kernels::Shape& input_shape,
                                                  int64_t lm_head_chunk_bytes) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  const std::optional<TransformerParts> parts = TransformerPartsOf(spec);
  if (!parts.has_value()) return absl::InvalidArgumentError("model: not a transformer");
  const TransformerParts& s = *parts;
  AMPD_RETURN_IF_ERROR(CheckInputShape(s, input_shape));
  const Widths wd(s);
  const int64_t b = input_shape[0];
  const int64_t t = input_shape[1];
  const auto w = static_cast<int64_t>(kernels::SizeOf(WorkingDType(precision)));
  const bool grouped = s.grouped();
  bool ok = true;
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = product({b, t});
  const int64_t chunk_rows = LmHeadChunkRows(s.vocab, precision, n, lm_head_chunk_bytes);
  const bool head_sum = w != 4 && chunk_rows < n;
  // A norm's statistics: rstd, and a LayerNorm's mean.
  const int64_t stats = s.layer_norm() ? 2 : 1;
  // The MLP's saved (N, I) activations: gate, up, act; or GELU's pre, post.
  const int64_t mlp_saved = s.gated() ? 3 : 2;
  // Per block: ln_1, resid, ln_2 (3 N C); qkv, its expansion, attn_y; the
  // MLP's; lse (B, H, T) and the two norms' statistics, F32; with qk_norm,
  // qkv_pre and the norms' rstd (N, H + K) F32.
  const int64_t qk_heads = s.heads + s.kv_heads;
  int64_t block = 0;
  for (int64_t part :
       {product({3, n, wd.c, w}), product({n, wd.qkv, w}), grouped ? product({3, n, wd.q, w}) : 0,
        product({n, wd.q, w}), product({mlp_saved, n, wd.i, w}), product({b, s.heads, t, 4}),
        product({2 * stats, n, 4}), s.qk_norm ? product({n, wd.qkv, w}) : 0,
        s.qk_norm ? product({n, qk_heads, 4}) : 0,
        s.sandwich_norms ? product({2, n, wd.c, w}) : 0,  // attn_o, mlp_o
        s.sandwich_norms ? product({2, n, 4}) : 0}) {     // their rstd
    ok = ok && CheckedAdd(block, part, &block);
  }
  // LoRA: each block's u of its targets (N r each), the stacked q|k|v
  // adapters and their gradients, dL/du; and no gradient scratch of the
  // frozen base (the stacked q|k|v weight's, the head's F32 sum).
  const bool frozen = s.lora.has_value();
  const int64_t rank = frozen ? s.lora->rank : 0;
  const LoraTargets targets = LoraTargetsOf(s);
  if (frozen) {
    ok = ok && CheckedAdd(block, product({n, rank, targets.qkv + targets.others, w}), &block);
  }
  int64_t total = product({s.layers, block});
  // The stacked q|k|v weight and bias, and their gradients (three separate
  // projections only).
  const int64_t stacked_qkv = s.fused_qkv ? 0 : (frozen ? 1 : 2);
  const int64_t qkv_bias = s.qkv_bias ? wd.qkv : 0;
  const int64_t stacked_rank = product({targets.qkv, rank});
  for (int64_t part : {
           product({s.layers + 2, n, wd.c, w}),              // x_0..x_L and the final norm's
           product({stats, n, 4}),                           // its statistics
           product({s.sandwich_norms ? 4 : 3, n, wd.c, w}),  // d_res, d_tmp, d_ln, d_branch
           wd.q == wd.c ? 0 : product({n, wd.q, w}),         // d_attn, unless d_tmp holds it
           product({n, wd.qkv, w}),                          // d_qkv
           grouped ? product({3, n, wd.q, w}) : 0,           // d_qkv_x
           product({s.gated() ? 3 : 1, n, wd.i, w}),         // d_gate (d_act, d_up)
           product({stacked_qkv, wd.qkv, wd.c, w}),          // w_qkv, dw_qkv
           product({stacked_qkv, qkv_bias, w}),              // b_qkv, db_qkv
           product({2, stacked_rank, wd.c + wd.qkv, w}),     // LoRA's stacked A, B, dA, dB
           frozen ? product({n, std::max<int64_t>(stacked_rank, rank), w}) : 0,  // lora_du
           product({s.any_slides() ? 2 : 1, static_cast<int64_t>(s.inv_freq.size()), 4}),
           product({chunk_rows, wd.v, w}),                      // one chunk of logits
           head_sum && !frozen ? product({wd.v, wd.c, 4}) : 0,  // the LM head's F32 gradient sum
           product({2, n, 8}),                                  // ids and targets, I64 at most
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

kernels::ScratchExtents TransformerScratchExtents(const ModelSpec& spec, Precision precision,
                                                  const kernels::Shape& input_shape, bool backward,
                                                  int64_t lm_head_chunk_bytes) {
  const TransformerParts s = *TransformerPartsOf(spec);
  const Widths wd(s);
  kernels::ScratchExtents e;
  e.dtype = WorkingDType(precision);
  const int64_t n = SaturatingMul(input_shape[0], input_shape[1]);
  const int64_t widest = std::max({wd.c, wd.qkv, SaturatingMul(3, wd.q), wd.i});
  const int64_t activations = SaturatingMul(n, widest);
  const int64_t block_weights =
      std::max({SaturatingMul(wd.qkv, wd.c), SaturatingMul(wd.c, wd.q), SaturatingMul(wd.i, wd.c)});
  e.gemm_a = std::max(activations, backward ? block_weights : 0);
  e.gemm_b = std::max(backward ? activations : 0, block_weights);
  e.gemm_c = std::max(activations, backward ? block_weights : 0);
  e.bias_activation_c = activations;  // the projections' forward, fused
  // d of the GELU MLP's GELU, in its GEMM's epilogue.
  e.activation_backward_c = backward && !s.gated() ? SaturatingMul(n, wd.i) : 0;
  AddLmHeadExtents(wd.v, wd.c, precision, n, lm_head_chunk_bytes, backward, e);
  e.attention_seq = input_shape[1];
  e.head_dim = wd.d;
  return e;
}

std::vector<int> TransformerModel::BlockParams::All() const {
  std::vector<int> all;
  for (const int i : {input_norm.weight,
                      input_norm.bias,
                      q_weight,
                      q_bias,
                      k_weight,
                      k_bias,
                      v_weight,
                      v_bias,
                      o_weight,
                      o_bias,
                      q_norm,
                      k_norm,
                      attn_out_norm,
                      post_norm.weight,
                      post_norm.bias,
                      gate,
                      up,
                      up_bias,
                      down,
                      down_bias,
                      mlp_out_norm}) {
    if (i >= 0) all.push_back(i);
  }
  for (const Adapter& adapter : lora) {
    if (!adapter.present()) continue;
    all.push_back(adapter.a);
    all.push_back(adapter.b);
  }
  return all;
}

TransformerModel::TransformerModel(const ModelSpec& spec, TransformerParts parts,
                                   Precision precision, kernels::Backend& backend,
                                   int64_t lm_head_chunk_bytes)
    : Network(spec, precision, backend),
      parts_(std::move(parts)),
      lm_head_chunk_bytes_(lm_head_chunk_bytes),
      residual_grad_scale_(static_cast<size_t>(parts_.layers), 1.0f) {
  for (int64_t l = 0; l < parts_.layers; ++l) {
    block_group_.push_back(static_cast<int>(GptBlockScaleGroup(l, parts_.layers)));
  }
  if (parts_.scale_embeddings) {
    // torch.tensor(hidden_size**0.5) (fp32), then .to(the weights' dtype).
    const auto scale = static_cast<float>(std::sqrt(static_cast<double>(parts_.hidden)));
    switch (WorkingDType(precision)) {
      case DType::kF16:
        embed_scale_ = kernels::RoundToHalf(scale);
        break;
      case DType::kBF16:
        embed_scale_ = kernels::RoundToBf16(scale);
        break;
      default:
        embed_scale_ = scale;
    }
  }
}

kernels::AttentionOptions TransformerModel::AttentionOptionsOf(size_t l) const {
  kernels::AttentionOptions options;
  if (parts_.query_pre_attn_scalar > 0.0f) {
    // Python's query_pre_attn_scalar**-0.5 in double, a float32 operand.
    options.scale =
        static_cast<float>(std::pow(static_cast<double>(parts_.query_pre_attn_scalar), -0.5));
  }
  if (parts_.layer_slides(l)) options.window = parts_.sliding_window;
  return options;
}

absl::Status TransformerModel::Norm(const Tensor& x, NormParams norm, Tensor& y, Tensor& mean,
                                    Tensor& rstd) {
  const Tensor& weight = Value(norm.weight);
  if (parts_.layer_norm()) {
    return backend_.LayerNormForward(x, &weight, ValueOrNull(norm.bias), parts_.norm_eps, y, mean,
                                     rstd);
  }
  return backend_.RmsNormForward(x, weight, parts_.norm_eps, parts_.norm_offset, y, rstd);
}

absl::Status TransformerModel::NormBackward(const Tensor& x, NormParams norm, const Tensor& mean,
                                            const Tensor& rstd, const Tensor& dy, Tensor& dx) {
  const Tensor& weight = Value(norm.weight);
  if (parts_.layer_norm()) {
    return backend_.LayerNormBackward(x, &weight, mean, rstd, dy, dx, GradOrNull(norm.weight),
                                      norm.bias >= 0 ? GradOrNull(norm.bias) : nullptr);
  }
  return backend_.RmsNormBackward(x, weight, parts_.norm_offset, rstd, dy, dx,
                                  GradOrNull(norm.weight));
}

std::vector<int> TransformerModel::ParamScaleGroups() const {
  const int last = block_group_.back();
  std::vector<int> groups(params().size(), last);  // the final norm, an untied head
  groups[static_cast<size_t>(embed_)] = 0;
  if (positions_ >= 0) groups[static_cast<size_t>(positions_)] = 0;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (const int index : blocks_[l].All()) groups[static_cast<size_t>(index)] = block_group_[l];
  }
  return groups;
}

absl::Status TransformerModel::SetGroupScales(absl::Span<const float> scales) {
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
  head_grad_alpha_ = parts_.tied_head ? ratio(scales.front(), scales.back()) : 1.0f;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TransformerModel>> TransformerModel::Create(
    const ModelSpec& spec, Precision precision, uint64_t seed, kernels::Backend& backend,
    int64_t lm_head_chunk_bytes, std::shared_ptr<const FrozenBase> base) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  std::optional<TransformerParts> parts = TransformerPartsOf(spec);
  if (!parts.has_value()) return absl::InvalidArgumentError("model: not a transformer");
  if (lm_head_chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head_chunk_bytes: must be >= 1, got ", lm_head_chunk_bytes));
  }
  std::unique_ptr<TransformerModel> m(
      new TransformerModel(spec, *std::move(parts), precision, backend, lm_head_chunk_bytes));
  const TransformerParts& s = m->parts_;
  const TransformerNames& names = s.names;
  if (s.sandwich_norms && s.layer_norm()) {
    // The output norms keep an rstd only (transformer_workspace.h).
    return absl::UnimplementedError("transformer: sandwich norms are RMSNorms");
  }
  if (base != nullptr) {
    if (!s.lora.has_value()) {
      return absl::InvalidArgumentError("base_model: only a LoRA decoder shares a base's weights");
    }
    m->UseFrozenBase(std::move(base));
  }
  const Widths wd(s);
  const ParamInit normal{true, NormalInit(seed, 0, s.init_std)};
  const ParamInit residual{true, NormalInit(seed, 0, s.residual_init_std)};
  ParamInit zeros;
  // Norm weights start at 1, or at 0 where an RMSNorm scales by 1 + w
  // (Gemma3RMSNorm's zeros): the identity scale either way.
  ParamInit norm_init;
  norm_init.value = 1.0f - s.norm_offset;
  // Gradients that only accumulate (+=): the embeddings (scatter-add, and a
  // tied head), the position table (only its first T rows are written),
  // the norms' weights and biases (q_norm and k_norm too) and an untied LM
  // head (lm_head.h's contract); every projection's GEMM writes its own on
  // the first micro-batch.
  const bool kPlusEqual = true;
  const bool kGemm = false;
  // A LoRA job's base is frozen: no gradient, so nothing to accumulate.
  const bool frozen = s.lora.has_value();
  auto add = [&](const std::string& name, const kernels::Shape& shape, const ParamInit& init,
                 bool plus_equal) {
    return frozen ? m->AddFrozenParameter(name, shape, init)
                  : m->AddParameter(name, shape, init, plus_equal);
  };
  // A norm's weight and, for a LayerNorm, its bias.
  auto add_norm = [&](const std::string& name, NormParams& norm) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(norm.weight, add(name + ".weight", {wd.c}, norm_init, kPlusEqual));
    if (s.layer_norm()) {
      AMPD_ASSIGN_OR_RETURN(norm.bias, add(name + ".bias", {wd.c}, zeros, kPlusEqual));
    }
    return absl::OkStatus();
  };
  // A projection (out, in) in the family's layout, and its bias.
  auto add_projection = [&](const std::string& name, int64_t out, int64_t in, const ParamInit& init,
                            bool bias, int& weight_index, int& bias_index) -> absl::Status {
    const kernels::Shape shape =
        s.layout == WeightLayout::kLinear ? kernels::Shape{out, in} : kernels::Shape{in, out};
    AMPD_ASSIGN_OR_RETURN(weight_index, add(name + ".weight", shape, init, kGemm));
    if (!bias) return absl::OkStatus();
    AMPD_ASSIGN_OR_RETURN(bias_index, add(name + ".bias", {out}, zeros, kGemm));
    return absl::OkStatus();
  };
  AMPD_ASSIGN_OR_RETURN(m->embed_, add(names.embed + ".weight", {wd.v, wd.c}, normal, kPlusEqual));
  if (s.learned_positions()) {
    AMPD_ASSIGN_OR_RETURN(m->positions_, add(names.positions + ".weight", {s.max_positions, wd.c},
                                             normal, kPlusEqual));
  }
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat(names.layer, l, ".");
    BlockParams b;
    AMPD_RETURN_IF_ERROR(add_norm(p + names.input_norm, b.input_norm));
    if (s.fused_qkv) {
      AMPD_RETURN_IF_ERROR(
          add_projection(p + names.qkv, wd.qkv, wd.c, normal, s.qkv_bias, b.q_weight, b.q_bias));
    } else {
      AMPD_RETURN_IF_ERROR(
          add_projection(p + names.q, wd.q, wd.c, normal, s.qkv_bias, b.q_weight, b.q_bias));
      AMPD_RETURN_IF_ERROR(
          add_projection(p + names.k, wd.kv, wd.c, normal, s.qkv_bias, b.k_weight, b.k_bias));
      AMPD_RETURN_IF_ERROR(
          add_projection(p + names.v, wd.kv, wd.c, normal, s.qkv_bias, b.v_weight, b.v_bias));
    }
    AMPD_RETURN_IF_ERROR(
        add_projection(p + names.o, wd.c, wd.q, residual, s.o_bias, b.o_weight, b.o_bias));
    if (s.qk_norm) {
      AMPD_ASSIGN_OR_RETURN(b.q_norm,
                            add(p + names.q_norm + ".weight", {wd.d}, norm_init, kPlusEqual));
      AMPD_ASSIGN_OR_RETURN(b.k_norm,
                            add(p + names.k_norm + ".weight", {wd.d}, norm_init, kPlusEqual));
    }
    if (s.sandwich_norms) {
      AMPD_ASSIGN_OR_RETURN(
          b.attn_out_norm, add(p + names.attn_out_norm + ".weight", {wd.c}, norm_init, kPlusEqual));
    }
    AMPD_RETURN_IF_ERROR(add_norm(p + names.post_norm, b.post_norm));
    int no_bias = -1;
    if (s.gated()) {
      AMPD_RETURN_IF_ERROR(
          add_projection(p + names.gate, wd.i, wd.c, normal, s.mlp_bias, b.gate, no_bias));
    }
    AMPD_RETURN_IF_ERROR(
        add_projection(p + names.up, wd.i, wd.c, normal, s.mlp_bias, b.up, b.up_bias));
    AMPD_RETURN_IF_ERROR(
        add_projection(p + names.down, wd.c, wd.i, residual, s.mlp_bias, b.down, b.down_bias));
    if (s.sandwich_norms) {
      AMPD_ASSIGN_OR_RETURN(b.mlp_out_norm,
                            add(p + names.mlp_out_norm + ".weight", {wd.c}, norm_init, kPlusEqual));
    }
    m->blocks_.push_back(b);
  }
  AMPD_RETURN_IF_ERROR(add_norm(names.final_norm, m->norm_));
  if (!s.tied_head) {
    AMPD_ASSIGN_OR_RETURN(m->lm_head_,
                          add(names.lm_head + ".weight", {wd.v, wd.c}, normal, kPlusEqual));
  }
  AMPD_RETURN_IF_ERROR(m->CheckFrozenBaseUsed());
  if (frozen) {
    const LoraSpec& adapters = *s.lora;
    m->lora_scale_ = adapters.alpha / static_cast<float>(adapters.rank);
    for (int module = 0; module < kModules; ++module) {
      const auto& targets = adapters.target_modules;
      if (module <= kV &&
          std::find(targets.begin(), targets.end(), kLoraModules[module]) != targets.end()) {
        m->qkv_targets_.push_back(static_cast<Module>(module));
      }
    }
    for (int64_t l = 0; l < s.layers; ++l) {
      BlockParams& b = m->blocks_[static_cast<size_t>(l)];
      for (int module = 0; module < kModules; ++module) {
        const auto& targets = adapters.target_modules;
        if (std::find(targets.begin(), targets.end(), kLoraModules[module]) == targets.end()) {
          continue;
        }
        // The (out, in) of q, k, v, o, gate, up, down.
        const int64_t outs[kModules] = {wd.q, wd.kv, wd.kv, wd.c, wd.i, wd.i, wd.c};
        const int64_t ins[kModules] = {wd.c, wd.c, wd.c, wd.q, wd.c, wd.c, wd.i};
        const int64_t out = outs[module];
        const int64_t in = ins[module];
        // The stream is the parameter's index, as every parameter's.
        const ParamInit kaiming{true, LinearUniformInit(seed, 0, in)};
        Adapter& adapter = b.lora[static_cast<size_t>(module)];
        AMPD_ASSIGN_OR_RETURN(adapter.a, m->AddParameter(AdapterName(l, module, "lora_A"),
                                                         {adapters.rank, in}, kaiming, kGemm));
        AMPD_ASSIGN_OR_RETURN(adapter.b, m->AddParameter(AdapterName(l, module, "lora_B"),
                                                         {out, adapters.rank}, zeros, kGemm));
      }
    }
  }
  AMPD_RETURN_IF_ERROR(m->CastWorking());
  return m;
}

absl::StatusOr<int64_t> TransformerModel::BytesFor(const kernels::Shape& input_shape) const {
  return TransformerWorkspaceBytes(spec(), precision(), input_shape, lm_head_chunk_bytes_);
}

absl::StatusOr<std::unique_ptr<Workspace>> TransformerModel::NewWorkspace(
    const kernels::Shape& input_shape) {
  const TransformerParts& s = parts_;
  AMPD_RETURN_IF_ERROR(CheckInputShape(s, input_shape));
  const Widths wd(s);
  const bool grouped = s.grouped();
  auto owned = std::make_unique<TransformerWorkspace>();
  TransformerWorkspace& ws = *owned;
  ws.batch = input_shape[0];
  ws.seq = input_shape[1];
  ws.rows = ws.batch * ws.seq;  // BytesFor checked every product first
  ws.chunk_rows = LmHeadChunkRows(s.vocab, precision(), ws.rows, lm_head_chunk_bytes_);
  const int64_t n = ws.rows;
  const DType w = working_dtype();
  const RowAllocator alloc{backend_, s, n};
  AMPD_RETURN_IF_ERROR(alloc.Upload(s.inv_freq, ws.inv_freq));
  AMPD_RETURN_IF_ERROR(alloc.Upload(s.inv_freq_local, ws.inv_freq_local));
  ws.x.resize(static_cast<size_t>(s.layers + 1));
  for (Tensor& t : ws.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, t));
  ws.blocks.resize(static_cast<size_t>(s.layers));
  for (TransformerWorkspace::Block& b : ws.blocks) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.ln_1));
    AMPD_RETURN_IF_ERROR(alloc.Stats(b.mean_1, b.rstd_1));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, b.qkv));
    if (s.qk_norm) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, b.qkv_pre));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.heads}, b.rstd_q));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.kv_heads}, b.rstd_k));
    }
    if (grouped) AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * wd.q}, b.qkv_x));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {ws.batch, s.heads, ws.seq}, b.lse));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, b.attn_y));
    if (s.sandwich_norms) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.attn_o));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_ao));
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.mlp_o));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_mo));
    }
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.resid));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.ln_2));
    AMPD_RETURN_IF_ERROR(alloc.Stats(b.mean_2, b.rstd_2));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, b.gate));
    if (s.gated()) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, b.up));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, b.act));
    if (!lora()) continue;
    const int64_t rank = s.lora->rank;
    if (!qkv_targets_.empty()) {
      AMPD_RETURN_IF_ERROR(
          alloc(w, {n, static_cast<int64_t>(qkv_targets_.size()) * rank}, b.lora_u_qkv));
    }
    for (int module = kO; module < kModules; ++module) {
      if (!blocks_.front().lora[static_cast<size_t>(module)].present()) continue;
      AMPD_RETURN_IF_ERROR(alloc(w, {n, rank}, b.lora_u[static_cast<size_t>(module - kO)]));
    }
  }
  if (lora()) {
    const int64_t rank = s.lora->rank;
    const int64_t stacked = static_cast<int64_t>(qkv_targets_.size()) * rank;
    if (stacked > 0) {
      AMPD_RETURN_IF_ERROR(alloc(w, {stacked, wd.c}, ws.stack.lora_a));
      AMPD_RETURN_IF_ERROR(alloc(w, {stacked, wd.c}, ws.lora_da_qkv));
      AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, stacked}, ws.stack.lora_b));
      AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, stacked}, ws.lora_db_qkv));
      // Only the diagonal blocks are ever written (StackQkvAdapters).
      AMPD_RETURN_IF_ERROR(backend_.Fill(ws.stack.lora_b, 0.0f));
    }
    AMPD_RETURN_IF_ERROR(alloc(w, {n, std::max(stacked, rank)}, ws.lora_du));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.ln_f));
  AMPD_RETURN_IF_ERROR(alloc.Stats(ws.mean_f, ws.rstd_f));
  if (!s.fused_qkv) {
    AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, ws.stack.w));
    if (!lora()) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, ws.dw_qkv));
    if (s.qkv_bias) {
      AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, ws.stack.b));
      if (!lora()) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, ws.db_qkv));
    }
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_res));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_tmp));
  if (s.sandwich_norms) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_branch));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_ln));
  if (wd.q == wd.c) {
    // The attention output's gradient lives in d_tmp (transformer_workspace.h).
    AMPD_ASSIGN_OR_RETURN(ws.d_attn, ws.d_tmp.View(0, {n, wd.q}));
  } else {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, ws.d_attn));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, ws.d_qkv));
  if (grouped) AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * wd.q}, ws.d_qkv_x));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_gate));
  if (s.gated()) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_act));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_up));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {ws.chunk_rows, wd.v}, ws.logits));
  if (w != DType::kF32 && ws.chunk_rows < n && !lora()) {
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {wd.v, wd.c}, ws.head_grad));
  }
  return std::unique_ptr<Workspace>(std::move(owned));
}

absl::Status TransformerModel::LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                                         const TokenLossInputs& tokens, Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * ws, Own<TransformerWorkspace>(any));
  return LoadTokenBatch(backend_, inputs, targets, tokens, *ws);
}

Tensor* TransformerModel::GradOrNull(int index) {
  Parameter& p = params()[static_cast<size_t>(index)];
  return p.frozen ? nullptr : &p.grad;
}

absl::Status TransformerModel::CopyQkv(const BlockParams& p, bool grads, bool to_params,
                                       Tensor& weight, Tensor* bias) {
  const Widths wd(parts_);
  const int64_t offsets[] = {0, wd.q, wd.q + wd.kv};
  const int64_t rows[] = {wd.q, wd.kv, wd.kv};
  const int weights[] = {p.q_weight, p.k_weight, p.v_weight};
  const int biases[] = {p.q_bias, p.k_bias, p.v_bias};
  auto copy = [&](int index, Tensor& stacked) -> absl::Status {
    Parameter& param = params()[static_cast<size_t>(index)];
    if (to_params) return backend_.Copy(stacked, param.grad);
    return backend_.Copy(grads ? param.grad : param.value(), stacked);
  };
  for (int j = 0; j < 3; ++j) {
    AMPD_ASSIGN_OR_RETURN(Tensor block, weight.View(offsets[j] * wd.c, {rows[j], wd.c}));
    AMPD_RETURN_IF_ERROR(copy(weights[j], block));
    if (bias == nullptr) continue;
    AMPD_ASSIGN_OR_RETURN(Tensor part, bias->View(offsets[j], {rows[j]}));
    AMPD_RETURN_IF_ERROR(copy(biases[j], part));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
