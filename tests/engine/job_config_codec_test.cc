// job_config_codec: EncodeJobConfig/DecodeJobConfig round trips every field
// bit for bit over every scaler policy, precision, optimizer kind and layer
// kind, and the reader refuses what is not a config of its format with the
// key at fault. Also the engine's per-kind optimizer defaults.
#include "server/engine/config/job_config_codec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "server/engine/optim/optimizer_state.h"

namespace ampd::engine {
namespace {

using amp::ScalerPolicy;
using model::LayerKind;
using model::LayerSpec;
using model::LossKind;
using model::Precision;
using optim::OptimizerKind;

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Every field a job of this kind reads, compared exactly (floats by bits).
void ExpectSameConfig(const JobConfig& a, const JobConfig& b) {
  EXPECT_EQ(a.batch_invariant, b.batch_invariant);
  EXPECT_EQ(a.display_name, b.display_name);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.precision, b.precision);
  ASSERT_EQ(a.model.layers.size(), b.model.layers.size());
  for (size_t i = 0; i < a.model.layers.size(); ++i) {
    const LayerSpec& x = a.model.layers[i];
    const LayerSpec& y = b.model.layers[i];
    SCOPED_TRACE(absl::StrCat("layers[", i, "]"));
    EXPECT_EQ(x.kind, y.kind);
    EXPECT_EQ(x.in_features, y.in_features);
    EXPECT_EQ(x.out_features, y.out_features);
    EXPECT_EQ(x.bias, y.bias);
    EXPECT_EQ(x.normalized_shape, y.normalized_shape);
    EXPECT_TRUE(SameBits(x.eps, y.eps)) << x.eps << " vs " << y.eps;
    EXPECT_EQ(x.elementwise_affine, y.elementwise_affine);
    EXPECT_EQ(x.num_embeddings, y.num_embeddings);
    EXPECT_EQ(x.embedding_dim, y.embedding_dim);
  }
  ASSERT_EQ(a.model.gpt() != nullptr, b.model.gpt() != nullptr);
  if (a.model.gpt() != nullptr) {
    const model::GptSpec& x = *a.model.gpt();
    const model::GptSpec& y = *b.model.gpt();
    EXPECT_EQ(x.vocab_size, y.vocab_size);
    EXPECT_EQ(x.context_length, y.context_length);
    EXPECT_EQ(x.d_model, y.d_model);
    EXPECT_EQ(x.n_layer, y.n_layer);
    EXPECT_EQ(x.n_head, y.n_head);
    EXPECT_EQ(x.mlp_ratio, y.mlp_ratio);
    EXPECT_TRUE(SameBits(x.layer_norm_eps, y.layer_norm_eps));
    EXPECT_EQ(x.tie_embeddings, y.tie_embeddings);
  }
  ASSERT_EQ(a.model.decoder() != nullptr, b.model.decoder() != nullptr);
  if (a.model.decoder() != nullptr) {
    const model::DecoderSpec& x = *a.model.decoder();
    const model::DecoderSpec& y = *b.model.decoder();
    EXPECT_EQ(x.vocab_size, y.vocab_size);
    EXPECT_EQ(x.hidden_size, y.hidden_size);
    EXPECT_EQ(x.intermediate_size, y.intermediate_size);
    EXPECT_EQ(x.num_hidden_layers, y.num_hidden_layers);
    EXPECT_EQ(x.num_attention_heads, y.num_attention_heads);
    EXPECT_EQ(x.num_key_value_heads, y.num_key_value_heads);
    EXPECT_EQ(x.head_dim, y.head_dim);
    EXPECT_TRUE(SameBits(x.rms_norm_eps, y.rms_norm_eps));
    EXPECT_TRUE(SameBits(x.rope_theta, y.rope_theta));
    EXPECT_EQ(x.max_position_embeddings, y.max_position_embeddings);
    EXPECT_EQ(x.tie_word_embeddings, y.tie_word_embeddings);
    EXPECT_TRUE(SameBits(x.initializer_range, y.initializer_range));
    EXPECT_EQ(x.qkv_bias, y.qkv_bias);
    EXPECT_EQ(x.o_bias, y.o_bias);
    EXPECT_EQ(x.qk_norm, y.qk_norm);
    EXPECT_EQ(x.norm_unit_offset, y.norm_unit_offset);
    EXPECT_EQ(x.mlp_activation, y.mlp_activation);
    EXPECT_EQ(x.sandwich_norms, y.sandwich_norms);
    EXPECT_EQ(x.scale_embeddings, y.scale_embeddings);
    EXPECT_TRUE(SameBits(x.query_pre_attn_scalar, y.query_pre_attn_scalar));
    EXPECT_EQ(x.sliding_layers, y.sliding_layers);
    EXPECT_EQ(x.sliding_window, y.sliding_window);
    EXPECT_TRUE(SameBits(x.rope_local_theta, y.rope_local_theta));
    EXPECT_EQ(x.rope_scaling.type, y.rope_scaling.type);
    EXPECT_TRUE(SameBits(x.rope_scaling.factor, y.rope_scaling.factor));
    EXPECT_TRUE(SameBits(x.rope_scaling.low_freq_factor, y.rope_scaling.low_freq_factor));
    EXPECT_TRUE(SameBits(x.rope_scaling.high_freq_factor, y.rope_scaling.high_freq_factor));
    EXPECT_EQ(x.rope_scaling.original_max_position_embeddings,
              y.rope_scaling.original_max_position_embeddings);
    ASSERT_EQ(x.lora.has_value(), y.lora.has_value());
    if (x.lora.has_value()) {
      EXPECT_EQ(x.lora->rank, y.lora->rank);
      EXPECT_TRUE(SameBits(x.lora->alpha, y.lora->alpha));
      EXPECT_EQ(x.lora->target_modules, y.lora->target_modules);
    }
  }
  EXPECT_EQ(a.model.loss, b.model.loss);
  EXPECT_TRUE(SameBits(a.model.loss_multiplier, b.model.loss_multiplier));
  const optim::OptimizerSpec& o = a.optimizer;
  const optim::OptimizerSpec& p = b.optimizer;
  EXPECT_EQ(o.kind, p.kind);
  EXPECT_EQ(o.lr_schedule.kind, p.lr_schedule.kind);
  if (o.lr_schedule.kind != optim::LrScheduleKind::kConstant) {
    EXPECT_EQ(o.lr_schedule.warmup_steps, p.lr_schedule.warmup_steps);
    EXPECT_EQ(o.lr_schedule.decay_steps, p.lr_schedule.decay_steps);
    EXPECT_TRUE(SameBits(o.lr_schedule.min_lr, p.lr_schedule.min_lr));
  }
  if (o.kind == OptimizerKind::kSgd) {
    EXPECT_TRUE(SameBits(o.sgd.lr, p.sgd.lr)) << o.sgd.lr << " vs " << p.sgd.lr;
    EXPECT_TRUE(SameBits(o.sgd.momentum, p.sgd.momentum));
    EXPECT_TRUE(SameBits(o.sgd.dampening, p.sgd.dampening));
    EXPECT_TRUE(SameBits(o.sgd.weight_decay, p.sgd.weight_decay));
    EXPECT_EQ(o.sgd.nesterov, p.sgd.nesterov);
  } else {
    EXPECT_TRUE(SameBits(o.adam.lr, p.adam.lr)) << o.adam.lr << " vs " << p.adam.lr;
    EXPECT_TRUE(SameBits(o.adam.beta1, p.adam.beta1));
    EXPECT_TRUE(SameBits(o.adam.beta2, p.adam.beta2));
    EXPECT_TRUE(SameBits(o.adam.eps, p.adam.eps));
    EXPECT_TRUE(SameBits(o.adam.weight_decay, p.adam.weight_decay));
    EXPECT_EQ(optim::AdamUpdateConfig(o).decoupled_weight_decay,
              optim::AdamUpdateConfig(p).decoupled_weight_decay);
  }
  EXPECT_TRUE(SameBits(o.max_grad_norm, p.max_grad_norm));
  const amp::ScalerConfig& s = a.scaler;
  const amp::ScalerConfig& t = b.scaler;
  EXPECT_EQ(s.policy, t.policy);
  EXPECT_EQ(s.enabled, t.enabled);
  EXPECT_EQ(s.dynamic, t.dynamic);
  EXPECT_TRUE(SameBits(s.init_scale, t.init_scale)) << s.init_scale << " vs " << t.init_scale;
  EXPECT_TRUE(SameBits(s.growth_factor, t.growth_factor));
  EXPECT_TRUE(SameBits(s.backoff_factor, t.backoff_factor));
  EXPECT_EQ(s.growth_interval, t.growth_interval);
  EXPECT_EQ(s.hysteresis, t.hysteresis);
  EXPECT_EQ(s.consecutive_hysteresis, t.consecutive_hysteresis);
  EXPECT_EQ(s.raise_at_min_scale, t.raise_at_min_scale);
  EXPECT_EQ(s.min_scale.has_value(), t.min_scale.has_value());
  if (s.min_scale && t.min_scale) {
    EXPECT_TRUE(SameBits(*s.min_scale, *t.min_scale));
  }
  EXPECT_EQ(s.max_scale.has_value(), t.max_scale.has_value());
  if (s.max_scale && t.max_scale) {
    EXPECT_TRUE(SameBits(*s.max_scale, *t.max_scale));
  }
  EXPECT_EQ(s.overflow_margin_log2, t.overflow_margin_log2);
  EXPECT_TRUE(SameBits(s.underflow_threshold, t.underflow_threshold));
  EXPECT_EQ(s.per_layer_scales, t.per_layer_scales);
}

LayerSpec Linear(int64_t in, int64_t out, bool bias = true) {
  LayerSpec l;
  l.kind = LayerKind::kLinear;
  l.in_features = in;
  l.out_features = out;
  l.bias = bias;
  return l;
}

LayerSpec Activation(LayerKind kind) {
  LayerSpec l;
  l.kind = kind;
  return l;
}

LayerSpec LayerNorm(int64_t n, float eps, bool affine) {
  LayerSpec l;
  l.kind = LayerKind::kLayerNorm;
  l.normalized_shape = n;
  l.eps = eps;
  l.elementwise_affine = affine;
  return l;
}

LayerSpec Embedding(int64_t n, int64_t dim) {
  LayerSpec l;
  l.kind = LayerKind::kEmbedding;
  l.num_embeddings = n;
  l.embedding_dim = dim;
  return l;
}

// Models covering every layer kind and both losses.
std::vector<model::ModelSpec> Models() {
  std::vector<model::ModelSpec> models(3);
  models[0].layers = {Linear(16, 64), Activation(LayerKind::kGELU), Linear(64, 4)};
  models[1].layers = {Linear(8, 6, false), Activation(LayerKind::kReLU), LayerNorm(6, 1e-6f, false),
                      Activation(LayerKind::kTanh), Linear(6, 3)};
  models[1].loss = LossKind::kCrossEntropy;
  models[1].loss_multiplier = 1.0f / 3.0f;
  models[2].layers = {Embedding(50257, 7), LayerNorm(7, std::nextafter(1e-5f, 1.0f), true),
                      Linear(7, 50257, false)};
  models[2].loss = LossKind::kCrossEntropy;
  models[2].loss_multiplier = 1e-30f;
  return models;
}

// Floats whose shortest decimal form needs all 9 digits, or that are
// subnormal, so a writer with fewer digits would lose bits.
constexpr float kAwkwardLr = 0.100000024f;  // 8 digits (0.10000002) read back as 0.1f + 2 ulp
const float kSubnormal = std::numeric_limits<float>::denorm_min();

std::vector<JobConfig> ManyConfigs() {
  std::vector<JobConfig> configs;
  int n = 0;
  for (Precision precision : {Precision::kFp32, Precision::kFp16, Precision::kBf16}) {
    for (ScalerPolicy policy :
         {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
          ScalerPolicy::kMegatron, ScalerPolicy::kAdaptive}) {
      for (OptimizerKind kind :
           {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
        for (const model::ModelSpec& model : Models()) {
          ++n;
          JobConfig c = DefaultJobConfig(precision, policy, kind);
          c.model = model;
          c.display_name = absl::StrCat("job ", n);
          c.seed = static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull;
          configs.push_back(c);
          // The same with every number moved off its default.
          c.display_name = absl::StrCat("job \"", n, "\"\\ \t\x01 \xc3\xa9 \xf0\x9f\x98\x80");
          c.seed = std::numeric_limits<uint64_t>::max() - static_cast<uint64_t>(n);
          if (kind == OptimizerKind::kSgd) {
            c.optimizer.sgd.lr = kAwkwardLr;
            c.optimizer.sgd.momentum = 0.9f;
            c.optimizer.sgd.dampening = n % 2 == 0 ? 0.0f : 0.25f;
            c.optimizer.sgd.nesterov = n % 2 == 0;
            c.optimizer.sgd.weight_decay = kSubnormal;
          } else {
            c.optimizer.adam.lr = kAwkwardLr;
            c.optimizer.adam.beta1 = std::nextafter(1.0f, 0.0f);
            c.optimizer.adam.beta2 = 0.0f;
            c.optimizer.adam.eps = kSubnormal;
            c.optimizer.adam.weight_decay = 3.4e38f;
          }
          c.optimizer.max_grad_norm = n % 3 == 0 ? -1.0f : 0.7f;
          if (n % 2 == 0) {
            c.optimizer.lr_schedule.kind = optim::LrScheduleKind::kWarmupCosine;
            c.optimizer.lr_schedule.warmup_steps = n % 4 == 0 ? 0 : int64_t{1} << 40;
            c.optimizer.lr_schedule.decay_steps = std::numeric_limits<int64_t>::max();
            c.optimizer.lr_schedule.min_lr = kSubnormal;
          }
          amp::ScalerConfig& s = c.scaler;
          s.enabled = n % 5 != 0;
          s.dynamic = n % 2 == 1;
          s.init_scale = 1024.0 + 1.0 / 3.0;
          s.growth_factor = 2.0000000000000004;
          s.backoff_factor = 0.1;
          s.growth_interval = 7 + n;
          s.hysteresis = 1 + n % 4;
          s.consecutive_hysteresis = n % 2 == 0;
          s.raise_at_min_scale = n % 3 == 0;
          if (n % 2 == 0) s.min_scale = 0.5;
          if (n % 3 != 0) s.max_scale = 16777216.0;
          if (policy == ScalerPolicy::kAdaptive) {
            s.overflow_margin_log2 = n % 16;
            s.underflow_threshold = 1.0 / 3.0;
          }
          configs.push_back(c);
        }
      }
    }
  }
  return configs;
}

TEST(JobConfigCodec, RoundTripsEveryFieldBitForBit) {
  const std::vector<JobConfig> configs = ManyConfigs();
  ASSERT_EQ(configs.size(), 3u * 5u * 3u * 3u * 2u);
  for (size_t i = 0; i < configs.size(); ++i) {
    const JobConfig& config = configs[i];
    ASSERT_TRUE(ValidateJobConfig(config).ok()) << i << ": " << ValidateJobConfig(config);
    const std::string request_id = i % 2 == 0 ? "" : absl::StrCat("req-", i);
    const std::string json = EncodeJobConfig(config, request_id);
    SCOPED_TRACE(json);
    absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->request_id, request_id);
    ExpectSameConfig(config, decoded->config.get());
    // And the text is a fixed point.
    EXPECT_EQ(EncodeJobConfig(decoded->config.get(), decoded->request_id), json);
  }
}

TEST(JobConfigCodec, WritesTheDocumentedKeys) {
  JobConfig config = DefaultJobConfig(Precision::kFp16);
  config.model = Models()[0];
  config.seed = 7;
  // Moved in, not assigned from a literal: GCC 12's -Wrestrict misfires on
  // the inlined literal assignment here (its PR 105329).
  config.display_name = std::string(1, 'a');
  EXPECT_EQ(
      EncodeJobConfig(config, "r"),
      "{\"format_version\":1,\"display_name\":\"a\",\"request_id\":\"r\",\"seed\":7,"
      "\"precision\":\"fp16\",\"model\":{\"layers\":[{\"kind\":\"linear\",\"in_features\":16,"
      "\"out_features\":64,\"bias\":true},{\"kind\":\"gelu\"},{\"kind\":\"linear\","
      "\"in_features\":64,\"out_features\":4,\"bias\":true}],\"loss\":\"mse\","
      "\"loss_multiplier\":1},\"optimizer\":{\"kind\":\"adamw\",\"lr\":0.00100000005,"
      "\"beta1\":0.899999976,\"beta2\":0.999000013,\"eps\":9.99999994e-09,"
      "\"weight_decay\":0.00999999978,\"max_grad_norm\":0},\"scaler\":{\"policy\":\"pytorch\","
      "\"enabled\":true,\"dynamic\":true,\"init_scale\":65536,\"growth_factor\":2,"
      "\"backoff_factor\":0.5,\"growth_interval\":2000,\"hysteresis\":1,"
      "\"consecutive_hysteresis\":false,\"raise_at_min_scale\":false}}");
}

TEST(JobConfigCodec, ReadsJsonEscapesAndWhitespace) {
  JobConfig config = DefaultJobConfig(Precision::kBf16, ScalerPolicy::kMegatron);
  config.model = Models()[1];
  std::string json = EncodeJobConfig(config, "");
  json = absl::StrReplaceAll(
      json, {{"\"display_name\":\"\"", "\"display_name\" :\n\t\"\\u00e9\\ud83d\\ude00\\/\\n\\\"\""},
             {",", " , "}});
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->config.get().display_name, "\xc3\xa9\xf0\x9f\x98\x80/\n\"");
  EXPECT_EQ(decoded->request_id, "");
}

class JobConfigCodecRefuses : public ::testing::Test {
 protected:
  // A valid encoding with `from` replaced by `to` (which must occur once).
  static std::string Edited(const std::string& from, const std::string& to) {
    JobConfig config = DefaultJobConfig(Precision::kFp16);
    config.model = Models()[1];
    const std::string json = EncodeJobConfig(config, "req");
    EXPECT_EQ(json.find(from), json.rfind(from)) << from;
    EXPECT_NE(json.find(from), std::string::npos) << from << " in " << json;
    return absl::StrReplaceAll(json, {{from, to}});
  }

  // A JSON syntax error: the message up to the offset, which it ends with.
  static void ExpectSyntaxError(const std::string& json, absl::string_view what) {
    absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
    ASSERT_FALSE(decoded.ok()) << json;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
    EXPECT_TRUE(
        absl::StartsWith(decoded.status().message(),
                         absl::StrCat("ampd.config: not a JSON document: ", what, " at offset ")))
        << decoded.status() << " for " << json;
  }

  static void ExpectError(const std::string& json, absl::StatusCode code,
                          absl::string_view message) {
    absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
    ASSERT_FALSE(decoded.ok()) << json;
    EXPECT_EQ(decoded.status().code(), code) << decoded.status();
    EXPECT_EQ(decoded.status().message(), message) << json;
  }
};

TEST_F(JobConfigCodecRefuses, TextThatIsNotJson) {
  const std::string good = Edited("\"seed\":0", "\"seed\":0");
  ExpectError("", absl::StatusCode::kDataLoss,
              "ampd.config: not a JSON document: unexpected end at offset 0");
  ExpectError(good.substr(0, good.size() - 1), absl::StatusCode::kDataLoss,
              absl::StrCat("ampd.config: not a JSON document: expected ',' or '}' at offset ",
                           good.size() - 1));
  ExpectError(good + "x", absl::StatusCode::kDataLoss,
              absl::StrCat("ampd.config: not a JSON document: characters after the value at "
                           "offset ",
                           good.size()));
  ExpectSyntaxError(Edited("\"seed\":0", "\"seed\":01"), "a number with a leading zero");
  ExpectSyntaxError(Edited("\"seed\":0", "\"seed\":-"), "a number without digits");
  ExpectSyntaxError(Edited("\"seed\":0", "\"seed\":0."), "a number without digits after '.'");
  ExpectSyntaxError(Edited("\"bias\":false}", "\"bias\":false,}"), "expected a key");
  ExpectSyntaxError(Edited("\"req\"", "\"r\\q\""), "a bad escape");
  ExpectSyntaxError(Edited("\"req\"", "\"\\ud800\""), "a lone high surrogate");
  ExpectSyntaxError(Edited("\"req\"", "\"\\udc00\""), "a lone low surrogate");
  ExpectSyntaxError(Edited("\"req\"", "\"a\tb\""), "a control character in a string");
  ExpectSyntaxError(Edited("\"seed\":0", "\"seed\" 0"), "expected ':'");
  ExpectSyntaxError(Edited("\"enabled\":true", "\"enabled\":ture"), "unexpected character 't'");
  ExpectError(std::string(100, '[') + std::string(100, ']'), absl::StatusCode::kDataLoss,
              "ampd.config: not a JSON document: nested too deep at offset 17");
  ExpectError("[1]", absl::StatusCode::kDataLoss,
              "ampd.config: (the document): expected an object, got an array");
}

TEST_F(JobConfigCodecRefuses, UnknownMissingAndDuplicateKeys) {
  ExpectError(Edited("\"seed\":0", "\"seed\":0,\"color\":\"red\""), absl::StatusCode::kDataLoss,
              "ampd.config: color: unknown key");
  ExpectError(Edited("{\"kind\":\"relu\"}", "{\"kind\":\"relu\",\"eps\":1e-05}"),
              absl::StatusCode::kDataLoss, "ampd.config: model.layers[1].eps: unknown key");
  // beta1 is not a key of an SGD optimizer.
  ExpectError(Edited("\"kind\":\"adamw\"",
                     "\"kind\":\"sgd\",\"momentum\":0,\"dampening\":0,"
                     "\"nesterov\":false"),
              absl::StatusCode::kDataLoss, "ampd.config: optimizer.beta1: unknown key");
  ExpectError(Edited("\"growth_interval\":2000,", ""), absl::StatusCode::kDataLoss,
              "ampd.config: scaler.growth_interval: missing");
  ExpectError(Edited("\"seed\":0", "\"seed\":0,\"seed\":1"), absl::StatusCode::kDataLoss,
              "ampd.config: seed: duplicate key");
}

TEST_F(JobConfigCodecRefuses, WrongTypesAndRanges) {
  ExpectError(Edited("\"lr\":0.00100000005", "\"lr\":\"0.001\""), absl::StatusCode::kDataLoss,
              "ampd.config: optimizer.lr: expected a number, got a string");
  ExpectError(Edited("\"dynamic\":true", "\"dynamic\":1"), absl::StatusCode::kDataLoss,
              "ampd.config: scaler.dynamic: expected a boolean, got a number");
  ExpectError(Edited("\"loss\":\"cross_entropy\"", "\"loss\":[\"cross_entropy\"]"),
              absl::StatusCode::kDataLoss,
              "ampd.config: model.loss: expected a string, got an array");
  ExpectError(Edited("\"display_name\":\"\"", "\"display_name\":null"), absl::StatusCode::kDataLoss,
              "ampd.config: display_name: expected a string, got null");
  ExpectError(Edited("\"growth_interval\":2000", "\"growth_interval\":2000.5"),
              absl::StatusCode::kDataLoss,
              "ampd.config: scaler.growth_interval: not an integer of the field's range: 2000.5");
  ExpectError(Edited("\"in_features\":8", "\"in_features\":9223372036854775808"),
              absl::StatusCode::kDataLoss,
              "ampd.config: model.layers[0].in_features: not an integer of the field's range: "
              "9223372036854775808");
  ExpectError(Edited("\"seed\":0", "\"seed\":-1"), absl::StatusCode::kDataLoss,
              "ampd.config: seed: not an integer of the field's range: -1");
  ExpectError(Edited("\"lr\":0.00100000005", "\"lr\":1e39"), absl::StatusCode::kDataLoss,
              "ampd.config: optimizer.lr: not a finite float32: 1e39");
  ExpectError(Edited("\"init_scale\":65536", "\"init_scale\":1e400"), absl::StatusCode::kDataLoss,
              "ampd.config: scaler.init_scale: not a finite float64: 1e400");
  ExpectError(Edited("\"precision\":\"fp16\"", "\"precision\":\"fp8\""),
              absl::StatusCode::kDataLoss,
              "ampd.config: precision: unknown value 'fp8' (one of fp32, fp16, bf16)");
  ExpectError(Edited("\"kind\":\"tanh\"", "\"kind\":\"sigmoid\""), absl::StatusCode::kDataLoss,
              "ampd.config: model.layers[3].kind: unknown value 'sigmoid' (one of linear, relu, "
              "gelu, tanh, layer_norm, embedding)");
}

TEST_F(JobConfigCodecRefuses, OtherFormatVersions) {
  ExpectError(Edited("\"format_version\":1", "\"format_version\":0"), absl::StatusCode::kDataLoss,
              "ampd.config: format_version: 0 is not a version this ampd reads (1 to 12); the "
              "checkpoint was written by another ampd");
  ExpectError(Edited("\"format_version\":1,", ""), absl::StatusCode::kDataLoss,
              "ampd.config: format_version: missing");
  // A later format may change any key: the version is checked before them.
  ExpectError(Edited("\"format_version\":1,", "\"format_version\":13,\"new\":{},"),
              absl::StatusCode::kDataLoss,
              "ampd.config: format_version: 13 is not a version this ampd reads (1 to 12); the "
              "checkpoint was written by a newer ampd");
}

// Version 2 exists for the adaptive policy only: its configs are written as
// version 2 with its two fields, every other policy's still as version 1
// (readable by an ampd that predates version 2), and a version-1 document
// naming adaptive is refused.
TEST(JobConfigCodec, AdaptiveConfigsAreVersionTwoOthersStayVersionOne) {
  JobConfig config = DefaultJobConfig(Precision::kFp16, ScalerPolicy::kAdaptive);
  config.model = Models()[0];
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":2,")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"policy\":\"adaptive\"")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"overflow_margin_log2\":3,\"underflow_threshold\":"))
      << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  const std::string v1 =
      absl::StrReplaceAll(json, {{"\"format_version\":2", "\"format_version\":1"}});
  decoded = DecodeJobConfig(v1);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: scaler.policy: adaptive is not a policy of format_version 1");

  JobConfig pytorch = DefaultJobConfig(Precision::kFp16, ScalerPolicy::kPyTorch);
  pytorch.model = Models()[0];
  const std::string old = EncodeJobConfig(pytorch, "");
  EXPECT_TRUE(absl::StartsWith(old, "{\"format_version\":1,")) << old;
  EXPECT_FALSE(absl::StrContains(old, "overflow_margin_log2")) << old;
}

// Version 5 exists for per-layer loss scales: the key is written (last in
// the scaler) only when they are on, and an older version naming it is
// refused, as is a config the engine refuses (a GPT with per-layer scales).
TEST(JobConfigCodec, PerLayerScaleConfigsAreVersionFive) {
  JobConfig config = DefaultJobConfig(Precision::kFp16, ScalerPolicy::kAdaptive);
  config.model = Models()[0];
  const std::string off = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(off, "{\"format_version\":2,")) << off;
  EXPECT_FALSE(absl::StrContains(off, "per_layer_scales")) << off;

  config.scaler.per_layer_scales = true;
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":5,")) << json;
  EXPECT_TRUE(absl::StrContains(json, ",\"per_layer_scales\":true}")) << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());
  EXPECT_EQ(EncodeJobConfig(decoded->config.get(), ""), json);

  for (const char* older : {"2", "3", "4"}) {
    decoded = DecodeJobConfig(absl::StrReplaceAll(
        json, {{"\"format_version\":5", absl::StrCat("\"format_version\":", older)}}));
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(
        decoded.status().message(),
        absl::StrCat("ampd.config: scaler.per_layer_scales: not a key of format_version ", older));
  }
  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"per_layer_scales\":true", "\"per_layer_scales\":1"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
  // Written as the engine wrote it but with a policy that has no per-layer
  // scales: the key is not one of that policy's scaler object.
  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"policy\":\"adaptive\"", "\"policy\":\"pytorch\""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
}

// Version 3 exists for learning-rate schedules: a config with one is
// written as version 3 with an lr_schedule object, a constant one as before
// (no key, version 1 or 2), and an older version naming a schedule is
// refused, as is a schedule the engine refuses.
TEST(JobConfigCodec, ScheduleConfigsAreVersionThreeOthersKeepTheirBytes) {
  JobConfig config = DefaultJobConfig(Precision::kBf16);
  config.model = Models()[0];
  const std::string constant = EncodeJobConfig(config, "r");
  EXPECT_TRUE(absl::StartsWith(constant, "{\"format_version\":1,")) << constant;
  EXPECT_FALSE(absl::StrContains(constant, "lr_schedule")) << constant;

  config.optimizer.lr_schedule = {optim::LrScheduleKind::kWarmupCosine, 100, 5000, 6e-5f};
  const std::string json = EncodeJobConfig(config, "r");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":3,")) << json;
  EXPECT_TRUE(absl::StrContains(json,
                                "\"lr_schedule\":{\"kind\":\"warmup_cosine\",\"warmup_steps\":100,"
                                "\"decay_steps\":5000,\"min_lr\":5.99999985e-05}"))
      << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  for (const char* older : {"1", "2"}) {
    decoded = DecodeJobConfig(absl::StrReplaceAll(
        json, {{"\"format_version\":3", absl::StrCat("\"format_version\":", older)}}));
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(
        decoded.status().message(),
        absl::StrCat("ampd.config: optimizer.lr_schedule: not a key of format_version ", older));
  }
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"\"warmup_cosine\"", "\"step\""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_TRUE(absl::StartsWith(decoded.status().message(),
                               "ampd.config: optimizer.lr_schedule.kind: unknown value 'step'"))
      << decoded.status();
  decoded =
      DecodeJobConfig(absl::StrReplaceAll(json, {{"\"decay_steps\":5000", "\"decay_steps\":100"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(decoded.status().message(),
                               "ampd.config: optimizer.decay_steps: must be > warmup_steps"))
      << decoded.status();
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{",\"min_lr\":5.99999985e-05", ""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
}

TEST_F(JobConfigCodecRefuses, ConfigsTheEngineRefuses) {
  ExpectError(Edited("\"beta1\":0.899999976", "\"beta1\":1"), absl::StatusCode::kInvalidArgument,
              "ampd.config: optimizer.adam.beta1: must be in [0, 1), got 1");
  JobConfig unchained = DefaultJobConfig(Precision::kFp16);
  unchained.model = Models()[1];
  unchained.model.layers[4].in_features = 5;
  const absl::Status refused = ValidateJobConfig(unchained);
  ASSERT_FALSE(refused.ok());
  ExpectError(Edited("\"in_features\":6,", "\"in_features\":5,"),
              absl::StatusCode::kInvalidArgument, absl::StrCat("ampd.config: ", refused.message()));
}

TEST(OptimizerDefaults, PerKindArePyTorchs) {
  const optim::OptimizerSpec sgd = optim::DefaultOptimizerSpec(OptimizerKind::kSgd);
  EXPECT_EQ(sgd.kind, OptimizerKind::kSgd);
  EXPECT_EQ(sgd.sgd.lr, 1e-2f);
  EXPECT_EQ(sgd.sgd.momentum, 0.0f);
  EXPECT_EQ(sgd.sgd.weight_decay, 0.0f);
  EXPECT_FALSE(sgd.sgd.nesterov);
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    const optim::OptimizerSpec spec = optim::DefaultOptimizerSpec(kind);
    EXPECT_EQ(spec.kind, kind);
    EXPECT_EQ(spec.adam.lr, 1e-3f);
    EXPECT_EQ(spec.adam.beta1, 0.9f);
    EXPECT_EQ(spec.adam.beta2, 0.999f);
    EXPECT_EQ(spec.adam.eps, 1e-8f);
    // torch.optim.Adam's weight_decay is 0, torch.optim.AdamW's 1e-2.
    EXPECT_EQ(spec.adam.weight_decay, kind == OptimizerKind::kAdamW ? 1e-2f : 0.0f);
    EXPECT_EQ(spec.max_grad_norm, 0.0f);
    EXPECT_EQ(optim::AdamUpdateConfig(spec).decoupled_weight_decay, kind == OptimizerKind::kAdamW);
  }
  // The kind alone decides decoupling: the spec has no flag to contradict it.
  EXPECT_EQ(DefaultJobConfig(Precision::kFp16, ScalerPolicy::kPyTorch, OptimizerKind::kAdam)
                .optimizer.adam.weight_decay,
            0.0f);
}

TEST(ScalerConfig, InitialScaleIsTheIdentityWhenScalingIsOff) {
  amp::ScalerConfig c = amp::ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  EXPECT_EQ(c.InitialScale(), 4294967296.0f);
  c.enabled = false;
  EXPECT_EQ(c.InitialScale(), 1.0f);
}

// Version 3 also holds the GPT: its configs round-trip with every field, a
// layer stack's keep their older version, and a version-2 document carrying
// a GPT is refused.
TEST(JobConfigCodec, GptConfigsAreVersionThree) {
  JobConfig config = DefaultJobConfig(Precision::kBf16);
  config.model.loss = model::LossKind::kCrossEntropy;
  model::GptSpec gpt;
  gpt.vocab_size = 50257;
  gpt.context_length = 1024;
  gpt.d_model = 768;
  gpt.n_layer = 12;
  gpt.n_head = 12;
  gpt.mlp_ratio = 3;
  gpt.layer_norm_eps = 1e-6f;
  gpt.tie_embeddings = false;
  config.model.kind = gpt;
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":3,")) << json;
  EXPECT_TRUE(absl::StrContains(
      json, "\"gpt\":{\"vocab_size\":50257,\"context_length\":1024,\"d_model\":768,"))
      << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  const std::string v2 =
      absl::StrReplaceAll(json, {{"\"format_version\":3", "\"format_version\":2"}});
  decoded = DecodeJobConfig(v2);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.gpt: not a key of format_version 1 or 2");

  // A GPT that the engine refuses does not restore either.
  const std::string bad = absl::StrReplaceAll(json, {{"\"n_head\":12", "\"n_head\":7"}});
  decoded = DecodeJobConfig(bad);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "model.gpt.n_head: must divide"))
      << decoded.status();
}

// A Qwen2.5-0.5B-shaped decoder (with per-layer scales, which alone would
// be version 5) is written as version 6 and reads back bit for bit; an
// older version naming it, or a decoder the engine refuses, is refused.
TEST(JobConfigCodec, DecoderConfigsAreVersionSix) {
  JobConfig config = DefaultJobConfig(Precision::kFp16, amp::ScalerPolicy::kAdaptive);
  config.scaler.per_layer_scales = true;
  config.model.loss = model::LossKind::kCrossEntropy;
  model::DecoderSpec d;
  d.vocab_size = 151936;
  d.hidden_size = 896;
  d.intermediate_size = 4864;
  d.num_hidden_layers = 24;
  d.num_attention_heads = 14;
  d.num_key_value_heads = 2;
  d.rms_norm_eps = 1e-6f;
  d.rope_theta = 1000000.0f;
  d.max_position_embeddings = 32768;
  d.tie_word_embeddings = true;
  d.initializer_range = 0.02f;
  d.qkv_bias = true;
  config.model.kind = d;
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":6,")) << json;
  EXPECT_TRUE(absl::StrContains(
      json, "\"decoder\":{\"vocab_size\":151936,\"hidden_size\":896,\"intermediate_size\":4864,"))
      << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":6", "\"format_version\":5"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder: not a key of format_version 5");
  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"num_key_value_heads\":2", "\"num_key_value_heads\":3"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(),
                                "model.decoder.num_key_value_heads: must divide"))
      << decoded.status();
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{",\"o_bias\":false", ""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  // A model is one kind: a file that names a GPT beside the decoder is
  // not a config this codec wrote.
  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"decoder\":{",
                                  "\"gpt\":{\"vocab_size\":8,\"context_length\":4,\"d_model\":4,"
                                  "\"n_layer\":1,\"n_head\":1,\"mlp_ratio\":4,"
                                  "\"layer_norm_eps\":9.99999975e-06,\"tie_embeddings\":true},"
                                  "\"decoder\":{"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder: a model is a GPT or a decoder, not both");
}

// A small Llama-shaped decoder config (fp32, like a LoRA conformance job).
JobConfig SmallDecoderConfig() {
  JobConfig config = DefaultJobConfig(Precision::kFp32);
  config.model.loss = model::LossKind::kCrossEntropy;
  model::DecoderSpec d;
  d.vocab_size = 64;
  d.hidden_size = 32;
  d.intermediate_size = 48;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = 2;
  d.max_position_embeddings = 16;
  config.model.kind = d;
  return config;
}

TEST(JobConfigCodec, LoraConfigsAreVersionSevenAndOthersKeepTheirBytes) {
  JobConfig config = SmallDecoderConfig();
  const std::string plain = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(plain, "{\"format_version\":6,")) << plain;
  EXPECT_FALSE(absl::StrContains(plain, "lora")) << plain;

  model::LoraSpec lora;
  lora.rank = 4;
  lora.alpha = 8.0f;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  config.model.decoder()->lora = lora;
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":7,")) << json;
  EXPECT_TRUE(absl::StrContains(json,
                                "\"o_bias\":false,\"lora\":{\"rank\":4,\"alpha\":8,"
                                "\"target_modules\":[\"q_proj\",\"v_proj\",\"down_proj\"]}}"))
      << json;
  // Without the lora key the rest is the plain config's bytes.
  EXPECT_EQ(absl::StrReplaceAll(json, {{"\"format_version\":7", "\"format_version\":6"},
                                       {",\"lora\":{\"rank\":4,\"alpha\":8,\"target_modules\":["
                                        "\"q_proj\",\"v_proj\",\"down_proj\"]}",
                                        ""}}),
            plain);
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":7", "\"format_version\":6"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder.lora: not a key of format_version 6");
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"\"down_proj\"]", "7]"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "model.decoder.lora.target_modules[2]"))
      << decoded.status();
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"\"rank\":4", "\"rank\":0"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "decoder.lora.rank: must be >= 1"))
      << decoded.status();
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{",\"alpha\":8", ""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
}

// Version 8: "batch_invariant":true last, written only when it is on; any
// other config keeps its version and bytes.
TEST(JobConfigCodec, BatchInvariantJobsAreVersionEight) {
  JobConfig config = DefaultJobConfig(Precision::kBf16);
  config.model = Models()[0];
  const std::string plain = EncodeJobConfig(config, "");
  config.batch_invariant = true;
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":8,")) << json;
  EXPECT_TRUE(absl::EndsWith(json, ",\"batch_invariant\":true}")) << json;
  const std::string version = plain.substr(0, plain.find(','));
  EXPECT_EQ(absl::StrReplaceAll(
                json, {{"{\"format_version\":8", version}, {",\"batch_invariant\":true", ""}}),
            plain);
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"{\"format_version\":8", version}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "batch_invariant: not a key"))
      << decoded.status();
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{":true}", ":1}"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
}

// Version 11: "base_model" last, written only for a job made from a base
// model; every other config keeps its version and bytes.
TEST(JobConfigCodec, BaseModelJobsAreVersionEleven) {
  JobConfig config = SmallDecoderConfig();
  const std::string plain = EncodeJobConfig(config, "");
  config.base_model = "Qwen/Qwen2.5-0.5B";
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":11,")) << json;
  EXPECT_TRUE(absl::EndsWith(json, ",\"base_model\":\"Qwen/Qwen2.5-0.5B\"}")) << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->config.get().base_model, "Qwen/Qwen2.5-0.5B");
  EXPECT_EQ(EncodeJobConfig(decoded->config.get(), ""), json);
  EXPECT_FALSE(absl::StrContains(plain, "base_model")) << plain;

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":11", "\"format_version\":10"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(), "ampd.config: base_model: not a key of format_version 10");
  // A name that escapes the models dir is refused on the way in as out.
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"Qwen/Qwen2.5", "../Qwen2.5"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "base_model: the component"))
      << decoded.status();
}

// Version 9: a decoder's RoPE scaling after "o_bias", written only when its
// type is not the default; every other config keeps its version and bytes.
TEST(JobConfigCodec, RopeScaledDecodersAreVersionNine) {
  JobConfig config = SmallDecoderConfig();
  const std::string plain = EncodeJobConfig(config, "");
  config.model.decoder()->rope_scaling = {model::RopeType::kLlama3, 8.0f, 1.0f, 4.0f, 8192};
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":9,")) << json;
  const std::string rope =
      ",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,"
      "\"high_freq_factor\":4,\"original_max_position_embeddings\":8192}";
  EXPECT_TRUE(absl::StrContains(json, absl::StrCat("\"o_bias\":false", rope))) << json;
  EXPECT_EQ(
      absl::StrReplaceAll(json, {{"\"format_version\":9", "\"format_version\":6"}, {rope, ""}}),
      plain);
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":9", "\"format_version\":8"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder.rope_scaling: not a key of format_version 8");
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"\"llama3\"", "\"yarn\""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "model.decoder.rope_scaling.rope_type"))
      << decoded.status();

  config.model.decoder()->rope_scaling = {model::RopeType::kLinear, 2.0f, 0.0f, 0.0f, 0};
  decoded = DecodeJobConfig(EncodeJobConfig(config, ""));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());
}

// Version 10: a decoder's per-head q/k norm (Qwen3) as "qk_norm":true right
// after "o_bias", written only when on; every other decoder keeps its
// version and bytes, and an older version naming the key is refused.
TEST(JobConfigCodec, QkNormDecodersAreVersionTen) {
  JobConfig config = SmallDecoderConfig();
  const std::string plain = EncodeJobConfig(config, "");
  EXPECT_FALSE(absl::StrContains(plain, "qk_norm")) << plain;
  config.model.decoder()->qk_norm = true;
  config.model.decoder()->head_dim = 16;  // Qwen3's explicit head_dim, not hidden / heads (8)
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":10,")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"o_bias\":false,\"qk_norm\":true}")) << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());
  EXPECT_TRUE(decoded->config.get().model.decoder()->qk_norm);

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":10", "\"format_version\":9"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder.qk_norm: not a key of format_version 9");
  decoded = DecodeJobConfig(absl::StrReplaceAll(json, {{"\"qk_norm\":true", "\"qk_norm\":1"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);

  // With RoPE scaling and LoRA too: each key in its place, read back.
  config.model.decoder()->rope_scaling = {model::RopeType::kLinear, 2.0f, 0.0f, 0.0f, 0};
  config.model.decoder()->lora = model::LoraSpec{4, 8.0f, {"q_proj", "k_proj"}};
  decoded = DecodeJobConfig(EncodeJobConfig(config, ""));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());
}

TEST(JobConfigCodec, RopeScalingValidationNamesTheField) {
  struct Case {
    model::RopeScaling rope;
    std::string error;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {{model::RopeType::kLinear, 0.5f, 0.0f, 0.0f, 0},
       "decoder.rope_scaling.factor: must be finite and >= 1, got 0.5"},
      {{model::RopeType::kLlama3, nan, 1.0f, 4.0f, 8192}, "decoder.rope_scaling.factor"},
      {{model::RopeType::kLlama3, 8.0f, 0.0f, 4.0f, 8192},
       "decoder.rope_scaling.low_freq_factor: must be finite and > 0"},
      {{model::RopeType::kLlama3, 8.0f, 4.0f, 4.0f, 8192},
       "decoder.rope_scaling.high_freq_factor: must be finite and > low_freq_factor 4"},
      {{model::RopeType::kLlama3, 8.0f, 1.0f, 4.0f, 0},
       "decoder.rope_scaling.original_max_position_embeddings: must be > 0"},
  };
  for (const Case& c : cases) {
    JobConfig config = SmallDecoderConfig();
    config.model.decoder()->rope_scaling = c.rope;
    const absl::Status s = ValidateJobConfig(config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.error;
    EXPECT_TRUE(absl::StrContains(s.message(), c.error)) << s;
  }
}

TEST(JobConfigCodec, LoraValidationNamesTheField) {
  struct Case {
    int64_t rank;
    float alpha;
    std::vector<std::string> modules;
    std::string error;
  };
  // q_proj (32, 32), k_proj/v_proj (16, 32), gate_proj (48, 32), down_proj (32, 48).
  const Case cases[] = {
      {0, 8.0f, {"q_proj"}, "decoder.lora.rank: must be >= 1 and <= 32"},
      {17, 8.0f, {"q_proj", "k_proj"}, "decoder.lora.rank: must be >= 1 and <= 16"},
      {33, 8.0f, {"down_proj"}, "decoder.lora.rank: must be >= 1 and <= 32"},
      {4, 0.0f, {"q_proj"}, "decoder.lora.alpha: must be in (0, 65536], got 0"},
      {4, std::numeric_limits<float>::infinity(), {"q_proj"}, "decoder.lora.alpha: must be in"},
      {4, 3.4e38f, {"q_proj"}, "decoder.lora.alpha: must be in (0, 65536], got 3.4e+38"},
      {4, 8.0f, {}, "decoder.lora.target_modules: must name at least one projection"},
      {4, 8.0f, {"q_proj", "lm_head"}, "decoder.lora.target_modules[1]: must be one of"},
      {4,
       8.0f,
       {"q_proj", "v_proj", "q_proj"},
       "decoder.lora.target_modules[2]: repeats target_modules[0]"},
  };
  for (const Case& c : cases) {
    JobConfig config = SmallDecoderConfig();
    config.model.decoder()->lora = model::LoraSpec{c.rank, c.alpha, c.modules};
    const absl::Status s = ValidateJobConfig(config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.error;
    EXPECT_TRUE(absl::StrContains(s.message(), c.error)) << s;
  }
  JobConfig config = SmallDecoderConfig();
  config.model.decoder()->lora = model::LoraSpec{16, 32.0f, {"q_proj", "k_proj", "gate_proj"}};
  EXPECT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  // Per block: q (32 + 32) r, k (32 + 16) r, gate (32 + 48) r; two blocks.
  EXPECT_EQ(model::LoraParameterCount(*config.model.decoder()), 2 * 16 * (64 + 48 + 80));
}

TEST(JobConfigCodec, DistributedConfigsAreVersionFourAndRoundTrip) {
  JobConfig config = DefaultJobConfig(Precision::kFp16);
  config.model = JobConfig{}.model;
  model::LayerSpec linear;
  linear.kind = model::LayerKind::kLinear;
  linear.in_features = 4;
  linear.out_features = 2;
  config.model.layers = {linear};
  config.distributed.world_size = 4;
  config.distributed.rank = 3;
  config.distributed.group = "run-7.a_b";
  config.distributed.rendezvous = "ampd-0.ampd-peers:50052";
  config.distributed.timeout_ms = 12345;
  config.distributed.secret = std::string("0123456789abcdef\xff", 17);
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":4,")) << json;
  EXPECT_TRUE(
      absl::StrContains(json,
                        "\"distributed\":{\"world_size\":4,\"rank\":3,\"group\":\"run-7.a_b\","
                        "\"rendezvous\":\"ampd-0.ampd-peers:50052\",\"timeout_ms\":12345,"
                        "\"secret\":\"30313233343536373839616263646566ff\"}}"))
      << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->config.get().distributed, config.distributed);

  // Not a key of older versions; and a job of one ampd keeps its version.
  const std::string v3 =
      absl::StrReplaceAll(json, {{"\"format_version\":4", "\"format_version\":3"}});
  decoded = DecodeJobConfig(v3);
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  config.distributed = {};
  EXPECT_TRUE(absl::StartsWith(EncodeJobConfig(config, ""), "{\"format_version\":1,"));
}

TEST(DistributedSpec, ValidationNamesTheField) {
  dist::DistributedSpec spec;
  EXPECT_TRUE(dist::ValidateDistributedSpec(spec).ok());
  spec.rank = 1;  // world_size 1 with a rank
  EXPECT_TRUE(absl::StrContains(dist::ValidateDistributedSpec(spec).message(), "world_size"));
  spec = {.world_size = 2,
          .rank = 0,
          .group = "g",
          .rendezvous = "h:1",
          .secret = std::string(16, 's')};
  EXPECT_TRUE(dist::ValidateDistributedSpec(spec).ok()) << dist::ValidateDistributedSpec(spec);
  for (const char* address :
       {"[::1]:50052", "10.0.0.7:1", "ampd-0.ampd-peers:65535", "[fe80::1%eth0]:9"}) {
    dist::DistributedSpec good = spec;
    good.rendezvous = address;
    EXPECT_TRUE(dist::ValidateDistributedSpec(good).ok()) << address;
  }
  auto error = [](dist::DistributedSpec s) { return dist::ValidateDistributedSpec(s); };
  dist::DistributedSpec bad = spec;
  bad.rank = 2;
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "rank:"));
  bad = spec;
  bad.world_size = 65;
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "world_size:"));
  bad = spec;
  bad.group = "a/b";
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "group:"));
  bad.group = std::string(129, 'g');
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "group:"));
  bad = spec;
  for (const char* address : {"", "host", "host:0", "host:65536", ":80", "a b:1", "h:x", "[::1",
                              "127.0.0.1:1:2", "::1:80", "[::1]", "[::1]x:80", "[]:80", "[a.b]:80",
                              "h:+80", "h: 80", "h:080000", "h]:80", "[::1:80"}) {
    bad.rendezvous = address;
    EXPECT_TRUE(absl::StartsWith(error(bad).message(), "rendezvous:")) << address;
  }
  bad = spec;
  bad.timeout_ms = 0;
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "timeout_ms:"));
  bad.timeout_ms = 600001;
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "timeout_ms:"));
  bad = spec;
  for (size_t size : {size_t{0}, size_t{15}, size_t{65}}) {
    bad.secret = std::string(size, 's');
    EXPECT_TRUE(absl::StartsWith(error(bad).message(), "secret:")) << size;
  }
  // A job of one ampd carries no secret.
  bad = {};
  bad.secret = std::string(16, 's');
  EXPECT_TRUE(absl::StartsWith(error(bad).message(), "world_size:"));
}

// Version 12: Gemma 3's parts as one "gemma" object, written only when one
// differs from the Llama default; a Llama decoder keeps its version and
// bytes, and an older version naming the key is refused.
TEST(JobConfigCodec, GemmaDecodersAreVersionTwelve) {
  JobConfig config = SmallDecoderConfig();
  const std::string plain = EncodeJobConfig(config, "");
  EXPECT_FALSE(absl::StrContains(plain, "gemma")) << plain;
  model::DecoderSpec& d = *config.model.decoder();
  d.qk_norm = true;
  d.norm_unit_offset = true;
  d.mlp_activation = model::MlpActivation::kGeluTanh;
  d.sandwich_norms = true;
  d.scale_embeddings = true;
  d.query_pre_attn_scalar = 32.0f;
  d.sliding_layers.assign(static_cast<size_t>(d.num_hidden_layers), false);
  d.sliding_layers[0] = true;
  d.sliding_window = 20;
  d.rope_local_theta = 10000.0f;
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  const std::string json = EncodeJobConfig(config, "");
  EXPECT_TRUE(absl::StartsWith(json, "{\"format_version\":12,")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"mlp_activation\":\"gelu_tanh\"")) << json;
  absl::StatusOr<DecodedJobConfig> decoded = DecodeJobConfig(json);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameConfig(config, decoded->config.get());

  decoded = DecodeJobConfig(
      absl::StrReplaceAll(json, {{"\"format_version\":12", "\"format_version\":11"}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().message(),
            "ampd.config: model.decoder.gemma: not a key of format_version 11");
  decoded = DecodeJobConfig(absl::StrReplaceAll(
      json, {{"\"mlp_activation\":\"gelu_tanh\"", "\"mlp_activation\":\"relu\""}}));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss);
  // A window that no layer can use without one sliding layer is refused.
  d.sliding_layers.assign(static_cast<size_t>(d.num_hidden_layers), true);
  d.sliding_window = 0;
  EXPECT_FALSE(ValidateJobConfig(config).ok());
}

}  // namespace
}  // namespace ampd::engine
