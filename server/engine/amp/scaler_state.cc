// GradScaler's state dict: each policy's keys as its framework names them
// (one table, PolicySpecs, that the exporter, the loader and the messages
// read), the strict number text a checkpoint stores them as, and the
// all-or-nothing loader with each key's own check.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/charconv.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/config/scaler_field_checks.h"

namespace ampd::engine::amp {
namespace {

// Integers travel as doubles in a state dict; beyond 2^53 they stop being
// exact, so a counter that large is corrupt rather than merely big.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

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

// A policy's state dict keys, in the order LoadStateDict reads them and
// names the first one missing.
struct PolicySpec {
  ScalerPolicy policy;
  std::vector<StateKey> keys;
};

const std::vector<PolicySpec>& PolicySpecs() {
  static const auto* specs = new std::vector<PolicySpec>{
      {ScalerPolicy::kPyTorch,
       {
           {"scale", Field::kScale},
           {"growth_factor", Field::kGrowthFactor, GrowthFactorKey},
           {"backoff_factor", Field::kBackoffFactor, BackoffFactorKey},
           {"growth_interval", Field::kGrowthInterval, AtLeastOneKey},
           {"_growth_tracker", Field::kGrowthTracker, BelowGrowthIntervalKey},
       }},
      {ScalerPolicy::kPaddle,
       {
           {"scale", Field::kScale},
           {"incr_ratio", Field::kGrowthFactor, GrowthFactorKey},
           {"decr_ratio", Field::kBackoffFactor, BackoffFactorKey},
           {"incr_every_n_steps", Field::kGrowthInterval, AtLeastOneKey},
           {"decr_every_n_nan_or_inf", Field::kHysteresis, AtLeastOneKey},
           {"incr_count", Field::kGrowthTracker, BelowGrowthIntervalKey},
           {"decr_count", Field::kBadSteps, BelowHysteresisKey},
           {"use_dynamic_loss_scaling", Field::kDynamic},
       }},
      {ScalerPolicy::kDeepSpeed,
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
       }},
      {ScalerPolicy::kMegatron,
       {
           {"scale", Field::kScale},
           {"growth_tracker", Field::kGrowthTracker, BelowGrowthIntervalKey},
           {"hysteresis_tracker", Field::kHysteresisLeft, MegatronHysteresisKey},
       }},
      // pytorch's keys, so its scale and tracker read the same, then the
      // adaptive policy's own: its two hyper-parameters, the deferred-growth
      // count and whether the scale has been calibrated (a state saved
      // before the first step has not, and calibrates after loading).
      {ScalerPolicy::kAdaptive,
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
       }},
  };
  return *specs;
}

const PolicySpec* FindSpec(ScalerPolicy policy) {
  for (const PolicySpec& spec : PolicySpecs()) {
    if (spec.policy == policy) return &spec;
  }
  return nullptr;
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
