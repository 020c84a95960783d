// ModelSpecOfHfConfig: config.json's keys onto a GptSpec or a DecoderSpec,
// family by family, and the family table that pairs each reader with its
// writer (HfConfigOfModelSpec).
#include "server/engine/model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "codec/json_value.h"
#include "common/status_macros.h"
#include "server/engine/model/hf_config_writer.h"

namespace ampd::engine::model {
namespace {

using codec::JsonTruthy;
using codec::JsonValue;

absl::Status Refused(absl::string_view key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": ", why));
}

// An object's member, absent when missing or null (Hugging Face writes
// null for "unset").
const JsonValue* Get(const JsonValue& object, absl::string_view key) {
  const JsonValue* v = object.Find(key);
  return v == nullptr || v->is_null() ? nullptr : v;
}

absl::StatusOr<int64_t> IntOf(const JsonValue* v, absl::string_view key) {
  int64_t out = 0;
  if (v->type != JsonValue::Type::kNumber || !absl::SimpleAtoi(v->text, &out)) {
    // 32768.0 is an integer too.
    double d = 0;
    if (v->type != JsonValue::Type::kNumber || !absl::SimpleAtod(v->text, &d) ||
        d != std::floor(d) || std::fabs(d) > 9.0e15) {
      return Refused(key, "must be an integer");
    }
    out = static_cast<int64_t>(d);
  }
  return out;
}

absl::StatusOr<int64_t> RequiredInt(const JsonValue& c, absl::string_view key) {
  const JsonValue* v = Get(c, key);
  if (v == nullptr) return Refused(key, "missing");
  return IntOf(v, key);
}

// float32 of the literal, as Python's float goes onto the proto's float.
absl::StatusOr<float> FloatOf(const JsonValue* v, absl::string_view key) {
  double d = 0;
  if (v->type != JsonValue::Type::kNumber || !absl::SimpleAtod(v->text, &d) || !std::isfinite(d)) {
    return Refused(key, "must be a finite number");
  }
  // 1e39 is finite as Python's float and infinite as the proto's.
  if (std::fabs(d) > std::numeric_limits<float>::max()) {
    return Refused(key, absl::StrCat(v->text, ": beyond float32's range"));
  }
  return static_cast<float>(d);
}

absl::StatusOr<bool> BoolOf(const JsonValue* v, absl::string_view key) {
  if (v->type != JsonValue::Type::kBool) return Refused(key, "must be true or false");
  return v->boolean;
}

absl::StatusOr<std::string> StringOf(const JsonValue* v, absl::string_view key) {
  if (v->type != JsonValue::Type::kString) return Refused(key, "must be a string");
  return v->text;
}

absl::StatusOr<ModelSpec> Gpt2(const JsonValue& c) {
  if (const JsonValue* act = Get(c, "activation_function"); act != nullptr) {
    AMPD_ASSIGN_OR_RETURN(const std::string name, StringOf(act, "activation_function"));
    if (name != "gelu_new" && name != "gelu_pytorch_tanh") {
      return Refused("activation_function",
                     absl::StrCat("\"", name, "\": the MLP's GELU is the tanh approximation"));
    }
  }
  const struct {
    const char* key;
    bool wanted;
  } fixed[] = {{"scale_attn_weights", true},
               {"scale_attn_by_inverse_layer_idx", false},
               {"add_cross_attention", false}};
  for (const auto& f : fixed) {
    const JsonValue* v = Get(c, f.key);
    if (v == nullptr) continue;
    AMPD_ASSIGN_OR_RETURN(const bool b, BoolOf(v, f.key));
    if (b != f.wanted) return Refused(f.key, absl::StrCat("only ", f.wanted, " is supported"));
  }
  GptSpec g;
  AMPD_ASSIGN_OR_RETURN(g.vocab_size, RequiredInt(c, "vocab_size"));
  AMPD_ASSIGN_OR_RETURN(g.context_length, RequiredInt(c, "n_positions"));
  AMPD_ASSIGN_OR_RETURN(g.d_model, RequiredInt(c, "n_embd"));
  AMPD_ASSIGN_OR_RETURN(g.n_layer, RequiredInt(c, "n_layer"));
  if (g.n_layer > kMaxHfConfigLayers) {
    return Refused("n_layer", absl::StrCat(g.n_layer, ": at most ", kMaxHfConfigLayers));
  }
  AMPD_ASSIGN_OR_RETURN(g.n_head, RequiredInt(c, "n_head"));
  int64_t inner = 0;
  if (const JsonValue* v = Get(c, "n_inner"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(inner, IntOf(v, "n_inner"));
  }
  if (inner == 0) inner = 4 * g.d_model;
  if (g.d_model <= 0 || inner % g.d_model != 0) {
    return Refused("n_inner", absl::StrCat(inner, ": must be a multiple of n_embd ", g.d_model));
  }
  g.mlp_ratio = inner / g.d_model;
  if (const JsonValue* v = Get(c, "layer_norm_epsilon"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(g.layer_norm_eps, FloatOf(v, "layer_norm_epsilon"));
  }
  if (const JsonValue* v = Get(c, "tie_word_embeddings"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(g.tie_embeddings, BoolOf(v, "tie_word_embeddings"));
  }
  ModelSpec spec;
  spec.kind = g;
  spec.loss = LossKind::kCrossEntropy;
  return spec;
}

// RoPE in either style (4.x's rope_theta + rope_scaling, 5.x's
// rope_parameters): rope_theta and the
// scaling into d.
absl::Status Rope(const JsonValue& c, DecoderSpec& d) {
  const JsonValue* params = Get(c, "rope_parameters");
  const char* key = "rope_parameters";
  const JsonValue* theta = Get(c, "rope_theta");
  if (params == nullptr) {
    params = Get(c, "rope_scaling");
    key = "rope_scaling";
  }
  JsonValue empty;
  empty.type = JsonValue::Type::kObject;
  if (params == nullptr) params = &empty;
  if (params->type != JsonValue::Type::kObject) return Refused(key, "must be an object");
  if (std::string(key) == "rope_parameters") {
    for (const auto& [name, value] : params->members) {
      if (value.type == JsonValue::Type::kObject) {
        return Refused(key, "one set for every layer is supported, not one per layer type");
      }
    }
    if (const JsonValue* t = Get(*params, "rope_theta"); t != nullptr) theta = t;
  }
  if (theta != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.rope_theta, FloatOf(theta, absl::StrCat(key, ".rope_theta")));
  }
  const JsonValue* partial = Get(*params, "partial_rotary_factor");
  if (partial == nullptr) partial = Get(c, "partial_rotary_factor");
  if (partial != nullptr) {
    AMPD_ASSIGN_OR_RETURN(const float f, FloatOf(partial, "partial_rotary_factor"));
    if (f != 1.0f) return Refused("partial_rotary_factor", "RoPE rotates the whole head here");
  }
  std::string type = "default";
  for (const char* name : {"rope_type", "type"}) {
    const JsonValue* v = Get(*params, name);
    if (v == nullptr) continue;
    AMPD_ASSIGN_OR_RETURN(type, StringOf(v, absl::StrCat(key, ".", name)));
    if (!type.empty()) break;
    type = "default";
  }
  std::vector<std::string> known;
  if (type == "default") {
    d.rope_scaling.type = RopeType::kDefault;
  } else if (type == "linear") {
    d.rope_scaling.type = RopeType::kLinear;
    known = {"factor"};
  } else if (type == "llama3") {
    d.rope_scaling.type = RopeType::kLlama3;
    known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  } else {
    return Refused(absl::StrCat(key, ".rope_type"),
                   absl::StrCat("\"", type, "\": ampd computes default, linear and llama3 RoPE"));
  }
  for (const auto& [name, value] : params->members) {
    if (name == "rope_theta" || name == "rope_type" || name == "type" ||
        name == "partial_rotary_factor" || value.is_null()) {
      continue;
    }
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return Refused(
          absl::StrCat(key, ".", name),
          absl::StrCat("not read by rope_type ", type, ", and ampd would compute without it"));
    }
  }
  for (const std::string& name : known) {
    const JsonValue* v = Get(*params, name);
    const std::string field = absl::StrCat(key, ".", name);
    if (name == "original_max_position_embeddings") {
      if (v == nullptr) v = Get(c, "max_position_embeddings");  // transformers' fallback
      if (v == nullptr) return Refused(field, absl::StrCat("rope_type ", type, " needs it"));
      AMPD_ASSIGN_OR_RETURN(d.rope_scaling.original_max_position_embeddings, IntOf(v, field));
      continue;
    }
    if (v == nullptr) return Refused(field, absl::StrCat("rope_type ", type, " needs it"));
    AMPD_ASSIGN_OR_RETURN(const float f, FloatOf(v, field));
    if (name == "factor") d.rope_scaling.factor = f;
    if (name == "low_freq_factor") d.rope_scaling.low_freq_factor = f;
    if (name == "high_freq_factor") d.rope_scaling.high_freq_factor = f;
  }
  return absl::OkStatus();
}

// transformers 5.x's per-layer attention kinds: every layer full attention.
absl::Status CheckLayerTypes(const JsonValue& c) {
  const JsonValue* types = Get(c, "layer_types");
  if (types == nullptr) return absl::OkStatus();
  if (types->type != JsonValue::Type::kArray) return Refused("layer_types", "must be a list");
  for (const JsonValue& t : types->items) {
    if (t.type != JsonValue::Type::kString || t.text != "full_attention") {
      return Refused("layer_types", "every layer must be full_attention (no sliding window)");
    }
  }
  return absl::OkStatus();
}

// The keys every decoder family reads alike under their own names,
// over what d holds already (a family's defaults).
absl::Status SharedKeys(const JsonValue& c, DecoderSpec& d) {
  AMPD_ASSIGN_OR_RETURN(d.vocab_size, RequiredInt(c, "vocab_size"));
  AMPD_ASSIGN_OR_RETURN(d.hidden_size, RequiredInt(c, "hidden_size"));
  AMPD_ASSIGN_OR_RETURN(d.intermediate_size, RequiredInt(c, "intermediate_size"));
  AMPD_ASSIGN_OR_RETURN(d.num_hidden_layers, RequiredInt(c, "num_hidden_layers"));
  // Refused here, not by admission later: a family's per-layer lists
  // (Gemma's sliding layers) are built from it before any size check.
  if (d.num_hidden_layers > kMaxHfConfigLayers) {
    return Refused("num_hidden_layers",
                   absl::StrCat(d.num_hidden_layers, ": at most ", kMaxHfConfigLayers));
  }
  AMPD_ASSIGN_OR_RETURN(d.num_attention_heads, RequiredInt(c, "num_attention_heads"));
  AMPD_ASSIGN_OR_RETURN(d.max_position_embeddings, RequiredInt(c, "max_position_embeddings"));
  d.num_key_value_heads = d.num_attention_heads;
  if (const JsonValue* v = Get(c, "num_key_value_heads"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.num_key_value_heads, IntOf(v, "num_key_value_heads"));
  }
  if (const JsonValue* v = Get(c, "head_dim"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.head_dim, IntOf(v, "head_dim"));
    if (d.head_dim <= 0) return Refused("head_dim", "must be > 0 when set");
  }
  if (const JsonValue* v = Get(c, "rms_norm_eps"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.rms_norm_eps, FloatOf(v, "rms_norm_eps"));
  }
  if (const JsonValue* v = Get(c, "tie_word_embeddings"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.tie_word_embeddings, BoolOf(v, "tie_word_embeddings"));
  }
  if (const JsonValue* v = Get(c, "initializer_range"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.initializer_range, FloatOf(v, "initializer_range"));
  }
  return absl::OkStatus();
}

// The Llama-style decoder families (llama, qwen2, qwen3): their refusals first (hidden_act for all;
// llama's mlp_bias; qwen2's and qwen3's sliding window), then RoPE, the
// shared keys, and the parts each family's keys set.
absl::StatusOr<ModelSpec> Decoder(const JsonValue& c, const std::string& model_type) {
  DecoderSpec d;
  if (const JsonValue* act = Get(c, "hidden_act"); act != nullptr) {
    AMPD_ASSIGN_OR_RETURN(const std::string name, StringOf(act, "hidden_act"));
    if (name != "silu") {
      return Refused("hidden_act", absl::StrCat("\"", name, "\": the MLP is SwiGLU (silu)"));
    }
  }
  if (model_type == "llama" && JsonTruthy(Get(c, "mlp_bias"))) {
    return Refused("mlp_bias", "the MLP's projections have no biases here");
  }
  if (model_type != "llama") {
    if (JsonTruthy(Get(c, "use_sliding_window"))) {
      return Refused("use_sliding_window", "sliding-window attention is not supported");
    }
    AMPD_RETURN_IF_ERROR(CheckLayerTypes(c));
  }
  AMPD_RETURN_IF_ERROR(Rope(c, d));
  AMPD_RETURN_IF_ERROR(SharedKeys(c, d));
  if (model_type == "qwen2") {
    d.qkv_bias = true;
    d.o_bias = false;
  } else {
    // llama and qwen3: attention_bias biases q, k, v and o_proj alike.
    bool bias = false;
    if (const JsonValue* v = Get(c, "attention_bias"); v != nullptr) {
      AMPD_ASSIGN_OR_RETURN(bias, BoolOf(v, "attention_bias"));
    }
    d.qkv_bias = bias;
    d.o_bias = bias;
  }
  if (model_type == "qwen3") {
    // Each q and k head RMSNorm-ed before RoPE; Qwen3Config's head_dim
    // defaults to 128, not hidden / heads.
    d.qk_norm = true;
    if (d.head_dim == 0) d.head_dim = 128;
  }
  ModelSpec spec;
  spec.kind = d;
  spec.loss = LossKind::kCrossEntropy;
  return spec;
}

// A copy of object o with key set to value where o lacks it.
JsonValue WithDefault(const JsonValue& o, const std::string& key, const JsonValue* value) {
  JsonValue out = o;
  if (Get(out, key) == nullptr && value != nullptr) {
    out.members.erase(std::remove_if(out.members.begin(), out.members.end(),
                                     [&](const auto& m) { return m.first == key; }),
                      out.members.end());
    out.members.emplace_back(key, *value);
  }
  return out;
}

JsonValue Number(double v) {
  JsonValue out;
  out.type = JsonValue::Type::kNumber;
  out.text = absl::StrCat(v);
  return out;
}

JsonValue Object() {
  JsonValue out;
  out.type = JsonValue::Type::kObject;
  return out;
}

// Gemma 3 text: its refusals, Gemma3TextConfig's
// defaults for the keys a config.json leaves out, the shared keys, RoPE per
// layer type (5.x's rope_parameters keyed by sliding_attention and
// full_attention, or 4.x's rope_theta, rope_local_base_freq and
// rope_scaling, the scaling for the full layers only), the layer types
// (layer_types, or 4.x's sliding_window_pattern) and Gemma's parts.
absl::StatusOr<ModelSpec> Gemma3(const JsonValue& c) {
  if (const JsonValue* act = Get(c, "hidden_activation"); act != nullptr) {
    AMPD_ASSIGN_OR_RETURN(const std::string name, StringOf(act, "hidden_activation"));
    if (name != "gelu_pytorch_tanh") {
      return Refused(
          "hidden_activation",
          absl::StrCat("\"", name,
                       "\": the MLP is GeGLU with gelu's tanh form (gelu_pytorch_tanh)"));
    }
  }
  if (Get(c, "attn_logit_softcapping") != nullptr) {
    return Refused("attn_logit_softcapping", "attention-score soft-capping is not supported");
  }
  if (Get(c, "final_logit_softcapping") != nullptr) {
    return Refused("final_logit_softcapping", "logit soft-capping is not supported");
  }
  if (JsonTruthy(Get(c, "use_bidirectional_attention"))) {
    return Refused("use_bidirectional_attention", "attention is causal here");
  }
  DecoderSpec d;
  d.head_dim = 256;
  d.tie_word_embeddings = true;
  d.rms_norm_eps = 1e-6f;
  AMPD_RETURN_IF_ERROR(SharedKeys(c, d));

  // RoPE: the full layers' set through Rope(), the sliding layers' default
  // RoPE of their own base.
  const JsonValue global_theta = Number(1000000.0);
  const JsonValue local_theta_default = Number(10000.0);
  const JsonValue* theta = Get(c, "rope_theta");
  const JsonValue* local_base = Get(c, "rope_local_base_freq");
  const JsonValue* params = Get(c, "rope_parameters");
  bool per_type = false;
  if (params != nullptr && params->type == JsonValue::Type::kObject) {
    for (const auto& [name, value] : params->members) {
      per_type = per_type || value.type == JsonValue::Type::kObject;
    }
  }
  JsonValue full = Object(), local = Object();
  if (per_type) {
    if (const JsonValue* f = Get(*params, "full_attention"); f != nullptr) full = *f;
    if (const JsonValue* l = Get(*params, "sliding_attention"); l != nullptr) local = *l;
    if (full.type != JsonValue::Type::kObject) {
      return Refused("rope_parameters.full_attention", "must be an object");
    }
    if (local.type != JsonValue::Type::kObject) {
      return Refused("rope_parameters.sliding_attention", "must be an object");
    }
    full = WithDefault(full, "rope_theta", theta != nullptr ? theta : &global_theta);
    local =
        WithDefault(local, "rope_theta", local_base != nullptr ? local_base : &local_theta_default);
  } else {
    const JsonValue* flat = params != nullptr ? params : Get(c, "rope_scaling");
    if (flat != nullptr) full = *flat;
    if (full.type != JsonValue::Type::kObject) {
      return Refused(params != nullptr ? "rope_parameters" : "rope_scaling", "must be an object");
    }
    full = WithDefault(full, "rope_theta", theta != nullptr ? theta : &global_theta);
    local =
        WithDefault(local, "rope_theta", local_base != nullptr ? local_base : &local_theta_default);
  }
  JsonValue full_config = Object();
  full_config.members.emplace_back("rope_parameters", full);
  if (const JsonValue* m = Get(c, "max_position_embeddings"); m != nullptr) {
    full_config.members.emplace_back("max_position_embeddings", *m);
  }
  AMPD_RETURN_IF_ERROR(Rope(full_config, d));
  for (const auto& [name, value] : local.members) {
    if (value.is_null()) continue;
    if (name == "rope_type" || name == "type") {
      AMPD_ASSIGN_OR_RETURN(
          const std::string t,
          StringOf(&value, absl::StrCat("rope_parameters.sliding_attention.", name)));
      if (t.empty() || t == "default") continue;
    } else if (name == "rope_theta") {
      continue;
    }
    return Refused(absl::StrCat("rope_parameters.sliding_attention.", name),
                   "the sliding layers' RoPE is the default here");
  }
  AMPD_ASSIGN_OR_RETURN(
      d.rope_local_theta,
      FloatOf(Get(local, "rope_theta"), "rope_parameters.sliding_attention.rope_theta"));

  // Layer types.
  const size_t layers = static_cast<size_t>(std::max<int64_t>(d.num_hidden_layers, 0));
  if (const JsonValue* types = Get(c, "layer_types"); types != nullptr) {
    if (types->type != JsonValue::Type::kArray) return Refused("layer_types", "must be a list");
    for (const JsonValue& t : types->items) {
      if (t.type != JsonValue::Type::kString ||
          (t.text != "sliding_attention" && t.text != "full_attention")) {
        return Refused("layer_types", "ampd computes sliding_attention and full_attention");
      }
      d.sliding_layers.push_back(t.text == "sliding_attention");
    }
  } else {
    int64_t pattern = 6;
    if (const JsonValue* v = Get(c, "sliding_window_pattern"); v != nullptr) {
      AMPD_ASSIGN_OR_RETURN(pattern, IntOf(v, "sliding_window_pattern"));
      if (pattern <= 0) return Refused("sliding_window_pattern", "must be > 0");
    }
    for (size_t i = 0; i < layers; ++i) {
      d.sliding_layers.push_back((static_cast<int64_t>(i) + 1) % pattern != 0);
    }
  }
  d.sliding_window = 4096;
  if (const JsonValue* v = Get(c, "sliding_window"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.sliding_window, IntOf(v, "sliding_window"));
  }
  d.query_pre_attn_scalar = 256.0f;
  if (const JsonValue* v = Get(c, "query_pre_attn_scalar"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(d.query_pre_attn_scalar, FloatOf(v, "query_pre_attn_scalar"));
  }
  bool bias = false;
  if (const JsonValue* v = Get(c, "attention_bias"); v != nullptr) {
    AMPD_ASSIGN_OR_RETURN(bias, BoolOf(v, "attention_bias"));
  }
  d.qkv_bias = bias;
  d.o_bias = bias;
  d.qk_norm = true;
  d.norm_unit_offset = true;
  d.mlp_activation = MlpActivation::kGeluTanh;
  d.sandwich_norms = true;
  d.scale_embeddings = true;
  ModelSpec spec;
  spec.kind = d;
  spec.loss = LossKind::kCrossEntropy;
  return spec;
}

bool HasGemmaParts(const DecoderSpec& d) {
  return d.norm_unit_offset || d.sandwich_norms || d.scale_embeddings ||
         d.mlp_activation != MlpActivation::kSilu || SlidingLayers(d) ||
         d.query_pre_attn_scalar != 0.0f;
}

// Whether spec is a decoder of the Llama-style parts (none of Gemma's)
// whose biases and q/k norm are as a family has them.
bool LlamaStyle(const ModelSpec& spec) {
  return spec.decoder() != nullptr && !HasGemmaParts(*spec.decoder());
}
bool OwnsLlama(const ModelSpec& s) {
  return LlamaStyle(s) && !s.decoder()->qk_norm && s.decoder()->qkv_bias == s.decoder()->o_bias;
}
bool OwnsQwen2(const ModelSpec& s) {
  return LlamaStyle(s) && !s.decoder()->qk_norm && s.decoder()->qkv_bias && !s.decoder()->o_bias;
}
bool OwnsQwen3(const ModelSpec& s) {
  return LlamaStyle(s) && s.decoder()->qk_norm && s.decoder()->qkv_bias == s.decoder()->o_bias;
}
bool OwnsGemma3(const ModelSpec& s) {
  if (s.decoder() == nullptr) return false;
  const DecoderSpec& d = *s.decoder();
  return d.norm_unit_offset && d.sandwich_norms && d.scale_embeddings && d.qk_norm &&
         d.mlp_activation == MlpActivation::kGeluTanh && d.qkv_bias == d.o_bias;
}
bool OwnsGpt2(const ModelSpec& s) { return s.gpt() != nullptr; }
absl::StatusOr<ModelSpec> ReadLlama(const JsonValue& c) { return Decoder(c, "llama"); }
absl::StatusOr<ModelSpec> ReadQwen2(const JsonValue& c) { return Decoder(c, "qwen2"); }
absl::StatusOr<ModelSpec> ReadQwen3(const JsonValue& c) { return Decoder(c, "qwen3"); }

// The families, one entry each: the model_type, how its config.json reads
// (the functions above), which specs are its own (at most one family owns
// a spec), and the config.json an export of such a spec writes
// (hf_config_writer.cc).
struct Family {
  const char* model_type;
  absl::StatusOr<ModelSpec> (*read)(const JsonValue& config);
  bool (*owns)(const ModelSpec& spec);
  JsonValue (*write)(const ModelSpec& spec);
};

constexpr Family kFamilies[] = {
    {"gpt2", Gpt2, OwnsGpt2, hf::Gpt2Config},
    {"llama", ReadLlama, OwnsLlama, hf::LlamaConfig},
    {"qwen2", ReadQwen2, OwnsQwen2, hf::Qwen2Config},
    {"qwen3", ReadQwen3, OwnsQwen3, hf::Qwen3Config},
    {"gemma3_text", Gemma3, OwnsGemma3, hf::Gemma3Config},
};

const Family* FamilyOf(absl::string_view model_type) {
  for (const Family& f : kFamilies) {
    if (model_type == f.model_type) return &f;
  }
  return nullptr;
}

std::string ModelTypes() {
  std::string out;
  for (const Family& f : kFamilies) absl::StrAppend(&out, out.empty() ? "" : ", ", f.model_type);
  return out;
}

}  // namespace

absl::StatusOr<ModelSpec> ModelSpecOfHfConfig(absl::string_view config_json) {
  absl::StatusOr<JsonValue> parsed = codec::ParseJson(config_json);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", parsed.status().message()));
  }
  const JsonValue& c = *parsed;
  if (c.type != JsonValue::Type::kObject) return Refused("(document)", "must be an object");
  const JsonValue* type = Get(c, "model_type");
  if (type == nullptr) return Refused("model_type", "missing");
  AMPD_ASSIGN_OR_RETURN(const std::string model_type, StringOf(type, "model_type"));
  if (const Family* f = FamilyOf(model_type); f != nullptr) return f->read(c);
  return Refused("model_type", absl::StrCat("\"", model_type, "\": one of ", ModelTypes()));
}

absl::StatusOr<std::string> HfConfigOfModelSpec(const ModelSpec& spec) {
  for (const Family& f : kFamilies) {
    if (f.owns(spec)) return hf::JsonText(f.write(spec));
  }
  return absl::FailedPreconditionError(
      absl::StrCat(IsSequenceModel(spec) ? "a transformer with these parts" : "a layer stack",
                   " is no Hugging Face family ampd writes (", ModelTypes(), ")"));
}

}  // namespace ampd::engine::model
