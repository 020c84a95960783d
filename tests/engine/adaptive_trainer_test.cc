// The adaptive scaler wired into the step (CPU backend): the first step
// runs at the scale calibrated from its own gradients (the largest power of
// two keeping max|g| * S under 65504 / 2^3), where pytorch's first step at
// 65536 overflows and is skipped; the step reports max|g| of the unscaled
// gradients from the fused check; loading a state without scaler keys
// calibrates again, loading one with them does not.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/engine/amp/adaptive_policy.h"
#include "server/engine/jobs/job.h"
#include "server/engine/trainer/trainer.h"
#include "tests/engine/engine_test_util.h"

namespace ampd::engine {
namespace {

using testing::DataRng;
using testing::F32;
using testing::Linear;

JobConfig Config(amp::ScalerPolicy policy) {
  JobConfig c = DefaultJobConfig(model::Precision::kFp16, policy);
  c.model.layers = {Linear(16, 32), testing::Act(model::LayerKind::kReLU), Linear(32, 8)};
  c.model.loss = model::LossKind::kMse;
  c.seed = 11;
  return c;
}

// Targets far from the initial outputs: gradients in the hundreds, so that
// 65536 * max|g| overflows fp16.
StepInput Batch(uint64_t seed) {
  DataRng rng(seed);
  StepInput input;
  MicroBatch mb;
  mb.inputs = F32({32, 16}, rng.UniformVector(32 * 16, -1, 1));
  mb.targets = F32({32, 8}, rng.UniformVector(32 * 8, -400, 400));
  input.micro_batches.push_back(std::move(mb));
  return input;
}

StepReport Step(Trainer& t, const StepInput& input) {
  absl::StatusOr<StepReport> r = t.Step(input);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : StepReport{};
}

TEST(AdaptiveTrainer, FirstStepRunsAtTheCalibratedScaleAndIsNotSkipped) {
  const amp::ScalerConfig defaults = amp::ScalerConfig::Defaults(amp::ScalerPolicy::kAdaptive);
  std::unique_ptr<Trainer> pytorch = testing::MakeTrainer(Config(amp::ScalerPolicy::kPyTorch));
  std::unique_ptr<Trainer> adaptive = testing::MakeTrainer(Config(amp::ScalerPolicy::kAdaptive));
  ASSERT_NE(pytorch, nullptr);
  ASSERT_NE(adaptive, nullptr);
  const StepReport p = Step(*pytorch, Batch(1));
  EXPECT_TRUE(p.scaler.skipped) << "the batch must overflow pytorch's 65536";

  const StepReport a = Step(*adaptive, Batch(1));
  EXPECT_FALSE(a.scaler.skipped);
  ASSERT_TRUE(std::isfinite(a.grad_max_abs));
  ASSERT_GT(a.grad_max_abs, 0.0f);
  // Power-of-two scales commute with fp16 rounding in the normal range, so
  // the max measured at S = 1 is the one the step reports at S.
  EXPECT_EQ(a.scaler.scale_before, amp::CalibratedScale(a.grad_max_abs, defaults));
  EXPECT_LE(static_cast<double>(a.grad_max_abs) * a.scaler.scale_before, 65504.0 / 8);
  EXPECT_GT(static_cast<double>(a.grad_max_abs) * a.scaler.scale_before * 2, 65504.0 / 8);
  EXPECT_EQ(a.applied_steps, 1);

  // The applied update is the one a pytorch job started at that scale applies.
  JobConfig tuned = Config(amp::ScalerPolicy::kPyTorch);
  tuned.scaler.init_scale = a.scaler.scale_before;
  std::unique_ptr<Trainer> reference = testing::MakeTrainer(tuned);
  const StepReport r = Step(*reference, Batch(1));
  EXPECT_EQ(r.loss, a.loss);
  EXPECT_EQ(r.grad_norm, a.grad_norm);
  absl::StatusOr<checkpoint::StateDict> ra = adaptive->ExportState();
  absl::StatusOr<checkpoint::StateDict> rr = reference->ExportState();
  ASSERT_TRUE(ra.ok() && rr.ok());
  for (size_t i = 0; i < ra->tensors.size(); ++i) {
    EXPECT_EQ(ra->tensors[i].tensor.data, rr->tensors[i].tensor.data) << ra->tensors[i].name;
  }

  // Every step reports max|g| of the unscaled gradients.
  const StepReport b = Step(*adaptive, Batch(2));
  EXPECT_GT(b.grad_max_abs, 0.0f);
  EXPECT_EQ(b.scaler.scale_before, a.scaler.scale_after);
}

TEST(AdaptiveTrainer, LoadingAStateWithoutScalerKeysCalibratesAgain) {
  const amp::ScalerConfig defaults = amp::ScalerConfig::Defaults(amp::ScalerPolicy::kAdaptive);
  std::unique_ptr<Trainer> t = testing::MakeTrainer(Config(amp::ScalerPolicy::kAdaptive));
  ASSERT_NE(t, nullptr);
  Step(*t, Batch(1));
  absl::StatusOr<checkpoint::StateDict> state = t->ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->metadata.at("scaler.calibrated"), "1");

  // With scaler keys: the loaded scale is used as is, no calibration.
  checkpoint::StateDict pinned = *state;
  pinned.metadata["scaler.scale"] = amp::FormatStateNumber(1.0);
  ASSERT_TRUE(t->LoadState(pinned).ok());
  EXPECT_EQ(Step(*t, Batch(3)).scaler.scale_before, 1.0f);

  // Without: the next step calibrates on its own gradients.
  checkpoint::StateDict bare = *state;
  for (auto it = bare.metadata.begin(); it != bare.metadata.end();) {
    it = absl::StartsWith(it->first, "scaler.") ? bare.metadata.erase(it) : std::next(it);
  }
  ASSERT_TRUE(t->LoadState(bare).ok());
  const StepReport r = Step(*t, Batch(3));
  EXPECT_FALSE(r.scaler.skipped);
  EXPECT_EQ(r.scaler.scale_before, amp::CalibratedScale(r.grad_max_abs, defaults));
  EXPECT_GT(r.scaler.scale_before, 1.0f);

  // A framework policy still refuses a state without its keys.
  std::unique_ptr<Trainer> p = testing::MakeTrainer(Config(amp::ScalerPolicy::kPyTorch));
  EXPECT_EQ(p->LoadState(bare).code(), absl::StatusCode::kInvalidArgument);
}

// A replayed step (a resent sequence number) answers from the recorded
// report: a deferred growth survives the record, and a report without one
// records exactly what it did before the adaptive policy existed.
TEST(AdaptiveTrainer, RecordedStepReportKeepsAGrowthDeferral) {
  StepReport r;
  r.step = 3;
  r.scaler.growth_deferred = true;
  absl::StatusOr<StepReport> back = DecodeStepReport(EncodeStepReport(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->scaler.growth_deferred);
  r.scaler.growth_deferred = false;
  EXPECT_FALSE(absl::StrContains(EncodeStepReport(r), "growth_deferred"));
  back = DecodeStepReport(EncodeStepReport(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->scaler.growth_deferred);
  EXPECT_FALSE(absl::StrContains(EncodeStepReport(r), "layer_scales_after"));

  // Per-layer scales survive the record too.
  r.scaler.layer_scales_after = {16777216.0f, 0.5f, 2048.0f};
  back = DecodeStepReport(EncodeStepReport(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->scaler.layer_scales_after, r.scaler.layer_scales_after);
  const std::string text = EncodeStepReport(r);
  EXPECT_FALSE(DecodeStepReport(absl::StrCat(text, ";layer_scales_after=0x1p+1")).ok());
  EXPECT_FALSE(DecodeStepReport(
                   absl::StrReplaceAll(text, {{"layer_scales_after=", "layer_scales_after=x,"}}))
                   .ok());
}

// A token loss's mismatch survives the record too (NaN included: a NaN
// log-prob is reported, not hidden); a report without one writes no key.
TEST(RecordedStepReport, KeepsTheLogprobMismatch) {
  StepReport r;
  r.step = 4;
  EXPECT_FALSE(absl::StrContains(EncodeStepReport(r), "logprob_mismatch"));
  for (const float mismatch : {0.0f, 0.375f, std::nanf("")}) {
    r.logprob_mismatch = mismatch;
    absl::StatusOr<StepReport> back = DecodeStepReport(EncodeStepReport(r));
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_TRUE(back->logprob_mismatch.has_value());
    if (std::isnan(mismatch)) {
      EXPECT_TRUE(std::isnan(*back->logprob_mismatch));
    } else {
      EXPECT_EQ(*back->logprob_mismatch, mismatch);
    }
  }
}

}  // namespace
}  // namespace ampd::engine
