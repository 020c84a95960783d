// The GPT model spec: validation messages naming the field, the parameter
// count against Hugging Face GPT-2's published sizes, overflow refusal, and
// the micro-batch check of token sequences (shapes, ids, ignored targets).
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/model/batch_check.h"

namespace ampd::engine::model {
namespace {

ModelSpec Gpt(int64_t vocab, int64_t context, int64_t d_model, int64_t n_layer, int64_t n_head) {
  ModelSpec spec;
  spec.loss = LossKind::kCrossEntropy;
  GptSpec g;
  g.vocab_size = vocab;
  g.context_length = context;
  g.d_model = d_model;
  g.n_layer = n_layer;
  g.n_head = n_head;
  spec.kind = g;
  return spec;
}

void ExpectInvalid(const ModelSpec& spec, const std::string& message_start) {
  const absl::Status s = ValidateModelSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), message_start)) << s;
}

TEST(GptSpec, ParameterCountIsGpt2s) {
  // transformers' GPT2LMHeadModel(GPT2Config()).num_parameters(): 124439808
  // (lm_head tied to wte); GPT-2 medium (24 x 1024, 16 heads): 354823168.
  ModelSpec small = Gpt(50257, 1024, 768, 12, 12);
  ASSERT_TRUE(ValidateModelSpec(small).ok()) << ValidateModelSpec(small);
  EXPECT_EQ(ParameterCount(small), 124439808);
  EXPECT_EQ(ParameterCount(Gpt(50257, 1024, 1024, 24, 16)), 354823168);
  // Untied: lm_head.weight (V, C) on top.
  small.gpt()->tie_embeddings = false;
  EXPECT_EQ(ParameterCount(small), 124439808 + 50257 * 768);
}

TEST(GptSpec, RefusesBadFieldsNamingThem) {
  ModelSpec s = Gpt(256, 64, 128, 2, 4);
  ASSERT_TRUE(ValidateModelSpec(s).ok());
  ModelSpec bad = s;
  bad.gpt()->n_head = 3;
  ExpectInvalid(bad, "gpt.n_head: must divide d_model 128, got 3");
  bad = s;
  bad.gpt()->vocab_size = 0;
  ExpectInvalid(bad, "gpt.vocab_size: must be > 0, got 0");
  bad = s;
  bad.gpt()->context_length = -1;
  ExpectInvalid(bad, "gpt.context_length: must be > 0");
  bad = s;
  bad.gpt()->n_layer = 0;
  ExpectInvalid(bad, "gpt.n_layer: must be > 0");
  bad = s;
  bad.gpt()->mlp_ratio = 0;
  ExpectInvalid(bad, "gpt.mlp_ratio: must be > 0");
  bad = s;
  bad.gpt()->layer_norm_eps = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(bad, "gpt.layer_norm_eps: must be finite and > 0");
  bad = s;
  bad.gpt()->layer_norm_eps = 0.0f;
  ExpectInvalid(bad, "gpt.layer_norm_eps: must be finite and > 0");
  bad = s;
  bad.layers.push_back(LayerSpec{});
  ExpectInvalid(bad, "layers: must be empty when gpt is set");
  bad = s;
  bad.loss = LossKind::kMse;
  ExpectInvalid(bad, "loss: a GPT's loss is the token cross-entropy");
  bad = s;
  bad.loss_multiplier = 0.0f;
  ExpectInvalid(bad, "loss_multiplier: must be finite and > 0");
}

TEST(GptSpec, RefusesSizesThatOverflow) {
  ModelSpec wide = Gpt(256, 64, 128, 1, 1);
  wide.gpt()->mlp_ratio = int64_t{1} << 60;
  ExpectInvalid(wide, "gpt.mlp_ratio: gives the MLP's hidden width");
  // c_attn alone (3 C^2 = 3 x 2^54) fits; the MLP's 8 C^2 does not.
  ModelSpec s = Gpt(256, 64, int64_t{1} << 27, 1, 1);
  s.gpt()->mlp_ratio = 8;
  ExpectInvalid(s, "gpt.mlp_ratio: gives the MLP's weights");
  // A d_model too large by itself is d_model's fault, whatever mlp_ratio.
  for (const int64_t d_model : {int64_t{1} << 28, int64_t{1} << 31, int64_t{1} << 40}) {
    s = Gpt(256, 64, d_model, 1, 1);
    ExpectInvalid(s, "gpt.d_model: gives the attention's c_attn weight");
  }
  s = Gpt(int64_t{1} << 50, 64, 128, 1, 1);
  ExpectInvalid(s, "gpt.vocab_size: gives the token embedding");
  s = Gpt(256, int64_t{1} << 50, 128, 1, 1);
  ExpectInvalid(s, "gpt.context_length: gives the position embedding");
  s = Gpt(256, 64, 1 << 20, 1 << 14, 1);  // 12 C^2 per layer x 2^14 layers: over 2^56
  ExpectInvalid(s, "gpt: the model has more than");
  s = Gpt(256, 64, 128, std::numeric_limits<int64_t>::max(), 1);
  ExpectInvalid(s, "gpt: the model has more than");
  EXPECT_EQ(ParameterCount(s), std::numeric_limits<int64_t>::max());
}

HostTensor Ids(codec::DType dtype, const std::vector<int64_t>& shape,
               const std::vector<int64_t>& values) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = shape;
  for (int64_t v : values) {
    if (dtype == codec::DType::kI32) {
      const auto x = static_cast<int32_t>(v);
      t.data.append(reinterpret_cast<const char*>(&x), 4);
    } else {
      t.data.append(reinterpret_cast<const char*>(&v), 8);
    }
  }
  return t;
}

absl::Status Check(const ModelSpec& spec, const HostTensor& inputs, const HostTensor& targets) {
  return CheckBatchFitsModel(spec, inputs, targets, "micro_batches[0].inputs",
                             "micro_batches[0].targets");
}

TEST(GptBatch, AcceptsSequencesUpToTheContext) {
  const ModelSpec s = Gpt(10, 4, 8, 1, 2);
  using codec::DType;
  EXPECT_TRUE(Check(s, Ids(DType::kI32, {2, 4}, {0, 1, 2, 3, 9, 8, 7, 6}),
                    Ids(DType::kI64, {2, 4}, {1, 2, 3, -100, 8, 7, 6, 5}))
                  .ok());
  EXPECT_TRUE(Check(s, Ids(DType::kI64, {1, 1}, {3}), Ids(DType::kI32, {1, 1}, {4})).ok());
}

TEST(GptBatch, RefusesBadSequencesNamingTheField) {
  const ModelSpec s = Gpt(10, 4, 8, 1, 2);
  using codec::DType;
  auto expect = [&](const HostTensor& in, const HostTensor& tg, const std::string& message) {
    const absl::Status st = Check(s, in, tg);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_EQ(st.message(), message);
  };
  expect(Ids(DType::kI32, {1, 5}, {0, 0, 0, 0, 0}), Ids(DType::kI32, {1, 5}, {0, 0, 0, 0, 0}),
         "micro_batches[0].inputs: T = 5 exceeds context_length 4");
  expect(Ids(DType::kI32, {1, 2}, {0, 10}), Ids(DType::kI32, {1, 2}, {0, 0}),
         "micro_batches[0].inputs[0, 1]: 10 is outside [0, 10)");
  expect(Ids(DType::kI32, {2, 2}, {0, 1, 2, 3}), Ids(DType::kI32, {2, 2}, {0, 1, -1, 3}),
         "micro_batches[0].targets[1, 0]: -1 is outside [0, 10) and not -100");
  expect(Ids(DType::kI32, {1, 2}, {0, 1}), Ids(DType::kI32, {1, 2}, {-100, -100}),
         "micro_batches[0].targets: every target is -100; a micro-batch needs at least one target "
         "token to train on");
  expect(Ids(DType::kI32, {4}, {0, 1, 2, 3}), Ids(DType::kI32, {4}, {0, 1, 2, 3}),
         "micro_batches[0].inputs: expected I32 or I64 (B, T) token ids with B, T >= 1, got "
         "I32(4)");
  expect(Ids(DType::kI32, {2, 2}, {0, 1, 2, 3}), Ids(DType::kI32, {1, 4}, {0, 1, 2, 3}),
         "micro_batches[0].targets: expected I32 or I64 (2, 2) token ids (the inputs' shape), "
         "got I32(1, 4)");
  HostTensor floats;
  floats.dtype = DType::kF32;
  floats.shape = {1, 2};
  floats.data.assign(8, '\0');
  expect(floats, Ids(DType::kI32, {1, 2}, {0, 1}),
         "micro_batches[0].inputs: expected I32 or I64 (B, T) token ids with B, T >= 1, got "
         "F32(1, 2)");
  expect(Ids(DType::kI32, {1, 2}, {0, 1}), floats,
         "micro_batches[0].targets: expected I32 or I64 (1, 2) token ids (the inputs' shape), "
         "got F32(1, 2)");
}

}  // namespace
}  // namespace ampd::engine::model
