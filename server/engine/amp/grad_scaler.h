// GradScaler: dynamic loss scaling as PyTorch, Paddle, DeepSpeed and
// Megatron each do it, so that a job moved from one of them sees the same
// scale trace step for step (policies pytorch, paddle, deepspeed, megatron),
// with the min/max/static/enabled knobs every policy takes, and a fifth
// policy, adaptive (adaptive_policy.h), that goes beyond them.
// docs/SCALER.md states every policy's rules, defaults, state keys and the
// choices made where the frameworks differ or leave room (each arithmetic
// as its framework rounds it, the growth guard for every policy, refused
// rather than clamped bounds, a job failed rather than left without a
// usable scale). Plain C++: it sees one found_inf per optimizer step (and,
// for adaptive, max|g| and the underflow fraction) and nothing of tensors
// or devices, which is what lets a data-parallel job reduce found_inf
// across ranks first and feed every rank's scaler the same answer.
//
// Per-layer scales (adaptive's opt-in, per_layer_scales): the model's
// parameters fall into G layer groups (for a layer stack, each Linear with
// the layers after it up to the next Linear; for a GPT, each block), and
// group g has its own power
// of two S_g. The loss gradient carries S_{G-1}; backward multiplies the
// upstream gradient by S_{g-1} / S_g where it leaves group g, so every
// group's gradients are stored at its own scale, and each group is unscaled
// with its own 1 / S_g. Powers of two commute with fp16 rounding in the
// normal range, so while no group under- or overflows the applied update is
// bit for bit a single scale's. Each S_g follows adaptive's rules from its
// own max|g| and underflow fraction. Choices:
//  - A real overflow skips the step for every group (one found_inf). The
//    group that backs off is the highest-numbered one whose max|g| is inf:
//    backward runs from group G-1 down, so a non-finite value first appears
//    there and every lower group's may only be inherited from it. When no
//    group's max is inf (only NaNs were seen) every group backs off. Every
//    group's growth tracker restarts on a skipped step.
//  - scale() is S_{G-1}, the scale the loss gradient carries; grew and
//    backed_off in ScalerUpdate say whether any group's scale did.
//  - A group also backs off on a clean step whose max|g| * S_g has used
//    half the overflow margin (it exceeds 65504 / 2^(margin - 1), twice
//    the limit growth respects, so growth and this backoff never chase
//    each other), straight to the scale calibration would pick from that
//    max (no step is skipped). A group's gradients drift much
//    faster than a whole model's largest ones: they scale with the weights
//    of every group after it, and a weight near zero grows by orders of
//    magnitude under Adam's first updates. Without it each doubling of a
//    group's range costs a skipped step.
//  - growths_deferred counts deferrals of every group.
//  - At most kMaxLayerScaleGroups groups (bounded metric label cardinality).
//  - init_scale, growth_factor, backoff_factor, min_scale and max_scale
//    must be powers of two, so every S_g and every ratio is one.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/dtype.h"
#include "server/engine/config/scaler_config.h"

namespace ampd::engine::amp {
// What the step measured about its gradients. Only found_inf is read by the
// framework policies; adaptive also reads the rest when present.
struct StepGradStats {
  bool found_inf = false;
  // max |g * inv_scale| over every gradient element, i.e. of the unscaled
  // gradients (from the fused check pass); absent when not measured.
  std::optional<float> max_abs;
  // Fraction of the stored (scaled) gradient elements that are zero or
  // fp16-subnormal, from a sampled histogram; absent on unsampled steps.
  std::optional<double> underflow_fraction;
  // Per-layer scales: max_abs and underflow_fraction of each group's own
  // gradients (group g at index g; empty when not measured). The max also
  // covers the gradient entering the group (the step's GroupEntryCheck).
  std::vector<float> layer_max_abs;
  std::vector<double> layer_underflow_fraction;
};

// state_dict values: scales are float32 values, counters integers and flags
// 0/1, all exact in a double. Keys are the framework's own names:
//   pytorch:   scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
//   paddle:    scale, incr_ratio, decr_ratio, incr_every_n_steps,
//              decr_every_n_nan_or_inf, incr_count, decr_count, use_dynamic_loss_scaling
//   deepspeed: cur_scale, cur_iter, last_overflow_iter, scale_factor, scale_window,
//              min_scale, cur_hysteresis, delayed_shift, consecutive_hysteresis
//   megatron:  scale, growth_tracker, hysteresis_tracker
//   adaptive:  scale, growth_factor, backoff_factor, growth_interval, _growth_tracker
//              (pytorch's), overflow_margin_log2, underflow_threshold,
//              growths_deferred, calibrated; with per-layer scales also
//              layer_groups (G, which must match the job's) and
//              layer.{g}.scale, layer.{g}._growth_tracker for g in [0, G),
//              where scale and _growth_tracker are group G-1's
// As in each framework, the hyper-parameters a state carries replace the
// config's on load (config() reflects them afterwards).
using ScalerState = std::map<std::string, double>;

// One state value as text (a checkpoint's "scaler.<key>" metadata) to its
// number, strictly: a plain decimal, [-]digits[.digits][e[+|-]digits], with
// no sign '+', no whitespace, no hex ("0x10" is not 16), no "inf" or "nan",
// and within a double's range ("1e-999" is refused, not read as 0).
// InvalidArgument whose message starts with `key` otherwise. Range and integrality per key are
// LoadStateDict's.
absl::StatusOr<double> ParseStateNumber(absl::string_view key, absl::string_view text);
// The text a checkpoint stores for a state value, read back exactly (the
// same double) by ParseStateNumber: integers as integers, values with 9
// significant digits where those are exact (short decimals, and most
// float32 values a scaler holds), anything else with 17.
std::string FormatStateNumber(double v);

class GradScaler {
 public:
  // layer_groups: the model's group count G when config.per_layer_scales,
  // in [1, kMaxLayerScaleGroups]; otherwise it must be 1.
  static absl::StatusOr<GradScaler> Create(const ScalerConfig& config, int64_t layer_groups = 1);

  const ScalerConfig& config() const { return config_; }
  // S for the coming step (1.0 when disabled). float32, as PyTorch keeps it.
  float scale() const;
  // Advance one optimizer step. FailedPrecondition when a backoff is due at
  // min_scale with raise_at_min_scale, or would leave no usable scale (the
  // job must stop: the file comment); the scaler's state is then left as
  // it was.
  absl::StatusOr<ScalerUpdate> Update(bool found_inf);
  // The same with the step's gradient statistics (only adaptive reads more
  // than found_inf).
  absl::StatusOr<ScalerUpdate> Update(const StepGradStats& stats);

  // adaptive: true until the scale has been calibrated, i.e. on a new job's
  // first step and after loading a state that carries no scaler keys.
  bool NeedsCalibration() const;
  // Sets the scale from max|g| of the unscaled gradients measured at a scale
  // that cannot overflow (adaptive_policy.h: CalibratedScale) and marks the
  // scaler calibrated. Returns the new scale.
  float Calibrate(float max_abs);
  // Per-layer scales: sets each group's scale from max|g| of its own
  // unscaled gradients (max_abs[g], CalibratedScale), as Calibrate does for
  // one scale. max_abs.size() must be layer_groups().
  void CalibrateLayers(absl::Span<const float> max_abs);
  // adaptive: scheduled growths refused so far (0 for the other policies).
  int64_t growths_deferred() const { return growths_deferred_; }

  // G with per-layer scales, else 1.
  int64_t layer_groups() const {
    return layers_.empty() ? 1 : static_cast<int64_t>(layers_.size());
  }
  // Each group's S_g (per-layer scales), or {scale()}.
  std::vector<float> layer_scales() const;
  // Group g's S_g, g in [0, layer_groups()) (scale() for a job-wide scale).
  float layer_scale(int64_t g) const {
    return layers_.empty() ? scale() : layers_[static_cast<size_t>(g)].scale;
  }

  ScalerCounters counters() const;

  ScalerState StateDict() const;
  // Loads a state produced by this policy's StateDict (or the framework's
  // own); InvalidArgument naming the missing or bad key. Loading an empty
  // state into an enabled scaler is an error. A disabled scaler ignores any
  // state, as PyTorch's does. All or nothing: on error nothing changes.
  absl::Status LoadStateDict(const ScalerState& state);

 private:
  explicit GradScaler(const ScalerConfig& config);

  // One dynamic update per policy; they only touch the members below.
  // FailedPrecondition when a backoff is due at the floor (BackOff).
  absl::Status UpdatePyTorch(bool found_inf);
  absl::Status UpdatePaddle(bool found_inf);
  absl::Status UpdateDeepSpeed(bool found_inf);
  absl::Status UpdateMegatron(bool found_inf);
  absl::Status UpdateAdaptive(const StepGradStats& stats, ScalerUpdate& update);
  absl::Status UpdateAdaptiveLayers(const StepGradStats& stats, ScalerUpdate& update);
  // adaptive's rule on a clean step for one scale (the job's or a group's)
  // and its tracker; true when a scheduled growth was deferred.
  bool AdaptiveCleanStep(std::optional<float> max_abs, std::optional<double> underflow_fraction,
                         float& scale, int64_t& growth_tracker) const;
  // scale * factor (or / factor for deepspeed backoff) with the policy's
  // own rounding, then the floor or the cap and the finite guard.
  float Grown(float scale) const;
  float BackedOff(float scale) const;
  // Every policy's backoff of `scale` (the job's or a group's): BackedOff,
  // unless the scale is at its floor: a configured min_scale, where it
  // stays when !raise_at_min_scale, or the smallest usable scale (the
  // file comment). FailedPrecondition, `scale` unchanged, when the job must
  // stop.
  absl::Status BackOff(float& scale) const;

  // One layer group's scale and growth tracker (per-layer scales).
  struct LayerScale {
    float scale = 1.0f;
    int64_t growth_tracker = 0;
  };

  ScalerConfig config_;
  float scale_ = 1.0f;
  int64_t growth_tracker_ = 0;            // pytorch _growth_tracker, paddle incr_count,
                                          // megatron growth_tracker
  int64_t bad_steps_ = 0;                 // paddle decr_count
  int64_t hysteresis_left_ = 1;           // deepspeed cur_hysteresis, megatron hysteresis_tracker
                                          // (megatron's may go below 0, as Megatron's does)
  int64_t iteration_ = 0;                 // deepspeed cur_iter: updates done so far
  int64_t last_overflow_iteration_ = -1;  // deepspeed last_overflow_iter
  int64_t growths_deferred_ = 0;          // adaptive growths_deferred
  bool calibrated_ = false;               // adaptive calibrated
  // Per-layer scales: one per group, and scale_ / growth_tracker_ mirror
  // the last group's; empty for a job-wide scale.
  std::vector<LayerScale> layers_;
};

}  // namespace ampd::engine::amp
