// The adaptive policy: calibration picks the largest safe power of two
// (checked against a float64 search), a growth that would leave the
// overflow margin is deferred and counted, a sampled underflow grows early
// only with head-room, a real overflow backs off as pytorch, the state
// round-trips under its own keys, and without gradient statistics the
// policy's scale trace is pytorch's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "codec/dtype.h"
#include "common/grad_histogram.h"
#include "server/engine/amp/adaptive_policy.h"
#include "server/engine/amp/grad_scaler.h"

namespace ampd::engine::amp {
namespace {

GradScaler MakeScaler(const ScalerConfig& config) {
  absl::StatusOr<GradScaler> scaler = GradScaler::Create(config);
  EXPECT_TRUE(scaler.ok()) << scaler.status();
  return *std::move(scaler);
}

ScalerUpdate Step(GradScaler& scaler, const StepGradStats& stats) {
  absl::StatusOr<ScalerUpdate> update = scaler.Update(stats);
  EXPECT_TRUE(update.ok()) << update.status();
  return update.ok() ? *update : ScalerUpdate{};
}

StepGradStats Good(float max_abs) {
  StepGradStats s;
  s.max_abs = max_abs;
  return s;
}

// The largest 2^k, k in [-126, 127], with m * 2^k <= 65504 / 2^margin, by
// walking k down from the top in float64.
double ReferenceCalibration(double m, int margin) {
  const double limit = 65504.0 / std::pow(2.0, margin);
  for (int k = 127; k >= -126; --k) {
    if (m * std::pow(2.0, k) <= limit) return std::pow(2.0, k);
  }
  return std::pow(2.0, -126);
}

TEST(AdaptiveConfig, DefaultsAndNames) {
  const ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  EXPECT_EQ(c.init_scale, 65536.0);
  EXPECT_EQ(c.growth_factor, 2.0);
  EXPECT_EQ(c.backoff_factor, 0.5);
  EXPECT_EQ(c.growth_interval, 2000);
  EXPECT_EQ(c.overflow_margin_log2, 3);
  EXPECT_EQ(c.underflow_threshold, 1.0 / 1024);
  EXPECT_EQ(c.max_scale, 16777216.0);
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_EQ(PolicyName(ScalerPolicy::kAdaptive), "adaptive");
  EXPECT_EQ(PolicyFromName("adaptive"), ScalerPolicy::kAdaptive);
}

TEST(AdaptiveConfig, ValidateNamesTheBadField) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.overflow_margin_log2 = 16;
  EXPECT_TRUE(absl::StartsWith(c.Validate().message(), "overflow_margin_log2")) << c.Validate();
  c.overflow_margin_log2 = -1;
  EXPECT_FALSE(c.Validate().ok());
  c.overflow_margin_log2 = 0;
  EXPECT_TRUE(c.Validate().ok());
  c.underflow_threshold = 1.5;
  EXPECT_TRUE(absl::StartsWith(c.Validate().message(), "underflow_threshold")) << c.Validate();
  c.underflow_threshold = std::nan("");
  EXPECT_FALSE(c.Validate().ok());
}

TEST(AdaptiveCalibration, PicksTheLargestSafePowerOfTwo) {
  const ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  // limit = 65504 / 8 = 8188.
  EXPECT_EQ(CalibratedScale(1.0f, c), 4096.0f);       // 8192 would give 8192 > 8188
  EXPECT_EQ(CalibratedScale(0.5f, c), 8192.0f);       // 0.5 * 8192 = 4096, * 16384 = 8192
  EXPECT_EQ(CalibratedScale(8188.0f, c), 1.0f);       // exactly at the limit
  EXPECT_EQ(CalibratedScale(8189.0f, c), 0.5f);       // just over it
  EXPECT_EQ(CalibratedScale(100.0f, c), 64.0f);       // 6400 <= 8188 < 12800
  EXPECT_EQ(CalibratedScale(0.0f, c), 65536.0f);      // nothing measured: init_scale
  EXPECT_EQ(CalibratedScale(1e-9f, c), 16777216.0f);  // the 2^24 cap
  EXPECT_EQ(CalibratedScale(std::numeric_limits<float>::infinity(), c), 1.0f);

  ScalerConfig bounded = c;
  bounded.min_scale = 256.0;
  EXPECT_EQ(CalibratedScale(100.0f, bounded), 256.0f);
  ScalerConfig margin0 = c;
  margin0.overflow_margin_log2 = 0;
  EXPECT_EQ(CalibratedScale(1.0f, margin0), 32768.0f);  // 32768 <= 65504 < 65536
}

TEST(AdaptiveCalibration, MatchesFloat64SearchOverManyMagnitudes) {
  std::mt19937_64 rng(15);
  std::uniform_real_distribution<double> exponent(-40.0, 20.0);
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.max_scale.reset();
  int checked = 0;
  for (int margin = 0; margin <= 15; margin += 3) {
    c.overflow_margin_log2 = margin;
    for (int i = 0; i < 2000; ++i) {
      const auto m = static_cast<float>(std::pow(2.0, exponent(rng)));
      ASSERT_EQ(static_cast<double>(CalibratedScale(m, c)), ReferenceCalibration(m, margin))
          << "max " << m << " margin " << margin;
      ++checked;
    }
    // Exact powers of two and the limit itself, where rounding of the
    // quotient could land one octave off.
    for (int e = -30; e <= 15; ++e) {
      const auto m = static_cast<float>(std::ldexp(1.0, e));
      ASSERT_EQ(static_cast<double>(CalibratedScale(m, c)), ReferenceCalibration(m, margin));
      const auto at_limit = static_cast<float>(OverflowLimit(margin) / std::ldexp(1.0, e));
      ASSERT_EQ(static_cast<double>(CalibratedScale(at_limit, c)),
                ReferenceCalibration(at_limit, margin));
      checked += 2;
    }
  }
  EXPECT_GT(checked, 10000);
}

TEST(AdaptiveCalibration, CalibrateSetsTheScaleOnce) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive));
  EXPECT_TRUE(s.NeedsCalibration());
  EXPECT_EQ(s.Calibrate(100.0f), 64.0f);
  EXPECT_EQ(s.scale(), 64.0f);
  EXPECT_FALSE(s.NeedsCalibration());

  // The framework policies and static or disabled scalers never calibrate.
  EXPECT_FALSE(MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kPyTorch)).NeedsCalibration());
  EXPECT_FALSE(
      MakeScaler(ScalerConfig::ForPrecisionDefault(codec::DType::kBF16, ScalerPolicy::kAdaptive))
          .NeedsCalibration());
  ScalerConfig off = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  off.enabled = false;
  EXPECT_FALSE(MakeScaler(off).NeedsCalibration());
}

TEST(AdaptiveGrowth, GrowthThatWouldLeaveTheMarginIsDeferredAndCounted) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.growth_interval = 3;
  GradScaler s = MakeScaler(c);
  s.Calibrate(1.0f);  // S = 4096: 1 * 4096 * 2 = 8192 > 8188
  for (int i = 0; i < 2; ++i) {
    const ScalerUpdate u = Step(s, Good(1.0f));
    EXPECT_FALSE(u.grew || u.growth_deferred || u.skipped);
  }
  ScalerUpdate u = Step(s, Good(1.0f));
  EXPECT_TRUE(u.growth_deferred);
  EXPECT_FALSE(u.grew);
  EXPECT_EQ(u.scale_after, 4096.0f);
  EXPECT_EQ(u.counters.growth_tracker, 0);
  EXPECT_EQ(s.growths_deferred(), 1);

  // Once the gradients shrink to leave room, the next scheduled growth is taken.
  for (int i = 0; i < 2; ++i) Step(s, Good(0.5f));
  u = Step(s, Good(0.5f));  // 0.5 * 8192 = 4096 <= 8188
  EXPECT_TRUE(u.grew);
  EXPECT_FALSE(u.growth_deferred);
  EXPECT_EQ(u.scale_after, 8192.0f);
  EXPECT_EQ(s.growths_deferred(), 1);
}

TEST(AdaptiveGrowth, AtTheCapNothingIsDeferred) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.growth_interval = 1;
  c.max_scale = 4096.0;
  c.init_scale = 1024.0;
  GradScaler s = MakeScaler(c);
  s.Calibrate(1.0f);
  const ScalerUpdate u = Step(s, Good(1.0f));
  EXPECT_FALSE(u.growth_deferred);
  EXPECT_EQ(s.growths_deferred(), 0);
}

TEST(AdaptiveGrowth, OverflowBacksOffAsPyTorch) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive));
  s.Calibrate(0.5f);  // 8192
  Step(s, Good(0.5f));
  StepGradStats inf;
  inf.found_inf = true;
  inf.max_abs = std::numeric_limits<float>::infinity();
  const ScalerUpdate u = Step(s, inf);
  EXPECT_TRUE(u.skipped);
  EXPECT_TRUE(u.backed_off);
  EXPECT_EQ(u.scale_after, 4096.0f);
  EXPECT_EQ(u.counters.growth_tracker, 0);
}

TEST(AdaptiveGrowth, SampledUnderflowGrowsEarlyOnlyWithHeadRoom) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive));
  s.Calibrate(1.0f);  // 4096
  StepGradStats stats = Good(0.25f);
  stats.underflow_fraction = 0.01;  // > 2^-10
  ScalerUpdate u = Step(s, stats);  // 0.25 * 8192 = 2048 fits
  EXPECT_TRUE(u.grew);
  EXPECT_EQ(u.scale_after, 8192.0f);
  EXPECT_EQ(u.counters.growth_tracker, 0);

  // Under the threshold: no early growth.
  stats.underflow_fraction = 0.0005;
  u = Step(s, stats);
  EXPECT_FALSE(u.grew);
  EXPECT_EQ(u.counters.growth_tracker, 1);

  // Over the threshold but the max has no head-room: no growth, no deferral
  // (only scheduled growths are deferred).
  stats = Good(0.75f);  // 0.75 * 16384 = 12288 > 8188
  stats.underflow_fraction = 0.5;
  u = Step(s, stats);
  EXPECT_FALSE(u.grew);
  EXPECT_FALSE(u.growth_deferred);
  EXPECT_EQ(u.scale_after, 8192.0f);
}

TEST(AdaptiveGrowth, WithoutStatisticsTheTraceIsPyTorchs) {
  ScalerConfig a = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  ScalerConfig p = ScalerConfig::Defaults(ScalerPolicy::kPyTorch);
  a.growth_interval = p.growth_interval = 5;
  a.max_scale.reset();
  GradScaler adaptive = MakeScaler(a);
  GradScaler pytorch = MakeScaler(p);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 5000; ++i) {
    const bool inf = rng() % 7 == 0;
    absl::StatusOr<ScalerUpdate> x = adaptive.Update(inf);
    absl::StatusOr<ScalerUpdate> y = pytorch.Update(inf);
    ASSERT_TRUE(x.ok() && y.ok());
    ASSERT_EQ(x->scale_after, y->scale_after) << "step " << i;
    ASSERT_EQ(x->counters.growth_tracker, y->counters.growth_tracker);
  }
}

TEST(AdaptiveState, RoundTripsUnderItsOwnKeys) {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.growth_interval = 2;
  c.overflow_margin_log2 = 4;
  c.underflow_threshold = 0.125;
  GradScaler s = MakeScaler(c);
  s.Calibrate(2.0f);  // limit 4094: 2 * 2048 = 4096 > 4094, so 1024
  EXPECT_EQ(s.scale(), 1024.0f);
  Step(s, Good(2.0f));
  Step(s, Good(2.0f));  // 2 * 2048 = 4096 > 4094: deferred
  Step(s, Good(1.0f));
  ASSERT_EQ(s.growths_deferred(), 1);

  const ScalerState state = s.StateDict();
  std::vector<std::string> keys;
  for (const auto& [k, v] : state) keys.push_back(k);
  EXPECT_EQ(keys,
            (std::vector<std::string>{"_growth_tracker", "backoff_factor", "calibrated",
                                      "growth_factor", "growth_interval", "growths_deferred",
                                      "overflow_margin_log2", "scale", "underflow_threshold"}));
  EXPECT_EQ(state.at("scale"), 1024.0);
  EXPECT_EQ(state.at("_growth_tracker"), 1.0);
  EXPECT_EQ(state.at("growths_deferred"), 1.0);
  EXPECT_EQ(state.at("calibrated"), 1.0);
  EXPECT_EQ(state.at("overflow_margin_log2"), 4.0);
  EXPECT_EQ(state.at("underflow_threshold"), 0.125);

  GradScaler loaded = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive));
  ASSERT_TRUE(loaded.LoadStateDict(state).ok());
  EXPECT_EQ(loaded.StateDict(), state);
  EXPECT_FALSE(loaded.NeedsCalibration());
  EXPECT_EQ(loaded.config().overflow_margin_log2, 4);
  EXPECT_EQ(loaded.config().underflow_threshold, 0.125);
  EXPECT_EQ(loaded.growths_deferred(), 1);
  // The loaded scaler continues exactly as the original.
  for (float m : {1.0f, 0.5f, 4.0f, 0.1f}) {
    EXPECT_EQ(Step(loaded, Good(m)).scale_after, Step(s, Good(m)).scale_after);
  }
}

TEST(AdaptiveState, EmptyStateRecalibratesAndBadStatesAreRefused) {
  GradScaler s = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive));
  s.Calibrate(1.0f);
  ASSERT_FALSE(s.NeedsCalibration());
  ASSERT_TRUE(s.LoadStateDict({}).ok());
  EXPECT_TRUE(s.NeedsCalibration());

  // A pytorch state lacks the adaptive keys; a foreign key is refused.
  GradScaler pytorch = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kPyTorch));
  absl::Status st = s.LoadStateDict(pytorch.StateDict());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "missing key 'overflow_margin_log2'")) << st;

  s.Calibrate(1.0f);
  const ScalerState before = s.StateDict();
  ScalerState state = before;
  state["overflow_margin_log2"] = 16;
  st = s.LoadStateDict(state);
  EXPECT_TRUE(absl::StrContains(st.message(), "'overflow_margin_log2' must be in [0, 15]")) << st;
  state = s.StateDict();
  state["calibrated"] = 0.5;
  EXPECT_FALSE(s.LoadStateDict(state).ok());
  state = s.StateDict();
  state["growths_deferred"] = -1;
  EXPECT_FALSE(s.LoadStateDict(state).ok());
  state = s.StateDict();
  state["incr_count"] = 0;
  EXPECT_TRUE(absl::StrContains(s.LoadStateDict(state).message(), "unknown key 'incr_count'"));
  EXPECT_EQ(s.StateDict(), before);  // nothing half loaded
  EXPECT_EQ(s.scale(), 4096.0f);
}

TEST(AdaptiveHistogram, UnderflowFractionCountsZerosAndFp16Subnormals) {
  std::vector<int64_t> bins(kGradHistogramBins, 0);
  EXPECT_EQ(UnderflowFraction(bins), 0.0);
  bins[0] = 10;  // exact zeros
  bins[1] = 5;   // below 2^-30
  // Bin 2 + j holds [2^(j - 30), 2^(j - 29)): [2^-15, 2^-14) is j = 15,
  // [2^-14, 2^-13) (fp16's smallest normals) j = 16.
  bins[2 + 15] = 5;
  bins[2 + 16] = 30;
  bins[kGradHistogramBins - 1] = 50;
  EXPECT_DOUBLE_EQ(UnderflowFraction(bins), 20.0 / 100.0);
}

}  // namespace
}  // namespace ampd::engine::amp
