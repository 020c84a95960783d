// The families' config.json writers: a spec's parts back into the keys
// hf_config.cc reads them from, so that reading a written config gives the
// spec again (tests/engine/hf_config_test.cc holds every family to that).
#include "server/engine/model/hf_config_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/json_text.h"

namespace ampd::engine::model::hf {
namespace {

using codec::JsonValue;

JsonValue Str(const std::string& s) {
  JsonValue v;
  v.type = JsonValue::Type::kString;
  v.text = s;
  return v;
}

JsonValue Int(int64_t i) {
  JsonValue v;
  v.type = JsonValue::Type::kNumber;
  v.text = absl::StrCat(i);
  return v;
}

// The shortest literal that reads back as the same float32 (1e-06, not
// 9.99999997e-07), with ".0" on a whole number so that Python reads a
// float where transformers types one (rope_theta 10000.0).
JsonValue Float(float f) {
  char buffer[48];
  if (f == std::floor(f) && std::fabs(f) < 1.0e15f) {
    // Every whole float32 below 2^53 prints exactly: 1000000.0, not 1e+06.
    std::snprintf(buffer, sizeof buffer, "%.1f", static_cast<double>(f));
  } else {
    for (int precision = 1; precision <= 9; ++precision) {
      std::snprintf(buffer, sizeof buffer, "%.*g", precision, static_cast<double>(f));
      if (std::strtof(buffer, nullptr) == f) break;
    }
  }
  std::string text = buffer;
  if (text.find_first_of(".en") == std::string::npos) text += ".0";
  JsonValue v;
  v.type = JsonValue::Type::kNumber;
  v.text = text;
  return v;
}

// An int where the value is whole (Gemma3TextConfig's query_pre_attn_scalar
// is typed int, and transformers 5.x checks it), else a float.
JsonValue Number(float f) {
  if (f == std::floor(f) && std::fabs(f) < 9.0e15f) return Int(static_cast<int64_t>(f));
  return Float(f);
}

JsonValue Bool(bool b) {
  JsonValue v;
  v.type = JsonValue::Type::kBool;
  v.boolean = b;
  return v;
}

JsonValue Null() { return JsonValue(); }

JsonValue Object(std::initializer_list<std::pair<std::string, JsonValue>> members) {
  JsonValue v;
  v.type = JsonValue::Type::kObject;
  for (const auto& m : members) v.members.push_back(m);
  return v;
}

// Sets key (replacing it where object has it already).
void Set(JsonValue& object, const std::string& key, JsonValue value) {
  for (auto& [name, member] : object.members) {
    if (name == key) {
      member = std::move(value);
      return;
    }
  }
  object.members.emplace_back(key, std::move(value));
}

// RoPE's scaling as rope_scaling's members (rope_type and the factors its
// type reads); an empty object for the default.
JsonValue RopeScalingObject(const RopeScaling& r) {
  switch (r.type) {
    case RopeType::kDefault:
      return Object({});
    case RopeType::kLinear:
      return Object({{"rope_type", Str("linear")}, {"factor", Float(r.factor)}});
    case RopeType::kLlama3:
      return Object(
          {{"rope_type", Str("llama3")},
           {"factor", Float(r.factor)},
           {"low_freq_factor", Float(r.low_freq_factor)},
           {"high_freq_factor", Float(r.high_freq_factor)},
           {"original_max_position_embeddings", Int(r.original_max_position_embeddings)}});
  }
  return Object({});
}

// The keys every decoder family writes alike (the reader's SharedKeys and
// Rope), in transformers 4.x's RoPE keys.
JsonValue DecoderConfig(const DecoderSpec& d, const char* model_type, const char* architecture) {
  JsonValue architectures;
  architectures.type = JsonValue::Type::kArray;
  architectures.items.push_back(Str(architecture));
  JsonValue c = Object({{"model_type", Str(model_type)},
                        {"architectures", architectures},
                        {"vocab_size", Int(d.vocab_size)},
                        {"hidden_size", Int(d.hidden_size)},
                        {"intermediate_size", Int(d.intermediate_size)},
                        {"num_hidden_layers", Int(d.num_hidden_layers)},
                        {"num_attention_heads", Int(d.num_attention_heads)},
                        {"num_key_value_heads", Int(d.num_key_value_heads)},
                        {"head_dim", Int(DecoderHeadDim(d))},
                        {"rms_norm_eps", Float(d.rms_norm_eps)},
                        {"max_position_embeddings", Int(d.max_position_embeddings)},
                        {"tie_word_embeddings", Bool(d.tie_word_embeddings)},
                        {"initializer_range", Float(d.initializer_range)},
                        {"hidden_act", Str("silu")},
                        {"torch_dtype", Str("float32")},
                        {"rope_theta", Float(d.rope_theta)}});
  if (d.rope_scaling.type != RopeType::kDefault) {
    Set(c, "rope_scaling", RopeScalingObject(d.rope_scaling));
  }
  return c;
}

void AppendIndent(int depth, std::string* out) { out->append(2 * depth, ' '); }

void AppendValue(const JsonValue& v, int depth, std::string* out) {
  switch (v.type) {
    case JsonValue::Type::kNull:
      out->append("null");
      return;
    case JsonValue::Type::kBool:
      out->append(v.boolean ? "true" : "false");
      return;
    case JsonValue::Type::kNumber:
      out->append(v.text);
      return;
    case JsonValue::Type::kString:
      codec::AppendJsonString(v.text, out);
      return;
    case JsonValue::Type::kArray:
      if (v.items.empty()) {
        out->append("[]");
        return;
      }
      out->append("[\n");
      for (size_t i = 0; i < v.items.size(); ++i) {
        AppendIndent(depth + 1, out);
        AppendValue(v.items[i], depth + 1, out);
        out->append(i + 1 < v.items.size() ? ",\n" : "\n");
      }
      AppendIndent(depth, out);
      out->append("]");
      return;
    case JsonValue::Type::kObject:
      if (v.members.empty()) {
        out->append("{}");
        return;
      }
      out->append("{\n");
      for (size_t i = 0; i < v.members.size(); ++i) {
        AppendIndent(depth + 1, out);
        codec::AppendJsonString(v.members[i].first, out);
        out->append(": ");
        AppendValue(v.members[i].second, depth + 1, out);
        out->append(i + 1 < v.members.size() ? ",\n" : "\n");
      }
      AppendIndent(depth, out);
      out->append("}");
      return;
  }
}

}  // namespace

JsonValue Gpt2Config(const ModelSpec& spec) {
  const GptSpec& g = *spec.gpt();
  JsonValue architectures;
  architectures.type = JsonValue::Type::kArray;
  architectures.items.push_back(Str("GPT2LMHeadModel"));
  // Dropout is a training-time choice ampd does not make: none.
  return Object({{"model_type", Str("gpt2")},
                 {"architectures", architectures},
                 {"vocab_size", Int(g.vocab_size)},
                 {"n_positions", Int(g.context_length)},
                 {"n_embd", Int(g.d_model)},
                 {"n_layer", Int(g.n_layer)},
                 {"n_head", Int(g.n_head)},
                 {"n_inner", Int(g.mlp_ratio * g.d_model)},
                 {"layer_norm_epsilon", Float(g.layer_norm_eps)},
                 {"tie_word_embeddings", Bool(g.tie_embeddings)},
                 {"activation_function", Str("gelu_new")},
                 {"resid_pdrop", Float(0.0f)},
                 {"embd_pdrop", Float(0.0f)},
                 {"attn_pdrop", Float(0.0f)},
                 {"torch_dtype", Str("float32")}});
}

JsonValue LlamaConfig(const ModelSpec& spec) {
  JsonValue c = DecoderConfig(*spec.decoder(), "llama", "LlamaForCausalLM");
  Set(c, "attention_bias", Bool(spec.decoder()->qkv_bias));
  Set(c, "mlp_bias", Bool(false));
  return c;
}

JsonValue Qwen2Config(const ModelSpec& spec) {
  JsonValue c = DecoderConfig(*spec.decoder(), "qwen2", "Qwen2ForCausalLM");
  Set(c, "use_sliding_window", Bool(false));
  return c;
}

JsonValue Qwen3Config(const ModelSpec& spec) {
  JsonValue c = DecoderConfig(*spec.decoder(), "qwen3", "Qwen3ForCausalLM");
  Set(c, "attention_bias", Bool(spec.decoder()->qkv_bias));
  Set(c, "use_sliding_window", Bool(false));
  return c;
}

JsonValue Gemma3Config(const ModelSpec& spec) {
  const DecoderSpec& d = *spec.decoder();
  const int64_t head_dim = DecoderHeadDim(d);
  JsonValue c = DecoderConfig(d, "gemma3_text", "Gemma3ForCausalLM");
  // Gemma's own names and RoPE per layer type (5.x's rope_parameters: 4.x's
  // keys cannot give the sliding layers' base beside the full ones' scaling).
  c.members.erase(std::remove_if(c.members.begin(), c.members.end(),
                                 [](const auto& m) {
                                   return m.first == "hidden_act" || m.first == "rope_theta" ||
                                          m.first == "rope_scaling";
                                 }),
                  c.members.end());
  JsonValue full = Object({{"rope_type", Str("default")}, {"rope_theta", Float(d.rope_theta)}});
  for (const auto& [name, value] : RopeScalingObject(d.rope_scaling).members)
    Set(full, name, value);
  JsonValue layer_types;
  layer_types.type = JsonValue::Type::kArray;
  for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
    layer_types.items.push_back(Str(
        DecoderLayerSlides(d, static_cast<size_t>(l)) ? "sliding_attention" : "full_attention"));
  }
  Set(c, "hidden_activation", Str("gelu_pytorch_tanh"));
  Set(c, "attention_bias", Bool(d.qkv_bias));
  Set(c, "query_pre_attn_scalar",
      Number(d.query_pre_attn_scalar != 0.0f ? d.query_pre_attn_scalar
                                             : static_cast<float>(head_dim)));
  Set(c, "sliding_window", d.sliding_window > 0 ? Int(d.sliding_window) : Null());
  Set(c, "layer_types", layer_types);
  Set(c, "rope_parameters",
      Object({{"full_attention", full},
              {"sliding_attention", Object({{"rope_type", Str("default")},
                                            {"rope_theta", Float(d.rope_local_theta)}})}}));
  Set(c, "final_logit_softcapping", Null());
  Set(c, "attn_logit_softcapping", Null());
  Set(c, "use_bidirectional_attention", Bool(false));
  return c;
}

std::string JsonText(const JsonValue& value) {
  std::string out;
  AppendValue(value, 0, &out);
  out.push_back('\n');
  return out;
}

}  // namespace ampd::engine::model::hf
