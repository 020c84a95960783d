// Model spec validation and the derived sizes (input/output widths,
// parameter count) the Trainer and the service need before building anything.
#include "server/engine/config/model_spec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checked_math.h"
#include "common/overloaded.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

absl::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kFp16:
      return "fp16";
    case Precision::kBf16:
      return "bf16";
  }
  return "?";
}

codec::DType WorkingDType(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return codec::DType::kF32;
    case Precision::kFp16:
      return codec::DType::kF16;
    case Precision::kBf16:
      return codec::DType::kBF16;
  }
  return codec::DType::kF32;
}

absl::string_view LayerKindName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kLinear:
      return "linear";
    case LayerKind::kReLU:
      return "relu";
    case LayerKind::kGELU:
      return "gelu";
    case LayerKind::kTanh:
      return "tanh";
    case LayerKind::kLayerNorm:
      return "layer_norm";
    case LayerKind::kEmbedding:
      return "embedding";
  }
  return "?";
}

namespace {

bool IsElementwise(LayerKind kind) {
  return kind == LayerKind::kReLU || kind == LayerKind::kGELU || kind == LayerKind::kTanh;
}

// Width a layer expects on its input; 0 for element-wise layers (any width).
int64_t LayerInWidth(const LayerSpec& layer) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return layer.in_features;
    case LayerKind::kLayerNorm:
      return layer.normalized_shape;
    default:
      return 0;
  }
}

int64_t LayerOutWidth(const LayerSpec& layer, int64_t in_width) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return layer.out_features;
    case LayerKind::kLayerNorm:
      return layer.normalized_shape;
    case LayerKind::kEmbedding:
      return layer.embedding_dim;
    default:
      return in_width;
  }
}

// Elements of the layer's parameters (weight and bias), saturating at
// INT64_MAX when the product overflows.
int64_t LayerParameterCount(const LayerSpec& layer) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return SaturatingAdd(SaturatingMul(layer.in_features, layer.out_features),
                           layer.bias ? layer.out_features : 0);
    case LayerKind::kLayerNorm:
      return layer.elementwise_affine ? SaturatingMul(2, layer.normalized_shape) : 0;
    case LayerKind::kEmbedding:
      return SaturatingMul(layer.num_embeddings, layer.embedding_dim);
    default:
      return 0;
  }
}

absl::Status Positive(int64_t value, size_t i, absl::string_view field) {
  if (value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers[", i, "].", field, ": must be > 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status GptPositive(int64_t value, absl::string_view field) {
  if (value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("gpt.", field, ": must be > 0, got ", value));
  }
  return absl::OkStatus();
}

// A size derived from the spec's fields, refused when it overflows or
// exceeds kMaxParameters (every buffer and byte count multiplies it again).
absl::Status GptSize(bool ok, int64_t value, absl::string_view field, absl::string_view what) {
  if (!ok || value > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat("gpt.", field, ": gives ", what, " more than ",
                                                   kMaxParameters, " (2^56) elements"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGptSpec(const ModelSpec& spec, const GptSpec& g) {
  if (!spec.layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: must be empty when gpt is set, got ", spec.layers.size(), " layers"));
  }
  if (spec.loss != LossKind::kCrossEntropy) {
    return absl::InvalidArgumentError("loss: a GPT's loss is the token cross-entropy");
  }
  AMPD_RETURN_IF_ERROR(GptPositive(g.vocab_size, "vocab_size"));
  AMPD_RETURN_IF_ERROR(GptPositive(g.context_length, "context_length"));
  AMPD_RETURN_IF_ERROR(GptPositive(g.d_model, "d_model"));
  AMPD_RETURN_IF_ERROR(GptPositive(g.n_layer, "n_layer"));
  AMPD_RETURN_IF_ERROR(GptPositive(g.n_head, "n_head"));
  AMPD_RETURN_IF_ERROR(GptPositive(g.mlp_ratio, "mlp_ratio"));
  if (g.d_model % g.n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt.n_head: must divide d_model ", g.d_model, ", got ", g.n_head));
  }
  if (!std::isfinite(g.layer_norm_eps) || g.layer_norm_eps <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt.layer_norm_eps: must be finite and > 0, got ", g.layer_norm_eps));
  }
  struct Derived {
    int64_t a, b;
    absl::string_view field, what;
  };
  // d_model's own products first: a d_model too large by itself is blamed
  // on d_model, not on the mlp_ratio it is later multiplied with.
  const Derived derived[] = {
      {3, SaturatingMul(g.d_model, g.d_model), "d_model", "the attention's c_attn weight"},
      {g.mlp_ratio, g.d_model, "mlp_ratio", "the MLP's hidden width (mlp_ratio * d_model)"},
      {g.mlp_ratio, SaturatingMul(g.d_model, g.d_model), "mlp_ratio", "the MLP's weights"},
      {g.vocab_size, g.d_model, "vocab_size", "the token embedding (vocab_size * d_model)"},
      {g.context_length, g.d_model, "context_length",
       "the position embedding (context_length * d_model)"},
  };
  for (const Derived& d : derived) {
    int64_t v = 0;
    const bool ok = CheckedMul(d.a, d.b, &v);
    AMPD_RETURN_IF_ERROR(GptSize(ok, v, d.field, d.what));
  }
  if (GptParameterCount(g) > kMaxParameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt: the model has more than ", kMaxParameters, " (2^56) parameters"));
  }
  if (!std::isfinite(spec.loss_multiplier) || spec.loss_multiplier <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_multiplier: must be finite and > 0, got ", spec.loss_multiplier));
  }
  return absl::OkStatus();
}

absl::Status DecoderField(bool ok, absl::string_view field, absl::string_view rule,
                          const std::string& got) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("decoder.", field, ": ", rule, ", got ", got));
}

absl::Status ValidateLoraSpec(const DecoderSpec& d) {
  const LoraSpec& lora = *d.lora;
  if (lora.target_modules.empty()) {
    return absl::InvalidArgumentError(
        "decoder.lora.target_modules: must name at least one projection, got none");
  }
  int64_t narrowest = INT64_MAX;
  for (size_t i = 0; i < lora.target_modules.size(); ++i) {
    const std::string& name = lora.target_modules[i];
    const std::string field = absl::StrCat("lora.target_modules[", i, "]");
    const auto [out, in] = DecoderProjectionShape(d, name);
    AMPD_RETURN_IF_ERROR(DecoderField(
        out > 0, field, absl::StrCat("must be one of ", absl::StrJoin(kLoraModules, ", ")),
        absl::StrCat("\"", name, "\"")));
    for (size_t j = 0; j < i; ++j) {
      AMPD_RETURN_IF_ERROR(DecoderField(lora.target_modules[j] != name, field,
                                        absl::StrCat("repeats target_modules[", j, "]"),
                                        absl::StrCat("\"", name, "\"")));
    }
    narrowest = std::min({narrowest, out, in});
  }
  AMPD_RETURN_IF_ERROR(DecoderField(
      lora.rank >= 1 && lora.rank <= narrowest, "lora.rank",
      absl::StrCat("must be >= 1 and <= ", narrowest, " (the narrowest target's min(in, out))"),
      absl::StrCat(lora.rank)));
  return DecoderField(std::isfinite(lora.alpha) && lora.alpha > 0.0f && lora.alpha <= kMaxLoraAlpha,
                      "lora.alpha", absl::StrCat("must be in (0, ", kMaxLoraAlpha, "]"),
                      absl::StrCat(lora.alpha));
}

// The scaling's fields its type reads: linear a factor >= 1 (Hugging
// Face's own check); llama3 that and 0 < low_freq_factor < high_freq_factor
// with original_max_position_embeddings > 0 (the blend divides by their
// difference and by the context).
absl::Status ValidateRopeScaling(const RopeScaling& r) {
  if (r.type == RopeType::kDefault) return absl::OkStatus();
  AMPD_RETURN_IF_ERROR(DecoderField(std::isfinite(r.factor) && r.factor >= 1.0f,
                                    "rope_scaling.factor", "must be finite and >= 1",
                                    absl::StrCat(r.factor)));
  if (r.type != RopeType::kLlama3) return absl::OkStatus();
  AMPD_RETURN_IF_ERROR(DecoderField(std::isfinite(r.low_freq_factor) && r.low_freq_factor > 0.0f,
                                    "rope_scaling.low_freq_factor", "must be finite and > 0",
                                    absl::StrCat(r.low_freq_factor)));
  AMPD_RETURN_IF_ERROR(
      DecoderField(std::isfinite(r.high_freq_factor) && r.high_freq_factor > r.low_freq_factor,
                   "rope_scaling.high_freq_factor",
                   absl::StrCat("must be finite and > low_freq_factor ", r.low_freq_factor),
                   absl::StrCat(r.high_freq_factor)));
  return DecoderField(r.original_max_position_embeddings > 0,
                      "rope_scaling.original_max_position_embeddings", "must be > 0",
                      absl::StrCat(r.original_max_position_embeddings));
}

absl::Status ValidateDecoderSpec(const ModelSpec& spec, const DecoderSpec& d) {
  if (!spec.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: must be empty when decoder is set, got ", spec.layers.size(), " layers"));
  }
  if (spec.loss != LossKind::kCrossEntropy) {
    return absl::InvalidArgumentError("loss: a decoder's loss is the token cross-entropy");
  }
  const std::pair<int64_t, absl::string_view> positive[] = {
      {d.vocab_size, "vocab_size"},
      {d.hidden_size, "hidden_size"},
      {d.intermediate_size, "intermediate_size"},
      {d.num_hidden_layers, "num_hidden_layers"},
      {d.num_attention_heads, "num_attention_heads"},
      {d.num_key_value_heads, "num_key_value_heads"},
      {d.max_position_embeddings, "max_position_embeddings"},
  };
  for (const auto& [value, field] : positive) {
    AMPD_RETURN_IF_ERROR(DecoderField(value > 0, field, "must be > 0", absl::StrCat(value)));
  }
  AMPD_RETURN_IF_ERROR(
      DecoderField(d.num_attention_heads % d.num_key_value_heads == 0, "num_key_value_heads",
                   absl::StrCat("must divide num_attention_heads ", d.num_attention_heads),
                   absl::StrCat(d.num_key_value_heads)));
  if (d.head_dim == 0) {
    AMPD_RETURN_IF_ERROR(
        DecoderField(d.hidden_size % d.num_attention_heads == 0, "num_attention_heads",
                     absl::StrCat("must divide hidden_size ", d.hidden_size, " when head_dim is 0"),
                     absl::StrCat(d.num_attention_heads)));
  }
  const int64_t head_dim = DecoderHeadDim(d);
  AMPD_RETURN_IF_ERROR(DecoderField(head_dim > 0 && head_dim % 2 == 0, "head_dim",
                                    "must be even and > 0 (RoPE rotates pairs)",
                                    absl::StrCat(head_dim)));
  const std::pair<float, absl::string_view> reals[] = {
      {d.rms_norm_eps, "rms_norm_eps"},
      {d.rope_theta, "rope_theta"},
      {d.initializer_range, "initializer_range"},
  };
  for (const auto& [value, field] : reals) {
    AMPD_RETURN_IF_ERROR(DecoderField(std::isfinite(value) && value > 0.0f, field,
                                      "must be finite and > 0", absl::StrCat(value)));
  }
  AMPD_RETURN_IF_ERROR(DecoderField(
      d.initializer_range <= kMaxInitializerRange, "initializer_range",
      absl::StrCat("must be <= ", kMaxInitializerRange, " (the init's standard deviation)"),
      absl::StrCat(d.initializer_range)));
  AMPD_RETURN_IF_ERROR(ValidateRopeScaling(d.rope_scaling));
  AMPD_RETURN_IF_ERROR(
      DecoderField(std::isfinite(d.query_pre_attn_scalar) && d.query_pre_attn_scalar >= 0.0f,
                   "query_pre_attn_scalar", "must be finite and > 0 when set",
                   absl::StrCat(d.query_pre_attn_scalar)));
  AMPD_RETURN_IF_ERROR(DecoderField(std::isfinite(d.rope_local_theta) && d.rope_local_theta > 0.0f,
                                    "rope_local_theta", "must be finite and > 0",
                                    absl::StrCat(d.rope_local_theta)));
  if (!d.sliding_layers.empty()) {
    AMPD_RETURN_IF_ERROR(DecoderField(
        static_cast<int64_t>(d.sliding_layers.size()) == d.num_hidden_layers, "sliding_layers",
        absl::StrCat("must have one entry per layer (", d.num_hidden_layers, ") or none"),
        absl::StrCat(d.sliding_layers.size(), " entries")));
  }
  const bool slides = SlidingLayers(d);
  AMPD_RETURN_IF_ERROR(DecoderField(
      slides ? d.sliding_window > 0 && d.sliding_window <= std::numeric_limits<int>::max()
             : d.sliding_window >= 0,
      "sliding_window", slides ? "must be in 1 .. 2^31 - 1 when a layer slides" : "must be >= 0",
      absl::StrCat(d.sliding_window)));
  struct Derived {
    std::initializer_list<int64_t> factors;
    absl::string_view field, what;
  };
  // The head width's products first, then the widths they multiply.
  const Derived derived[] = {
      {{d.num_attention_heads, head_dim, 3}, "head_dim", "the expanded q|k|v row"},
      {{d.num_attention_heads + 2 * d.num_key_value_heads, head_dim, d.hidden_size},
       "hidden_size",
       "the q/k/v projections"},
      {{d.intermediate_size, d.hidden_size}, "intermediate_size", "the MLP's weights"},
      {{d.vocab_size, d.hidden_size}, "vocab_size", "the token embedding"},
      {{d.max_position_embeddings, d.hidden_size},
       "max_position_embeddings",
       "a sequence's activations"},
  };
  for (const Derived& x : derived) {
    int64_t v = 1;
    bool ok = true;
    for (const int64_t f : x.factors) ok = ok && CheckedMul(v, f, &v);
    if (!ok || v > kMaxParameters) {
      return absl::InvalidArgumentError(absl::StrCat("decoder.", x.field, ": gives ", x.what,
                                                     " more than ", kMaxParameters,
                                                     " (2^56) elements"));
    }
  }
  if (DecoderParameterCount(d) > kMaxParameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("decoder: the model has more than ", kMaxParameters, " (2^56) parameters"));
  }
  // rank <= min(in, out) keeps the adapters within the base's count.
  if (d.lora.has_value()) AMPD_RETURN_IF_ERROR(ValidateLoraSpec(d));
  if (!std::isfinite(spec.loss_multiplier) || spec.loss_multiplier <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_multiplier: must be finite and > 0, got ", spec.loss_multiplier));
  }
  return absl::OkStatus();
}

}  // namespace

const char* RopeTypeName(RopeType type) {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kLlama3:
      return "llama3";
  }
  return "?";
}

std::string LoraModuleOfPeftTarget(absl::string_view target) {
  for (size_t i = 0; i < std::size(kLoraModules); ++i) {
    const absl::string_view module = kLoraModules[i];
    // The attention's four (first in kLoraModules) live in self_attn, the
    // MLP's three in mlp.
    const absl::string_view parent = i < 4 ? "self_attn." : "mlp.";
    if (target == module || target == absl::StrCat(parent, module)) return std::string(module);
  }
  return std::string(target);
}

int64_t DecoderHeadDim(const DecoderSpec& d) {
  if (d.head_dim != 0) return d.head_dim;
  return d.num_attention_heads > 0 ? d.hidden_size / d.num_attention_heads : 0;
}

std::pair<int64_t, int64_t> DecoderProjectionShape(const DecoderSpec& d,
                                                   const std::string& module) {
  const int64_t c = d.hidden_size;
  const int64_t head_dim = DecoderHeadDim(d);
  const int64_t q = SaturatingMul(d.num_attention_heads, head_dim);
  const int64_t kv = SaturatingMul(d.num_key_value_heads, head_dim);
  const int64_t i = d.intermediate_size;
  if (module == "q_proj") return {q, c};
  if (module == "k_proj" || module == "v_proj") return {kv, c};
  if (module == "o_proj") return {c, q};
  if (module == "gate_proj" || module == "up_proj") return {i, c};
  if (module == "down_proj") return {c, i};
  return {0, 0};
}

int64_t LoraParameterCount(const DecoderSpec& d) {
  if (!d.lora.has_value()) return 0;
  int64_t block = 0;
  for (const std::string& module : d.lora->target_modules) {
    const auto [out, in] = DecoderProjectionShape(d, module);
    block = SaturatingAdd(block, SaturatingMul(d.lora->rank, SaturatingAdd(in, out)));
  }
  return SaturatingMul(d.num_hidden_layers, block);
}

int64_t DecoderParameterCount(const DecoderSpec& d) {
  const int64_t c = d.hidden_size;
  const int64_t head_dim = DecoderHeadDim(d);
  const int64_t q = SaturatingMul(d.num_attention_heads, head_dim);
  const int64_t kv = SaturatingMul(d.num_key_value_heads, head_dim);
  const int64_t qkv = SaturatingAdd(q, SaturatingMul(2, kv));
  // input_layernorm, post_attention_layernorm (C each); q/k/v (qkv x C, + qkv
  // biased); o (C x q, + C biased); q_norm, k_norm (D each, with qk_norm);
  // gate, up, down (3 x I x C).
  int64_t block = SaturatingMul(2, c);
  block = SaturatingAdd(block, SaturatingMul(qkv, c));
  if (d.qkv_bias) block = SaturatingAdd(block, qkv);
  block = SaturatingAdd(block, SaturatingMul(c, q));
  if (d.o_bias) block = SaturatingAdd(block, c);
  if (d.qk_norm) block = SaturatingAdd(block, SaturatingMul(2, head_dim));  // q_norm, k_norm (D)
  if (d.sandwich_norms) block = SaturatingAdd(block, SaturatingMul(2, c));  // post_*, pre_ff (C)
  block = SaturatingAdd(block, SaturatingMul(3, SaturatingMul(d.intermediate_size, c)));
  int64_t total = SaturatingMul(d.vocab_size, c);  // embed_tokens
  total = SaturatingAdd(total, SaturatingMul(d.num_hidden_layers, block));
  total = SaturatingAdd(total, c);  // norm
  if (!d.tie_word_embeddings) total = SaturatingAdd(total, SaturatingMul(d.vocab_size, c));
  return total;
}

bool IsSequenceModel(const ModelSpec& spec) {
  return !std::holds_alternative<LayerStack>(spec.kind);
}

TokenShape TokenShapeOf(const ModelSpec& spec) {
  return std::visit(Overloaded{[](const LayerStack&) { return TokenShape{}; },
                               [](const GptSpec& g) {
                                 return TokenShape{g.vocab_size, g.context_length};
                               },
                               [](const DecoderSpec& d) {
                                 return TokenShape{d.vocab_size, d.max_position_embeddings};
                               }},
                    spec.kind);
}

const LoraSpec* LoraOf(const ModelSpec& spec) {
  const DecoderSpec* d = spec.decoder();
  return d != nullptr && d->lora.has_value() ? &*d->lora : nullptr;
}

int64_t GptParameterCount(const GptSpec& g) {
  const int64_t c = g.d_model;
  const int64_t hidden = SaturatingMul(g.mlp_ratio, c);
  // ln_1, ln_2 (2C each); c_attn C x 3C + 3C; attn c_proj C x C + C;
  // c_fc C x H + H; mlp c_proj H x C + C.
  int64_t block = SaturatingMul(4, c);
  block = SaturatingAdd(block,
                        SaturatingAdd(SaturatingMul(SaturatingMul(3, c), c), SaturatingMul(3, c)));
  block = SaturatingAdd(block, SaturatingAdd(SaturatingMul(c, c), c));
  block = SaturatingAdd(block, SaturatingAdd(SaturatingMul(c, hidden), hidden));
  block = SaturatingAdd(block, SaturatingAdd(SaturatingMul(hidden, c), c));
  int64_t total = SaturatingMul(g.vocab_size, c);                    // wte
  total = SaturatingAdd(total, SaturatingMul(g.context_length, c));  // wpe
  total = SaturatingAdd(total, SaturatingMul(g.n_layer, block));
  total = SaturatingAdd(total, SaturatingMul(2, c));  // ln_f
  if (!g.tie_embeddings) total = SaturatingAdd(total, SaturatingMul(g.vocab_size, c));
  return total;
}

// ValidateModelSpec of a layer stack.
static absl::Status ValidateLayerStack(const ModelSpec& spec) {
  if (spec.layers.empty()) return absl::InvalidArgumentError("layers: the model has no layers");
  int64_t width = 0;  // 0 until a sized layer fixes it
  bool sized = false;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& layer = spec.layers[i];
    switch (layer.kind) {
      case LayerKind::kLinear:
        AMPD_RETURN_IF_ERROR(Positive(layer.in_features, i, "in_features"));
        AMPD_RETURN_IF_ERROR(Positive(layer.out_features, i, "out_features"));
        break;
      case LayerKind::kLayerNorm:
        AMPD_RETURN_IF_ERROR(Positive(layer.normalized_shape, i, "normalized_shape"));
        if (!std::isfinite(layer.eps) || layer.eps <= 0.0f) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "].eps: must be finite and > 0, got ", layer.eps));
        }
        break;
      case LayerKind::kEmbedding:
        if (i != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "].kind: Embedding is only allowed as the first layer"));
        }
        AMPD_RETURN_IF_ERROR(Positive(layer.num_embeddings, i, "num_embeddings"));
        AMPD_RETURN_IF_ERROR(Positive(layer.embedding_dim, i, "embedding_dim"));
        break;
      case LayerKind::kReLU:
      case LayerKind::kGELU:
      case LayerKind::kTanh:
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("layers[", i, "].kind: unknown layer kind"));
    }
    // Sizes are positive here; their product is checked before anything
    // multiplies them again (the parameter count, byte estimates, buffers).
    if (LayerParameterCount(layer) > kMaxParameters) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "]: these sizes give the ",
                                                     LayerKindName(layer.kind), " layer more than ",
                                                     kMaxParameters, " (2^56) parameters"));
    }
    const int64_t in = LayerInWidth(layer);
    if (sized && in != 0 && in != width) {
      const absl::string_view field =
          layer.kind == LayerKind::kLinear ? "in_features" : "normalized_shape";
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "].", field,
                                                     ": the previous layer produces ", width,
                                                     " features, got ", in));
    }
    if (!IsElementwise(layer.kind)) sized = true;
    width = LayerOutWidth(layer, in != 0 ? in : width);
  }
  if (!sized) {
    return absl::InvalidArgumentError(
        "layers: at least one Linear, LayerNorm or Embedding layer is needed to fix the widths");
  }
  if (ParameterCount(spec) > kMaxParameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: the model has more than ", kMaxParameters, " (2^56) parameters"));
  }
  if (spec.loss != LossKind::kMse && spec.loss != LossKind::kCrossEntropy) {
    return absl::InvalidArgumentError("loss: unknown loss kind");
  }
  if (!std::isfinite(spec.loss_multiplier) || spec.loss_multiplier <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_multiplier: must be finite and > 0, got ", spec.loss_multiplier));
  }
  return absl::OkStatus();
}

int64_t InputFeatures(const ModelSpec& spec) {
  for (const LayerSpec& layer : spec.layers) {
    if (layer.kind == LayerKind::kEmbedding) return 0;
    const int64_t in = LayerInWidth(layer);
    if (in != 0) return in;
  }
  return 0;
}

int64_t OutputFeatures(const ModelSpec& spec) {
  int64_t width = InputFeatures(spec);
  for (const LayerSpec& layer : spec.layers) width = LayerOutWidth(layer, width);
  return width;
}

int64_t ParameterCount(const ModelSpec& spec) {
  return std::visit(Overloaded{[&spec](const LayerStack&) {
                                 int64_t count = 0;
                                 for (const LayerSpec& layer : spec.layers) {
                                   count = SaturatingAdd(count, LayerParameterCount(layer));
                                 }
                                 return count;
                               },
                               [](const GptSpec& g) { return GptParameterCount(g); },
                               [](const DecoderSpec& d) {
                                 return SaturatingAdd(DecoderParameterCount(d),
                                                      LoraParameterCount(d));
                               }},
                    spec.kind);
}

int64_t FrozenParameterCount(const ModelSpec& spec) {
  return LoraOf(spec) != nullptr ? DecoderParameterCount(*spec.decoder()) : 0;
}

int64_t GptBlockScaleGroup(int64_t block, int64_t n_layer) {
  // block < n_layer and G <= 32: the product fits for any n_layer < 2^58.
  return block * std::min(n_layer, kMaxGptScaleGroups) / n_layer;
}

int64_t LayerScaleGroups(const ModelSpec& spec) {
  return std::visit(
      Overloaded{
          [&spec](const LayerStack&) {
            int64_t linears = 0;
            for (const LayerSpec& l : spec.layers) {
              linears += l.kind == LayerKind::kLinear ? 1 : 0;
            }
            return std::max<int64_t>(1, linears);
          },
          [](const GptSpec& g) { return std::min(g.n_layer, kMaxGptScaleGroups); },
          [](const DecoderSpec& d) { return std::min(d.num_hidden_layers, kMaxGptScaleGroups); }},
      spec.kind);
}

absl::Status ValidateModelSpec(const ModelSpec& spec) {
  return std::visit(
      Overloaded{[&spec](const LayerStack&) { return ValidateLayerStack(spec); },
                 [&spec](const GptSpec& g) { return ValidateGptSpec(spec, g); },
                 [&spec](const DecoderSpec& d) { return ValidateDecoderSpec(spec, d); }},
      spec.kind);
}

}  // namespace ampd::engine::model
