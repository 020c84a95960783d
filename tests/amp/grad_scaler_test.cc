// GradScaler against each framework's scaler: per policy, hand-written
// found_inf sequences whose scale and tracker traces were worked out from
// the framework's source by hand and written out below; validation; state
// dicts; and a randomized comparison with a deliberately plain second
// implementation kept in this file and sharing no code with the scaler.
#include "server/engine/amp/grad_scaler.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ampd::engine::amp {
namespace {

constexpr bool G = false;  // a good step: all gradients finite
constexpr bool I = true;   // found_inf

GradScaler MakeScaler(const ScalerConfig& config) {
  absl::StatusOr<GradScaler> scaler = GradScaler::Create(config);
  EXPECT_TRUE(scaler.ok()) << scaler.status();
  return *std::move(scaler);
}

ScalerUpdate Step(GradScaler& scaler, bool found_inf) {
  absl::StatusOr<ScalerUpdate> update = scaler.Update(found_inf);
  EXPECT_TRUE(update.ok()) << update.status();
  return update.ok() ? *update : ScalerUpdate{};
}

double Key(const GradScaler& scaler, const std::string& key) {
  ScalerState state = scaler.StateDict();
  auto it = state.find(key);
  EXPECT_NE(it, state.end()) << "state has no key " << key;
  return it == state.end() ? std::nan("") : it->second;
}

void ExpectInvalidNaming(const absl::Status& status, const std::string& name) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), name))
      << "message does not name '" << name << "': " << status.message();
}

// Runs `steps` and checks, after each, the scale and each named state key
// against the expected trace (one vector entry per step).
void ExpectTrace(GradScaler& scaler, const std::vector<bool>& steps,
                 const std::vector<float>& scales,
                 const std::vector<std::pair<std::string, std::vector<double>>>& keys) {
  ASSERT_EQ(steps.size(), scales.size());
  for (const auto& [key, values] : keys) ASSERT_EQ(values.size(), steps.size()) << key;
  for (size_t i = 0; i < steps.size(); ++i) {
    const float before = scaler.scale();
    ScalerUpdate update = Step(scaler, steps[i]);
    EXPECT_EQ(update.scale_before, before) << "step " << i;
    EXPECT_EQ(update.scale_after, scales[i]) << "step " << i;
    EXPECT_EQ(scaler.scale(), scales[i]) << "step " << i;
    EXPECT_EQ(update.found_inf, steps[i]) << "step " << i;
    EXPECT_EQ(update.skipped, steps[i]) << "step " << i;  // every bad step is skipped
    EXPECT_EQ(update.grew, scales[i] > before) << "step " << i;
    EXPECT_EQ(update.backed_off, scales[i] < before) << "step " << i;
    for (const auto& [key, values] : keys) {
      EXPECT_EQ(Key(scaler, key), values[i]) << key << " after step " << i;
    }
  }
}

// ---------------------------------------------------------------- policies

TEST(PolicyNames, RoundTrip) {
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    EXPECT_EQ(PolicyFromName(PolicyName(p)), p);
  }
  EXPECT_EQ(PolicyName(ScalerPolicy::kPyTorch), "pytorch");
  EXPECT_EQ(PolicyName(ScalerPolicy::kDeepSpeed), "deepspeed");
  EXPECT_FALSE(PolicyFromName("apex").has_value());
  EXPECT_FALSE(PolicyFromName("PyTorch").has_value());
}

TEST(Defaults, PerPolicy) {
  ScalerConfig pt = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  EXPECT_EQ(pt.init_scale, 65536.0);
  EXPECT_EQ(pt.growth_factor, 2.0);
  EXPECT_EQ(pt.backoff_factor, 0.5);
  EXPECT_EQ(pt.growth_interval, 2000);
  EXPECT_FALSE(pt.min_scale.has_value());
  EXPECT_FALSE(pt.max_scale.has_value());
  EXPECT_TRUE(pt.enabled);
  EXPECT_TRUE(pt.dynamic);

  ScalerConfig pd = ScalerConfig::Defaults(ScalerPolicy::kPaddle);
  EXPECT_EQ(pd.init_scale, 32768.0);
  EXPECT_EQ(pd.growth_factor, 2.0);
  EXPECT_EQ(pd.backoff_factor, 0.5);
  EXPECT_EQ(pd.growth_interval, 1000);
  EXPECT_EQ(pd.hysteresis, 2);

  ScalerConfig ds = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  EXPECT_EQ(ds.init_scale, 65536.0);
  EXPECT_EQ(ds.growth_interval, 1000);
  EXPECT_EQ(ds.hysteresis, 2);
  EXPECT_EQ(ds.min_scale, 1.0);
  EXPECT_FALSE(ds.consecutive_hysteresis);
  EXPECT_TRUE(ds.raise_at_min_scale);

  ScalerConfig mg = ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  EXPECT_EQ(mg.init_scale, 4294967296.0);
  EXPECT_EQ(mg.growth_interval, 1000);
  EXPECT_EQ(mg.hysteresis, 2);
  EXPECT_EQ(mg.min_scale, 1.0);

  // Only DeepSpeed raises at its floor; adaptive is ampd's own and does.
  EXPECT_FALSE(pt.raise_at_min_scale);
  EXPECT_FALSE(pd.raise_at_min_scale);
  EXPECT_FALSE(mg.raise_at_min_scale);
  EXPECT_TRUE(ScalerConfig::Defaults(ScalerPolicy::kAdaptive).raise_at_min_scale);

  for (const ScalerConfig& c : {pt, pd, ds, mg}) EXPECT_TRUE(c.Validate().ok());
}

TEST(PyTorch, GrowsAtExactlyGrowthInterval) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = 1024;
  c.growth_interval = 3;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {G, G, G, G, G, G}, {1024, 1024, 2048, 2048, 2048, 4096},
              {{"_growth_tracker", {1, 2, 0, 1, 2, 0}}});
}

TEST(PyTorch, DefaultScalerGrowsAfter2000GoodSteps) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kPyTorch));
  for (int i = 0; i < 1999; ++i) EXPECT_FALSE(Step(s, G).grew);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(Key(s, "_growth_tracker"), 1999);
  ScalerUpdate u = Step(s, G);
  EXPECT_TRUE(u.grew);
  EXPECT_EQ(s.scale(), 131072.0f);
}

TEST(PyTorch, InfBacksOffAndResetsTracker) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = 1024;
  c.growth_interval = 3;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {G, G, I, G, G, G, I, I}, {1024, 1024, 512, 512, 512, 1024, 512, 256},
              {{"_growth_tracker", {1, 2, 0, 1, 2, 0, 0, 0}}});
}

TEST(PyTorch, RefusesGrowthThatWouldOverflowFloat32) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = std::ldexp(1.0, 127);  // 2^127 * 2 is inf in float32
  c.growth_interval = 2;
  GradScaler s = MakeScaler(c);
  const float top = std::ldexp(1.0f, 127);
  ExpectTrace(s, {G, G, G, G, I, G, G}, {top, top, top, top, top / 2, top / 2, top},
              {{"_growth_tracker", {1, 0, 1, 0, 0, 1, 0}}});
}

TEST(PyTorch, RefusesGrowthFromFltMax) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = FLT_MAX;
  c.growth_interval = 1;
  c.growth_factor = 1.0000001;  // even a tiny growth rounds FLT_MAX to inf
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {G, G}, {FLT_MAX, FLT_MAX}, {{"_growth_tracker", {0, 0}}});
}

TEST(PyTorch, FallsBelowOneWithoutFloor) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = 2;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, I, I}, {1, 0.5, 0.25, 0.125}, {{"_growth_tracker", {0, 0, 0, 0}}});
}

TEST(PyTorch, MinScaleFloorsAndMaxScaleCaps) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = 1024;
  c.growth_interval = 1;
  c.min_scale = 300;
  c.max_scale = 3000;  // not a power of two: the cap itself is reached
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {G, G, G, I, I, I, I, G, G, G},
              {2048, 3000, 3000, 1500, 750, 375, 300, 600, 1200, 2400},
              {{"_growth_tracker", {0, 0, 0, 0, 0, 0, 0, 0, 0, 0}}});
}

TEST(PyTorch, MaxScaleBelowInfReachedEvenWhenProductOverflows) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  c.init_scale = std::ldexp(1.0, 127);
  c.max_scale = FLT_MAX;  // 2^128 > FLT_MAX, so the cap, not the guard, decides
  c.growth_interval = 1;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {G, G}, {FLT_MAX, FLT_MAX}, {{"_growth_tracker", {0, 0}}});
}

// PyTorch's kernel computes float * double and rounds once; Paddle and
// Megatron multiply two float32s. 3 * 1.1 and 3 * 0.3 tell them apart.
TEST(Arithmetic, PerPolicyRoundingOfNonPowerOfTwoFactors) {
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(p);
    c.init_scale = 3;
    c.min_scale.reset();
    c.growth_factor = 1.1;
    c.backoff_factor = 0.3;
    c.growth_interval = 1;
    c.hysteresis = 1;
    const bool float_multiply = p != ScalerPolicy::kPyTorch;
    GradScaler up = MakeScaler(c);
    Step(up, G);
    EXPECT_EQ(up.scale(), float_multiply ? std::nextafter(3.3f, 4.0f) : 3.3f) << PolicyName(p);
    GradScaler down = MakeScaler(c);
    Step(down, I);
    EXPECT_EQ(down.scale(), float_multiply ? std::nextafter(0.9f, 1.0f) : 0.9f) << PolicyName(p);
  }
}

TEST(Paddle, ConsecutiveBadStepsBackOffAndEveryBadStepSkips) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPaddle);
  c.init_scale = 1024;
  c.growth_interval = 3;  // incr_every_n_steps
  c.hysteresis = 2;       // decr_every_n_nan_or_inf
  GradScaler s = MakeScaler(c);
  // I: first bad step only counts; I: second backs off; I: counts again;
  // G resets decr_count; I counts from 1 again (no backoff); G G G grows.
  ExpectTrace(
      s, {I, I, I, G, I, G, G, G, G}, {1024, 512, 512, 512, 512, 512, 512, 1024, 1024},
      {{"incr_count", {0, 0, 0, 1, 0, 1, 2, 0, 1}}, {"decr_count", {1, 0, 1, 0, 1, 0, 0, 0, 0}}});
}

TEST(Paddle, DecrEveryOneBacksOffEveryBadStep) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPaddle);
  c.init_scale = 8;
  c.hysteresis = 1;
  c.growth_interval = 2;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, G, I, G, G}, {4, 2, 2, 1, 1, 2},
              {{"incr_count", {0, 0, 1, 0, 1, 0}}, {"decr_count", {0, 0, 0, 0, 0, 0}}});
}

TEST(Paddle, StaticScaleStillSkips) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPaddle);
  c.dynamic = false;  // use_dynamic_loss_scaling=False
  c.init_scale = 1024;
  c.growth_interval = 1;
  c.hysteresis = 1;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, G, G, I}, {1024, 1024, 1024, 1024, 1024},
              {{"incr_count", {0, 0, 0, 0, 0}},
               {"decr_count", {0, 0, 0, 0, 0}},
               {"use_dynamic_loss_scaling", {0, 0, 0, 0, 0}}});
}

TEST(Paddle, MinAndMaxScale) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPaddle);
  c.init_scale = 4;
  c.hysteresis = 1;
  c.growth_interval = 1;
  c.min_scale = 2;
  c.max_scale = 8;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, G, G, G}, {2, 2, 4, 8, 8},
              {{"incr_count", {0, 0, 0, 0, 0}}, {"decr_count", {0, 0, 0, 0, 0}}});
}

TEST(DeepSpeed, HysteresisConsumedAndRefilledOnGrowth) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = 1024;
  c.growth_interval = 3;  // scale_window
  c.hysteresis = 2;       // delayed_shift
  GradScaler s = MakeScaler(c);
  // cur_iter before each step: 0..11. Growth when (cur_iter - last) % 3 == 0.
  // Overflow at cur_hysteresis 2 only decrements it; at 1 it backs off and is
  // not refilled until the next growth.
  ExpectTrace(s, {G, G, G, I, I, I, G, G, G, I, G, I},
              {1024, 1024, 2048, 2048, 1024, 512, 512, 512, 1024, 1024, 1024, 512},
              {{"cur_hysteresis", {2, 2, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1}},
               {"cur_iter", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}},
               {"last_overflow_iter", {-1, -1, -1, 3, 4, 5, 5, 5, 5, 9, 9, 11}}});
}

TEST(DeepSpeed, ConsecutiveHysteresisRefillsOnEveryGoodStep) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = 1024;
  c.growth_interval = 3;
  c.hysteresis = 2;
  c.consecutive_hysteresis = true;
  GradScaler s = MakeScaler(c);
  // Same sequence as above: the G at cur_iter 10 refills, so the last I only
  // decrements instead of backing off.
  ExpectTrace(s, {G, G, G, I, I, I, G, G, G, I, G, I},
              {1024, 1024, 2048, 2048, 1024, 512, 512, 512, 1024, 1024, 1024, 1024},
              {{"cur_hysteresis", {2, 2, 2, 1, 1, 1, 2, 2, 2, 1, 2, 1}},
               {"cur_iter", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}},
               {"last_overflow_iter", {-1, -1, -1, 3, 4, 5, 5, 5, 5, 9, 9, 11}}});
}

TEST(DeepSpeed, DelayedShiftOneAlwaysBacksOff) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = 64;
  c.growth_interval = 2;
  c.hysteresis = 1;
  GradScaler s = MakeScaler(c);
  ExpectTrace(
      s, {I, G, I, G, G, G, G}, {32, 32, 16, 16, 32, 32, 64},
      {{"cur_hysteresis", {1, 1, 1, 1, 1, 1, 1}}, {"last_overflow_iter", {0, 0, 2, 2, 2, 2, 2}}});
}

TEST(DeepSpeed, FloorsAtMinScaleThenFailsWithClearError) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = 3;
  c.hysteresis = 1;
  c.min_scale = 1;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I}, {1.5, 1}, {{"cur_iter", {1, 2}}});  // max(0.75, 1) = 1
  const ScalerState before = s.StateDict();
  absl::StatusOr<ScalerUpdate> update = s.Update(I);
  ASSERT_FALSE(update.ok());
  EXPECT_EQ(update.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(update.status().message(), "min_scale"))
      << update.status().message();
  EXPECT_TRUE(absl::StrContains(update.status().message(), "deepspeed"))
      << update.status().message();
  EXPECT_EQ(s.StateDict(), before);  // nothing advanced
  // A good step still works afterwards (the engine decides to stop the job).
  EXPECT_FALSE(Step(s, G).skipped);
}

TEST(DeepSpeed, AtMinScaleWithoutRaiseStaysThere) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = 2;
  c.hysteresis = 1;
  c.raise_at_min_scale = false;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, I}, {1, 1, 1}, {{"last_overflow_iter", {0, 1, 2}}});
}

TEST(DeepSpeed, DefaultsNeedWindowGoodStepsToGrow) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed));
  for (int i = 0; i < 999; ++i) Step(s, G);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_TRUE(Step(s, G).grew);
  EXPECT_EQ(s.scale(), 131072.0f);
  // Two overflows (hysteresis 2): the first only decrements, the second halves.
  EXPECT_FALSE(Step(s, I).backed_off);
  EXPECT_TRUE(Step(s, I).backed_off);
  EXPECT_EQ(s.scale(), 65536.0f);
}

TEST(DeepSpeed, CapAndGuard) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
  c.init_scale = std::ldexp(1.0, 126);
  c.growth_interval = 1;
  GradScaler s = MakeScaler(c);
  const float t = std::ldexp(1.0f, 126);
  ExpectTrace(s, {G, G, G}, {2 * t, 2 * t, 2 * t}, {{"cur_iter", {1, 2, 3}}});

  c.init_scale = 1024;
  c.max_scale = 4096;
  GradScaler capped = MakeScaler(c);
  ExpectTrace(capped, {G, G, G}, {2048, 4096, 4096}, {{"cur_hysteresis", {2, 2, 2}}});
}

TEST(Megatron, HysteresisTrackerAndGrowthTracker) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  c.init_scale = 1024;
  c.growth_interval = 3;
  c.hysteresis = 2;
  GradScaler s = MakeScaler(c);
  // The hysteresis tracker keeps falling below 0 and every overflow past it
  // backs off, until a growth refills it.
  ExpectTrace(s, {G, G, I, I, I, G, G, G, I, G, I},
              {1024, 1024, 1024, 512, 256, 256, 256, 512, 512, 512, 256},
              {{"growth_tracker", {1, 2, 0, 0, 0, 1, 2, 0, 0, 1, 0}},
               {"hysteresis_tracker", {2, 2, 1, 0, -1, -1, -1, 2, 1, 1, 0}}});
}

// The counters predict the scaler, whatever its policy and history: from
// any point, exactly overflows_until_backoff overflows in a row back the
// scale off (at the last of them), and exactly growth_interval -
// growth_tracker clean steps in a row grow it.
TEST(Counters, PredictTheNextBackoffAndGrowthForEveryPolicy) {
  for (const ScalerPolicy policy : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle,
                                    ScalerPolicy::kDeepSpeed, ScalerPolicy::kMegatron}) {
    for (const int64_t hysteresis : {1, 2, 3}) {
      for (const bool consecutive : {false, true}) {
        if (policy != ScalerPolicy::kDeepSpeed && consecutive) continue;
        if (policy == ScalerPolicy::kPyTorch && hysteresis != 1) continue;
        ScalerConfig c = ScalerConfig::Defaults(policy);
        c.init_scale = 1048576;
        c.growth_interval = 4;
        c.hysteresis = hysteresis;
        c.consecutive_hysteresis = consecutive;
        GradScaler s = MakeScaler(c);
        uint64_t state = 12345;
        for (int step = 0; step < 40; ++step) {
          SCOPED_TRACE(testing::Message() << PolicyName(policy) << " hysteresis " << hysteresis
                                          << " consecutive " << consecutive << " step " << step);
          const ScalerCounters counters = s.counters();
          GradScaler overflowing = s;
          int64_t overflows = 0;
          float before = overflowing.scale();
          do {
            Step(overflowing, I);
            ++overflows;
          } while (overflowing.scale() == before && overflows < 10);
          EXPECT_EQ(overflows, counters.overflows_until_backoff);
          GradScaler clean = s;
          int64_t good = 0;
          before = clean.scale();
          do {
            Step(clean, G);
            ++good;
          } while (clean.scale() == before && good < 10);
          EXPECT_EQ(good, c.growth_interval - counters.growth_tracker);
          state = state * 6364136223846793005ULL + 1442695040888963407ULL;
          const ScalerUpdate update = Step(s, (state >> 33) % 3 == 0);
          EXPECT_EQ(update.counters.growth_tracker, s.counters().growth_tracker);
          EXPECT_EQ(update.counters.overflows_until_backoff, s.counters().overflows_until_backoff);
        }
      }
    }
  }
}

TEST(Counters, ZeroWhenTheScaleCannotMove) {
  for (const ScalerPolicy policy : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle,
                                    ScalerPolicy::kDeepSpeed, ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(policy);
    c.dynamic = false;
    GradScaler s = MakeScaler(c);
    Step(s, G);
    Step(s, I);
    EXPECT_EQ(s.counters().growth_tracker, 0) << PolicyName(policy);
    EXPECT_EQ(s.counters().overflows_until_backoff, 0) << PolicyName(policy);
  }
}

TEST(Megatron, FloorsAtMinScaleWithoutError) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  c.init_scale = 4;
  c.hysteresis = 1;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, I, I, I}, {2, 1, 1, 1}, {{"hysteresis_tracker", {0, -1, -2, -3}}});
}

// Every policy (adaptive's job-wide and per-layer scales too): a run of
// overflows backs the scale off until the next backoff would leave a scale
// whose inverse overflows float32 (2^-128); that step fails the job with
// FailedPrecondition, whatever raise_at_min_scale says, instead of letting
// the scale reach 0 and skipping every later step. Every state on the way,
// the last included, loads back into a fresh scaler.
TEST(Floor, UnderflowFailsForEveryPolicyAndEveryStateReachedLoads) {
  for (const ScalerPolicy policy :
       {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
        ScalerPolicy::kMegatron, ScalerPolicy::kAdaptive}) {
    for (const bool raise : {false, true}) {
      SCOPED_TRACE(absl::StrCat(PolicyName(policy), raise ? " raise" : " no raise"));
      ScalerConfig c = ScalerConfig::Defaults(policy);
      c.init_scale = std::ldexp(1.0, -100);
      c.hysteresis = 1;
      c.raise_at_min_scale = raise;
      c.max_scale.reset();
      // deepspeed needs a floor: the smallest float32, below every usable scale.
      c.min_scale.reset();
      if (policy == ScalerPolicy::kDeepSpeed) c.min_scale = std::ldexp(1.0, -149);
      GradScaler s = MakeScaler(c);
      int steps = 0;
      absl::StatusOr<ScalerUpdate> u = s.Update(I);
      for (; u.ok() && steps < 100; ++steps) {
        ASSERT_GT(s.scale(), 0.0f);
        GradScaler fresh = MakeScaler(c);
        ASSERT_TRUE(fresh.LoadStateDict(s.StateDict()).ok());
        ASSERT_EQ(fresh.StateDict(), s.StateDict());
        u = s.Update(I);
      }
      ASSERT_FALSE(u.ok());
      EXPECT_EQ(steps, 27);  // 2^-100 down to 2^-127
      EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_TRUE(absl::StrContains(u.status().message(), "minimum loss scale")) << u.status();
      EXPECT_TRUE(absl::StrContains(u.status().message(), "overflows float32")) << u.status();
      // The state is the last usable one, and it loads.
      EXPECT_EQ(s.scale(), std::ldexp(1.0f, -127));
      const ScalerState last = s.StateDict();
      EXPECT_FALSE(s.Update(I).ok());
      EXPECT_EQ(s.StateDict(), last);
      GradScaler fresh = MakeScaler(c);
      ASSERT_TRUE(fresh.LoadStateDict(last).ok());
      // A clean step still applies there, and the scale can grow again.
      EXPECT_TRUE(s.Update(G).ok());
    }
  }
}

// A loaded scale that is already unusable (its inverse is inf) fails at its
// first overflow, without a flag that could let it loop.
TEST(Floor, UnusableLoadedScaleFailsAtItsFirstOverflow) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  GradScaler s = MakeScaler(c);
  ScalerState state = s.StateDict();
  state["scale"] = 1e-45;
  ASSERT_TRUE(s.LoadStateDict(state).ok());
  absl::StatusOr<ScalerUpdate> u = s.Update(I);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_GT(s.scale(), 0.0f);
}

// raise_at_min_scale means the same for every policy that has a min_scale:
// an overflow due to back off at the floor fails (state unchanged), and
// without it the scale stays at the floor and the step is only skipped.
TEST(Floor, RaiseAtMinScaleForEveryPolicy) {
  for (const ScalerPolicy policy :
       {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
        ScalerPolicy::kMegatron, ScalerPolicy::kAdaptive}) {
    SCOPED_TRACE(PolicyName(policy));
    ScalerConfig c = ScalerConfig::Defaults(policy);
    c.init_scale = 8;
    c.min_scale = 4;
    c.max_scale.reset();
    c.hysteresis = 1;
    c.raise_at_min_scale = true;
    GradScaler raising = MakeScaler(c);
    ASSERT_TRUE(raising.Update(I).ok());
    EXPECT_EQ(raising.scale(), 4.0f);
    const ScalerState at_floor = raising.StateDict();
    absl::StatusOr<ScalerUpdate> u = raising.Update(I);
    ASSERT_FALSE(u.ok());
    EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(u.status().message(), "(min_scale 4)")) << u.status();
    EXPECT_EQ(raising.StateDict(), at_floor);

    c.raise_at_min_scale = false;
    GradScaler holding = MakeScaler(c);
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<ScalerUpdate> held = holding.Update(I);
      ASSERT_TRUE(held.ok()) << held.status();
      EXPECT_TRUE(held->skipped);
      EXPECT_EQ(holding.scale(), 4.0f);
    }
  }
}

// Per-layer scales: the group that backs off fails the job when it cannot.
TEST(Floor, PerLayerGroupUnderflowFails) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.per_layer_scales = true;
  c.max_scale.reset();
  c.init_scale = std::ldexp(1.0, -126);
  absl::StatusOr<GradScaler> made = GradScaler::Create(c, 2);
  ASSERT_TRUE(made.ok()) << made.status();
  GradScaler s = *std::move(made);
  StepGradStats overflow;
  overflow.found_inf = true;
  overflow.layer_max_abs = {std::numeric_limits<float>::infinity(), 1.0f};
  ASSERT_TRUE(s.Update(overflow).ok());  // group 0: 2^-126 -> 2^-127
  EXPECT_EQ(s.layer_scale(0), std::ldexp(1.0f, -127));
  const ScalerState last = s.StateDict();
  absl::StatusOr<ScalerUpdate> u = s.Update(overflow);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.StateDict(), last);
  absl::StatusOr<GradScaler> fresh = GradScaler::Create(c, 2);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(fresh->LoadStateDict(last).ok());
  EXPECT_EQ(fresh->StateDict(), last);
}

TEST(Megatron, CapResetsBothTrackers) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  c.init_scale = 1024;
  c.max_scale = 2048;
  c.growth_interval = 2;
  c.hysteresis = 3;
  GradScaler s = MakeScaler(c);
  ExpectTrace(s, {I, G, G, G, G}, {1024, 1024, 2048, 2048, 2048},
              {{"growth_tracker", {0, 1, 0, 1, 0}}, {"hysteresis_tracker", {2, 2, 3, 3, 3}}});
}

TEST(Megatron, RefusesGrowthToInf) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kMegatron);
  c.init_scale = std::ldexp(1.0, 127);
  c.growth_interval = 1;
  GradScaler s = MakeScaler(c);
  const float top = std::ldexp(1.0f, 127);
  ExpectTrace(s, {G, I, I, G}, {top, top, top / 2, top},
              {{"growth_tracker", {0, 0, 0, 0}}, {"hysteresis_tracker", {2, 1, 0, 2}}});
}

// ---------------------------------------------------- static and disabled

TEST(Static, ScaleFixedButInfStepsSkippedForEveryPolicy) {
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(p);
    c.dynamic = false;
    c.init_scale = 128;
    c.growth_interval = 1;
    c.hysteresis = 1;
    GradScaler s = MakeScaler(c);
    const ScalerState initial = s.StateDict();
    for (bool inf : {I, G, G, I, I, G}) {
      ScalerUpdate u = Step(s, inf);
      EXPECT_EQ(u.scale_before, 128.0f) << PolicyName(p);
      EXPECT_EQ(u.scale_after, 128.0f) << PolicyName(p);
      EXPECT_EQ(u.skipped, inf) << PolicyName(p);
      EXPECT_FALSE(u.grew);
      EXPECT_FALSE(u.backed_off);
    }
    EXPECT_EQ(s.StateDict(), initial) << PolicyName(p);
  }
}

TEST(Disabled, IdentityScaleNeverSkipsEmptyState) {
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(p);
    c.enabled = false;
    c.hysteresis = 1;
    c.min_scale = p == ScalerPolicy::kDeepSpeed ? std::optional<double>(65536) : std::nullopt;
    GradScaler s = MakeScaler(c);
    EXPECT_EQ(s.scale(), 1.0f);
    for (bool inf : {I, I, I, G}) {
      // With deepspeed at min_scale an enabled scaler would fail here.
      ScalerUpdate u = Step(s, inf);
      EXPECT_EQ(u.found_inf, inf);
      EXPECT_FALSE(u.skipped) << PolicyName(p);
      EXPECT_EQ(u.scale_before, 1.0f);
      EXPECT_EQ(u.scale_after, 1.0f);
      EXPECT_FALSE(u.grew);
      EXPECT_FALSE(u.backed_off);
    }
    EXPECT_TRUE(s.StateDict().empty());
    // As PyTorch: a disabled scaler ignores whatever it is given.
    EXPECT_TRUE(s.LoadStateDict({}).ok());
    EXPECT_TRUE(s.LoadStateDict({{"scale", 8.0}}).ok());
    EXPECT_EQ(s.scale(), 1.0f);
  }
}

TEST(Disabled, EmptyStateIntoEnabledScalerIsAnError) {
  GradScaler disabled = MakeScaler([] {
    ScalerConfig c;
    c.enabled = false;
    return c;
  }());
  GradScaler enabled = MakeScaler(ScalerConfig{});
  absl::Status status = enabled.LoadStateDict(disabled.StateDict());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "empty")) << status;
}

TEST(PrecisionDefault, Fp16DynamicBf16AndFp32StaticOneThatSkips) {
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    ScalerConfig fp16 = ScalerConfig::ForPrecisionDefault(codec::DType::kF16, p);
    ScalerConfig defaults = ScalerConfig::Defaults(p);
    EXPECT_TRUE(fp16.dynamic);
    EXPECT_EQ(fp16.init_scale, defaults.init_scale);
    EXPECT_EQ(fp16.policy, p);
    for (codec::DType d : {codec::DType::kBF16, codec::DType::kF32}) {
      ScalerConfig c = ScalerConfig::ForPrecisionDefault(d, p);
      EXPECT_EQ(c.policy, p);
      EXPECT_TRUE(c.enabled);
      EXPECT_FALSE(c.dynamic);
      GradScaler s = MakeScaler(c);
      EXPECT_EQ(s.scale(), 1.0f);
      for (int i = 0; i < 5000; ++i) {
        const bool inf = i % 7 == 0;
        ScalerUpdate u = Step(s, inf);
        ASSERT_EQ(u.skipped, inf);
        ASSERT_EQ(u.scale_after, 1.0f);
      }
    }
  }
  EXPECT_EQ(ScalerConfig::ForPrecisionDefault(codec::DType::kF16).policy, ScalerPolicy::kPyTorch);
}

// ------------------------------------------------------------- validation

struct BadField {
  const char* what;
  ScalerPolicy policy;
  void (*mutate)(ScalerConfig&);
  const char* field;  // must appear in the message
};

TEST(Validate, NamesTheBadField) {
  const std::vector<BadField> cases = {
      {"growth 1", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.growth_factor = 1.0; },
       "growth_factor"},
      {"growth 0.5", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.growth_factor = 0.5; },
       "growth_factor"},
      {"growth nan", ScalerPolicy::kPyTorch,
       [](ScalerConfig& c) { c.growth_factor = std::nan(""); }, "growth_factor"},
      {"growth inf", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.growth_factor = HUGE_VAL; },
       "growth_factor"},
      {"paddle incr", ScalerPolicy::kPaddle, [](ScalerConfig& c) { c.growth_factor = 1.0; },
       "incr_ratio"},
      {"backoff 0", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.backoff_factor = 0.0; },
       "backoff_factor"},
      {"backoff 1", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.backoff_factor = 1.0; },
       "backoff_factor"},
      {"backoff neg", ScalerPolicy::kMegatron, [](ScalerConfig& c) { c.backoff_factor = -0.5; },
       "backoff_factor"},
      {"backoff nan", ScalerPolicy::kPaddle,
       [](ScalerConfig& c) { c.backoff_factor = std::nan(""); }, "decr_ratio"},
      {"interval 0", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.growth_interval = 0; },
       "growth_interval"},
      {"interval -3", ScalerPolicy::kDeepSpeed, [](ScalerConfig& c) { c.growth_interval = -3; },
       "loss_scale_window"},
      {"init 0", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = 0; }, "init_scale"},
      {"init neg", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = -1; },
       "init_scale"},
      {"init inf", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = HUGE_VAL; },
       "init_scale"},
      {"init nan", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = std::nan(""); },
       "init_scale"},
      {"init inf in float32", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = 1e39; },
       "init_scale"},
      {"init 0 in float32", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.init_scale = 1e-50; },
       "init_scale"},
      {"paddle init", ScalerPolicy::kPaddle, [](ScalerConfig& c) { c.init_scale = -2; },
       "init_loss_scaling"},
      {"hysteresis 0", ScalerPolicy::kMegatron, [](ScalerConfig& c) { c.hysteresis = 0; },
       "hysteresis"},
      {"paddle decr_every 0", ScalerPolicy::kPaddle, [](ScalerConfig& c) { c.hysteresis = 0; },
       "decr_every_n_nan_or_inf"},
      {"min nan", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.min_scale = std::nan(""); },
       "min_scale"},
      {"min 0", ScalerPolicy::kMegatron, [](ScalerConfig& c) { c.min_scale = 0.0; }, "min_scale"},
      {"max nan", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.max_scale = std::nan(""); },
       "max_scale"},
      {"max inf", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.max_scale = HUGE_VAL; },
       "max_scale"},
      {"min > max", ScalerPolicy::kPyTorch,
       [](ScalerConfig& c) {
         c.min_scale = 4.0;
         c.max_scale = 2.0;
         c.init_scale = 3.0;
       },
       "min_scale"},
      {"init < min", ScalerPolicy::kMegatron, [](ScalerConfig& c) { c.init_scale = 0.5; },
       "init_scale"},
      {"init > max", ScalerPolicy::kPyTorch, [](ScalerConfig& c) { c.max_scale = 1024.0; },
       "init_scale"},
      {"deepspeed no min", ScalerPolicy::kDeepSpeed, [](ScalerConfig& c) { c.min_scale.reset(); },
       "min_scale"},
  };
  for (const BadField& bad : cases) {
    ScalerConfig c = ScalerConfig::Defaults(bad.policy);
    bad.mutate(c);
    ExpectInvalidNaming(c.Validate(), bad.field);
    absl::StatusOr<GradScaler> created = GradScaler::Create(c);
    EXPECT_FALSE(created.ok()) << bad.what;
    ExpectInvalidNaming(created.status(), bad.field);
  }
}

TEST(Validate, EdgesThatAreValid) {
  ScalerConfig c;
  c.growth_factor = 1.0000001;
  c.backoff_factor = 0.999;
  c.growth_interval = 1;
  c.init_scale = FLT_MAX;
  EXPECT_TRUE(c.Validate().ok());
  c.init_scale = std::ldexp(1.0, -149);  // smallest float32 subnormal
  EXPECT_TRUE(c.Validate().ok());
  c.min_scale = c.init_scale;
  c.max_scale = c.init_scale;
  EXPECT_TRUE(c.Validate().ok());
}

// ------------------------------------------------------------ state dicts

std::vector<ScalerConfig> OnePerPolicy() {
  std::vector<ScalerConfig> configs;
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(p);
    c.init_scale = 4096;
    c.growth_interval = 4;
    c.hysteresis = 3;
    configs.push_back(c);
  }
  return configs;
}

std::vector<std::string> Keys(const ScalerState& state) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : state) keys.push_back(k);
  return keys;
}

TEST(StateDict, KeysAreTheFrameworksOwn) {
  using V = std::vector<std::string>;
  const std::vector<V> expected = {
      {"_growth_tracker", "backoff_factor", "growth_factor", "growth_interval", "scale"},
      {"decr_count", "decr_every_n_nan_or_inf", "decr_ratio", "incr_count", "incr_every_n_steps",
       "incr_ratio", "scale", "use_dynamic_loss_scaling"},
      {"consecutive_hysteresis", "cur_hysteresis", "cur_iter", "cur_scale", "delayed_shift",
       "last_overflow_iter", "min_scale", "scale_factor", "scale_window"},
      {"growth_tracker", "hysteresis_tracker", "scale"},
  };
  std::vector<ScalerConfig> configs = OnePerPolicy();
  for (size_t i = 0; i < configs.size(); ++i) {
    EXPECT_EQ(Keys(MakeScaler(configs[i]).StateDict()), expected[i])
        << PolicyName(configs[i].policy);
  }
}

TEST(StateDict, FreshValues) {
  std::vector<ScalerConfig> configs = OnePerPolicy();
  EXPECT_EQ(MakeScaler(configs[0]).StateDict(), (ScalerState{{"scale", 4096},
                                                             {"growth_factor", 2},
                                                             {"backoff_factor", 0.5},
                                                             {"growth_interval", 4},
                                                             {"_growth_tracker", 0}}));
  EXPECT_EQ(MakeScaler(configs[2]).StateDict(), (ScalerState{{"cur_scale", 4096},
                                                             {"cur_iter", 0},
                                                             {"last_overflow_iter", -1},
                                                             {"scale_factor", 2},
                                                             {"scale_window", 4},
                                                             {"min_scale", 1},
                                                             {"cur_hysteresis", 3},
                                                             {"delayed_shift", 3},
                                                             {"consecutive_hysteresis", 0}}));
  EXPECT_EQ(MakeScaler(configs[3]).StateDict(),
            (ScalerState{{"scale", 4096}, {"growth_tracker", 0}, {"hysteresis_tracker", 3}}));
}

TEST(StateDict, RoundTripsMidSequenceAndContinuesIdentically) {
  const std::vector<bool> prefix = {G, I, G, G, I, I, G, G, G, I, G, G};
  const std::vector<bool> suffix = {G, G, G, I, G, G, G, G, I, I, I, G, G, G, G, G};
  for (const ScalerConfig& c : OnePerPolicy()) {
    GradScaler a = MakeScaler(c);
    for (bool inf : prefix) Step(a, inf);
    const ScalerState saved = a.StateDict();
    GradScaler b = MakeScaler(ScalerConfig::Defaults(c.policy));  // different config
    ASSERT_TRUE(b.LoadStateDict(saved).ok()) << PolicyName(c.policy);
    EXPECT_EQ(b.StateDict(), saved) << PolicyName(c.policy);
    EXPECT_EQ(b.scale(), a.scale());
    if (c.policy == ScalerPolicy::kMegatron) continue;  // its state carries no hyper-parameters
    for (bool inf : suffix) {
      EXPECT_EQ(Step(a, inf).scale_after, Step(b, inf).scale_after) << PolicyName(c.policy);
      EXPECT_EQ(a.StateDict(), b.StateDict()) << PolicyName(c.policy);
    }
  }
}

TEST(StateDict, PyTorchCheckpointLoadsAsIs) {
  // What torch.amp.GradScaler().state_dict() holds 1999 steps after a growth.
  const ScalerState torch_state = {{"scale", 32768.0},
                                   {"growth_factor", 2.0},
                                   {"backoff_factor", 0.5},
                                   {"growth_interval", 2000},
                                   {"_growth_tracker", 1999}};
  GradScaler s = MakeScaler(ScalerConfig{});
  ASSERT_TRUE(s.LoadStateDict(torch_state).ok());
  EXPECT_EQ(s.scale(), 32768.0f);
  EXPECT_EQ(s.StateDict(), torch_state);
  EXPECT_TRUE(Step(s, G).grew);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(Key(s, "_growth_tracker"), 0);
}

TEST(StateDict, LoadedHyperParametersReplaceTheConfigs) {
  GradScaler s = MakeScaler(ScalerConfig{});
  ASSERT_TRUE(s.LoadStateDict({{"scale", 8.0},
                               {"growth_factor", 4.0},
                               {"backoff_factor", 0.25},
                               {"growth_interval", 1},
                               {"_growth_tracker", 0}})
                  .ok());
  EXPECT_EQ(s.config().growth_factor, 4.0);
  EXPECT_EQ(s.config().growth_interval, 1);
  ExpectTrace(s, {G, I, I}, {32, 8, 2}, {{"_growth_tracker", {0, 0, 0}}});

  GradScaler paddle = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kPaddle));
  ASSERT_TRUE(paddle
                  .LoadStateDict({{"scale", 1024.0},
                                  {"incr_ratio", 2.0},
                                  {"decr_ratio", 0.5},
                                  {"incr_every_n_steps", 1000},
                                  {"decr_every_n_nan_or_inf", 2},
                                  {"incr_count", 0},
                                  {"decr_count", 1},
                                  {"use_dynamic_loss_scaling", 0}})
                  .ok());
  EXPECT_FALSE(paddle.config().dynamic);
  ExpectTrace(paddle, {I, I}, {1024, 1024}, {{"decr_count", {1, 1}}});
}

TEST(StateDict, MissingKeyIsNamed) {
  for (const ScalerConfig& c : OnePerPolicy()) {
    GradScaler s = MakeScaler(c);
    Step(s, I);
    const ScalerState full = s.StateDict();
    for (const auto& [key, value] : full) {
      ScalerState partial = full;
      partial.erase(key);
      ExpectInvalidNaming(s.LoadStateDict(partial), key);
      EXPECT_EQ(s.StateDict(), full) << "a failed load changed the scaler";
    }
  }
}

TEST(StateDict, NonFiniteValueIsNamed) {
  for (const ScalerConfig& c : OnePerPolicy()) {
    GradScaler s = MakeScaler(c);
    const ScalerState full = s.StateDict();
    for (const auto& [key, value] : full) {
      for (double bad : {std::nan(""), HUGE_VAL}) {
        ScalerState broken = full;
        broken[key] = bad;
        ExpectInvalidNaming(s.LoadStateDict(broken), key);
      }
    }
    EXPECT_EQ(s.StateDict(), full);
  }
}

struct BadKey {
  ScalerPolicy policy;
  std::string key;
  double value;
};

TEST(StateDict, BadValueIsNamed) {
  const std::vector<BadKey> cases = {
      {ScalerPolicy::kPyTorch, "scale", -4.0},
      {ScalerPolicy::kPyTorch, "scale", 1e39},  // inf in float32
      {ScalerPolicy::kPyTorch, "growth_factor", 1.0},
      {ScalerPolicy::kPyTorch, "backoff_factor", 1.5},
      {ScalerPolicy::kPyTorch, "growth_interval", 0},
      {ScalerPolicy::kPyTorch, "growth_interval", 2.5},
      {ScalerPolicy::kPyTorch, "_growth_tracker", 4},  // == growth_interval: would never grow
      {ScalerPolicy::kPyTorch, "_growth_tracker", -1},
      {ScalerPolicy::kPyTorch, "_growth_tracker", 0.5},
      {ScalerPolicy::kPaddle, "incr_ratio", 0.9},
      {ScalerPolicy::kPaddle, "decr_ratio", 0.0},
      {ScalerPolicy::kPaddle, "incr_every_n_steps", 0},
      {ScalerPolicy::kPaddle, "decr_every_n_nan_or_inf", 0},
      {ScalerPolicy::kPaddle, "decr_count", 3},
      {ScalerPolicy::kPaddle, "incr_count", 4},
      {ScalerPolicy::kPaddle, "use_dynamic_loss_scaling", 2},
      {ScalerPolicy::kDeepSpeed, "cur_scale", 0.5},  // below min_scale 1
      {ScalerPolicy::kDeepSpeed, "cur_iter", -1},
      {ScalerPolicy::kDeepSpeed, "last_overflow_iter", 0},  // must be < cur_iter (0)
      {ScalerPolicy::kDeepSpeed, "last_overflow_iter", -2},
      {ScalerPolicy::kDeepSpeed, "scale_factor", 1.0},
      {ScalerPolicy::kDeepSpeed, "scale_window", 0},
      {ScalerPolicy::kDeepSpeed, "min_scale", 0.0},
      {ScalerPolicy::kDeepSpeed, "cur_hysteresis", 0},
      {ScalerPolicy::kDeepSpeed, "cur_hysteresis", 4},  // > delayed_shift 3
      {ScalerPolicy::kDeepSpeed, "delayed_shift", 0},
      {ScalerPolicy::kDeepSpeed, "consecutive_hysteresis", 0.5},
      {ScalerPolicy::kMegatron, "scale", 0.5},  // below min_scale 1
      {ScalerPolicy::kMegatron, "growth_tracker", 4},
      {ScalerPolicy::kMegatron, "hysteresis_tracker", 4},  // > hysteresis 3
  };
  for (const BadKey& bad : cases) {
    ScalerConfig c = OnePerPolicy()[static_cast<size_t>(bad.policy)];
    ASSERT_EQ(c.policy, bad.policy);
    GradScaler s = MakeScaler(c);
    const ScalerState full = s.StateDict();
    ScalerState broken = full;
    ASSERT_TRUE(broken.contains(bad.key)) << bad.key;
    broken[bad.key] = bad.value;
    ExpectInvalidNaming(s.LoadStateDict(broken), bad.key);
    EXPECT_EQ(s.StateDict(), full);
  }
}

TEST(StateDict, UnknownOrForeignKeysAreRefused) {
  std::vector<ScalerConfig> configs = OnePerPolicy();
  GradScaler pytorch = MakeScaler(configs[0]);
  ScalerState with_extra = pytorch.StateDict();
  with_extra["_hysteresis"] = 1;
  ExpectInvalidNaming(pytorch.LoadStateDict(with_extra), "_hysteresis");
  // A Megatron state into a PyTorch scaler names the first key it lacks.
  GradScaler megatron = MakeScaler(configs[3]);
  ExpectInvalidNaming(pytorch.LoadStateDict(megatron.StateDict()), "growth_factor");
  // A PyTorch state into a Megatron scaler: it has Megatron's 'scale' but not
  // 'growth_tracker'.
  ExpectInvalidNaming(megatron.LoadStateDict(pytorch.StateDict()), "growth_tracker");
}

// A scale of 0 (or one that is 0 in float32) is refused on load: its
// inverse is inf, and the job could never apply a step. No scaler reaches
// it (PyTorch's float32 scale underflows to 0 after enough backoffs; here
// the backoff that would leave no usable scale fails instead, and the state
// stays at the last usable one, which loads). The smallest positive float32
// still loads.
TEST(StateDict, ZeroScaleIsRefusedOnLoad) {
  ScalerConfig c;
  c.init_scale = 1e-30;
  c.backoff_factor = 0.001;
  GradScaler s = MakeScaler(c);
  for (int i = 0; i < 2; ++i) Step(s, I);              // 1e-33, 1e-36
  absl::StatusOr<ScalerUpdate> refused = s.Update(I);  // 1e-39 has an inf inverse
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(s.scale(), 1e-36f);
  GradScaler t = MakeScaler(ScalerConfig{});
  const ScalerState before = t.StateDict();
  ASSERT_TRUE(t.LoadStateDict(s.StateDict()).ok());
  ASSERT_TRUE(t.LoadStateDict(before).ok());
  ScalerState state = before;
  for (double zero : {0.0, -0.0, 1e-50}) {
    state["scale"] = zero;
    ExpectInvalidNaming(t.LoadStateDict(state), "scale");
  }
  EXPECT_EQ(t.StateDict(), before);
  state["scale"] = std::ldexp(1.0, -149);
  ASSERT_TRUE(t.LoadStateDict(state).ok());
  EXPECT_EQ(t.scale(), std::ldexp(1.0f, -149));
}

TEST(StateNumber, PlainDecimalsOnly) {
  const std::vector<std::pair<std::string, double>> good = {{"16", 16.0},
                                                            {"-1", -1.0},
                                                            {"0", 0.0},
                                                            {"0.5", 0.5},
                                                            {".5", 0.5},
                                                            {"5.", 5.0},
                                                            {"65536", 65536.0},
                                                            {"1e+30", 1e30},
                                                            {"1.5E-3", 1.5e-3},
                                                            {"-0", -0.0},
                                                            {"4294967296", 4294967296.0}};
  for (const auto& [text, want] : good) {
    absl::StatusOr<double> v = ParseStateNumber("scale", text);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(*v, want) << text;
  }
  for (const std::string& bad : std::vector<std::string>{"0x10",
                                                         "0X10",
                                                         "0x1p4",
                                                         "1e-999",
                                                         "1e999",
                                                         "inf",
                                                         "-inf",
                                                         "nan",
                                                         "infinity",
                                                         "+16",
                                                         " 16",
                                                         "16 ",
                                                         "16abc",
                                                         "",
                                                         "-",
                                                         ".",
                                                         "e5",
                                                         "1e",
                                                         "1e+",
                                                         "1..5",
                                                         "--1",
                                                         "1,5",
                                                         std::string("1\0", 2)}) {
    ExpectInvalidNaming(ParseStateNumber("scale", bad).status(), "scale");
  }
}

TEST(StateDict, LoadedScaleMustRespectBounds) {
  ScalerConfig c;
  c.max_scale = 65536;
  GradScaler s = MakeScaler(c);
  ScalerState state = s.StateDict();
  state["scale"] = 131072;
  ExpectInvalidNaming(s.LoadStateDict(state), "scale");
  EXPECT_EQ(s.scale(), 65536.0f);
}

// ----------------------------------------------- randomized vs. reference

// A second implementation, written from the frameworks'
// Python as directly as C++ allows, with no shared code: one struct per
// policy, fields named as the framework names them. The capped-and-guarded
// growth and the floored backoff are spelt out in each.
struct Bounds {
  bool has_min = false;
  float min = 0;
  bool has_max = false;
  float max = 0;
};

int64_t g_refused_growths = 0;  // how often the inf guard fired, across the run

float CapThenGuard(float old_scale, float grown, const Bounds& b) {
  if (b.has_max && grown > b.max) grown = b.max;
  if (std::isinf(grown)) {
    ++g_refused_growths;
    return old_scale;
  }
  return grown;
}

float Floor(float backed_off, const Bounds& b) {
  if (b.has_min && backed_off < b.min) return b.min;
  return backed_off;
}

// ampd's floor, the same for every policy (grad_scaler.h): a backoff at
// min_scale fails with raise_at_min_scale (DeepSpeed's error) and leaves
// the scale there without it; one that would leave a scale whose inverse
// overflows float32 fails whatever the flag. False where the step fails.
bool UsableRef(float scale) { return scale > 0.0f && std::isfinite(float(1.0 / double(scale))); }
bool BackOffRef(float& scale, float backed_off, const Bounds& b, bool raise) {
  const float next = Floor(backed_off, b);
  const bool at_min = b.has_min && scale <= b.min;
  if (!at_min && UsableRef(next)) {
    scale = next;
    return true;
  }
  return at_min && UsableRef(scale) && !raise;
}

struct RefTorch {
  float scale;
  double growth_factor, backoff_factor;
  int64_t growth_interval;
  int64_t _growth_tracker = 0;
  Bounds b;
  bool raise = true;
  // False where the step fails (at the floor); nothing changes then.
  bool update(bool inf) {
    if (inf) {
      if (!BackOffRef(scale, float(double(scale) * backoff_factor), b, raise)) return false;
      _growth_tracker = 0;
    } else if (_growth_tracker + 1 == growth_interval) {
      scale = CapThenGuard(scale, float(double(scale) * growth_factor), b);
      _growth_tracker = 0;
    } else {
      _growth_tracker++;
    }
    return true;
  }
  ScalerState state() const {
    return {{"scale", scale},
            {"growth_factor", growth_factor},
            {"backoff_factor", backoff_factor},
            {"growth_interval", double(growth_interval)},
            {"_growth_tracker", double(_growth_tracker)}};
  }
};

struct RefPaddle {
  float scale;
  double incr_ratio, decr_ratio;
  int64_t incr_every_n_steps, decr_every_n_nan_or_inf;
  int64_t incr_count = 0, decr_count = 0;
  bool use_dynamic_loss_scaling;
  Bounds b;
  bool raise = true;
  bool update(bool inf) {
    if (!use_dynamic_loss_scaling) return true;
    if (inf) {
      if (decr_count + 1 == decr_every_n_nan_or_inf &&
          !BackOffRef(scale, scale * float(decr_ratio), b, raise)) {
        return false;
      }
      incr_count = 0;
      decr_count++;
      if (decr_count == decr_every_n_nan_or_inf) decr_count = 0;
    } else {
      decr_count = 0;
      incr_count++;
      if (incr_count == incr_every_n_steps) {
        scale = CapThenGuard(scale, scale * float(incr_ratio), b);
        incr_count = 0;
      }
    }
    return true;
  }
  ScalerState state() const {
    return {{"scale", scale},
            {"incr_ratio", incr_ratio},
            {"decr_ratio", decr_ratio},
            {"incr_every_n_steps", double(incr_every_n_steps)},
            {"decr_every_n_nan_or_inf", double(decr_every_n_nan_or_inf)},
            {"incr_count", double(incr_count)},
            {"decr_count", double(decr_count)},
            {"use_dynamic_loss_scaling", use_dynamic_loss_scaling ? 1.0 : 0.0}};
  }
};

struct RefDeepSpeed {
  float cur_scale;
  int64_t cur_iter = 0, last_overflow_iter = -1;
  double scale_factor;
  int64_t scale_window;
  double min_scale;
  int64_t delayed_shift, cur_hysteresis;
  bool consecutive_hysteresis, raise_error_at_min_scale;
  Bounds b;
  // Returns false where DeepSpeed raises; nothing changes then.
  bool update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (!BackOffRef(cur_scale, float(double(cur_scale) / scale_factor), b,
                        raise_error_at_min_scale)) {
          return false;
        }
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      // Counted as the step's 1-based number: growth after exactly
      // scale_window good steps since the last overflow.
      const int64_t iter = cur_iter + 1;
      const int64_t n = iter - last_overflow_iter - 1;
      if (n > 0 && n % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale = CapThenGuard(cur_scale, float(double(cur_scale) * scale_factor), b);
      }
    }
    cur_iter += 1;
    return true;
  }
  ScalerState state() const {
    return {{"cur_scale", cur_scale},
            {"cur_iter", double(cur_iter)},
            {"last_overflow_iter", double(last_overflow_iter)},
            {"scale_factor", scale_factor},
            {"scale_window", double(scale_window)},
            {"min_scale", min_scale},
            {"cur_hysteresis", double(cur_hysteresis)},
            {"delayed_shift", double(delayed_shift)},
            {"consecutive_hysteresis", consecutive_hysteresis ? 1.0 : 0.0}};
  }
};

struct RefMegatron {
  float _scale;
  double growth_factor, backoff_factor;
  int64_t growth_interval, hysteresis;
  int64_t _growth_tracker = 0, _hysteresis_tracker;
  Bounds b;
  bool raise = true;
  bool update(bool found_inf) {
    if (found_inf) {
      if (_hysteresis_tracker - 1 <= 0 &&
          !BackOffRef(_scale, _scale * float(backoff_factor), b, raise)) {
        return false;
      }
      _growth_tracker = 0;
      _hysteresis_tracker -= 1;
    } else {
      _growth_tracker += 1;
      if (_growth_tracker == growth_interval) {
        _growth_tracker = 0;
        _hysteresis_tracker = hysteresis;
        _scale = CapThenGuard(_scale, _scale * float(growth_factor), b);
      }
    }
    return true;
  }
  ScalerState state() const {
    return {{"scale", _scale},
            {"growth_tracker", double(_growth_tracker)},
            {"hysteresis_tracker", double(_hysteresis_tracker)}};
  }
};

// Deterministic generator (xorshift64*), so a failure reproduces exactly.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545F4914F6CDD1Dull;
  }
  double Uniform() { return double(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int64_t Int(int64_t lo, int64_t hi) { return lo + int64_t(Next() % uint64_t(hi - lo + 1)); }
  bool Chance(double p) { return Uniform() < p; }
  template <typename T>
  T Pick(const std::vector<T>& v) {
    return v[size_t(Next() % v.size())];
  }

 private:
  uint64_t state_;
};

ScalerConfig RandomConfig(Rng& rng) {
  ScalerConfig c;
  c.policy = rng.Pick<ScalerPolicy>({ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle,
                                     ScalerPolicy::kDeepSpeed, ScalerPolicy::kMegatron});
  c.enabled = !rng.Chance(0.05);
  c.dynamic = !rng.Chance(0.1);
  c.growth_factor = rng.Chance(0.5) ? rng.Pick<double>({2.0, 1.5, 3.0, 1.1, 4.0})
                                    : 1.0 + 0.001 + rng.Uniform() * 7.0;
  c.backoff_factor = rng.Chance(0.5) ? rng.Pick<double>({0.5, 0.25, 0.1, 0.3, 0.9})
                                     : 0.001 + rng.Uniform() * 0.998;
  c.growth_interval = rng.Int(1, 8);
  c.hysteresis = rng.Int(1, 4);
  c.consecutive_hysteresis = rng.Chance(0.5);
  c.raise_at_min_scale = rng.Chance(0.7);
  // Powers of two and odd values; bounds sometimes near the float32 ends.
  auto random_scale = [&rng] {
    return rng.Chance(0.5) ? std::ldexp(1.0, int(rng.Int(-20, 127)))
                           : std::ldexp(1.0 + rng.Uniform(), int(rng.Int(-20, 126)));
  };
  if (c.policy == ScalerPolicy::kDeepSpeed || rng.Chance(0.4)) c.min_scale = random_scale();
  if (rng.Chance(0.4)) c.max_scale = random_scale();
  if (c.min_scale && c.max_scale && *c.min_scale > *c.max_scale)
    std::swap(c.min_scale, c.max_scale);
  if (c.policy == ScalerPolicy::kDeepSpeed && !c.min_scale) c.min_scale = 1.0;
  c.init_scale = rng.Chance(0.1) ? FLT_MAX / rng.Pick<double>({1.0, 2.0, 1.5}) : random_scale();
  if (c.min_scale && c.init_scale < *c.min_scale) c.init_scale = *c.min_scale;
  if (c.max_scale && c.init_scale > *c.max_scale) c.init_scale = *c.max_scale;
  return c;
}

// One reference per policy, built from the config as each framework would be.
struct Reference {
  ScalerConfig config;
  RefTorch torch;
  RefPaddle paddle;
  RefDeepSpeed deepspeed;
  RefMegatron megatron;

  explicit Reference(const ScalerConfig& c) : config(c) {
    Bounds b;
    b.has_min = c.min_scale.has_value();
    b.min = b.has_min ? float(*c.min_scale) : 0.0f;
    b.has_max = c.max_scale.has_value();
    b.max = b.has_max ? float(*c.max_scale) : 0.0f;
    const float s = float(c.init_scale);
    torch = {s, c.growth_factor, c.backoff_factor, c.growth_interval, 0, b, c.raise_at_min_scale};
    paddle = {
        s, c.growth_factor,     c.backoff_factor, c.growth_interval, c.hysteresis, 0, 0, c.dynamic,
        b, c.raise_at_min_scale};
    deepspeed = {s,
                 0,
                 -1,
                 c.growth_factor,
                 c.growth_interval,
                 c.min_scale.value_or(1.0),
                 c.hysteresis,
                 c.hysteresis,
                 c.consecutive_hysteresis,
                 c.raise_at_min_scale,
                 b};
    megatron = {
        s, c.growth_factor,     c.backoff_factor, c.growth_interval, c.hysteresis, 0, c.hysteresis,
        b, c.raise_at_min_scale};
  }

  // Returns false where the step must fail (at the floor: BackOffRef).
  bool Update(bool inf) {
    if (!config.enabled) return true;
    // Static scaling: Paddle's update() returns at once; the others have no
    // static mode of their own, and ampd freezes them the same way.
    if (!config.dynamic && config.policy != ScalerPolicy::kPaddle) return true;
    switch (config.policy) {
      case ScalerPolicy::kPyTorch:
        return torch.update(inf);
      case ScalerPolicy::kPaddle:
        return paddle.update(inf);
      case ScalerPolicy::kDeepSpeed:
        return deepspeed.update(inf);
      case ScalerPolicy::kMegatron:
        return megatron.update(inf);
      case ScalerPolicy::kAdaptive:  // no framework to mirror: adaptive_scaler_test.cc
        ADD_FAILURE() << "RandomConfig draws the framework policies only";
        return true;
    }
    return true;
  }
  float Scale() const {
    if (!config.enabled) return 1.0f;
    switch (config.policy) {
      case ScalerPolicy::kPyTorch:
        return torch.scale;
      case ScalerPolicy::kPaddle:
        return paddle.scale;
      case ScalerPolicy::kDeepSpeed:
        return deepspeed.cur_scale;
      case ScalerPolicy::kMegatron:
        return megatron._scale;
      case ScalerPolicy::kAdaptive:
        ADD_FAILURE() << "RandomConfig draws the framework policies only";
        return 0;
    }
    return 0;
  }
  ScalerState State() const {
    if (!config.enabled) return {};
    switch (config.policy) {
      case ScalerPolicy::kPyTorch:
        return torch.state();
      case ScalerPolicy::kPaddle:
        return paddle.state();
      case ScalerPolicy::kDeepSpeed:
        return deepspeed.state();
      case ScalerPolicy::kMegatron:
        return megatron.state();
      case ScalerPolicy::kAdaptive:
        ADD_FAILURE() << "RandomConfig draws the framework policies only";
        return {};
    }
    return {};
  }
};

TEST(Randomized, MatchesPlainReferenceStepForStep) {
  Rng rng(20240607);
  int64_t steps_checked = 0, grows = 0, backoffs = 0, failures = 0, reloads = 0;
  g_refused_growths = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const ScalerConfig config = RandomConfig(rng);
    ASSERT_TRUE(config.Validate().ok()) << "trial " << trial << ": " << config.Validate();
    GradScaler scaler = MakeScaler(config);
    Reference ref(config);
    const double p_inf = rng.Pick<double>({0.0, 0.02, 0.1, 0.3, 0.6, 0.95});
    const int64_t length = rng.Int(1, 300);
    for (int64_t i = 0; i < length; ++i) {
      const bool inf = rng.Chance(p_inf);
      const float before = ref.Scale();
      const bool ref_ok = ref.Update(inf);
      absl::StatusOr<ScalerUpdate> got = scaler.Update(inf);
      ASSERT_EQ(got.ok(), ref_ok) << "trial " << trial << " step " << i << ": " << got.status();
      if (!ref_ok) {
        ++failures;
        ASSERT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
      } else {
        ASSERT_EQ(got->scale_before, before) << "trial " << trial << " step " << i;
        ASSERT_EQ(got->scale_after, ref.Scale()) << "trial " << trial << " step " << i;
        ASSERT_EQ(got->skipped, inf && config.enabled);
        ASSERT_EQ(got->grew, ref.Scale() > before);
        ASSERT_EQ(got->backed_off, ref.Scale() < before);
        grows += got->grew;
        backoffs += got->backed_off;
      }
      ASSERT_EQ(scaler.scale(), ref.Scale());
      ASSERT_EQ(scaler.StateDict(), ref.State()) << "trial " << trial << " step " << i;
      ++steps_checked;
      // Now and then, continue from a fresh scaler loaded from the state.
      if (rng.Chance(0.03)) {
        GradScaler reloaded = MakeScaler(config);
        // Every state a scaler reaches loads back: no scale reaches 0.
        const absl::Status loaded = reloaded.LoadStateDict(scaler.StateDict());
        ASSERT_TRUE(loaded.ok()) << loaded;
        ASSERT_EQ(reloaded.StateDict(), scaler.StateDict());
        scaler = std::move(reloaded);
        ++reloads;
      }
    }
  }
  // The sequences must actually exercise every path.
  EXPECT_GT(steps_checked, 400000);
  EXPECT_GT(grows, 10000);
  EXPECT_GT(backoffs, 10000);
  EXPECT_GT(failures, 100);
  EXPECT_GT(reloads, 5000);
  EXPECT_GT(g_refused_growths, 50);
}

}  // namespace
}  // namespace ampd::engine::amp
