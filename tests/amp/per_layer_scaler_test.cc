// Per-layer loss scales in the adaptive policy, on the scaler alone: the
// config's checks, calibration of each group from its own max|g|, each
// group's growth and deferral from its own statistics, which group backs
// off on an overflow (the highest one whose max is inf, or every group when
// none is) or before one (past half its margin), the shared skip, and the state dict's per-group
// keys (round trip, and every inconsistent state refused with nothing half loaded).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "server/engine/amp/adaptive_policy.h"
#include "server/engine/amp/grad_scaler.h"

namespace ampd::engine::amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

ScalerConfig PerLayer() {
  ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kAdaptive);
  c.per_layer_scales = true;
  return c;
}

GradScaler MakeScaler(const ScalerConfig& config, int64_t groups) {
  absl::StatusOr<GradScaler> scaler = GradScaler::Create(config, groups);
  EXPECT_TRUE(scaler.ok()) << scaler.status();
  return *std::move(scaler);
}

ScalerUpdate Step(GradScaler& scaler, const StepGradStats& stats) {
  absl::StatusOr<ScalerUpdate> update = scaler.Update(stats);
  EXPECT_TRUE(update.ok()) << update.status();
  return update.ok() ? *update : ScalerUpdate{};
}

StepGradStats Layers(std::vector<float> max_abs, bool found_inf = false) {
  StepGradStats s;
  s.found_inf = found_inf;
  s.layer_max_abs = std::move(max_abs);
  float m = 0.0f;
  for (float v : s.layer_max_abs) m = std::fmax(m, v);
  s.max_abs = m;
  return s;
}

void ExpectRefused(const ScalerConfig& c, absl::string_view message) {
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), message)) << s;
}

TEST(PerLayerConfig, OnlyAdaptiveDynamicAndPowersOfTwo) {
  EXPECT_FALSE(ScalerConfig::Defaults(ScalerPolicy::kAdaptive).per_layer_scales);
  EXPECT_TRUE(PerLayer().Validate().ok());
  for (ScalerPolicy p : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle, ScalerPolicy::kDeepSpeed,
                         ScalerPolicy::kMegatron}) {
    ScalerConfig c = ScalerConfig::Defaults(p);
    c.per_layer_scales = true;
    ExpectRefused(c, "per_layer_scales: applies to the adaptive policy only");
  }
  ScalerConfig c = PerLayer();
  c.dynamic = false;
  ExpectRefused(c, "per_layer_scales: needs an enabled, dynamic scaler");
  c = PerLayer();
  c.enabled = false;
  ExpectRefused(c, "per_layer_scales: needs an enabled, dynamic scaler");
  c = PerLayer();
  c.growth_factor = 3.0;
  ExpectRefused(c, "per_layer_scales: growth_factor must be a power of two, got 3");
  c = PerLayer();
  c.backoff_factor = 0.75;
  ExpectRefused(c, "per_layer_scales: backoff_factor must be a power of two");
  c = PerLayer();
  c.init_scale = 1000.0;
  ExpectRefused(c, "per_layer_scales: init_scale must be a power of two");
  c = PerLayer();
  c.max_scale = 1e6;
  ExpectRefused(c, "per_layer_scales: max_scale must be a power of two");
  c = PerLayer();
  c.min_scale = 0.3;
  ExpectRefused(c, "per_layer_scales: min_scale must be a power of two");

  // The group count: 1..kMaxLayerScaleGroups with per-layer scales, 1 without.
  EXPECT_TRUE(GradScaler::Create(PerLayer(), kMaxLayerScaleGroups).ok());
  EXPECT_EQ(GradScaler::Create(PerLayer(), kMaxLayerScaleGroups + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GradScaler::Create(PerLayer(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GradScaler::Create(ScalerConfig::Defaults(ScalerPolicy::kAdaptive), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive), 1).layer_groups(), 1);
}

TEST(PerLayerCalibration, EachGroupFromItsOwnMax) {
  GradScaler s = MakeScaler(PerLayer(), 3);
  ASSERT_TRUE(s.NeedsCalibration());
  EXPECT_EQ(s.layer_scales(), (std::vector<float>{65536, 65536, 65536}));
  // Ranges 2^36 apart: one scale could serve only the largest.
  const std::vector<float> max_abs = {std::ldexp(1.0f, -30), 0.5f, 16.0f};
  s.CalibrateLayers(max_abs);
  EXPECT_FALSE(s.NeedsCalibration());
  const ScalerConfig c = PerLayer();
  EXPECT_EQ(s.layer_scales(),
            (std::vector<float>{CalibratedScale(max_abs[0], c), CalibratedScale(max_abs[1], c),
                                CalibratedScale(max_abs[2], c)}));
  EXPECT_EQ(s.layer_scales()[0], 16777216.0f);  // the 2^24 cap
  EXPECT_EQ(s.layer_scales()[1], 8192.0f);      // 0.5 * 2^13 <= 65504 / 2^3 < 0.5 * 2^14
  EXPECT_EQ(s.scale(), s.layer_scales()[2]);    // the loss carries the last group's
}

// Three groups calibrated 2^24 (capped), 8192 and 256, growth every 2
// clean steps.
GradScaler Calibrated() {
  ScalerConfig c = PerLayer();
  c.growth_interval = 2;
  GradScaler s = MakeScaler(c, 3);
  s.CalibrateLayers(std::vector<float>{std::ldexp(1.0f, -30), 0.5f, 16.0f});
  EXPECT_EQ(s.layer_scales(), (std::vector<float>{16777216, 8192, 256}));
  return s;
}

TEST(PerLayerGrowth, EachGroupGrowsOrDefersFromItsOwnMax) {
  GradScaler s = Calibrated();
  const StepGradStats stats = Layers({std::ldexp(1.0f, -30), 0.5f, 4.0f});
  ScalerUpdate u = Step(s, stats);
  EXPECT_FALSE(u.grew);
  EXPECT_EQ(u.layer_scales_before, (std::vector<float>{16777216, 8192, 256}));
  EXPECT_EQ(u.layer_scales_after, u.layer_scales_before);
  u = Step(s, stats);
  // Group 0 is at the cap (nothing to defer); group 1's doubled scale
  // would put 0.5 * 16384 past the margin (deferred); group 2's fits.
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{16777216, 8192, 512}));
  EXPECT_TRUE(u.grew);
  EXPECT_FALSE(u.backed_off);
  EXPECT_TRUE(u.growth_deferred);
  EXPECT_FALSE(u.skipped);
  EXPECT_EQ(s.growths_deferred(), 1);
  EXPECT_EQ(u.scale_before, 256.0f);
  EXPECT_EQ(u.scale_after, 512.0f);
  EXPECT_EQ(s.scale(), 512.0f);

  // Underflow-aware growth reads each group's own fraction.
  StepGradStats under = Layers({std::ldexp(1.0f, -30), 0.25f, 4.0f});
  under.layer_underflow_fraction = {0.0, 0.5, 0.0};
  u = Step(s, under);
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{16777216, 16384, 512}));
}

TEST(PerLayerBackoff, TheHighestGroupWithAnInfMaxBacksOffAndEveryGroupSkips) {
  GradScaler s = Calibrated();
  Step(s, Layers({std::ldexp(1.0f, -30), 0.5f, 4.0f}));  // every tracker at 1
  // Group 2 overflowed first in backward; groups 0 and 1 only inherited it.
  ScalerUpdate u = Step(s, Layers({kInf, kInf, 2.0f}, /*found_inf=*/true));
  EXPECT_TRUE(u.skipped);
  EXPECT_TRUE(u.backed_off);
  EXPECT_FALSE(u.grew);
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{16777216, 4096, 256}));
  // Every tracker restarted: one clean step is not yet an interval.
  EXPECT_EQ(s.counters().growth_tracker, 0);
  u = Step(s, Layers({std::ldexp(1.0f, -30), 0.125f, 4.0f}));
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{16777216, 4096, 256}));
  // Only NaNs (no group's max is inf): every group backs off.
  u = Step(s, Layers({std::ldexp(1.0f, -30), 0.125f, 4.0f}, /*found_inf=*/true));
  EXPECT_TRUE(u.skipped);
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{8388608, 2048, 128}));
  EXPECT_EQ(s.scale(), 128.0f);
}

// A group whose gradients grew through half its margin backs off before
// they overflow, straight to its calibrated scale, and the step is applied;
// within half the margin nothing moves.
TEST(PerLayerBackoff, AGroupPastHalfItsMarginBacksOffWithoutSkipping) {
  GradScaler s = Calibrated();  // 2^24, 8192, 256
  // Group 1: 1.5 * 8192 = 12288 is past 8188 (growth's limit) but within
  // 16376 (half the margin): kept. 3 * 8192 = 24576 is past both.
  ScalerUpdate u = Step(s, Layers({std::ldexp(1.0f, -30), 1.5f, 16.0f}));
  EXPECT_EQ(u.layer_scales_after, (std::vector<float>{16777216, 8192, 256}));
  u = Step(s, Layers({std::ldexp(1.0f, -30), 3.0f, 16.0f}));
  EXPECT_FALSE(u.skipped);
  EXPECT_TRUE(u.backed_off);
  EXPECT_EQ(u.layer_scales_after[1], CalibratedScale(3.0f, PerLayer()));
  EXPECT_EQ(u.layer_scales_after[1], 2048.0f);
  EXPECT_EQ(u.layer_scales_after[0], 16777216.0f);
  EXPECT_EQ(u.layer_scales_after[2], 256.0f);
}

TEST(PerLayerState, RoundTripsUnderScalerLayerKeys) {
  GradScaler s = Calibrated();
  Step(s, Layers({std::ldexp(1.0f, -30), 0.5f, 4.0f}));
  Step(s, Layers({std::ldexp(1.0f, -30), 0.5f, 4.0f}));
  Step(s, Layers({std::ldexp(1.0f, -30), 0.5f, 4.0f}));
  const ScalerState state = s.StateDict();
  std::vector<std::string> keys;
  for (const auto& [k, v] : state) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{
                      "_growth_tracker", "backoff_factor", "calibrated", "growth_factor",
                      "growth_interval", "growths_deferred", "layer.0._growth_tracker",
                      "layer.0.scale", "layer.1._growth_tracker", "layer.1.scale",
                      "layer.2._growth_tracker", "layer.2.scale", "layer_groups",
                      "overflow_margin_log2", "scale", "underflow_threshold"}));
  EXPECT_EQ(state.at("layer_groups"), 3.0);
  EXPECT_EQ(state.at("layer.0.scale"), 16777216.0);
  EXPECT_EQ(state.at("layer.1.scale"), 8192.0);
  EXPECT_EQ(state.at("layer.2.scale"), 512.0);
  EXPECT_EQ(state.at("scale"), 512.0);
  EXPECT_EQ(state.at("layer.2._growth_tracker"), 1.0);
  EXPECT_EQ(state.at("growths_deferred"), 1.0);

  GradScaler loaded = MakeScaler(PerLayer(), 3);
  ASSERT_TRUE(loaded.LoadStateDict(state).ok());
  EXPECT_EQ(loaded.StateDict(), state);
  EXPECT_FALSE(loaded.NeedsCalibration());
  EXPECT_EQ(loaded.layer_scales(), s.layer_scales());
  for (const StepGradStats& stats :
       {Layers({1e-9f, 0.25f, 2.0f}), Layers({1e-9f, kInf, 2.0f}, true), Layers({1e-9f, 1, 1}),
        Layers({1e-9f, 1, 1}), Layers({1e-9f, 0.1f, 0.5f})}) {
    EXPECT_EQ(Step(loaded, stats).layer_scales_after, Step(s, stats).layer_scales_after);
  }
  EXPECT_EQ(loaded.StateDict(), s.StateDict());
}

TEST(PerLayerState, InconsistentStatesAreRefusedWithNothingLoaded) {
  GradScaler s = Calibrated();
  const ScalerState good = s.StateDict();
  const auto refused = [&](const ScalerState& state, absl::string_view message) {
    GradScaler target = MakeScaler(PerLayer(), 3);
    target.CalibrateLayers(std::vector<float>{1, 1, 1});
    const ScalerState before = target.StateDict();
    const absl::Status st = target.LoadStateDict(state);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), message)) << st;
    EXPECT_EQ(target.StateDict(), before);
  };
  ScalerState bad = good;
  bad["layer.1.scale"] = 3000;
  refused(bad,
          "'layer.1.scale' must be a power of two float32 value within [min_scale, "
          "max_scale], got 3000");
  bad = good;
  bad["layer.0.scale"] = 33554432;  // above the 2^24 cap
  refused(bad, "'layer.0.scale' must be a power of two");
  bad = good;
  bad["layer.2._growth_tracker"] = 2;  // growth_interval 2
  refused(bad, "'layer.2._growth_tracker' must be in [0, 1]");
  bad = good;
  bad["scale"] = 128;
  refused(bad, "keys 'scale' and '_growth_tracker' must equal the last group's");
  bad = good;
  bad["layer_groups"] = 2;
  refused(bad, "key 'layer_groups' must be 3 (this job's layer groups), got 2");
  bad = good;
  bad.erase("layer.2._growth_tracker");
  refused(bad, "missing key 'layer.2._growth_tracker'");
  bad = good;
  bad["layer.3.scale"] = 256;
  refused(bad, "unknown key 'layer.3.scale'");

  // A job-wide adaptive state lacks the groups; a per-layer state has keys
  // a job-wide scaler does not know.
  GradScaler job_wide = MakeScaler(ScalerConfig::Defaults(ScalerPolicy::kAdaptive), 1);
  job_wide.Calibrate(1.0f);
  refused(job_wide.StateDict(), "missing key 'layer_groups'");
  const absl::Status st = job_wide.LoadStateDict(good);
  EXPECT_TRUE(absl::StrContains(st.message(), "unknown key 'layer.0._growth_tracker'")) << st;

  // An empty state (weights from elsewhere) calibrates every group again.
  GradScaler fresh = Calibrated();
  ASSERT_TRUE(fresh.LoadStateDict({}).ok());
  EXPECT_TRUE(fresh.NeedsCalibration());
}

}  // namespace
}  // namespace ampd::engine::amp
