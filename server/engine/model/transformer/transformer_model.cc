// TransformerModel: its parameters and their initialisation, the workspace of
// one (B, T) shape and its byte count, and loading a micro-batch.
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
#include "server/engine/model/transformer/transformer_workspace.h"
#include "server/engine/model/transformer/rope_frequencies.h"
#include "server/engine/model/init.h"
#include "server/engine/model/lm_head.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

namespace {

// (B, T) with B >= 1 and 1 <= T <= max_position_embeddings.
absl::Status CheckInputShape(const DecoderSpec& d, const kernels::Shape& shape) {
  if (shape.size() != 2 || shape[0] < 1 || shape[1] < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: a decoder takes (B, T) token ids with B, T >= 1, got ",
                     kernels::ShapeToString(shape)));
  }
  if (shape[1] > d.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: T = ", shape[1], " exceeds max_position_embeddings ", d.max_position_embeddings));
  }
  return absl::OkStatus();
}

using Widths = DecoderWidths;

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
  if (!spec.decoder.has_value()) return absl::InvalidArgumentError("decoder: not set");
  const DecoderSpec& s = *spec.decoder;
  AMPD_RETURN_IF_ERROR(CheckInputShape(s, input_shape));
  const Widths wd(s);
  const int64_t b = input_shape[0];
  const int64_t t = input_shape[1];
  const auto w = static_cast<int64_t>(kernels::SizeOf(WorkingDType(precision)));
  const bool grouped = s.num_key_value_heads < s.num_attention_heads;
  bool ok = true;
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = product({b, t});
  const int64_t chunk_rows = LmHeadChunkRows(s.vocab_size, precision, n, lm_head_chunk_bytes);
  const bool head_sum = w != 4 && chunk_rows < n;
  // Per block: ln_1, resid, ln_2 (3 N C); qkv, its expansion, attn_y; gate,
  // up, act (3 N I); lse (B, H, T) and two rstd (N), F32; with qk_norm,
  // qkv_pre and the norms' rstd (N, H + K) F32.
  const int64_t qk_heads = s.num_attention_heads + s.num_key_value_heads;
  int64_t block = 0;
  for (int64_t part :
       {product({3, n, wd.c, w}), product({n, wd.qkv, w}), grouped ? product({3, n, wd.q, w}) : 0,
        product({n, wd.q, w}), product({3, n, wd.i, w}), product({b, s.num_attention_heads, t, 4}),
        product({2, n, 4}), s.qk_norm ? product({n, wd.qkv, w}) : 0,
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
  int64_t total = product({s.num_hidden_layers, block});
  const int64_t qkv_bias = s.qkv_bias ? wd.qkv : 0;
  const int64_t stacked_rank = product({targets.qkv, rank});
  for (int64_t part : {
           product({s.num_hidden_layers + 2, n, wd.c, w}),   // x_0..x_L and the final norm's
           product({n, 4}),                                  // its rstd
           product({s.sandwich_norms ? 4 : 3, n, wd.c, w}),  // d_res, d_tmp, d_ln, d_branch
           product({n, wd.q, w}),                            // d_attn
           product({n, wd.qkv, w}),                          // d_qkv
           grouped ? product({3, n, wd.q, w}) : 0,           // d_qkv_x
           product({3, n, wd.i, w}),                         // d_act, d_gate, d_up
           product({frozen ? 1 : 2, wd.qkv, wd.c, w}),       // w_qkv, dw_qkv
           product({frozen ? 1 : 2, qkv_bias, w}),           // b_qkv, db_qkv
           product({2, stacked_rank, wd.c + wd.qkv, w}),     // LoRA's stacked A, B, dA, dB
           frozen ? product({n, std::max<int64_t>(stacked_rank, rank), w}) : 0,  // lora_du
           product({SlidingLayers(s) ? 2 : 1, wd.d / 2, 4}),    // inv_freq, inv_freq_local
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
  const DecoderSpec& s = *spec.decoder;
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
  AddLmHeadExtents(wd.v, wd.c, precision, n, lm_head_chunk_bytes, backward, e);
  e.attention_seq = input_shape[1];
  e.head_dim = wd.d;
  return e;
}

std::vector<int> TransformerModel::BlockParams::All() const {
  std::vector<int> all;
  for (const int i :
       {input_norm, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight, o_bias, q_norm,
        k_norm, attn_out_norm, post_norm, gate, up, down, mlp_out_norm}) {
    if (i >= 0) all.push_back(i);
  }
  for (const Adapter& adapter : lora) {
    if (!adapter.present()) continue;
    all.push_back(adapter.a);
    all.push_back(adapter.b);
  }
  return all;
}

TransformerModel::TransformerModel(const ModelSpec& spec, Precision precision, kernels::Backend& backend,
                           int64_t lm_head_chunk_bytes)
    : Network(spec, precision, backend),
      lm_head_chunk_bytes_(lm_head_chunk_bytes),
      residual_grad_scale_(static_cast<size_t>(spec.decoder->num_hidden_layers), 1.0f) {
  const int64_t layers = spec.decoder->num_hidden_layers;
  for (int64_t l = 0; l < layers; ++l) {
    block_group_.push_back(static_cast<int>(GptBlockScaleGroup(l, layers)));
  }
  const DecoderSpec& s = *spec.decoder;
  inv_freq_ = RopeInverseFrequencies(s);
  if (SlidingLayers(s)) {
    // The sliding layers' RoPE: rope_local_theta, unscaled (Gemma 3's
    // rope_parameters["sliding_attention"], rope_local_base_freq in 4.x).
    DecoderSpec local = s;
    local.rope_theta = s.rope_local_theta;
    local.rope_scaling = RopeScaling{};
    inv_freq_local_ = RopeInverseFrequencies(local);
  }
  if (s.scale_embeddings) {
    // torch.tensor(hidden_size**0.5) (fp32), then .to(the weights' dtype).
    const auto scale = static_cast<float>(std::sqrt(static_cast<double>(s.hidden_size)));
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
  const DecoderSpec& s = decoder();
  kernels::AttentionOptions options;
  if (s.query_pre_attn_scalar > 0.0f) {
    // Python's query_pre_attn_scalar**-0.5 in double, a float32 operand.
    options.scale =
        static_cast<float>(std::pow(static_cast<double>(s.query_pre_attn_scalar), -0.5));
  }
  if (DecoderLayerSlides(s, l)) options.window = s.sliding_window;
  return options;
}

absl::Status TransformerModel::Norm(const Tensor& x, int weight, Tensor& y, Tensor& rstd) {
  const DecoderSpec& s = decoder();
  return backend_.RmsNormForward(x, params()[static_cast<size_t>(weight)].value(), s.rms_norm_eps,
                                 DecoderNormOffset(s), y, rstd);
}

absl::Status TransformerModel::NormBackward(const Tensor& x, int weight, const Tensor& rstd,
                                        const Tensor& dy, Tensor& dx) {
  return backend_.RmsNormBackward(x, params()[static_cast<size_t>(weight)].value(),
                                  DecoderNormOffset(decoder()), rstd, dy, dx, GradOrNull(weight));
}

std::vector<int> TransformerModel::ParamScaleGroups() const {
  const int last = block_group_.back();
  std::vector<int> groups(params().size(), last);  // the final norm, an untied head
  groups[static_cast<size_t>(embed_)] = 0;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (const int index : blocks_[l].All()) groups[static_cast<size_t>(index)] = block_group_[l];
  }
  return groups;
}

absl::Status TransformerModel::SetGroupScales(absl::Span<const float> scales) {
  AMPD_RETURN_IF_ERROR(CheckGroupScaleCount(scales));
  // Ratios of powers of two: exact (GptModel::SetGroupScales).
  auto ratio = [](float to, float from) {
    return static_cast<float>(static_cast<double>(to) / static_cast<double>(from));
  };
  residual_grad_scale_[0] = 1.0f;
  for (size_t l = 1; l < residual_grad_scale_.size(); ++l) {
    residual_grad_scale_[l] = ratio(scales[static_cast<size_t>(block_group_[l - 1])],
                                    scales[static_cast<size_t>(block_group_[l])]);
  }
  head_grad_alpha_ = decoder().tie_word_embeddings ? ratio(scales.front(), scales.back()) : 1.0f;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TransformerModel>> TransformerModel::Create(
    const ModelSpec& spec, Precision precision, uint64_t seed, kernels::Backend& backend,
    int64_t lm_head_chunk_bytes, std::shared_ptr<const FrozenBase> base) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (!spec.decoder.has_value()) return absl::InvalidArgumentError("decoder: not set");
  if (lm_head_chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head_chunk_bytes: must be >= 1, got ", lm_head_chunk_bytes));
  }
  std::unique_ptr<TransformerModel> m(new TransformerModel(spec, precision, backend, lm_head_chunk_bytes));
  const DecoderSpec& s = *spec.decoder;
  if (base != nullptr) {
    if (!s.lora.has_value()) {
      return absl::InvalidArgumentError("base_model: only a LoRA decoder shares a base's weights");
    }
    m->UseFrozenBase(std::move(base));
  }
  const Widths wd(s);
  const ParamInit normal{true, NormalInit(seed, 0, s.initializer_range)};
  ParamInit zeros;
  // RMSNorm weights start at 1, or at 0 where the norm scales by 1 + w
  // (Gemma3RMSNorm's zeros): the identity scale either way.
  ParamInit norm_init;
  norm_init.value = s.norm_unit_offset ? 0.0f : 1.0f;
  // Gradients that only accumulate (+=): the embedding (scatter-add, and a
  // tied head), the RMSNorm weights (q_norm and k_norm too) and an untied LM head (gpt_lm_head.cc's
  // contract); every projection's GEMM writes its own on the first
  // micro-batch.
  const bool kPlusEqual = true;
  const bool kGemm = false;
  // A LoRA job's base is frozen: no gradient, so nothing to accumulate.
  const bool frozen = s.lora.has_value();
  auto add = [&](const std::string& name, const kernels::Shape& shape, const ParamInit& init,
                 bool plus_equal) {
    return frozen ? m->AddFrozenParameter(name, shape, init)
                  : m->AddParameter(name, shape, init, plus_equal);
  };
  AMPD_ASSIGN_OR_RETURN(m->embed_,
                        add("model.embed_tokens.weight", {wd.v, wd.c}, normal, kPlusEqual));
  for (int64_t l = 0; l < s.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    BlockParams b;
    AMPD_ASSIGN_OR_RETURN(b.input_norm,
                          add(p + "input_layernorm.weight", {wd.c}, norm_init, kPlusEqual));
    const struct {
      const char* name;
      int64_t rows;
      int* weight;
      int* bias;
    } projections[] = {{"q_proj", wd.q, &b.q_weight, &b.q_bias},
                       {"k_proj", wd.kv, &b.k_weight, &b.k_bias},
                       {"v_proj", wd.kv, &b.v_weight, &b.v_bias}};
    for (const auto& proj : projections) {
      const std::string name = absl::StrCat(p, "self_attn.", proj.name);
      AMPD_ASSIGN_OR_RETURN(*proj.weight, add(name + ".weight", {proj.rows, wd.c}, normal, kGemm));
      if (s.qkv_bias) {
        AMPD_ASSIGN_OR_RETURN(*proj.bias, add(name + ".bias", {proj.rows}, zeros, kGemm));
      }
    }
    AMPD_ASSIGN_OR_RETURN(b.o_weight,
                          add(p + "self_attn.o_proj.weight", {wd.c, wd.q}, normal, kGemm));
    if (s.o_bias) {
      AMPD_ASSIGN_OR_RETURN(b.o_bias, add(p + "self_attn.o_proj.bias", {wd.c}, zeros, kGemm));
    }
    if (s.qk_norm) {
      AMPD_ASSIGN_OR_RETURN(b.q_norm,
                            add(p + "self_attn.q_norm.weight", {wd.d}, norm_init, kPlusEqual));
      AMPD_ASSIGN_OR_RETURN(b.k_norm,
                            add(p + "self_attn.k_norm.weight", {wd.d}, norm_init, kPlusEqual));
    }
    if (s.sandwich_norms) {
      AMPD_ASSIGN_OR_RETURN(b.attn_out_norm, add(p + "post_attention_layernorm.weight", {wd.c},
                                                 norm_init, kPlusEqual));
    }
    AMPD_ASSIGN_OR_RETURN(b.post_norm,
                          add(p + (s.sandwich_norms ? "pre_feedforward_layernorm.weight"
                                                    : "post_attention_layernorm.weight"),
                              {wd.c}, norm_init, kPlusEqual));
    AMPD_ASSIGN_OR_RETURN(b.gate, add(p + "mlp.gate_proj.weight", {wd.i, wd.c}, normal, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.up, add(p + "mlp.up_proj.weight", {wd.i, wd.c}, normal, kGemm));
    AMPD_ASSIGN_OR_RETURN(b.down, add(p + "mlp.down_proj.weight", {wd.c, wd.i}, normal, kGemm));
    if (s.sandwich_norms) {
      AMPD_ASSIGN_OR_RETURN(b.mlp_out_norm, add(p + "post_feedforward_layernorm.weight", {wd.c},
                                                norm_init, kPlusEqual));
    }
    m->blocks_.push_back(b);
  }
  AMPD_ASSIGN_OR_RETURN(m->norm_, add("model.norm.weight", {wd.c}, norm_init, kPlusEqual));
  if (!s.tie_word_embeddings) {
    AMPD_ASSIGN_OR_RETURN(m->lm_head_, add("lm_head.weight", {wd.v, wd.c}, normal, kPlusEqual));
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
    for (int64_t l = 0; l < s.num_hidden_layers; ++l) {
      BlockParams& b = m->blocks_[static_cast<size_t>(l)];
      for (int module = 0; module < kModules; ++module) {
        const auto& targets = adapters.target_modules;
        if (std::find(targets.begin(), targets.end(), kLoraModules[module]) == targets.end()) {
          continue;
        }
        const auto [out, in] = DecoderProjectionShape(s, kLoraModules[module]);
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
  const DecoderSpec& s = decoder();
  AMPD_RETURN_IF_ERROR(CheckInputShape(s, input_shape));
  const Widths wd(s);
  const bool grouped = s.num_key_value_heads < s.num_attention_heads;
  auto owned = std::make_unique<TransformerWorkspace>();
  TransformerWorkspace& ws = *owned;
  ws.batch = input_shape[0];
  ws.seq = input_shape[1];
  ws.rows = ws.batch * ws.seq;  // BytesFor checked every product first
  ws.chunk_rows = LmHeadChunkRows(s.vocab_size, precision(), ws.rows, lm_head_chunk_bytes_);
  const int64_t n = ws.rows;
  const DType w = working_dtype();
  auto alloc = [&](DType dtype, const kernels::Shape& shape, Tensor& t) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(t, backend_.Allocate(dtype, shape));
    return absl::OkStatus();
  };
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {wd.d / 2}, ws.inv_freq));
  AMPD_RETURN_IF_ERROR(
      backend_.CopyFromHost(inv_freq_.data(), inv_freq_.size() * sizeof(float), ws.inv_freq));
  if (!inv_freq_local_.empty()) {
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {wd.d / 2}, ws.inv_freq_local));
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(
        inv_freq_local_.data(), inv_freq_local_.size() * sizeof(float), ws.inv_freq_local));
  }
  ws.x.resize(static_cast<size_t>(s.num_hidden_layers + 1));
  for (Tensor& t : ws.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, t));
  ws.blocks.resize(static_cast<size_t>(s.num_hidden_layers));
  for (TransformerWorkspace::Block& b : ws.blocks) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.ln_1));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_1));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, b.qkv));
    if (s.qk_norm) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, b.qkv_pre));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.num_attention_heads}, b.rstd_q));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.num_key_value_heads}, b.rstd_k));
    }
    if (grouped) AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * wd.q}, b.qkv_x));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {ws.batch, s.num_attention_heads, ws.seq}, b.lse));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, b.attn_y));
    if (s.sandwich_norms) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.attn_o));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_ao));
      AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.mlp_o));
      AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_mo));
    }
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.resid));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, b.ln_2));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, b.rstd_2));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, b.gate));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, b.up));
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
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, ws.rstd_f));
  AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, ws.stack.w));
  if (!lora()) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, ws.dw_qkv));
  if (s.qkv_bias) {
    AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, ws.stack.b));
    if (!lora()) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, ws.db_qkv));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_res));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_tmp));
  if (s.sandwich_norms) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_branch));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, ws.d_ln));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, ws.d_attn));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, ws.d_qkv));
  if (grouped) AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * wd.q}, ws.d_qkv_x));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_act));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_gate));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, ws.d_up));
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

absl::Status TransformerModel::CopyQkv(const BlockParams& p, bool grads, bool to_params, Tensor& weight,
                                   Tensor* bias) {
  const Widths wd(decoder());
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
