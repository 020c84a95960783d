// ForwardBackward calls then OptimStep against one Step over the same
// micro-batches, on the CPU backend: the weights, optimizer moments, scaler
// state and reports must be the same bit for bit, for fp32, bf16 and fp16
// with dynamic scaling through a skipped update, on a full decoder and a
// LoRA one, with a token loss (a sum) and with the model's own loss (a mean
// over micro_batches_in_update). Also: OptimStep's hyperparameters are used
// for that update only, nothing accumulated is refused, and a failed call
// drops what was accumulated.
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "server/engine/trainer/trainer.h"

namespace ampd::engine {
namespace {

using namespace ampd::engine::testing;

JobConfig TinyDecoderJob(model::Precision precision, bool lora) {
  JobConfig config = DefaultJobConfig(precision);
  model::ModelSpec spec;
  spec.loss = model::LossKind::kCrossEntropy;
  model::DecoderSpec d;
  d.vocab_size = 32;
  d.hidden_size = 32;
  d.intermediate_size = 64;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = 2;
  d.max_position_embeddings = 16;
  d.rope_theta = 1000.0f;
  d.rms_norm_eps = 1e-5f;
  d.qkv_bias = true;
  if (lora) d.lora = model::LoraSpec{4, 8.0f, {"q_proj", "v_proj", "down_proj"}};
  spec.kind = d;
  config.model = spec;
  config.optimizer.adam.lr = 3e-3f;
  config.optimizer.max_grad_norm = 1.0f;
  config.seed = 5;
  // fp16: a first scale that overflows, so the first update is skipped,
  // and a short growth interval, so the scale also grows.
  if (precision == model::Precision::kFp16) {
    config.scaler.init_scale = 0x1p30;
    config.scaler.growth_interval = 2;
  }
  return config;
}

// K micro-batches of (B, T) token ids, with per-token weights for `loss`
// when it is cross_entropy.
StepInput Batches(int k, DataRng& rng, LossFnKind loss = LossFnKind::kModel) {
  StepInput input;
  for (int i = 0; i < k; ++i) {
    const int64_t b = 2 + i % 2;  // two shapes
    const int64_t t = 8;
    std::vector<int32_t> ids, targets;
    std::vector<float> weights;
    for (int64_t j = 0; j < b * t; ++j) {
      ids.push_back(rng.Index(32));
      targets.push_back(j % 5 == 4 ? -100 : rng.Index(32));
      weights.push_back(rng.Uniform(0.5f, 1.5f));
    }
    MicroBatch mb{I32({b, t}, ids), I32({b, t}, targets)};
    if (loss == LossFnKind::kCrossEntropy) mb.weights = F32({b, t}, weights);
    input.micro_batches.push_back(std::move(mb));
  }
  input.loss_fn.kind = loss;
  return input;
}

// `step` split into calls of the given sizes, in order.
std::vector<ForwardBackwardInput> Split(const StepInput& step, const std::vector<int>& sizes) {
  std::vector<ForwardBackwardInput> calls;
  size_t at = 0;
  for (const int n : sizes) {
    ForwardBackwardInput call;
    call.batch.loss_fn = step.loss_fn;
    call.batch.return_logprobs = step.return_logprobs;
    call.micro_batches_in_update = static_cast<int64_t>(step.micro_batches.size());
    for (int i = 0; i < n; ++i) call.batch.micro_batches.push_back(step.micro_batches[at++]);
    calls.push_back(std::move(call));
  }
  return calls;
}

void ExpectSameBits(float a, float b, const std::string& what) {
  EXPECT_EQ(std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(b))
      << what << ": " << a << " vs " << b;
}

void ExpectSameUpdate(const StepReport& step, const StepReport& optim) {
  EXPECT_EQ(step.step, optim.step);
  EXPECT_EQ(step.applied_steps, optim.applied_steps);
  EXPECT_EQ(step.scaler.skipped, optim.scaler.skipped);
  EXPECT_EQ(step.scaler.found_inf, optim.scaler.found_inf);
  ExpectSameBits(step.scaler.scale_before, optim.scaler.scale_before, "scale_before");
  ExpectSameBits(step.scaler.scale_after, optim.scaler.scale_after, "scale_after");
  ExpectSameBits(step.loss, optim.loss, "loss");
  ExpectSameBits(step.learning_rate, optim.learning_rate, "learning_rate");
  ASSERT_EQ(step.grad_norm.has_value(), optim.grad_norm.has_value());
  if (step.grad_norm.has_value()) ExpectSameBits(*step.grad_norm, *optim.grad_norm, "grad_norm");
  ExpectSameBits(step.grad_max_abs, optim.grad_max_abs, "grad_max_abs");
}

// Steps of Step on one trainer and of ForwardBackward calls + OptimStep on
// another, from the same seed and batches: the same state after each. An
// fp16 job runs on (up to 40 updates) until its scaler has skipped an
// update and applied two.
void RunBoth(const JobConfig& config, LossFnKind loss, int updates) {
  const bool fp16 = config.precision == model::Precision::kFp16;
  if (fp16) updates = 40;
  std::unique_ptr<Trainer> fused = MakeTrainer(config);
  std::unique_ptr<Trainer> split = MakeTrainer(config);
  ASSERT_TRUE(fused && split);
  DataRng rng(11);
  int skipped = 0;
  for (int u = 0; u < updates; ++u) {
    SCOPED_TRACE(absl::StrCat("update ", u + 1));
    StepInput step = Batches(4, rng, loss);
    step.return_logprobs = true;
    absl::StatusOr<StepReport> a = fused->Step(step);
    ASSERT_TRUE(a.ok()) << a.status();
    // Calls of 1, 2 and 1 micro-batches: the second one spans two shapes.
    float call_loss_sum = 0;
    size_t logprob_at = 0;
    const std::vector<ForwardBackwardInput> calls = Split(step, {1, 2, 1});
    for (size_t c = 0; c < calls.size(); ++c) {
      absl::StatusOr<ForwardBackwardReport> r = split->ForwardBackward(calls[c]);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->pending, static_cast<int64_t>(c + 1));
      EXPECT_EQ(split->pending_forward_backward(), static_cast<int64_t>(c + 1));
      ExpectSameBits(r->loss_scale, a->scaler.scale_before, "loss_scale");
      // Each call's per-token log-probs are the Step's for its micro-batches.
      ASSERT_EQ(r->logprobs.size(), calls[c].batch.micro_batches.size());
      for (const HostTensor& lp : r->logprobs) {
        ASSERT_LT(logprob_at, a->logprobs.size());
        EXPECT_EQ(lp.data, a->logprobs[logprob_at].data)
            << "logprobs of micro-batch " << logprob_at;
        ++logprob_at;
      }
      call_loss_sum += r->loss;
      if (c == 0) {
        // An evaluation between the calls (its own workspace sizes, the
        // loss sum it shares) leaves the accumulated gradients alone.
        EvaluateInput eval;
        eval.micro_batches.push_back({step.micro_batches[1].inputs, step.micro_batches[1].targets});
        ASSERT_TRUE(split->Evaluate(eval).ok());
      }
    }
    if (loss != LossFnKind::kModel && std::isfinite(a->loss)) {
      EXPECT_NEAR(call_loss_sum, a->loss, 1e-4 * std::fabs(a->loss));
    }
    OptimStepInput optim;
    optim.forward_backward_calls = static_cast<int64_t>(calls.size());
    absl::StatusOr<StepReport> b = split->OptimStep(optim);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(split->pending_forward_backward(), 0);
    ExpectSameUpdate(*a, *b);
    if (a->scaler.skipped) ++skipped;
    if (fp16 && skipped > 0 && u + 1 - skipped >= 2) updates = u + 1;
    absl::StatusOr<checkpoint::StateDict> sa = fused->ExportState();
    absl::StatusOr<checkpoint::StateDict> sb = split->ExportState();
    ASSERT_TRUE(sa.ok() && sb.ok());
    ASSERT_EQ(StateDiff(*sa, *sb), "");
  }
  if (config.precision == model::Precision::kFp16) {
    EXPECT_GT(skipped, 0) << "the fp16 case must cover a skipped update";
    EXPECT_LT(skipped, updates) << "and applied ones";
  }
}

TEST(Accumulate, CallsThenOptimStepEqualOneStepBitForBit) {
  for (const bool lora : {false, true}) {
    for (const model::Precision precision :
         {model::Precision::kFp32, model::Precision::kBf16, model::Precision::kFp16}) {
      for (const LossFnKind loss : {LossFnKind::kCrossEntropy, LossFnKind::kModel}) {
        SCOPED_TRACE(absl::StrCat(model::PrecisionName(precision), lora ? " LoRA " : " full ",
                                  LossFnName(loss)));
        RunBoth(TinyDecoderJob(precision, lora), loss, 3);
      }
    }
  }
}

TEST(Accumulate, OptimStepHyperparametersApplyToThatUpdateOnly) {
  const JobConfig config = TinyDecoderJob(model::Precision::kFp32, false);
  // A job configured with the values the OptimStep carries trains as the
  // job whose OptimStep overrides its own.
  JobConfig same = config;
  same.optimizer.adam.lr = 1e-2f;
  same.optimizer.adam.beta1 = 0.8f;
  same.optimizer.adam.beta2 = 0.95f;
  same.optimizer.adam.eps = 1e-6f;
  same.optimizer.adam.weight_decay = 0.1f;
  same.optimizer.max_grad_norm = 0.5f;
  std::unique_ptr<Trainer> configured = MakeTrainer(same);
  std::unique_ptr<Trainer> overridden = MakeTrainer(config);
  ASSERT_TRUE(configured && overridden);
  DataRng rng(3);
  const StepInput step = Batches(2, rng);
  ASSERT_TRUE(configured->Step(step).ok());
  for (const ForwardBackwardInput& call : Split(step, {1, 1})) {
    ASSERT_TRUE(overridden->ForwardBackward(call).ok());
  }
  OptimStepInput optim;
  optim.forward_backward_calls = 2;
  optim.learning_rate = 1e-2f;
  optim.beta1 = 0.8f;
  optim.beta2 = 0.95f;
  optim.eps = 1e-6f;
  optim.weight_decay = 0.1f;
  optim.max_grad_norm = 0.5f;
  absl::StatusOr<StepReport> r = overridden->OptimStep(optim);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->learning_rate, 1e-2f);
  absl::StatusOr<checkpoint::StateDict> a = configured->ExportState();
  absl::StatusOr<checkpoint::StateDict> b = overridden->ExportState();
  ASSERT_TRUE(a.ok() && b.ok());
  // The weights and moments (the metadata holds the configs, which differ).
  EXPECT_EQ(StateDiff(*a, *b, /*compare_metadata=*/false), "");
  // The next update is the job's own again: lr 3e-3.
  ASSERT_TRUE(overridden->ForwardBackward(Split(step, {2})[0]).ok());
  optim = OptimStepInput();
  optim.forward_backward_calls = 1;
  r = overridden->OptimStep(optim);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->learning_rate, 3e-3f);
}

TEST(Accumulate, NothingAccumulatedIsRefusedAndFailedCallsDropTheRest) {
  std::unique_ptr<Trainer> trainer = MakeTrainer(TinyDecoderJob(model::Precision::kFp32, false));
  ASSERT_TRUE(trainer);
  OptimStepInput optim;
  optim.forward_backward_calls = 1;
  absl::StatusOr<StepReport> r = trainer->OptimStep(optim);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(trainer->applied_steps(), 0);
  EXPECT_EQ(trainer->steps_run(), 0);

  DataRng rng(4);
  const StepInput step = Batches(2, rng);
  ASSERT_TRUE(trainer->ForwardBackward(Split(step, {1})[0]).ok());
  // A call refused before it ran (a bad batch) keeps what was accumulated.
  ForwardBackwardInput bad = Split(step, {1})[0];
  bad.batch.micro_batches[0].targets = I32({1, 1}, {0});
  EXPECT_EQ(trainer->ForwardBackward(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trainer->pending_forward_backward(), 1);
  // A learning rate belongs to OptimStep.
  ForwardBackwardInput with_lr = Split(step, {1})[0];
  with_lr.batch.learning_rate = 0.1f;
  EXPECT_EQ(trainer->ForwardBackward(with_lr).status().code(), absl::StatusCode::kInvalidArgument);
  // Out-of-range hyperparameters are refused before anything is spent.
  optim.beta1 = 1.0f;
  EXPECT_EQ(trainer->OptimStep(optim).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(trainer->pending_forward_backward(), 1);
  trainer->DropAccumulated();
  EXPECT_EQ(trainer->pending_forward_backward(), 0);
}

}  // namespace
}  // namespace ampd::engine
