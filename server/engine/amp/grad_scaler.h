// GradScaler: dynamic loss scaling exactly as ../shared/design/SCALER.md
// specifies, policy by policy (pytorch, paddle, deepspeed, megatron), with
// the min/max/static/enabled knobs every policy takes. Plain C++: it sees one
// found_inf per optimizer step and nothing of tensors or devices, which is
// what lets a data-parallel job reduce found_inf across ranks first and feed
// every rank's scaler the same answer.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ampd::engine::amp {

enum class ScalerPolicy { kPyTorch, kPaddle, kDeepSpeed, kMegatron };

absl::string_view PolicyName(ScalerPolicy policy);  // "pytorch", "paddle", ...
std::optional<ScalerPolicy> PolicyFromName(absl::string_view name);

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
  double init_scale = 65536.0;       // pytorch init_scale, paddle init_loss_scaling
  double growth_factor = 2.0;        // pytorch growth_factor, paddle incr_ratio
  double backoff_factor = 0.5;       // pytorch backoff_factor, paddle decr_ratio
  int64_t growth_interval = 2000;    // pytorch growth_interval, paddle incr_every_n_steps,
                                     // deepspeed loss_scale_window
  int64_t hysteresis = 1;            // paddle decr_every_n_nan_or_inf, deepspeed/megatron hysteresis
  bool consecutive_hysteresis = false;  // deepspeed
  bool raise_at_min_scale = true;       // deepspeed: fail instead of looping at min_scale
  std::optional<double> min_scale;      // floor (deepspeed/megatron default 1.0)
  std::optional<double> max_scale;      // cap (none by default, Apex uses 2^24)

  // The policy's documented defaults (paddle: 32768, 2, 0.5, 1000, 2).
  static ScalerConfig Defaults(ScalerPolicy policy);
  absl::Status Validate() const;
};

// What one Update did, for the step's reply and the metrics.
struct ScalerUpdate {
  float scale_before = 1.0f;
  float scale_after = 1.0f;
  bool found_inf = false;
  bool skipped = false;     // the optimizer step must not be applied
  bool grew = false;
  bool backed_off = false;
};

// state_dict values: scales are float32 values, counters integers and flags
// 0/1, all exact in a double. Keys are the framework's own names.
using ScalerState = std::map<std::string, double>;

class GradScaler {
 public:
  static absl::StatusOr<GradScaler> Create(const ScalerConfig& config);

  const ScalerConfig& config() const { return config_; }
  // S for the coming step (1.0 when disabled). float32, as PyTorch keeps it.
  float scale() const;
  // Advance one optimizer step. FailedPrecondition when the deepspeed policy
  // overflows at min_scale with raise_at_min_scale (the job must stop).
  absl::StatusOr<ScalerUpdate> Update(bool found_inf);

  ScalerState StateDict() const;
  // Loads a state produced by this policy's StateDict (or the framework's
  // own); InvalidArgument naming the missing or bad key. Loading an empty
  // state into an enabled scaler is an error.
  absl::Status LoadStateDict(const ScalerState& state);

 private:
  explicit GradScaler(const ScalerConfig& config);

  ScalerConfig config_;
  float scale_ = 1.0f;
  int64_t growth_tracker_ = 0;   // pytorch _growth_tracker, paddle incr_count, megatron growth tracker
  int64_t bad_steps_ = 0;        // paddle decr_count
  int64_t hysteresis_left_ = 1;  // deepspeed cur_hysteresis, megatron hysteresis tracker
  int64_t iteration_ = 0;        // deepspeed cur_iter
  int64_t last_overflow_iteration_ = -1;  // deepspeed last_overflow_iter
};

}  // namespace ampd::engine::amp
