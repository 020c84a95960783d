// ScalerConfig: each policy's names, defaults and validation, and the checks
// of a scaler field's value (scaler_field_checks.h) that the state-dict
// loader shares.
#include "server/engine/config/scaler_config.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/config/scaler_field_checks.h"

namespace ampd::engine::amp {
namespace {

// The framework's own name for an ampd config field, for messages.
struct ConfigAlias {
  absl::string_view field;
  absl::string_view alias;
};

// A policy's names: its own, and its framework's names for config fields.
struct PolicyNames {
  ScalerPolicy policy;
  absl::string_view name;
  std::vector<ConfigAlias> aliases;
};

const std::vector<PolicyNames>& AllPolicyNames() {
  static const auto* names = new std::vector<PolicyNames>{
      {ScalerPolicy::kPyTorch, "pytorch", {}},
      {ScalerPolicy::kPaddle,
       "paddle",
       {
           {"init_scale", "init_loss_scaling"},
           {"growth_factor", "incr_ratio"},
           {"backoff_factor", "decr_ratio"},
           {"growth_interval", "incr_every_n_steps"},
           {"hysteresis", "decr_every_n_nan_or_inf"},
       }},
      {ScalerPolicy::kDeepSpeed,
       "deepspeed",
       {
           {"growth_factor", "scale_factor"},
           {"growth_interval", "loss_scale_window"},
           {"min_scale", "min_loss_scale"},
       }},
      {ScalerPolicy::kMegatron,
       "megatron",
       {
           {"growth_interval", "loss_scale_window"},
           {"min_scale", "min_loss_scale"},
       }},
      {ScalerPolicy::kAdaptive, "adaptive", {}},
  };
  return *names;
}

const PolicyNames* FindNames(ScalerPolicy policy) {
  for (const PolicyNames& names : AllPolicyNames()) {
    if (names.policy == policy) return &names;
  }
  return nullptr;
}

// "growth_factor (paddle incr_ratio)": the ampd field first, so a message
// always starts with the name a caller set, then the framework's own name
// for readers coming from that framework.
std::string Label(ScalerPolicy policy, absl::string_view field) {
  if (const PolicyNames* spec = FindNames(policy); spec != nullptr) {
    for (const ConfigAlias& alias : spec->aliases) {
      if (alias.field == field) return absl::StrCat(field, " (", spec->name, " ", alias.alias, ")");
    }
  }
  return std::string(field);
}

absl::Status CheckPerLayerValue(double value, absl::string_view name) {
  if (!IsPowerOfTwo(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("per_layer_scales: ", name, " must be a power of two, got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

// A scale (init, floor, cap or loaded) must be a positive float32: the scale
// lives in a float32, so a double that rounds to 0 or inf there is unusable.
absl::Status CheckScaleValue(double value, absl::string_view name) {
  const float as_float = static_cast<float>(value);
  if (!std::isfinite(value) || !(value > 0.0) || !std::isfinite(as_float) || !(as_float > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a finite float32 value > 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckGrowthFactor(double value, absl::string_view name) {
  // Written as !(x > 1) so that NaN fails too.
  if (!std::isfinite(value) || !(value > 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be finite and > 1, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckBackoffFactor(double value, absl::string_view name) {
  if (!(value > 0.0 && value < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be in (0, 1), got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckAtLeastOne(int64_t value, absl::string_view name) {
  if (value < 1) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 1, got ", value));
  }
  return absl::OkStatus();
}

// A margin of 2^15 leaves a limit of 2 (65504 / 32768); a larger one would
// hold every scaled gradient below 1, pushing them toward the underflow a
// loss scale exists to avoid.
constexpr int64_t kMaxOverflowMarginLog2 = 15;

absl::Status CheckOverflowMargin(int64_t value, absl::string_view name) {
  if (value < 0 || value > kMaxOverflowMarginLog2) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be in [0, ", kMaxOverflowMarginLog2, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckUnderflowThreshold(double value, absl::string_view name) {
  if (!(value >= 0.0 && value <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be in [0, 1], got ", value));
  }
  return absl::OkStatus();
}

bool IsPowerOfTwo(double value) {
  int exponent = 0;
  return std::isfinite(value) && value > 0.0 && std::frexp(value, &exponent) == 0.5;
}

absl::string_view PolicyName(ScalerPolicy policy) {
  const PolicyNames* spec = FindNames(policy);
  return spec == nullptr ? "unknown" : spec->name;
}

std::optional<ScalerPolicy> PolicyFromName(absl::string_view name) {
  for (const PolicyNames& spec : AllPolicyNames()) {
    if (spec.name == name) return spec.policy;
  }
  return std::nullopt;
}

ScalerConfig ScalerConfig::Defaults(ScalerPolicy policy) {
  ScalerConfig config;
  config.policy = policy;
  switch (policy) {
    case ScalerPolicy::kPyTorch:
      // torch.amp.GradScaler(init_scale=2**16, growth_factor=2.0,
      // backoff_factor=0.5, growth_interval=2000). No floor and no error
      // at one (a min_scale set on it floors as Apex's does).
      config.raise_at_min_scale = false;
      break;
    case ScalerPolicy::kPaddle:
      // paddle.amp.GradScaler's documented signature: init_loss_scaling
      // 2^15, incr_every_n_steps 1000, decr_every_n_nan_or_inf 2.
      config.init_scale = 32768.0;
      config.growth_interval = 1000;
      config.hysteresis = 2;
      config.raise_at_min_scale = false;  // as pytorch's
      break;
    case ScalerPolicy::kDeepSpeed:
      // DeepSpeed's fp16 config defaults: initial_scale_power 16,
      // loss_scale_window 1000, hysteresis 2, min_loss_scale 1;
      // DynamicLossScaler(scale_factor=2, raise_error_at_min_scale=True).
      config.init_scale = 65536.0;
      config.growth_interval = 1000;
      config.hysteresis = 2;
      config.min_scale = 1.0;
      break;
    case ScalerPolicy::kMegatron:
      // Megatron's arguments: initial_loss_scale 2^32, min_loss_scale 1,
      // loss_scale_window 1000, hysteresis 2.
      config.init_scale = 4294967296.0;
      config.growth_interval = 1000;
      config.hysteresis = 2;
      config.min_scale = 1.0;
      // Megatron floors the scale at min_loss_scale and trains on.
      config.raise_at_min_scale = false;
      break;
    case ScalerPolicy::kAdaptive:
      // pytorch's scale, factors and interval (the scheduled growth is
      // pytorch's, made predictive), plus Apex's cap (adaptive_policy.h).
      config.max_scale = 16777216.0;  // 2^24
      break;
  }
  return config;
}

ScalerConfig ScalerConfig::ForPrecisionDefault(codec::DType working_dtype, ScalerPolicy policy) {
  ScalerConfig config = Defaults(policy);
  if (working_dtype == codec::DType::kF16) return config;
  // bf16 and fp32 share fp32's exponent range: gradients that underflow
  // there are not rescued by a scale, so S = 1 and only the skip remains.
  config.dynamic = false;
  config.init_scale = 1.0;
  return config;
}

absl::Status ScalerConfig::Validate() const {
  if (!PolicyFromName(PolicyName(policy)).has_value()) {
    return absl::InvalidArgumentError("policy: unknown scaler policy");
  }
  AMPD_RETURN_IF_ERROR(CheckScaleValue(init_scale, Label(policy, "init_scale")));
  AMPD_RETURN_IF_ERROR(CheckGrowthFactor(growth_factor, Label(policy, "growth_factor")));
  AMPD_RETURN_IF_ERROR(CheckBackoffFactor(backoff_factor, Label(policy, "backoff_factor")));
  AMPD_RETURN_IF_ERROR(CheckAtLeastOne(growth_interval, Label(policy, "growth_interval")));
  AMPD_RETURN_IF_ERROR(CheckAtLeastOne(hysteresis, Label(policy, "hysteresis")));
  AMPD_RETURN_IF_ERROR(CheckOverflowMargin(overflow_margin_log2, "overflow_margin_log2"));
  AMPD_RETURN_IF_ERROR(CheckUnderflowThreshold(underflow_threshold, "underflow_threshold"));
  if (min_scale.has_value()) {
    AMPD_RETURN_IF_ERROR(CheckScaleValue(*min_scale, Label(policy, "min_scale")));
  } else if (policy == ScalerPolicy::kDeepSpeed) {
    // DeepSpeed always has one (its state carries min_scale), and the
    // raise-at-min check needs one to compare with.
    return absl::InvalidArgumentError(
        absl::StrCat(Label(policy, "min_scale"), " is required by the deepspeed policy"));
  }
  if (max_scale.has_value()) {
    AMPD_RETURN_IF_ERROR(CheckScaleValue(*max_scale, Label(policy, "max_scale")));
  }
  // Bounds and init are compared as the float32 values the scaler uses.
  const float init = static_cast<float>(init_scale);
  if (min_scale.has_value() && max_scale.has_value() &&
      static_cast<float>(*min_scale) > static_cast<float>(*max_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("min_scale must be <= max_scale, got min_scale ",
                                                   *min_scale, " > max_scale ", *max_scale));
  }
  if (min_scale.has_value() && init < static_cast<float>(*min_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        Label(policy, "init_scale"), " must be >= min_scale (", *min_scale, "), got ", init_scale));
  }
  if (max_scale.has_value() && init > static_cast<float>(*max_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        Label(policy, "init_scale"), " must be <= max_scale (", *max_scale, "), got ", init_scale));
  }
  if (per_layer_scales) {
    if (policy != ScalerPolicy::kAdaptive) {
      return absl::InvalidArgumentError(
          absl::StrCat("per_layer_scales: applies to the adaptive policy only, got policy ",
                       PolicyName(policy)));
    }
    if (!enabled || !dynamic) {
      return absl::InvalidArgumentError(
          "per_layer_scales: needs an enabled, dynamic scaler (enabled and dynamic true)");
    }
    AMPD_RETURN_IF_ERROR(CheckPerLayerValue(init_scale, "init_scale"));
    AMPD_RETURN_IF_ERROR(CheckPerLayerValue(growth_factor, "growth_factor"));
    AMPD_RETURN_IF_ERROR(CheckPerLayerValue(backoff_factor, "backoff_factor"));
    if (min_scale.has_value()) AMPD_RETURN_IF_ERROR(CheckPerLayerValue(*min_scale, "min_scale"));
    if (max_scale.has_value()) AMPD_RETURN_IF_ERROR(CheckPerLayerValue(*max_scale, "max_scale"));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::amp
