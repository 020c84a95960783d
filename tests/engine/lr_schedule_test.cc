// Learning-rate schedules: optim::ScheduledLearningRate against a line-for-
// line transcription of nanoGPT's get_lr at every applied count around its
// boundaries (0, warmup - 1, warmup, decay_steps, past it), the spec's
// validation naming the field, and the Trainer's use of it: the count is
// of applied updates (a skipped step does not advance it), a step's
// learning_rate overrides it for that step only, and the report carries
// the lr used. Also Trainer::Evaluate against the engine's own Step.
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/engine/config/optimizer_spec.h"
#include "tests/engine/engine_test_util.h"
#include "tests/support/nanogpt_lr.h"

namespace ampd::engine {
namespace {

using optim::LrScheduleKind;
using optim::OptimizerKind;
using optim::OptimizerSpec;

using test_support::NanoGptGetLr;

OptimizerSpec Cosine(OptimizerKind kind, float lr, int64_t warmup, int64_t decay, float min_lr) {
  OptimizerSpec spec = optim::DefaultOptimizerSpec(kind);
  (kind == OptimizerKind::kSgd ? spec.sgd.lr : spec.adam.lr) = lr;
  spec.lr_schedule.kind = LrScheduleKind::kWarmupCosine;
  spec.lr_schedule.warmup_steps = warmup;
  spec.lr_schedule.decay_steps = decay;
  spec.lr_schedule.min_lr = min_lr;
  return spec;
}

TEST(LrSchedule, WarmupCosineIsNanoGptsGetLr) {
  struct Case {
    OptimizerKind kind;
    float lr;
    int64_t warmup;
    int64_t decay;
    float min_lr;
  };
  // nanoGPT's GPT-2 defaults (6e-4, 2000, 600000, 6e-5), a short one, no
  // warmup, a floor above zero and at zero, and SGD's lr field.
  for (const Case& c : {Case{OptimizerKind::kAdamW, 6e-4f, 2000, 600000, 6e-5f},
                        Case{OptimizerKind::kAdamW, 1e-2f, 3, 8, 5e-4f},
                        Case{OptimizerKind::kAdam, 3e-3f, 0, 5, 0.0f},
                        Case{OptimizerKind::kSgd, 0.1f, 10, 11, 0.01f}}) {
    const OptimizerSpec spec = Cosine(c.kind, c.lr, c.warmup, c.decay, c.min_lr);
    ASSERT_TRUE(optim::ValidateOptimizerSpec(spec).ok()) << optim::ValidateOptimizerSpec(spec);
    std::vector<int64_t> counts = {
        0,           1,       c.warmup - 1, c.warmup,      c.warmup + 1, (c.warmup + c.decay) / 2,
        c.decay - 1, c.decay, c.decay + 1,  c.decay + 1000};
    for (int64_t a : counts) {
      if (a < 0) continue;
      SCOPED_TRACE(absl::StrCat("lr ", c.lr, " warmup ", c.warmup, " decay ", c.decay, " a ", a));
      const float want = static_cast<float>(NanoGptGetLr(a, c.lr, c.warmup, c.decay, c.min_lr));
      EXPECT_EQ(optim::ScheduledLearningRate(spec, a), want);
    }
    // The boundaries' own values.
    EXPECT_FLOAT_EQ(optim::ScheduledLearningRate(spec, 0),
                    c.warmup > 0 ? c.lr / static_cast<float>(c.warmup + 1) : c.lr);
    EXPECT_FLOAT_EQ(optim::ScheduledLearningRate(spec, c.warmup), c.lr);
    EXPECT_FLOAT_EQ(optim::ScheduledLearningRate(spec, c.decay), c.min_lr);
    EXPECT_EQ(optim::ScheduledLearningRate(spec, c.decay + 1), c.min_lr);
  }
  // Constant: lr whatever the count, the schedule's fields unread.
  OptimizerSpec constant = optim::DefaultOptimizerSpec(OptimizerKind::kAdamW);
  constant.lr_schedule.decay_steps = -5;
  ASSERT_TRUE(optim::ValidateOptimizerSpec(constant).ok());
  for (int64_t a : {0, 1, 1000000}) EXPECT_EQ(optim::ScheduledLearningRate(constant, a), 1e-3f);
}

TEST(LrSchedule, ValidationNamesTheField) {
  const auto expect = [](const OptimizerSpec& spec, const char* field) {
    const absl::Status s = optim::ValidateOptimizerSpec(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StartsWith(s.message(), absl::StrCat(field, ": "))) << s.message();
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, -1, 10, 0.0f), "warmup_steps");
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, 10, 10, 0.0f), "decay_steps");
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, 0, 0, 0.0f), "decay_steps");
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, 0, 10, -1e-4f), "min_lr");
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, 0, 10, nan), "min_lr");
  expect(Cosine(OptimizerKind::kAdamW, 1e-3f, 0, 10, inf), "min_lr");
  expect(Cosine(OptimizerKind::kAdamW, inf, 0, 10, 0.0f), "adam.lr");
  expect(Cosine(OptimizerKind::kSgd, nan, 0, 10, 0.0f), "sgd.lr");
}

// A 4 -> 2 MSE model whose batch `index` is finite, or holds an inf (which
// overflows every gradient: the step is skipped).
JobConfig SmallJob(model::Precision precision) {
  JobConfig config = DefaultJobConfig(precision);
  config.model.layers = {testing::Linear(4, 8), testing::Act(model::LayerKind::kTanh),
                         testing::Linear(8, 2)};
  config.optimizer = Cosine(OptimizerKind::kAdamW, 1e-2f, 2, 6, 1e-3f);
  config.seed = 5;
  // A scale the clean batches never overflow at: only the poisoned skip.
  if (precision == model::Precision::kFp16) config.scaler.init_scale = 1024;
  return config;
}

MicroBatch Batch(int index, int64_t rows = 6, bool poisoned = false) {
  testing::DataRng rng(static_cast<uint64_t>(100 + index));
  std::vector<float> x = rng.UniformVector(static_cast<size_t>(rows * 4), -1.0f, 1.0f);
  if (poisoned) x[0] = std::numeric_limits<float>::infinity();
  return {testing::F32({rows, 4}, x),
          testing::F32({rows, 2}, rng.UniformVector(static_cast<size_t>(rows * 2), -1.0f, 1.0f))};
}

TEST(LrSchedule, TheTrainerCountsAppliedStepsAndHonoursTheOverride) {
  const JobConfig config = SmallJob(model::Precision::kFp16);
  std::unique_ptr<Trainer> trainer = testing::MakeTrainer(config);
  ASSERT_NE(trainer, nullptr);
  const auto lr_at = [&](int64_t a) {
    return static_cast<float>(NanoGptGetLr(a, 1e-2f, 2, 6, 1e-3f));
  };
  // step: poisoned?, override, expected applied count before it.
  struct Want {
    bool poisoned;
    std::optional<float> lr;
    int64_t applied_before;
  };
  const std::vector<Want> plan = {
      {true, std::nullopt, 0},  {true, std::nullopt, 0},  {false, std::nullopt, 0},
      {false, std::nullopt, 1}, {true, std::nullopt, 2},  {false, 0.25f, 2},
      {false, std::nullopt, 3}, {false, std::nullopt, 4}, {false, std::nullopt, 5},
      {false, std::nullopt, 6}, {false, std::nullopt, 7}, {false, std::nullopt, 8}};
  for (size_t i = 0; i < plan.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("step ", i + 1));
    StepInput input;
    input.micro_batches = {Batch(static_cast<int>(i), 6, plan[i].poisoned)};
    input.learning_rate = plan[i].lr;
    ASSERT_EQ(trainer->applied_steps(), plan[i].applied_before);
    absl::StatusOr<StepReport> report = trainer->Step(input);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->scaler.skipped, plan[i].poisoned);
    EXPECT_EQ(report->learning_rate, plan[i].lr.value_or(lr_at(plan[i].applied_before)));
  }
  EXPECT_EQ(trainer->applied_steps(), 9);
}

// Evaluate on the engine alone: the loss the next Step reports, and the
// exported state (weights, optimizer, scaler, both counts) unchanged.
TEST(Evaluate, IsTheNextStepsLossAndChangesNoState) {
  for (model::Precision precision :
       {model::Precision::kFp16, model::Precision::kFp32, model::Precision::kBf16}) {
    SCOPED_TRACE(model::PrecisionName(precision));
    std::unique_ptr<Trainer> trainer = testing::MakeTrainer(SmallJob(precision));
    ASSERT_NE(trainer, nullptr);
    for (int i = 0; i < 6; ++i) {
      StepInput input;
      input.micro_batches = {Batch(i, 6, /*poisoned=*/i == 1)};
      ASSERT_TRUE(trainer->Step(input).ok());
      absl::StatusOr<checkpoint::StateDict> before = trainer->ExportState();
      ASSERT_TRUE(before.ok()) << before.status();
      EvaluateInput eval;
      eval.micro_batches = {Batch(50 + i, 3), Batch(60 + i, 6)};
      absl::StatusOr<EvaluateReport> evaluated = trainer->Evaluate(eval);
      ASSERT_TRUE(evaluated.ok()) << evaluated.status();
      EXPECT_EQ(evaluated->samples, 9);
      absl::StatusOr<checkpoint::StateDict> after = trainer->ExportState();
      ASSERT_TRUE(after.ok()) << after.status();
      EXPECT_EQ(testing::StateDiff(*before, *after), "");
      StepInput next;
      next.micro_batches = eval.micro_batches;
      absl::StatusOr<StepReport> stepped = trainer->Step(next);
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      EXPECT_EQ(stepped->loss, evaluated->loss);
    }
    // Bad input is refused naming the field, before anything runs.
    EvaluateInput empty;
    EXPECT_EQ(trainer->Evaluate(empty).status().code(), absl::StatusCode::kInvalidArgument);
    EvaluateInput wrong;
    wrong.micro_batches = {Batch(0),
                           {testing::F32({6, 3}, std::vector<float>(18, 0.0f)),
                            testing::F32({6, 2}, std::vector<float>(12, 0.0f))}};
    const absl::Status s = trainer->Evaluate(wrong).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "micro_batches[1].inputs")) << s.message();
  }
}

}  // namespace
}  // namespace ampd::engine
