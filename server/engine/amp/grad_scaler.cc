// GradScaler's rules: creation, each policy's update, adaptive's
// calibration. Every update rule below is transcribed from the framework's
// own source (torch/amp/grad_scaler.py and _amp_update_scale_,
// paddle/amp/grad_scaler.py, deepspeed/runtime/fp16/loss_scaler.py,
// megatron/core/optimizer/grad_scaler.py); the header lists the choices.
// The config's names, defaults and validation are
// server/engine/config/scaler_config.cc; the state dict is scaler_state.cc.
#include "server/engine/amp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/amp/adaptive_policy.h"

namespace ampd::engine::amp {
namespace {

// Whether a step can unscale by 1 / S: the step multiplies its gradients by
// inv_scale = float(1.0 / double(S)), which overflows to inf for S below
// about 2^-128 (and for S = 0). Gradients times inf are never finite, so a
// scaler below this can never apply a step again.
bool UsableScale(float scale) {
  return scale > 0.0f && std::isfinite(scale) &&
         std::isfinite(static_cast<float>(1.0 / static_cast<double>(scale)));
}

}  // namespace

absl::StatusOr<GradScaler> GradScaler::Create(const ScalerConfig& config, int64_t layer_groups) {
  AMPD_RETURN_IF_ERROR(config.Validate());
  if (!config.per_layer_scales && layer_groups != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer_groups: ", layer_groups, " groups need per_layer_scales (a job-wide scale has 1)"));
  }
  if (config.per_layer_scales && (layer_groups < 1 || layer_groups > kMaxLayerScaleGroups)) {
    return absl::InvalidArgumentError(absl::StrCat("per_layer_scales: the model has ", layer_groups,
                                                   " layer groups; 1 to ", kMaxLayerScaleGroups,
                                                   " are supported"));
  }
  GradScaler scaler(config);
  if (config.per_layer_scales) {
    scaler.layers_.assign(static_cast<size_t>(layer_groups),
                          LayerScale{static_cast<float>(config.init_scale), 0});
  }
  return scaler;
}

GradScaler::GradScaler(const ScalerConfig& config)
    : config_(config),
      scale_(static_cast<float>(config.init_scale)),
      hysteresis_left_(config.hysteresis) {}

float GradScaler::scale() const { return config_.enabled ? scale_ : 1.0f; }

float GradScaler::Grown(float scale) const {
  float grown = 0.0f;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
    case ScalerPolicy::kDeepSpeed:
    case ScalerPolicy::kAdaptive:
      // float * double, rounded once to float32 (PyTorch's kernel; DeepSpeed's
      // Python float product stored as float32).
      grown = static_cast<float>(static_cast<double>(scale) * config_.growth_factor);
      break;
    case ScalerPolicy::kPaddle:
    case ScalerPolicy::kMegatron:
      grown = scale * static_cast<float>(config_.growth_factor);
      break;
  }
  // min(inf, cap) is the cap, so a capped scaler reaches its cap.
  if (config_.max_scale.has_value()) {
    grown = std::min(grown, static_cast<float>(*config_.max_scale));
  }
  // As PyTorch's _amp_update_scale_: never grow to inf.
  return std::isfinite(grown) ? grown : scale;
}

float GradScaler::BackedOff(float scale) const {
  float backed_off = 0.0f;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
    case ScalerPolicy::kAdaptive:
      backed_off = static_cast<float>(static_cast<double>(scale) * config_.backoff_factor);
      break;
    case ScalerPolicy::kDeepSpeed:
      // DeepSpeed: cur_scale / scale_factor; one factor for both directions.
      backed_off = static_cast<float>(static_cast<double>(scale) / config_.growth_factor);
      break;
    case ScalerPolicy::kPaddle:
    case ScalerPolicy::kMegatron:
      backed_off = scale * static_cast<float>(config_.backoff_factor);
      break;
  }
  if (config_.min_scale.has_value()) {
    backed_off = std::max(backed_off, static_cast<float>(*config_.min_scale));
  }
  return backed_off;
}

absl::Status GradScaler::BackOff(float& scale) const {
  const float backed_off = BackedOff(scale);
  const bool at_min_scale =
      config_.min_scale.has_value() && scale <= static_cast<float>(*config_.min_scale);
  if (!at_min_scale && UsableScale(backed_off)) {
    scale = backed_off;
    return absl::OkStatus();
  }
  // The scale cannot decrease. At a configured min_scale without
  // raise_at_min_scale it stays there (Megatron's and Apex's floor: the job
  // goes on and skips its overflowing steps). Otherwise the job fails, as
  // DeepSpeed's raises: and below the smallest usable scale whatever the
  // flag, since no step could ever be applied again (PyTorch's scale
  // underflows to 0 there and every later step is skipped, silently).
  const bool floor_usable = at_min_scale && UsableScale(scale);
  if (floor_usable && !config_.raise_at_min_scale) return absl::OkStatus();
  const std::string floor =
      floor_usable
          ? absl::StrCat("min_scale ", *config_.min_scale)
          : absl::StrCat("scale ", scale, ": the next, ", backed_off,
                         ", has an inverse that overflows float32, so no step could be applied");
  const absl::string_view remedy = floor_usable ? "lower min_scale, or set raise_at_min_scale=false"
                                                : "raise init_scale, or set a usable min_scale";
  return absl::FailedPreconditionError(
      absl::StrCat(PolicyName(config_.policy),
                   " loss scaler: gradients overflowed at the minimum loss scale (", floor,
                   "); the scale cannot be decreased further. The job must stop: check for "
                   "NaN/inf in the data or model, ",
                   remedy));
}

absl::Status GradScaler::UpdatePyTorch(bool found_inf) {
  if (found_inf) {
    AMPD_RETURN_IF_ERROR(BackOff(scale_));
    growth_tracker_ = 0;
    return absl::OkStatus();
  }
  const int64_t successful = growth_tracker_ + 1;
  if (successful == config_.growth_interval) {
    scale_ = Grown(scale_);
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
  return absl::OkStatus();
}

absl::Status GradScaler::UpdatePaddle(bool found_inf) {
  if (found_inf) {
    // Bad steps count consecutively: a good step below resets decr_count.
    growth_tracker_ = 0;
    bad_steps_ += 1;
    if (bad_steps_ == config_.hysteresis) {
      AMPD_RETURN_IF_ERROR(BackOff(scale_));
      bad_steps_ = 0;
    }
    return absl::OkStatus();
  }
  bad_steps_ = 0;
  growth_tracker_ += 1;
  if (growth_tracker_ == config_.growth_interval) {
    scale_ = Grown(scale_);
    growth_tracker_ = 0;
  }
  return absl::OkStatus();
}

absl::Status GradScaler::UpdateDeepSpeed(bool found_inf) {
  if (found_inf) {
    if (config_.hysteresis == 1 || hysteresis_left_ == 1) {
      AMPD_RETURN_IF_ERROR(BackOff(scale_));
    } else {
      hysteresis_left_ -= 1;
    }
    last_overflow_iteration_ = iteration_;
  } else {
    if (config_.consecutive_hysteresis) hysteresis_left_ = config_.hysteresis;
    // Grows after exactly growth_interval good steps since the last
    // overflow: (iter - last_overflow_iter - 1) with iter counted from 1 for
    // the step being taken is DeepSpeed's cur_iter - last_overflow_iter
    // before its increment. It is always > 0 here, since
    // last_overflow_iter < cur_iter.
    if ((iteration_ - last_overflow_iteration_) % config_.growth_interval == 0) {
      if (!config_.consecutive_hysteresis) hysteresis_left_ = config_.hysteresis;
      scale_ = Grown(scale_);
    }
  }
  iteration_ += 1;
  return absl::OkStatus();
}

absl::Status GradScaler::UpdateMegatron(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    // Not refilled on backoff: once spent, every further overflow backs off
    // until a growth refills it (the tracker may go below 0, as Megatron's).
    hysteresis_left_ -= 1;
    if (hysteresis_left_ <= 0) AMPD_RETURN_IF_ERROR(BackOff(scale_));
    return absl::OkStatus();
  }
  growth_tracker_ += 1;
  if (growth_tracker_ == config_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_left_ = config_.hysteresis;
    scale_ = Grown(scale_);
  }
  return absl::OkStatus();
}

bool GradScaler::AdaptiveCleanStep(std::optional<float> max_abs,
                                   std::optional<double> underflow_fraction, float& scale,
                                   int64_t& growth_tracker) const {
  // Without a measured max the policy cannot predict, and grows as pytorch.
  const float grown = Grown(scale);
  const bool fits =
      !max_abs.has_value() || FitsMargin(*max_abs, grown, config_.overflow_margin_log2);
  const int64_t successful = growth_tracker + 1;
  if (successful == config_.growth_interval) {
    growth_tracker = 0;
    if (fits) {
      scale = grown;
      return false;
    }
    // Only a growth that would really have raised the scale counts as
    // deferred (at the cap, or at float32's top, there is none to defer).
    return grown > scale;
  }
  growth_tracker = successful;
  if (underflow_fraction.has_value() && *underflow_fraction > config_.underflow_threshold &&
      max_abs.has_value() && fits) {
    scale = grown;
    growth_tracker = 0;
  }
  return false;
}

absl::Status GradScaler::UpdateAdaptive(const StepGradStats& stats, ScalerUpdate& update) {
  if (stats.found_inf) {
    // A real overflow: pytorch's backoff.
    AMPD_RETURN_IF_ERROR(BackOff(scale_));
    growth_tracker_ = 0;
    return absl::OkStatus();
  }
  if (AdaptiveCleanStep(stats.max_abs, stats.underflow_fraction, scale_, growth_tracker_)) {
    ++growths_deferred_;
    update.growth_deferred = true;
  }
  return absl::OkStatus();
}

absl::Status GradScaler::UpdateAdaptiveLayers(const StepGradStats& stats, ScalerUpdate& update) {
  const size_t groups = layers_.size();
  if (stats.found_inf) {
    // The highest group whose max is inf is where the overflow entered the
    // backward pass; the groups below it may only have inherited it (the
    // header). None: only NaNs were seen, and every group backs off.
    size_t culprit = groups;
    for (size_t g = std::min(groups, stats.layer_max_abs.size()); g-- > 0;) {
      if (!std::isfinite(stats.layer_max_abs[g])) {
        culprit = g;
        break;
      }
    }
    for (size_t g = 0; g < groups; ++g) {
      if (culprit == groups || culprit == g) AMPD_RETURN_IF_ERROR(BackOff(layers_[g].scale));
      layers_[g].growth_tracker = 0;
    }
  } else {
    for (size_t g = 0; g < groups; ++g) {
      std::optional<float> max_abs;
      std::optional<double> underflow;
      if (g < stats.layer_max_abs.size()) max_abs = stats.layer_max_abs[g];
      if (g < stats.layer_underflow_fraction.size()) underflow = stats.layer_underflow_fraction[g];
      LayerScale& layer = layers_[g];
      // Half the margin: a growth leaves max|g| * S within the limit, so
      // only gradients that doubled since bring the group back here.
      const int64_t half_margin = std::max<int64_t>(0, config_.overflow_margin_log2 - 1);
      if (max_abs.has_value() && !FitsMargin(*max_abs, layer.scale, half_margin)) {
        // The group's gradients have grown through half its margin: back
        // off now, to the scale calibration would pick, before they
        // overflow (the header says why groups do and the job-wide scale
        // does not).
        layer.scale = std::min(layer.scale, CalibratedScale(*max_abs, config_));
        layer.growth_tracker = 0;
        continue;
      }
      if (AdaptiveCleanStep(max_abs, underflow, layer.scale, layer.growth_tracker)) {
        ++growths_deferred_;
        update.growth_deferred = true;
      }
    }
  }
  scale_ = layers_.back().scale;
  growth_tracker_ = layers_.back().growth_tracker;
  return absl::OkStatus();
}

bool GradScaler::NeedsCalibration() const {
  return config_.policy == ScalerPolicy::kAdaptive && config_.enabled && config_.dynamic &&
         !calibrated_;
}

float GradScaler::Calibrate(float max_abs) {
  scale_ = CalibratedScale(max_abs, config_);
  growth_tracker_ = 0;
  calibrated_ = true;
  for (LayerScale& layer : layers_) layer = {scale_, 0};
  return scale_;
}

void GradScaler::CalibrateLayers(absl::Span<const float> max_abs) {
  if (layers_.empty()) {
    Calibrate(max_abs.empty() ? 0.0f : max_abs.back());
    return;
  }
  for (size_t g = 0; g < layers_.size(); ++g) {
    layers_[g] = {CalibratedScale(g < max_abs.size() ? max_abs[g] : 0.0f, config_), 0};
  }
  scale_ = layers_.back().scale;
  growth_tracker_ = 0;
  calibrated_ = true;
}

std::vector<float> GradScaler::layer_scales() const {
  if (layers_.empty()) return {scale()};
  std::vector<float> scales;
  scales.reserve(layers_.size());
  for (const LayerScale& layer : layers_) scales.push_back(layer.scale);
  return scales;
}

absl::StatusOr<ScalerUpdate> GradScaler::Update(bool found_inf) {
  StepGradStats stats;
  stats.found_inf = found_inf;
  return Update(stats);
}

absl::StatusOr<ScalerUpdate> GradScaler::Update(const StepGradStats& stats) {
  const bool found_inf = stats.found_inf;
  ScalerUpdate update;
  update.found_inf = found_inf;
  update.scale_before = scale();
  if (!config_.enabled) {
    // PyTorch's enabled=False: step() is a plain optimizer.step().
    update.scale_after = 1.0f;
    return update;
  }
  update.skipped = found_inf;
  if (!layers_.empty()) update.layer_scales_before = layer_scales();
  if (config_.dynamic) {
    // A refusal leaves the state as it was: the policies update their
    // counters before they back off, so they run on a copy.
    GradScaler next = *this;
    absl::Status s;
    switch (config_.policy) {
      case ScalerPolicy::kPyTorch:
        s = next.UpdatePyTorch(found_inf);
        break;
      case ScalerPolicy::kPaddle:
        s = next.UpdatePaddle(found_inf);
        break;
      case ScalerPolicy::kDeepSpeed:
        s = next.UpdateDeepSpeed(found_inf);
        break;
      case ScalerPolicy::kMegatron:
        s = next.UpdateMegatron(found_inf);
        break;
      case ScalerPolicy::kAdaptive:
        s = next.layers_.empty() ? next.UpdateAdaptive(stats, update)
                                 : next.UpdateAdaptiveLayers(stats, update);
        break;
    }
    AMPD_RETURN_IF_ERROR(s);
    *this = std::move(next);
  }
  update.scale_after = scale_;
  update.grew = update.scale_after > update.scale_before;
  update.backed_off = update.scale_after < update.scale_before;
  if (!layers_.empty()) {
    update.layer_scales_after = layer_scales();
    for (size_t g = 0; g < layers_.size(); ++g) {
      update.grew = update.grew || update.layer_scales_after[g] > update.layer_scales_before[g];
      update.backed_off =
          update.backed_off || update.layer_scales_after[g] < update.layer_scales_before[g];
    }
  }
  update.counters = counters();
  return update;
}

ScalerCounters GradScaler::counters() const {
  ScalerCounters c;
  if (!config_.enabled || !config_.dynamic) return c;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
    case ScalerPolicy::kAdaptive:
      c.growth_tracker = growth_tracker_;
      c.overflows_until_backoff = 1;
      break;
    case ScalerPolicy::kPaddle:
      c.growth_tracker = growth_tracker_;
      c.overflows_until_backoff = config_.hysteresis - bad_steps_;
      break;
    case ScalerPolicy::kDeepSpeed:
      // The next clean update grows when (cur_iter - last_overflow_iter) is
      // a multiple of the window; this many clean ones have counted so far.
      c.growth_tracker = (iteration_ - last_overflow_iteration_ - 1) % config_.growth_interval;
      c.overflows_until_backoff = config_.hysteresis == 1 ? 1 : hysteresis_left_;
      break;
    case ScalerPolicy::kMegatron:
      c.growth_tracker = growth_tracker_;
      c.overflows_until_backoff = std::max<int64_t>(1, hysteresis_left_);
      break;
  }
  return c;
}

}  // namespace ampd::engine::amp
