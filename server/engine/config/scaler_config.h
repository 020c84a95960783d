// A job's loss-scaler configuration, as the client sets it and a checkpoint
// stores it: the policy (pytorch, paddle, deepspeed, megatron, adaptive),
// its knobs with each framework's names, their defaults and validation, and
// the plain records a scaler reports (its counters, one update). The scaler
// itself, its rules and its state dict are server/engine/amp/grad_scaler.h;
// docs/SCALER.md says what every policy and knob does.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/dtype.h"

namespace ampd::engine::amp {

enum class ScalerPolicy { kPyTorch, kPaddle, kDeepSpeed, kMegatron, kAdaptive };

absl::string_view PolicyName(ScalerPolicy policy);  // "pytorch", "paddle", ..., "adaptive"
std::optional<ScalerPolicy> PolicyFromName(absl::string_view name);

// The most layer groups a per-layer-scaled job may have: each group is one
// value of the per-layer scale metric's label, so the count stays bounded.
inline constexpr int64_t kMaxLayerScaleGroups = 32;

// One config for every policy; each field says which policy names it how.
// Defaults() fills the policy's own defaults; Validate names the bad field.
struct ScalerConfig {
  ScalerPolicy policy = ScalerPolicy::kPyTorch;
  // false: the scale is the identity (reads 1.0) and the scaler never skips
  // a step (PyTorch's enabled=False).
  bool enabled = true;
  // false: the scale stays at init_scale forever, yet non-finite steps are
  // still detected and skipped (Paddle's use_dynamic_loss_scaling=False,
  // the `static` knob). bf16 and fp32 jobs default to this with scale 1.
  bool dynamic = true;
  double init_scale = 65536.0;     // pytorch init_scale, paddle init_loss_scaling,
                                   // deepspeed 2^initial_scale_power, megatron initial_scale
  double growth_factor = 2.0;      // pytorch growth_factor, paddle incr_ratio,
                                   // deepspeed scale_factor (both directions)
  double backoff_factor = 0.5;     // pytorch backoff_factor, paddle decr_ratio;
                                   // unused by deepspeed (see the file comment)
  int64_t growth_interval = 2000;  // pytorch growth_interval, paddle incr_every_n_steps,
                                   // deepspeed loss_scale_window
  int64_t hysteresis = 1;          // paddle decr_every_n_nan_or_inf, deepspeed/megatron hysteresis
  bool consecutive_hysteresis = false;  // deepspeed
  bool raise_at_min_scale = true;       // fail instead of looping at min_scale (every
                                        // policy; Defaults: deepspeed and adaptive only)
  std::optional<double> min_scale;      // floor (deepspeed/megatron default 1.0)
  std::optional<double> max_scale;      // cap (none by default, Apex uses 2^24)
  // adaptive only: growth is taken only while max|g| * S * growth_factor
  // stays <= 65504 / 2^overflow_margin_log2 (fp16's max with 2^margin of
  // head-room for the gradients to grow between steps); the calibrated start
  // keeps max|g| * S under the same limit. In [0, 15].
  int64_t overflow_margin_log2 = 3;
  // adaptive only: when a sampled histogram shows more than this fraction of
  // the stored (scaled) gradient elements at zero or fp16-subnormal (< 2^-14)
  // and the max leaves head-room, the scale grows early. In [0, 1].
  double underflow_threshold = 1.0 / 1024;
  // adaptive only: one scale per layer group instead of one per job (the
  // file comment). Needs enabled, dynamic and power-of-two scales/factors.
  bool per_layer_scales = false;

  // The policy's documented defaults:
  //   pytorch:   65536, 2, 0.5, 2000, no floor, no cap, no raise at min.
  //   paddle:    32768, 2, 0.5, 1000, decr_every_n_nan_or_inf 2 (the
  //              documented paddle.amp.GradScaler signature; newer Paddle
  //              code defaults to 65536, 2000 and 1), no raise at min.
  //   deepspeed: 2^16 (initial_scale_power 16), 2, window 1000, hysteresis 2,
  //              consecutive_hysteresis false, min_loss_scale 1, raise at min.
  //   megatron:  2^32, 2, 0.5, window 1000, hysteresis 2, min_loss_scale 1, no raise at min.
  //   adaptive:  pytorch's (65536, 2, 0.5, 2000), margin 2^3, underflow
  //              threshold 2^-10, cap 2^24 (adaptive_policy.h says why).
  static ScalerConfig Defaults(ScalerPolicy policy);
  // The default for a job whose working copy has `working_dtype`: fp16 gets
  // Defaults(policy); bf16 and fp32 (whose range matches fp32, so scaling
  // buys nothing) get a static scale of 1 under `policy`, which still checks
  // and skips non-finite steps, so no non-finite update is ever applied.
  static ScalerConfig ForPrecisionDefault(codec::DType working_dtype,
                                          ScalerPolicy policy = ScalerPolicy::kPyTorch);
  // InvalidArgument whose message starts with the bad field's name.
  absl::Status Validate() const;
  // The scale a new scaler of this config reports: init_scale as a float32,
  // or 1 when scaling is disabled.
  float InitialScale() const { return enabled ? static_cast<float>(init_scale) : 1.0f; }
};

// Where a dynamic scaler stands between scale changes, in one vocabulary
// for every policy (the framework's own counters are in StateDict):
//   growth_tracker: clean steps counted toward the next growth (pytorch
//     _growth_tracker, paddle incr_count, megatron growth_tracker, deepspeed
//     (cur_iter - last_overflow_iter - 1) mod scale_window);
//   overflows_until_backoff: overflows from now until, and including, the
//     one that backs the scale off (1 for pytorch; deepspeed cur_hysteresis;
//     megatron max(1, hysteresis_tracker); paddle decr_every_n_nan_or_inf -
//     decr_count).
// Both are 0 when the scale is static or scaling disabled: it never moves.
struct ScalerCounters {
  int64_t growth_tracker = 0;
  int64_t overflows_until_backoff = 0;
};

// What one Update did, for the step's reply and the metrics.
struct ScalerUpdate {
  float scale_before = 1.0f;
  float scale_after = 1.0f;
  bool found_inf = false;
  bool skipped = false;     // the optimizer step must not be applied
  bool grew = false;        // scale_after > scale_before
  bool backed_off = false;  // scale_after < scale_before
  // adaptive: a scheduled growth was refused because max|g| * S *
  // growth_factor would have left the overflow margin.
  bool growth_deferred = false;
  ScalerCounters counters;  // after the update
  // Per-layer scales: every group's S_g before and after (empty otherwise).
  // Brace-initialised so that designated initializers may leave them out.
  std::vector<float> layer_scales_before{};
  std::vector<float> layer_scales_after{};
};

}  // namespace ampd::engine::amp
