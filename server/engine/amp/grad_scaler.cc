// GradScaler policies, validation and state dicts. Every update rule below
// is transcribed from the framework's own source (torch/amp/grad_scaler.py
// and _amp_update_scale_, paddle/amp/grad_scaler.py,
// deepspeed/runtime/fp16/loss_scaler.py,
// megatron/core/optimizer/grad_scaler.py); the header lists the choices.
// Each policy's state dict keys, and the frameworks' names for config
// fields, are one table per policy (PolicySpecs) that the exporter, the
// loader and the messages all read.
#include "server/engine/amp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/charconv.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/amp/adaptive_policy.h"

namespace ampd::engine::amp {
namespace {

// Integers travel as doubles in a state dict; beyond 2^53 they stop being
// exact, so a counter that large is corrupt rather than merely big.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

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

// Whether a step can unscale by 1 / S: the step multiplies its gradients by
// inv_scale = float(1.0 / double(S)), which overflows to inf for S below
// about 2^-128 (and for S = 0). Gradients times inf are never finite, so a
// scaler below this can never apply a step again.
bool UsableScale(float scale) {
  return scale > 0.0f && std::isfinite(scale) &&
         std::isfinite(static_cast<float>(1.0 / static_cast<double>(scale)));
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

// Per-layer scales multiply gradients by ratios of scales; only powers of
// two make those products exact.
bool IsPowerOfTwo(double value) {
  int exponent = 0;
  return std::isfinite(value) && value > 0.0 && std::frexp(value, &exponent) == 0.5;
}

absl::Status CheckPerLayerValue(double value, absl::string_view name) {
  if (!IsPowerOfTwo(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("per_layer_scales: ", name, " must be a power of two, got ", value));
  }
  return absl::OkStatus();
}

// What a state value must be: any finite number, an integer exact in a
// double, or a 0/1 flag.
enum class ValueKind { kReal, kInteger, kFlag };

// Reads one policy's keys out of a state, remembering which it used so that
// keys from another policy can be refused afterwards.
class StateReader {
 public:
  StateReader(const ScalerState& state, ScalerPolicy policy) : state_(state), policy_(policy) {}

  // The value of `key`: present, finite and of its kind.
  absl::StatusOr<double> Value(const std::string& key, ValueKind kind) {
    AMPD_ASSIGN_OR_RETURN(const double value, Finite(key));
    if (kind == ValueKind::kInteger &&
        (std::trunc(value) != value || std::fabs(value) > kMaxExactInteger)) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: key '", key, "' must be an integer, got ", value));
    }
    if (kind == ValueKind::kFlag && value != 0.0 && value != 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: key '", key, "' must be 0 or 1, got ", value));
    }
    return value;
  }

  // Keys of another policy (or typos) would otherwise be dropped silently.
  absl::Status NoUnknownKeys() const {
    for (const auto& [key, value] : state_) {
      if (!used_.contains(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat("scaler state: unknown key '", key, "' for policy ", PolicyName(policy_)));
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<double> Finite(const std::string& key) {
    auto it = state_.find(key);
    used_.insert(key);
    if (it == state_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: missing key '", key, "' (policy ", PolicyName(policy_), ")"));
    }
    if (!std::isfinite(it->second)) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: key '", key, "' must be finite, got ", it->second));
    }
    return it->second;
  }

  const ScalerState& state_;
  ScalerPolicy policy_;
  std::set<std::string> used_;
};

// [-]digits[.digits][(e|E)[+|-]digits], or [-].digits[...]: the decimal
// forms a float formatter writes, nothing that strtod accepts beyond them.
bool IsPlainDecimal(absl::string_view t) {
  size_t i = 0;
  if (i < t.size() && t[i] == '-') ++i;
  size_t digits = 0;
  while (i < t.size() && absl::ascii_isdigit(static_cast<unsigned char>(t[i]))) ++i, ++digits;
  if (i < t.size() && t[i] == '.') {
    ++i;
    while (i < t.size() && absl::ascii_isdigit(static_cast<unsigned char>(t[i]))) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < t.size() && absl::ascii_isdigit(static_cast<unsigned char>(t[i]))) {
      ++i;
      ++exp_digits;
    }
    if (exp_digits == 0) return false;
  }
  return i == t.size();
}

absl::Status InRange(int64_t value, int64_t lo, int64_t hi, absl::string_view key) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("scaler state: key '", key, "' must be in [", lo, ", ", hi, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status PrefixState(const absl::Status& status) {
  if (status.ok()) return status;
  return absl::InvalidArgumentError(absl::StrCat("scaler state: key ", status.message()));
}

// Everything a state dict can name: the config's hyper-parameters, the
// scale and the counters. StateDict reads one of these off the scaler;
// LoadStateDict fills a copy and commits it whole.
struct ScalerFields {
  ScalerConfig config;
  double scale = 0.0;
  int64_t growth_tracker = 0;
  int64_t bad_steps = 0;
  int64_t hysteresis_left = 1;
  int64_t iteration = 0;
  int64_t last_overflow_iteration = -1;
  int64_t growths_deferred = 0;
  bool calibrated = false;
};

// The field a state key holds. The field decides the value's type (a real,
// an integer or a 0/1 flag) and when LoadStateDict checks it: the scale
// last, against the config's bounds; hyper-parameters before the counters,
// whose ranges depend on them.
enum class Field {
  kScale,
  kGrowthFactor,
  kBackoffFactor,
  kGrowthInterval,
  kHysteresis,
  kMinScale,
  kConsecutiveHysteresis,
  kDynamic,
  kGrowthTracker,
  kBadSteps,
  kHysteresisLeft,
  kIteration,
  kLastOverflowIteration,
  kOverflowMarginLog2,
  kUnderflowThreshold,
  kGrowthsDeferred,
  kCalibrated,
};

ValueKind KindOf(Field field) {
  switch (field) {
    case Field::kScale:
    case Field::kGrowthFactor:
    case Field::kBackoffFactor:
    case Field::kMinScale:
    case Field::kUnderflowThreshold:
      return ValueKind::kReal;
    case Field::kConsecutiveHysteresis:
    case Field::kDynamic:
    case Field::kCalibrated:
      return ValueKind::kFlag;
    case Field::kGrowthInterval:
    case Field::kHysteresis:
    case Field::kGrowthTracker:
    case Field::kBadSteps:
    case Field::kHysteresisLeft:
    case Field::kIteration:
    case Field::kLastOverflowIteration:
    case Field::kOverflowMarginLog2:
    case Field::kGrowthsDeferred:
      return ValueKind::kInteger;
  }
  return ValueKind::kReal;
}

bool IsHyperParameter(Field field) {
  switch (field) {
    case Field::kGrowthFactor:
    case Field::kBackoffFactor:
    case Field::kGrowthInterval:
    case Field::kHysteresis:
    case Field::kMinScale:
    case Field::kConsecutiveHysteresis:
    case Field::kDynamic:
    case Field::kOverflowMarginLog2:
    case Field::kUnderflowThreshold:
      return true;
    default:
      return false;
  }
}

// Only the deepspeed table names min_scale, and that policy's config always
// has one (Validate requires it).
double Get(const ScalerFields& f, Field field) {
  switch (field) {
    case Field::kScale:
      return f.scale;
    case Field::kGrowthFactor:
      return f.config.growth_factor;
    case Field::kBackoffFactor:
      return f.config.backoff_factor;
    case Field::kGrowthInterval:
      return static_cast<double>(f.config.growth_interval);
    case Field::kHysteresis:
      return static_cast<double>(f.config.hysteresis);
    case Field::kMinScale:
      return *f.config.min_scale;
    case Field::kConsecutiveHysteresis:
      return f.config.consecutive_hysteresis ? 1.0 : 0.0;
    case Field::kDynamic:
      return f.config.dynamic ? 1.0 : 0.0;
    case Field::kGrowthTracker:
      return static_cast<double>(f.growth_tracker);
    case Field::kBadSteps:
      return static_cast<double>(f.bad_steps);
    case Field::kHysteresisLeft:
      return static_cast<double>(f.hysteresis_left);
    case Field::kIteration:
      return static_cast<double>(f.iteration);
    case Field::kLastOverflowIteration:
      return static_cast<double>(f.last_overflow_iteration);
    case Field::kOverflowMarginLog2:
      return static_cast<double>(f.config.overflow_margin_log2);
    case Field::kUnderflowThreshold:
      return f.config.underflow_threshold;
    case Field::kGrowthsDeferred:
      return static_cast<double>(f.growths_deferred);
    case Field::kCalibrated:
      return f.calibrated ? 1.0 : 0.0;
  }
  return 0.0;
}

// `value` has passed its kind's check: integers are exact, flags 0 or 1.
// Only an integer field's value is converted to int64: a scale may lie far
// outside int64's range, and converting it would be undefined behaviour.
void Set(ScalerFields& f, Field field, double value) {
  const auto integer = [value] { return static_cast<int64_t>(value); };
  switch (field) {
    case Field::kScale:
      f.scale = value;
      break;
    case Field::kGrowthFactor:
      f.config.growth_factor = value;
      break;
    case Field::kBackoffFactor:
      f.config.backoff_factor = value;
      break;
    case Field::kGrowthInterval:
      f.config.growth_interval = integer();
      break;
    case Field::kHysteresis:
      f.config.hysteresis = integer();
      break;
    case Field::kMinScale:
      f.config.min_scale = value;
      break;
    case Field::kConsecutiveHysteresis:
      f.config.consecutive_hysteresis = value == 1.0;
      break;
    case Field::kDynamic:
      f.config.dynamic = value == 1.0;
      break;
    case Field::kGrowthTracker:
      f.growth_tracker = integer();
      break;
    case Field::kBadSteps:
      f.bad_steps = integer();
      break;
    case Field::kHysteresisLeft:
      f.hysteresis_left = integer();
      break;
    case Field::kIteration:
      f.iteration = integer();
      break;
    case Field::kLastOverflowIteration:
      f.last_overflow_iteration = integer();
      break;
    case Field::kOverflowMarginLog2:
      f.config.overflow_margin_log2 = integer();
      break;
    case Field::kUnderflowThreshold:
      f.config.underflow_threshold = value;
      break;
    case Field::kGrowthsDeferred:
      f.growths_deferred = integer();
      break;
    case Field::kCalibrated:
      f.calibrated = value == 1.0;
      break;
  }
}

// A loaded value's own check, given every value loaded with it; the message
// names `key`. Integer fields arrive exact, so casting them back is lossless.
using KeyCheck = absl::Status (*)(const ScalerFields& loaded, double value, absl::string_view key);

absl::Status GrowthFactorKey(const ScalerFields&, double value, absl::string_view key) {
  return PrefixState(CheckGrowthFactor(value, absl::StrCat("'", key, "'")));
}

absl::Status BackoffFactorKey(const ScalerFields&, double value, absl::string_view key) {
  return PrefixState(CheckBackoffFactor(value, absl::StrCat("'", key, "'")));
}

absl::Status AtLeastOneKey(const ScalerFields&, double value, absl::string_view key) {
  return PrefixState(CheckAtLeastOne(static_cast<int64_t>(value), absl::StrCat("'", key, "'")));
}

// A floor carried by the state (deepspeed's): a usable scale, and not above
// the cap the job configured.
absl::Status FloorKey(const ScalerFields& loaded, double value, absl::string_view key) {
  AMPD_RETURN_IF_ERROR(PrefixState(CheckScaleValue(value, absl::StrCat("'", key, "'"))));
  if (loaded.config.max_scale.has_value() &&
      static_cast<float>(value) > static_cast<float>(*loaded.config.max_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: key '", key, "' (", value,
                                                   ") exceeds max_scale ",
                                                   *loaded.config.max_scale));
  }
  return absl::OkStatus();
}

// A tracker at or past the interval would never equal it again and the
// scale would never grow.
absl::Status BelowGrowthIntervalKey(const ScalerFields& loaded, double value,
                                    absl::string_view key) {
  return InRange(static_cast<int64_t>(value), 0, loaded.config.growth_interval - 1, key);
}

// Paddle's decr_count backs off (and resets) on reaching
// decr_every_n_nan_or_inf.
absl::Status BelowHysteresisKey(const ScalerFields& loaded, double value, absl::string_view key) {
  return InRange(static_cast<int64_t>(value), 0, loaded.config.hysteresis - 1, key);
}

absl::Status OverflowMarginKey(const ScalerFields&, double value, absl::string_view key) {
  return PrefixState(CheckOverflowMargin(static_cast<int64_t>(value), absl::StrCat("'", key, "'")));
}

absl::Status UnderflowThresholdKey(const ScalerFields&, double value, absl::string_view key) {
  return PrefixState(CheckUnderflowThreshold(value, absl::StrCat("'", key, "'")));
}

absl::Status IterationKey(const ScalerFields&, double value, absl::string_view key) {
  return InRange(static_cast<int64_t>(value), 0, static_cast<int64_t>(kMaxExactInteger) - 1, key);
}

// Set to cur_iter just before cur_iter increments, so always behind it.
absl::Status LastOverflowKey(const ScalerFields& loaded, double value, absl::string_view key) {
  return InRange(static_cast<int64_t>(value), -1, loaded.iteration - 1, key);
}

// DeepSpeed never lets cur_hysteresis below 1 (it backs off at 1 instead).
absl::Status DeepSpeedHysteresisKey(const ScalerFields& loaded, double value,
                                    absl::string_view key) {
  return InRange(static_cast<int64_t>(value), 1, loaded.config.hysteresis, key);
}

// Megatron's tracker below 0 is legitimate (it keeps decrementing); above
// the configured hysteresis is not reachable.
absl::Status MegatronHysteresisKey(const ScalerFields& loaded, double value,
                                   absl::string_view key) {
  return InRange(static_cast<int64_t>(value), -static_cast<int64_t>(kMaxExactInteger),
                 loaded.config.hysteresis, key);
}

// One key of a policy's state dict: the framework's own name, the field it
// holds, and its check beyond its kind (none for the scale, which is checked
// against the bounds once everything is loaded, and for flags).
struct StateKey {
  absl::string_view key;
  Field field;
  KeyCheck check = nullptr;
};

// The framework's own name for an ampd config field, for messages.
struct ConfigAlias {
  absl::string_view field;
  absl::string_view alias;
};

// A policy's names: its own, its state dict's keys (in the order
// LoadStateDict reads them and names the first one missing), and the
// framework's names for config fields.
struct PolicySpec {
  ScalerPolicy policy;
  absl::string_view name;
  std::vector<StateKey> keys;
  std::vector<ConfigAlias> aliases;
};

const std::vector<PolicySpec>& PolicySpecs() {
  static const auto* specs = new std::vector<PolicySpec>{
      {ScalerPolicy::kPyTorch,
       "pytorch",
       {
           {"scale", Field::kScale},
           {"growth_factor", Field::kGrowthFactor, GrowthFactorKey},
           {"backoff_factor", Field::kBackoffFactor, BackoffFactorKey},
           {"growth_interval", Field::kGrowthInterval, AtLeastOneKey},
           {"_growth_tracker", Field::kGrowthTracker, BelowGrowthIntervalKey},
       },
       {}},
      {ScalerPolicy::kPaddle,
       "paddle",
       {
           {"scale", Field::kScale},
           {"incr_ratio", Field::kGrowthFactor, GrowthFactorKey},
           {"decr_ratio", Field::kBackoffFactor, BackoffFactorKey},
           {"incr_every_n_steps", Field::kGrowthInterval, AtLeastOneKey},
           {"decr_every_n_nan_or_inf", Field::kHysteresis, AtLeastOneKey},
           {"incr_count", Field::kGrowthTracker, BelowGrowthIntervalKey},
           {"decr_count", Field::kBadSteps, BelowHysteresisKey},
           {"use_dynamic_loss_scaling", Field::kDynamic},
       },
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
           {"cur_scale", Field::kScale},
           {"cur_iter", Field::kIteration, IterationKey},
           {"last_overflow_iter", Field::kLastOverflowIteration, LastOverflowKey},
           {"scale_factor", Field::kGrowthFactor, GrowthFactorKey},
           {"scale_window", Field::kGrowthInterval, AtLeastOneKey},
           {"min_scale", Field::kMinScale, FloorKey},
           {"cur_hysteresis", Field::kHysteresisLeft, DeepSpeedHysteresisKey},
           {"delayed_shift", Field::kHysteresis, AtLeastOneKey},
           {"consecutive_hysteresis", Field::kConsecutiveHysteresis},
       },
       {
           {"growth_factor", "scale_factor"},
           {"growth_interval", "loss_scale_window"},
           {"min_scale", "min_loss_scale"},
       }},
      {ScalerPolicy::kMegatron,
       "megatron",
       {
           {"scale", Field::kScale},
           {"growth_tracker", Field::kGrowthTracker, BelowGrowthIntervalKey},
           {"hysteresis_tracker", Field::kHysteresisLeft, MegatronHysteresisKey},
       },
       {
           {"growth_interval", "loss_scale_window"},
           {"min_scale", "min_loss_scale"},
       }},
      // pytorch's keys, so its scale and tracker read the same, then the
      // adaptive policy's own: its two hyper-parameters, the deferred-growth
      // count and whether the scale has been calibrated (a state saved
      // before the first step has not, and calibrates after loading).
      {ScalerPolicy::kAdaptive,
       "adaptive",
       {
           {"scale", Field::kScale},
           {"growth_factor", Field::kGrowthFactor, GrowthFactorKey},
           {"backoff_factor", Field::kBackoffFactor, BackoffFactorKey},
           {"growth_interval", Field::kGrowthInterval, AtLeastOneKey},
           {"_growth_tracker", Field::kGrowthTracker, BelowGrowthIntervalKey},
           {"overflow_margin_log2", Field::kOverflowMarginLog2, OverflowMarginKey},
           {"underflow_threshold", Field::kUnderflowThreshold, UnderflowThresholdKey},
           {"growths_deferred", Field::kGrowthsDeferred, IterationKey},
           {"calibrated", Field::kCalibrated},
       },
       {}},
  };
  return *specs;
}

const PolicySpec* FindSpec(ScalerPolicy policy) {
  for (const PolicySpec& spec : PolicySpecs()) {
    if (spec.policy == policy) return &spec;
  }
  return nullptr;
}

// "growth_factor (paddle incr_ratio)": the ampd field first, so a message
// always starts with the name a caller set, then the framework's own name
// for readers coming from that framework.
std::string Label(ScalerPolicy policy, absl::string_view field) {
  if (const PolicySpec* spec = FindSpec(policy); spec != nullptr) {
    for (const ConfigAlias& alias : spec->aliases) {
      if (alias.field == field) return absl::StrCat(field, " (", spec->name, " ", alias.alias, ")");
    }
  }
  return std::string(field);
}

// A per-layer-scaled state's group keys, for a scaler of `groups` groups
// (none when 0), checked against the hyper-parameters `loaded` carries:
// each group's (scale, growth tracker).
absl::StatusOr<std::vector<std::pair<float, int64_t>>> LoadLayerScales(StateReader& reader,
                                                                       const ScalerFields& loaded,
                                                                       size_t groups) {
  std::vector<std::pair<float, int64_t>> layers;
  if (groups == 0) return layers;
  AMPD_ASSIGN_OR_RETURN(const double stored, reader.Value("layer_groups", ValueKind::kInteger));
  if (stored != static_cast<double>(groups)) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: key 'layer_groups' must be ",
                                                   groups, " (this job's layer groups), got ",
                                                   stored));
  }
  const ScalerConfig& config = loaded.config;
  for (size_t g = 0; g < groups; ++g) {
    const std::string scale_key = absl::StrCat("layer.", g, ".scale");
    const std::string tracker_key = absl::StrCat("layer.", g, "._growth_tracker");
    AMPD_ASSIGN_OR_RETURN(const double scale, reader.Value(scale_key, ValueKind::kReal));
    AMPD_ASSIGN_OR_RETURN(const double tracker, reader.Value(tracker_key, ValueKind::kInteger));
    // The value names a float32 exactly, or in the 9 significant digits
    // StateDict writes it with (2^-20 is written 9.53674316e-07, which a
    // double reads as a neighbour of 2^-20 that rounds to it in float32).
    const float as_float = static_cast<float>(scale);
    const bool names_float =
        static_cast<double>(as_float) == scale ||
        ParseStateNumber(scale_key, FormatStateNumber(as_float)).value_or(0) == scale;
    if (!IsPowerOfTwo(as_float) || !names_float ||
        (config.min_scale.has_value() && as_float < static_cast<float>(*config.min_scale)) ||
        (config.max_scale.has_value() && as_float > static_cast<float>(*config.max_scale))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scaler state: key '", scale_key,
          "' must be a power of two float32 value within [min_scale, max_scale], got ", scale));
    }
    AMPD_RETURN_IF_ERROR(
        InRange(static_cast<int64_t>(tracker), 0, config.growth_interval - 1, tracker_key));
    layers.emplace_back(as_float, static_cast<int64_t>(tracker));
  }
  // The job-wide keys are the last group's (the scale the loss carries).
  if (static_cast<float>(loaded.scale) != layers.back().first ||
      loaded.growth_tracker != layers.back().second) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scaler state: keys 'scale' and '_growth_tracker' must equal the last group's 'layer.",
        groups - 1, ".scale' and 'layer.", groups - 1, "._growth_tracker'"));
  }
  return layers;
}

}  // namespace

std::string FormatStateNumber(double v) {
  char buf[64];
  if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9007199254740992.0) {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(v));
  } else {
    // 9 digits read back as the same float32, not always as the same
    // double: a double-valued field (a factor, deepspeed's min_scale) that
    // happens to be a float32 must read back as itself, or a restored job
    // would write another number (2^-149 as "1.40129846e-45" reads back 1
    // ulp away, then writes "1.4012984600000001e-45"). So 9 only when they
    // are exact, else 17.
    std::snprintf(buf, sizeof(buf), "%.9g", v);
    if (static_cast<double>(static_cast<float>(v)) != v || std::strtod(buf, nullptr) != v) {
      std::snprintf(buf, sizeof(buf), "%.17g", v);
    }
  }
  return buf;
}

absl::StatusOr<double> ParseStateNumber(absl::string_view key, absl::string_view text) {
  if (!IsPlainDecimal(text)) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": must be a plain decimal number, got \"",
                                                   absl::CHexEscape(text), "\""));
  }
  double value = 0.0;
  const absl::from_chars_result r = absl::from_chars(text.data(), text.data() + text.size(), value);
  // A range error is an overflow to inf or an underflow to 0: either way the
  // text names a number the state cannot hold.
  if (r.ec != std::errc() || r.ptr != text.data() + text.size() || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, ": \"", text, "\" is outside the range of a double"));
  }
  return value;
}

absl::string_view PolicyName(ScalerPolicy policy) {
  const PolicySpec* spec = FindSpec(policy);
  return spec == nullptr ? "unknown" : spec->name;
}

std::optional<ScalerPolicy> PolicyFromName(absl::string_view name) {
  for (const PolicySpec& spec : PolicySpecs()) {
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

ScalerState GradScaler::StateDict() const {
  if (!config_.enabled) return {};
  const ScalerFields fields = {.config = config_,
                               .scale = static_cast<double>(scale_),
                               .growth_tracker = growth_tracker_,
                               .bad_steps = bad_steps_,
                               .hysteresis_left = hysteresis_left_,
                               .iteration = iteration_,
                               .last_overflow_iteration = last_overflow_iteration_,
                               .growths_deferred = growths_deferred_,
                               .calibrated = calibrated_};
  ScalerState state;
  for (const StateKey& k : FindSpec(config_.policy)->keys) {
    state[std::string(k.key)] = Get(fields, k.field);
  }
  if (!layers_.empty()) {
    state["layer_groups"] = static_cast<double>(layers_.size());
    for (size_t g = 0; g < layers_.size(); ++g) {
      state[absl::StrCat("layer.", g, ".scale")] = static_cast<double>(layers_[g].scale);
      state[absl::StrCat("layer.", g, "._growth_tracker")] =
          static_cast<double>(layers_[g].growth_tracker);
    }
  }
  return state;
}

absl::Status GradScaler::LoadStateDict(const ScalerState& state) {
  if (!config_.enabled) return absl::OkStatus();
  if (state.empty() && config_.policy == ScalerPolicy::kAdaptive) {
    // A state without scaler keys (weights from elsewhere): the adaptive
    // policy measures the loaded model's gradients again instead of failing.
    calibrated_ = false;
    growth_tracker_ = 0;
    for (LayerScale& layer : layers_) layer.growth_tracker = 0;
    return absl::OkStatus();
  }
  if (state.empty()) {
    return absl::InvalidArgumentError(
        "scaler state is empty (saved from a disabled scaler?) but this scaler is enabled");
  }
  // Everything is parsed into a copy and committed at the end, so a bad
  // state leaves the scaler as it was. Counters a policy's state does not
  // carry start where a new scaler's do.
  ScalerFields loaded;
  loaded.config = config_;
  loaded.hysteresis_left = config_.hysteresis;
  const PolicySpec& spec = *FindSpec(config_.policy);
  StateReader reader(state, config_.policy);
  std::string scale_key;
  for (const StateKey& k : spec.keys) {
    AMPD_ASSIGN_OR_RETURN(const double value, reader.Value(std::string(k.key), KindOf(k.field)));
    Set(loaded, k.field, value);
    if (k.field == Field::kScale) scale_key = std::string(k.key);
  }
  // Hyper-parameters first: the counters' ranges are read off them.
  for (const bool hyper_parameters : {true, false}) {
    for (const StateKey& k : spec.keys) {
      if (k.check == nullptr || IsHyperParameter(k.field) != hyper_parameters) continue;
      AMPD_RETURN_IF_ERROR(k.check(loaded, Get(loaded, k.field), k.key));
    }
  }
  AMPD_ASSIGN_OR_RETURN(const auto layers, LoadLayerScales(reader, loaded, layers_.size()));
  AMPD_RETURN_IF_ERROR(reader.NoUnknownKeys());

  // PyTorch's fill_ into its float32 scale tensor rounds the same way. A
  // scale of 0 (or one that rounds to 0 in float32) is refused: its inverse
  // is inf, so every step of the job would be skipped forever (the header
  // says why a run-time underflow is still allowed).
  ScalerConfig& config = loaded.config;
  const double scale_value = loaded.scale;
  const float scale = static_cast<float>(scale_value);
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: key '", scale_key,
                                                   "' must be a finite float32 value > 0, got ",
                                                   scale_value));
  }
  if (config.min_scale.has_value() && scale < static_cast<float>(*config.min_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: key '", scale_key, "' (",
                                                   scale_value, ") is below min_scale ",
                                                   *config.min_scale));
  }
  if (config.max_scale.has_value() && scale > static_cast<float>(*config.max_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: key '", scale_key, "' (",
                                                   scale_value, ") is above max_scale ",
                                                   *config.max_scale));
  }
  // PyTorch also resets _init_scale to the loaded scale.
  config.init_scale = scale;
  if (absl::Status s = config.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("scaler state: ", s.message()));
  }

  config_ = std::move(config);
  scale_ = scale;
  growth_tracker_ = loaded.growth_tracker;
  bad_steps_ = loaded.bad_steps;
  hysteresis_left_ = loaded.hysteresis_left;
  iteration_ = loaded.iteration;
  last_overflow_iteration_ = loaded.last_overflow_iteration;
  growths_deferred_ = loaded.growths_deferred;
  calibrated_ = loaded.calibrated;
  for (size_t g = 0; g < layers.size(); ++g) layers_[g] = {layers[g].first, layers[g].second};
  return absl::OkStatus();
}

}  // namespace ampd::engine::amp
