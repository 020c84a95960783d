// model::ModelSpecOfHfConfig: config.json files as transformers writes
// them for Qwen2, Llama 3.1 (RoPE llama3 scaling, in 4.x's and 5.x's
// keys), Qwen3, Gemma 3 and GPT-2, the specs they give, and each key the server refuses,
// named in the message; and model::HfConfigOfModelSpec, each family's
// config.json of a spec, which reads back as the same spec.
#include "server/engine/model/hf_config.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "codec/json_value.h"
#include "gtest/gtest.h"

namespace ampd::engine::model {
namespace {

// Qwen2.5-0.5B's config.json (transformers 4.x), abridged of keys ampd
// ignores as transformers' own model does at training time.
constexpr char kQwen2[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
  "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
  "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
  "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "sliding_window": 32768,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

constexpr char kLlama31[] = R"({
  "model_type": "llama", "hidden_act": "silu", "hidden_size": 2048,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
  "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "attention_bias": false, "mlp_bias": false,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": true, "vocab_size": 128256})";

// Qwen3-0.6B's (transformers 5.x: rope_parameters, layer_types).
constexpr char kQwen3[] = R"({
  "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
  "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
  "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 40960,
  "num_attention_heads": 16, "num_hidden_layers": 2, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
  "sliding_window": null, "tie_word_embeddings": true, "use_sliding_window": false,
  "vocab_size": 151936})";

// Gemma 3 1B's shape (transformers 5.x: rope_parameters per layer type,
// layer_types), six layers: five sliding, one full.
constexpr char kGemma3[] = R"({
  "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
  "attn_logit_softcapping": null, "final_logit_softcapping": null, "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
  "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                  "sliding_attention", "sliding_attention", "full_attention"],
  "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 6,
  "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
  "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                         "rope_theta": 1000000.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
  "sliding_window": 512, "tie_word_embeddings": true, "use_bidirectional_attention": false,
  "vocab_size": 262144})";

constexpr char kGpt2[] = R"({"model_type": "gpt2", "activation_function": "gelu_new",
  "n_embd": 768, "n_head": 12, "n_inner": null, "n_layer": 12, "n_positions": 1024,
  "layer_norm_epsilon": 1e-05, "vocab_size": 50257, "scale_attn_weights": true})";

std::string Refusal(const std::string& json) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(json);
  EXPECT_FALSE(spec.ok()) << json;
  if (spec.ok()) return "";
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

TEST(HfConfig, Qwen2IsADecoderWithQkvBiases) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kQwen2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->decoder() != nullptr);
  const DecoderSpec& d = *spec->decoder();
  EXPECT_EQ(d.vocab_size, 151936);
  EXPECT_EQ(d.hidden_size, 896);
  EXPECT_EQ(d.intermediate_size, 4864);
  EXPECT_EQ(d.num_hidden_layers, 24);
  EXPECT_EQ(d.num_attention_heads, 14);
  EXPECT_EQ(d.num_key_value_heads, 2);
  EXPECT_EQ(d.head_dim, 0);  // hidden / heads
  EXPECT_EQ(d.max_position_embeddings, 32768);
  EXPECT_EQ(d.rms_norm_eps, 1e-06f);
  EXPECT_EQ(d.rope_theta, 1000000.0f);
  EXPECT_EQ(d.rope_scaling.type, RopeType::kDefault);
  EXPECT_TRUE(d.tie_word_embeddings);
  EXPECT_TRUE(d.qkv_bias);
  EXPECT_FALSE(d.o_bias);
  EXPECT_FALSE(d.lora.has_value());
  EXPECT_EQ(spec->loss, LossKind::kCrossEntropy);
  EXPECT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
}

TEST(HfConfig, Llama31ScalesRopeInEitherKeyStyle) {
  for (const std::string& json :
       {std::string(kLlama31),
        // transformers 5.x: rope_parameters holds rope_theta and the scaling.
        absl::StrReplaceAll(kLlama31, {{R"("rope_theta": 500000.0,)", ""},
                                       {R"("rope_scaling": {)",
                                        R"("rope_parameters": {"rope_theta": 500000.0, )"}})}) {
    absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(json);
    ASSERT_TRUE(spec.ok()) << spec.status() << json;
    const DecoderSpec& d = *spec->decoder();
    EXPECT_EQ(d.head_dim, 64);
    EXPECT_EQ(d.rope_theta, 500000.0f);
    EXPECT_EQ(d.rope_scaling.type, RopeType::kLlama3);
    EXPECT_EQ(d.rope_scaling.factor, 32.0f);
    EXPECT_EQ(d.rope_scaling.low_freq_factor, 1.0f);
    EXPECT_EQ(d.rope_scaling.high_freq_factor, 4.0f);
    EXPECT_EQ(d.rope_scaling.original_max_position_embeddings, 8192);
    EXPECT_FALSE(d.qkv_bias);
    EXPECT_FALSE(d.o_bias);
    EXPECT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
  }
  absl::StatusOr<ModelSpec> biased = ModelSpecOfHfConfig(
      absl::StrReplaceAll(kLlama31, {{R"("attention_bias": false)", R"("attention_bias": true)"}}));
  ASSERT_TRUE(biased.ok()) << biased.status();
  EXPECT_TRUE(biased->decoder()->qkv_bias && biased->decoder()->o_bias);
}

TEST(HfConfig, Qwen3NormsEachQAndKHead) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kQwen3);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const DecoderSpec& d = *spec->decoder();
  EXPECT_TRUE(d.qk_norm);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_FALSE(d.qkv_bias || d.o_bias);
  EXPECT_EQ(d.rope_theta, 1000000.0f);
  EXPECT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
  // Qwen3Config's head_dim defaults to 128, not hidden / heads.
  absl::StatusOr<ModelSpec> unset =
      ModelSpecOfHfConfig(absl::StrReplaceAll(kQwen3, {{R"("head_dim": 128,)", ""}}));
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(unset->decoder()->head_dim, 128);
  // Qwen2 and Llama norm no head.
  EXPECT_FALSE(ModelSpecOfHfConfig(kQwen2)->decoder()->qk_norm);
}

TEST(HfConfig, Gemma3IsADecoderWithGemmasParts) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kGemma3);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const DecoderSpec& d = *spec->decoder();
  EXPECT_TRUE(d.qk_norm && d.norm_unit_offset && d.sandwich_norms && d.scale_embeddings);
  EXPECT_EQ(d.mlp_activation, MlpActivation::kGeluTanh);
  EXPECT_EQ(d.head_dim, 256);
  EXPECT_EQ(d.query_pre_attn_scalar, 256.0f);
  EXPECT_EQ(d.sliding_window, 512);
  EXPECT_EQ(d.sliding_layers, (std::vector<bool>{true, true, true, true, true, false}));
  // The full layers' RoPE carries the scaling, the sliding layers' base is their own.
  EXPECT_EQ(d.rope_theta, 1000000.0f);
  EXPECT_EQ(d.rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(d.rope_scaling.factor, 8.0f);
  EXPECT_EQ(d.rope_local_theta, 10000.0f);
  EXPECT_TRUE(ValidateModelSpec(*spec).ok()) << ValidateModelSpec(*spec);
  // 4.x keys: rope_theta, rope_local_base_freq and sliding_window_pattern.
  absl::StatusOr<ModelSpec> old = ModelSpecOfHfConfig(absl::StrReplaceAll(
      kGemma3,
      {{R"("layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                  "sliding_attention", "sliding_attention", "full_attention"],)",
        R"("sliding_window_pattern": 3,)"},
       {R"("rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                         "rope_theta": 1000000.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},)",
        R"("rope_theta": 1000000.0, "rope_local_base_freq": 5000.0, "rope_scaling": null,)"}}));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->decoder()->sliding_layers,
            (std::vector<bool>{true, true, false, true, true, false}));
  EXPECT_EQ(old->decoder()->rope_scaling.type, RopeType::kDefault);
  EXPECT_EQ(old->decoder()->rope_local_theta, 5000.0f);
}

TEST(HfConfig, Gpt2IsAGpt) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kGpt2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->gpt() != nullptr);
  EXPECT_EQ(spec->gpt()->d_model, 768);
  EXPECT_EQ(spec->gpt()->context_length, 1024);
  EXPECT_EQ(spec->gpt()->mlp_ratio, 4);  // n_inner null: 4 n_embd
  EXPECT_TRUE(spec->gpt()->tie_embeddings);
  EXPECT_TRUE(ValidateModelSpec(*spec).ok());
}

TEST(HfConfig, WhatWouldComputeDifferentlyIsRefusedNamingTheKey) {
  const struct {
    const char* base;
    const char* from;
    const char* to;
    const char* key;
  } cases[] = {
      {kQwen2, R"("model_type": "qwen2")", R"("model_type": "mistral")", "config.json: model_type"},
      {kQwen2, R"("hidden_act": "silu")", R"("hidden_act": "gelu")", "config.json: hidden_act"},
      {kQwen2, R"("use_sliding_window": false)", R"("use_sliding_window": true)",
       "config.json: use_sliding_window"},
      {kLlama31, R"("mlp_bias": false)", R"("mlp_bias": true)", "config.json: mlp_bias"},
      {kQwen3, R"(["full_attention", "full_attention"])",
       R"(["full_attention", "sliding_attention"])", "config.json: layer_types"},
      {kQwen3, R"("use_sliding_window": false)", R"("use_sliding_window": true)",
       "config.json: use_sliding_window"},
      {kLlama31, R"("rope_type": "llama3")", R"("rope_type": "yarn")",
       "config.json: rope_scaling.rope_type"},
      {kLlama31, R"("factor": 32.0,)", "", "config.json: rope_scaling.factor"},
      {kLlama31, R"("rope_type": "llama3")", R"("rope_type": "linear")",
       "config.json: rope_scaling.high_freq_factor"},
      {kQwen2, R"("rope_scaling": null)", R"("partial_rotary_factor": 0.5)",
       "config.json: partial_rotary_factor"},
      {kQwen2, R"("hidden_size": 896)", R"("hidden_size": 896.5)", "config.json: hidden_size"},
      {kQwen2, R"("hidden_size": 896,)", "", "config.json: hidden_size: missing"},
      {kQwen2, R"("tie_word_embeddings": true)", R"("tie_word_embeddings": 1)",
       "config.json: tie_word_embeddings"},
      {kGemma3, R"("final_logit_softcapping": null)", R"("final_logit_softcapping": 30.0)",
       "config.json: final_logit_softcapping"},
      {kGemma3, R"("attn_logit_softcapping": null)", R"("attn_logit_softcapping": 50.0)",
       "config.json: attn_logit_softcapping"},
      {kGemma3, R"("use_bidirectional_attention": false)", R"("use_bidirectional_attention": true)",
       "config.json: use_bidirectional_attention"},
      {kGemma3, R"("hidden_activation": "gelu_pytorch_tanh")", R"("hidden_activation": "silu")",
       "config.json: hidden_activation"},
      {kGemma3, R"("full_attention"])", R"("chunked_attention"])", "config.json: layer_types"},
      {kGemma3, R"("rope_type": "default", "rope_theta": 10000.0)",
       R"("rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0)",
       "config.json: rope_parameters.sliding_attention."},
      {kGpt2, R"("activation_function": "gelu_new")", R"("activation_function": "relu")",
       "config.json: activation_function"},
      {kGpt2, R"("n_inner": null)", R"("n_inner": 1000)", "config.json: n_inner"},
      {kGpt2, R"("scale_attn_weights": true)", R"("scale_attn_weights": false)",
       "config.json: scale_attn_weights"},
  };
  for (const auto& c : cases) {
    const std::string json = absl::StrReplaceAll(c.base, {{c.from, c.to}});
    ASSERT_NE(json, c.base) << c.from;
    const std::string message = Refusal(json);
    EXPECT_TRUE(absl::StartsWith(message, c.key)) << c.key << " vs " << message;
  }
  EXPECT_TRUE(absl::StartsWith(Refusal("[1, 2]"), "config.json: ")) << Refusal("[1, 2]");
  EXPECT_TRUE(
      absl::StrContains(Refusal(R"({"model_type": "qwen2", "model_type": "llama"})"), "twice"));
  EXPECT_TRUE(absl::StrContains(Refusal("{\"model_type\": \"qwen2\"} x"), "after the value"));
}

// Every field of a spec the config.json carries, as text, so that two
// specs compare field by field in a failure's message.
std::string Fields(const ModelSpec& spec) {
  if (spec.gpt() != nullptr) {
    const GptSpec& g = *spec.gpt();
    return absl::StrCat("gpt ", g.vocab_size, " ", g.context_length, " ", g.d_model, " ", g.n_layer,
                        " ", g.n_head, " ", g.mlp_ratio, " ", g.layer_norm_eps, " ",
                        g.tie_embeddings);
  }
  const DecoderSpec& d = *spec.decoder();
  std::string sliding;
  for (const bool s : d.sliding_layers) sliding += s ? "s" : "f";
  const RopeScaling& r = d.rope_scaling;
  return absl::StrCat(
      "decoder vocab ", d.vocab_size, " hidden ", d.hidden_size, " inter ", d.intermediate_size,
      " layers ", d.num_hidden_layers, " heads ", d.num_attention_heads, "/", d.num_key_value_heads,
      " head_dim ", DecoderHeadDim(d), " eps ", d.rms_norm_eps, " theta ", d.rope_theta, " rope ",
      RopeTypeName(r.type), " ", r.factor, " ", r.low_freq_factor, " ", r.high_freq_factor, " ",
      r.original_max_position_embeddings, " max_pos ", d.max_position_embeddings, " tied ",
      d.tie_word_embeddings, " init ", d.initializer_range, " bias ", d.qkv_bias, d.o_bias,
      " qk_norm ", d.qk_norm, " offset ", d.norm_unit_offset, " act ",
      static_cast<int>(d.mlp_activation), " sandwich ", d.sandwich_norms, " scale ",
      d.scale_embeddings, " qpas ", d.query_pre_attn_scalar, " sliding ", sliding, " window ",
      d.sliding_window, " local ", d.rope_local_theta);
}

TEST(HfConfig, EachFamilyWritesAConfigThatReadsBackAsTheSameSpec) {
  const struct {
    std::string json;
    const char* model_type;
  } cases[] = {
      {kQwen2, "qwen2"},
      {kLlama31, "llama"},
      {absl::StrReplaceAll(kLlama31, {{R"("attention_bias": false)", R"("attention_bias": true)"}}),
       "llama"},
      {absl::StrReplaceAll(kLlama31, {{R"("rope_type": "llama3")", R"("rope_type": "linear")"},
                                      {R"("high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192,)",
                                       ""}}),
       "llama"},
      {kQwen3, "qwen3"},
      {absl::StrReplaceAll(kQwen3, {{R"("attention_bias": false)", R"("attention_bias": true)"}}),
       "qwen3"},
      {kGemma3, "gemma3_text"},
      {kGpt2, "gpt2"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(c.json);
    ASSERT_TRUE(spec.ok()) << spec.status() << c.json;
    absl::StatusOr<std::string> written = HfConfigOfModelSpec(*spec);
    ASSERT_TRUE(written.ok()) << written.status();
    absl::StatusOr<codec::JsonValue> parsed = codec::ParseJson(*written);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << *written;
    ASSERT_NE(parsed->Find("model_type"), nullptr) << *written;
    EXPECT_EQ(parsed->Find("model_type")->text, c.model_type) << *written;
    absl::StatusOr<ModelSpec> again = ModelSpecOfHfConfig(*written);
    ASSERT_TRUE(again.ok()) << again.status() << *written;
    EXPECT_EQ(Fields(*again), Fields(*spec)) << *written;
  }
}

TEST(HfConfig, TheWriterKeepsFloatsShortAndExact) {
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kQwen2);
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<std::string> written = HfConfigOfModelSpec(*spec);
  ASSERT_TRUE(written.ok());
  // The float32 1e-6 as its shortest literal, a whole float with ".0".
  EXPECT_TRUE(absl::StrContains(*written, R"("rms_norm_eps": 1e-06,)")) << *written;
  EXPECT_TRUE(absl::StrContains(*written, R"("rope_theta": 1000000.0)")) << *written;
}

TEST(HfConfig, WhatNoFamilyOwnsIsNotWritten) {
  ModelSpec stack;
  stack.layers.push_back(LayerSpec{});
  EXPECT_EQ(HfConfigOfModelSpec(stack).status().code(), absl::StatusCode::kFailedPrecondition);
  // A decoder with o_proj biased and q/k/v not: no family has those biases.
  absl::StatusOr<ModelSpec> spec = ModelSpecOfHfConfig(kLlama31);
  ASSERT_TRUE(spec.ok());
  spec->decoder()->o_bias = true;
  EXPECT_EQ(HfConfigOfModelSpec(*spec).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ampd::engine::model
