// ModelSpecOfHfConfig: config.json's keys onto a GptSpec or a DecoderSpec,
// key by key as client/python/ampd/spec.py maps them.
#include "server/engine/model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "codec/json_value.h"
#include "common/status_macros.h"

namespace ampd::engine::model {
namespace {

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
  return static_cast<float>(d);
}

absl::StatusOr<bool> BoolOf(const JsonValue* v, absl::string_view key) {
  if (v->type != JsonValue::Type::kBool) return Refused(key, "must be true or false");
  return v->boolean;
}

// Python's truthiness of a value (for keys the client reads as `if value`).
bool Truthy(const JsonValue* v) {
  if (v == nullptr) return false;
  switch (v->type) {
    case JsonValue::Type::kBool:
      return v->boolean;
    case JsonValue::Type::kNumber: {
      double d = 0;
      return !absl::SimpleAtod(v->text, &d) || d != 0;
    }
    case JsonValue::Type::kString:
      return !v->text.empty();
    case JsonValue::Type::kArray:
      return !v->items.empty();
    case JsonValue::Type::kObject:
      return !v->members.empty();
    case JsonValue::Type::kNull:
      return false;
  }
  return false;
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
  spec.gpt = g;
  spec.loss = LossKind::kCrossEntropy;
  return spec;
}

// RoPE in either style (spec.py's _rope_of_hf_config): rope_theta and the
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

// The decoder families (client/python/ampd/families/llama.py, qwen2.py,
// qwen3.py over _decoder.py): their refusals first (hidden_act for all;
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
  if (model_type == "llama" && Truthy(Get(c, "mlp_bias"))) {
    return Refused("mlp_bias", "the MLP's projections have no biases here");
  }
  if (model_type != "llama") {
    if (Truthy(Get(c, "use_sliding_window"))) {
      return Refused("use_sliding_window", "sliding-window attention is not supported");
    }
    AMPD_RETURN_IF_ERROR(CheckLayerTypes(c));
  }
  AMPD_RETURN_IF_ERROR(Rope(c, d));
  AMPD_ASSIGN_OR_RETURN(d.vocab_size, RequiredInt(c, "vocab_size"));
  AMPD_ASSIGN_OR_RETURN(d.hidden_size, RequiredInt(c, "hidden_size"));
  AMPD_ASSIGN_OR_RETURN(d.intermediate_size, RequiredInt(c, "intermediate_size"));
  AMPD_ASSIGN_OR_RETURN(d.num_hidden_layers, RequiredInt(c, "num_hidden_layers"));
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
  spec.decoder = d;
  spec.loss = LossKind::kCrossEntropy;
  return spec;
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
  if (model_type == "gpt2") return Gpt2(c);
  if (model_type == "llama" || model_type == "qwen2" || model_type == "qwen3") {
    return Decoder(c, model_type);
  }
  return Refused("model_type",
                 absl::StrCat("\"", model_type, "\": one of gpt2, llama, qwen2, qwen3"));
}

}  // namespace ampd::engine::model
