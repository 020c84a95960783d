// GradScaler policies, validation and state dicts. Every update rule below is
// transcribed from SCALER.md and, where it leaves a detail open, from the
// framework's own source (torch/amp/grad_scaler.py and _amp_update_scale_,
// paddle/amp/grad_scaler.py, deepspeed/runtime/fp16/loss_scaler.py,
// megatron/core/optimizer/grad_scaler.py); the header lists the choices.
#include "server/engine/amp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/charconv.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::engine::amp {
namespace {

// Integers travel as doubles in a state dict; beyond 2^53 they stop being
// exact, so a counter that large is corrupt rather than merely big.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

// "growth_factor (paddle incr_ratio)": the ampd field first, so a message
// always starts with the name a caller set, then the framework's own name
// for readers coming from that framework.
std::string Label(ScalerPolicy policy, absl::string_view field) {
  absl::string_view alias;
  if (policy == ScalerPolicy::kPaddle) {
    if (field == "init_scale") alias = "paddle init_loss_scaling";
    if (field == "growth_factor") alias = "paddle incr_ratio";
    if (field == "backoff_factor") alias = "paddle decr_ratio";
    if (field == "growth_interval") alias = "paddle incr_every_n_steps";
    if (field == "hysteresis") alias = "paddle decr_every_n_nan_or_inf";
  } else if (policy == ScalerPolicy::kDeepSpeed) {
    if (field == "growth_factor") alias = "deepspeed scale_factor";
    if (field == "growth_interval") alias = "deepspeed loss_scale_window";
    if (field == "min_scale") alias = "deepspeed min_loss_scale";
  } else if (policy == ScalerPolicy::kMegatron) {
    if (field == "growth_interval") alias = "megatron loss_scale_window";
    if (field == "min_scale") alias = "megatron min_loss_scale";
  }
  if (alias.empty()) return std::string(field);
  return absl::StrCat(field, " (", alias, ")");
}

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

// Reads one policy's keys out of a state, remembering which it used so that
// keys from another policy can be refused afterwards.
class StateReader {
 public:
  StateReader(const ScalerState& state, ScalerPolicy policy) : state_(state), policy_(policy) {}

  absl::StatusOr<double> Real(const std::string& key) {
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

  absl::StatusOr<int64_t> Integer(const std::string& key) {
    absl::StatusOr<double> value = Real(key);
    if (!value.ok()) return value.status();
    if (std::trunc(*value) != *value || std::fabs(*value) > kMaxExactInteger) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: key '", key, "' must be an integer, got ", *value));
    }
    return static_cast<int64_t>(*value);
  }

  absl::StatusOr<bool> Flag(const std::string& key) {
    absl::StatusOr<double> value = Real(key);
    if (!value.ok()) return value.status();
    if (*value != 0.0 && *value != 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler state: key '", key, "' must be 0 or 1, got ", *value));
    }
    return *value == 1.0;
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

}  // namespace

std::string FormatStateNumber(double v) {
  char buf[64];
  if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9007199254740992.0) {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(v));
  } else if (static_cast<double>(static_cast<float>(v)) == v) {
    std::snprintf(buf, sizeof(buf), "%.9g", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.17g", v);
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
  switch (policy) {
    case ScalerPolicy::kPyTorch:
      return "pytorch";
    case ScalerPolicy::kPaddle:
      return "paddle";
    case ScalerPolicy::kDeepSpeed:
      return "deepspeed";
    case ScalerPolicy::kMegatron:
      return "megatron";
  }
  return "unknown";
}

std::optional<ScalerPolicy> PolicyFromName(absl::string_view name) {
  for (ScalerPolicy policy : {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle,
                              ScalerPolicy::kDeepSpeed, ScalerPolicy::kMegatron}) {
    if (PolicyName(policy) == name) return policy;
  }
  return std::nullopt;
}

ScalerConfig ScalerConfig::Defaults(ScalerPolicy policy) {
  ScalerConfig config;
  config.policy = policy;
  switch (policy) {
    case ScalerPolicy::kPyTorch:
      // torch.amp.GradScaler(init_scale=2**16, growth_factor=2.0,
      // backoff_factor=0.5, growth_interval=2000).
      break;
    case ScalerPolicy::kPaddle:
      // Seed 003's documented signature.
      config.init_scale = 32768.0;
      config.growth_interval = 1000;
      config.hysteresis = 2;
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
      break;
  }
  return config;
}

ScalerConfig ScalerConfig::ForPrecisionDefault(kernels::DType working_dtype, ScalerPolicy policy) {
  ScalerConfig config = Defaults(policy);
  if (working_dtype == kernels::DType::kF16) return config;
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
  if (absl::Status s = CheckScaleValue(init_scale, Label(policy, "init_scale")); !s.ok()) return s;
  if (absl::Status s = CheckGrowthFactor(growth_factor, Label(policy, "growth_factor")); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckBackoffFactor(backoff_factor, Label(policy, "backoff_factor"));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckAtLeastOne(growth_interval, Label(policy, "growth_interval"));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckAtLeastOne(hysteresis, Label(policy, "hysteresis")); !s.ok()) {
    return s;
  }
  if (min_scale.has_value()) {
    if (absl::Status s = CheckScaleValue(*min_scale, Label(policy, "min_scale")); !s.ok()) {
      return s;
    }
  } else if (policy == ScalerPolicy::kDeepSpeed) {
    // DeepSpeed always has one (its state carries min_scale), and the
    // raise-at-min check needs one to compare with.
    return absl::InvalidArgumentError(
        absl::StrCat(Label(policy, "min_scale"), " is required by the deepspeed policy"));
  }
  if (max_scale.has_value()) {
    if (absl::Status s = CheckScaleValue(*max_scale, Label(policy, "max_scale")); !s.ok()) {
      return s;
    }
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
  return absl::OkStatus();
}

absl::StatusOr<GradScaler> GradScaler::Create(const ScalerConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return GradScaler(config);
}

GradScaler::GradScaler(const ScalerConfig& config)
    : config_(config),
      scale_(static_cast<float>(config.init_scale)),
      hysteresis_left_(config.hysteresis) {}

float GradScaler::scale() const { return config_.enabled ? scale_ : 1.0f; }

float GradScaler::Grown() const {
  float grown = 0.0f;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
    case ScalerPolicy::kDeepSpeed:
      // float * double, rounded once to float32 (PyTorch's kernel; DeepSpeed's
      // Python float product stored as float32).
      grown = static_cast<float>(static_cast<double>(scale_) * config_.growth_factor);
      break;
    case ScalerPolicy::kPaddle:
    case ScalerPolicy::kMegatron:
      grown = scale_ * static_cast<float>(config_.growth_factor);
      break;
  }
  // min(inf, cap) is the cap, so a capped scaler reaches its cap.
  if (config_.max_scale.has_value()) {
    grown = std::min(grown, static_cast<float>(*config_.max_scale));
  }
  // PyTorch PR 98876: never grow to inf.
  return std::isfinite(grown) ? grown : scale_;
}

float GradScaler::BackedOff() const {
  float backed_off = 0.0f;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
      backed_off = static_cast<float>(static_cast<double>(scale_) * config_.backoff_factor);
      break;
    case ScalerPolicy::kDeepSpeed:
      // DeepSpeed: cur_scale / scale_factor; one factor for both directions.
      backed_off = static_cast<float>(static_cast<double>(scale_) / config_.growth_factor);
      break;
    case ScalerPolicy::kPaddle:
    case ScalerPolicy::kMegatron:
      backed_off = scale_ * static_cast<float>(config_.backoff_factor);
      break;
  }
  if (config_.min_scale.has_value()) {
    backed_off = std::max(backed_off, static_cast<float>(*config_.min_scale));
  }
  return backed_off;
}

void GradScaler::UpdatePyTorch(bool found_inf) {
  if (found_inf) {
    scale_ = BackedOff();
    growth_tracker_ = 0;
    return;
  }
  const int64_t successful = growth_tracker_ + 1;
  if (successful == config_.growth_interval) {
    scale_ = Grown();
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

void GradScaler::UpdatePaddle(bool found_inf) {
  if (found_inf) {
    // Bad steps count consecutively: a good step below resets decr_count.
    growth_tracker_ = 0;
    bad_steps_ += 1;
    if (bad_steps_ == config_.hysteresis) {
      scale_ = BackedOff();
      bad_steps_ = 0;
    }
    return;
  }
  bad_steps_ = 0;
  growth_tracker_ += 1;
  if (growth_tracker_ == config_.growth_interval) {
    scale_ = Grown();
    growth_tracker_ = 0;
  }
}

absl::Status GradScaler::UpdateDeepSpeed(bool found_inf) {
  if (found_inf) {
    if (config_.hysteresis == 1 || hysteresis_left_ == 1) {
      if (config_.raise_at_min_scale && scale_ == static_cast<float>(*config_.min_scale)) {
        // DeepSpeed raises here; looping at the floor would skip every step
        // of the job forever while reporting nothing.
        return absl::FailedPreconditionError(absl::StrCat(
            "deepspeed loss scaler: gradients overflowed at the minimum loss scale (min_scale ",
            *config_.min_scale,
            "); the scale cannot be decreased further. The job must stop: "
            "check for NaN/inf in the data or model, lower min_scale, or set "
            "raise_at_min_scale=false"));
      }
      scale_ = BackedOff();
    } else {
      hysteresis_left_ -= 1;
    }
    last_overflow_iteration_ = iteration_;
  } else {
    if (config_.consecutive_hysteresis) hysteresis_left_ = config_.hysteresis;
    // SCALER.md's (iter - last_overflow_iter - 1) with iter counted from 1 for
    // the step being taken, i.e. DeepSpeed's cur_iter before its increment.
    // It is always > 0 here, since last_overflow_iter < cur_iter.
    if ((iteration_ - last_overflow_iteration_) % config_.growth_interval == 0) {
      if (!config_.consecutive_hysteresis) hysteresis_left_ = config_.hysteresis;
      scale_ = Grown();
    }
  }
  iteration_ += 1;
  return absl::OkStatus();
}

void GradScaler::UpdateMegatron(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    // Not refilled on backoff: once spent, every further overflow backs off
    // until a growth refills it (the tracker may go below 0, as Megatron's).
    hysteresis_left_ -= 1;
    if (hysteresis_left_ <= 0) scale_ = BackedOff();
    return;
  }
  growth_tracker_ += 1;
  if (growth_tracker_ == config_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_left_ = config_.hysteresis;
    scale_ = Grown();
  }
}

absl::StatusOr<ScalerUpdate> GradScaler::Update(bool found_inf) {
  ScalerUpdate update;
  update.found_inf = found_inf;
  update.scale_before = scale();
  if (!config_.enabled) {
    // PyTorch's enabled=False: step() is a plain optimizer.step().
    update.scale_after = 1.0f;
    return update;
  }
  update.skipped = found_inf;
  if (config_.dynamic) {
    switch (config_.policy) {
      case ScalerPolicy::kPyTorch:
        UpdatePyTorch(found_inf);
        break;
      case ScalerPolicy::kPaddle:
        UpdatePaddle(found_inf);
        break;
      case ScalerPolicy::kDeepSpeed:
        if (absl::Status s = UpdateDeepSpeed(found_inf); !s.ok()) return s;
        break;
      case ScalerPolicy::kMegatron:
        UpdateMegatron(found_inf);
        break;
    }
  }
  update.scale_after = scale_;
  update.grew = update.scale_after > update.scale_before;
  update.backed_off = update.scale_after < update.scale_before;
  update.counters = counters();
  return update;
}

ScalerCounters GradScaler::counters() const {
  ScalerCounters c;
  if (!config_.enabled || !config_.dynamic) return c;
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
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
  const double scale = static_cast<double>(scale_);
  switch (config_.policy) {
    case ScalerPolicy::kPyTorch:
      return {{"scale", scale},
              {"growth_factor", config_.growth_factor},
              {"backoff_factor", config_.backoff_factor},
              {"growth_interval", static_cast<double>(config_.growth_interval)},
              {"_growth_tracker", static_cast<double>(growth_tracker_)}};
    case ScalerPolicy::kPaddle:
      return {{"scale", scale},
              {"incr_ratio", config_.growth_factor},
              {"decr_ratio", config_.backoff_factor},
              {"incr_every_n_steps", static_cast<double>(config_.growth_interval)},
              {"decr_every_n_nan_or_inf", static_cast<double>(config_.hysteresis)},
              {"incr_count", static_cast<double>(growth_tracker_)},
              {"decr_count", static_cast<double>(bad_steps_)},
              {"use_dynamic_loss_scaling", config_.dynamic ? 1.0 : 0.0}};
    case ScalerPolicy::kDeepSpeed:
      return {{"cur_scale", scale},
              {"cur_iter", static_cast<double>(iteration_)},
              {"last_overflow_iter", static_cast<double>(last_overflow_iteration_)},
              {"scale_factor", config_.growth_factor},
              {"scale_window", static_cast<double>(config_.growth_interval)},
              {"min_scale", *config_.min_scale},
              {"cur_hysteresis", static_cast<double>(hysteresis_left_)},
              {"delayed_shift", static_cast<double>(config_.hysteresis)},
              {"consecutive_hysteresis", config_.consecutive_hysteresis ? 1.0 : 0.0}};
    case ScalerPolicy::kMegatron:
      return {{"scale", scale},
              {"growth_tracker", static_cast<double>(growth_tracker_)},
              {"hysteresis_tracker", static_cast<double>(hysteresis_left_)}};
  }
  return {};
}

absl::Status GradScaler::LoadStateDict(const ScalerState& state) {
  if (!config_.enabled) return absl::OkStatus();
  if (state.empty()) {
    return absl::InvalidArgumentError(
        "scaler state is empty (saved from a disabled scaler?) but this scaler is enabled");
  }
  // Everything is parsed into copies and committed at the end, so a bad
  // state leaves the scaler as it was.
  ScalerConfig config = config_;
  StateReader reader(state, config.policy);
  double scale_value = 0.0;
  std::string scale_key = "scale";
  int64_t growth_tracker = 0;
  int64_t bad_steps = 0;
  int64_t hysteresis_left = config.hysteresis;
  int64_t iteration = 0;
  int64_t last_overflow_iteration = -1;

  switch (config.policy) {
    case ScalerPolicy::kPyTorch: {
      AMPD_ASSIGN_OR_RETURN(scale_value, reader.Real("scale"));
      AMPD_ASSIGN_OR_RETURN(config.growth_factor, reader.Real("growth_factor"));
      AMPD_ASSIGN_OR_RETURN(config.backoff_factor, reader.Real("backoff_factor"));
      AMPD_ASSIGN_OR_RETURN(config.growth_interval, reader.Integer("growth_interval"));
      AMPD_ASSIGN_OR_RETURN(growth_tracker, reader.Integer("_growth_tracker"));
      if (absl::Status s = CheckGrowthFactor(config.growth_factor, "'growth_factor'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckBackoffFactor(config.backoff_factor, "'backoff_factor'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckAtLeastOne(config.growth_interval, "'growth_interval'"); !s.ok()) {
        return PrefixState(s);
      }
      // A tracker at or past the interval would never equal it again and the
      // scale would never grow.
      if (absl::Status s =
              InRange(growth_tracker, 0, config.growth_interval - 1, "_growth_tracker");
          !s.ok()) {
        return s;
      }
      break;
    }
    case ScalerPolicy::kPaddle: {
      AMPD_ASSIGN_OR_RETURN(scale_value, reader.Real("scale"));
      AMPD_ASSIGN_OR_RETURN(config.growth_factor, reader.Real("incr_ratio"));
      AMPD_ASSIGN_OR_RETURN(config.backoff_factor, reader.Real("decr_ratio"));
      AMPD_ASSIGN_OR_RETURN(config.growth_interval, reader.Integer("incr_every_n_steps"));
      AMPD_ASSIGN_OR_RETURN(config.hysteresis, reader.Integer("decr_every_n_nan_or_inf"));
      AMPD_ASSIGN_OR_RETURN(growth_tracker, reader.Integer("incr_count"));
      AMPD_ASSIGN_OR_RETURN(bad_steps, reader.Integer("decr_count"));
      AMPD_ASSIGN_OR_RETURN(config.dynamic, reader.Flag("use_dynamic_loss_scaling"));
      if (absl::Status s = CheckGrowthFactor(config.growth_factor, "'incr_ratio'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckBackoffFactor(config.backoff_factor, "'decr_ratio'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckAtLeastOne(config.growth_interval, "'incr_every_n_steps'");
          !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckAtLeastOne(config.hysteresis, "'decr_every_n_nan_or_inf'");
          !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = InRange(growth_tracker, 0, config.growth_interval - 1, "incr_count");
          !s.ok()) {
        return s;
      }
      if (absl::Status s = InRange(bad_steps, 0, config.hysteresis - 1, "decr_count"); !s.ok()) {
        return s;
      }
      break;
    }
    case ScalerPolicy::kDeepSpeed: {
      scale_key = "cur_scale";
      double min_scale = 0.0;
      AMPD_ASSIGN_OR_RETURN(scale_value, reader.Real("cur_scale"));
      AMPD_ASSIGN_OR_RETURN(iteration, reader.Integer("cur_iter"));
      AMPD_ASSIGN_OR_RETURN(last_overflow_iteration, reader.Integer("last_overflow_iter"));
      AMPD_ASSIGN_OR_RETURN(config.growth_factor, reader.Real("scale_factor"));
      AMPD_ASSIGN_OR_RETURN(config.growth_interval, reader.Integer("scale_window"));
      AMPD_ASSIGN_OR_RETURN(min_scale, reader.Real("min_scale"));
      AMPD_ASSIGN_OR_RETURN(hysteresis_left, reader.Integer("cur_hysteresis"));
      AMPD_ASSIGN_OR_RETURN(config.hysteresis, reader.Integer("delayed_shift"));
      AMPD_ASSIGN_OR_RETURN(config.consecutive_hysteresis, reader.Flag("consecutive_hysteresis"));
      config.min_scale = min_scale;
      if (absl::Status s = CheckGrowthFactor(config.growth_factor, "'scale_factor'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckAtLeastOne(config.growth_interval, "'scale_window'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s = CheckScaleValue(min_scale, "'min_scale'"); !s.ok()) {
        return PrefixState(s);
      }
      if (config.max_scale.has_value() &&
          static_cast<float>(min_scale) > static_cast<float>(*config.max_scale)) {
        return absl::InvalidArgumentError(absl::StrCat("scaler state: key 'min_scale' (", min_scale,
                                                       ") exceeds max_scale ", *config.max_scale));
      }
      if (absl::Status s = CheckAtLeastOne(config.hysteresis, "'delayed_shift'"); !s.ok()) {
        return PrefixState(s);
      }
      if (absl::Status s =
              InRange(iteration, 0, static_cast<int64_t>(kMaxExactInteger) - 1, "cur_iter");
          !s.ok()) {
        return s;
      }
      // Set to cur_iter just before cur_iter increments, so always behind it.
      if (absl::Status s =
              InRange(last_overflow_iteration, -1, iteration - 1, "last_overflow_iter");
          !s.ok()) {
        return s;
      }
      // DeepSpeed never lets it below 1 (it backs off at 1 instead).
      if (absl::Status s = InRange(hysteresis_left, 1, config.hysteresis, "cur_hysteresis");
          !s.ok()) {
        return s;
      }
      break;
    }
    case ScalerPolicy::kMegatron: {
      AMPD_ASSIGN_OR_RETURN(scale_value, reader.Real("scale"));
      AMPD_ASSIGN_OR_RETURN(growth_tracker, reader.Integer("growth_tracker"));
      AMPD_ASSIGN_OR_RETURN(hysteresis_left, reader.Integer("hysteresis_tracker"));
      if (absl::Status s = InRange(growth_tracker, 0, config.growth_interval - 1, "growth_tracker");
          !s.ok()) {
        return s;
      }
      // Below 0 is legitimate (Megatron keeps decrementing it); above the
      // configured hysteresis is not reachable.
      if (absl::Status s = InRange(hysteresis_left, -static_cast<int64_t>(kMaxExactInteger),
                                   config.hysteresis, "hysteresis_tracker");
          !s.ok()) {
        return s;
      }
      break;
    }
  }

  if (absl::Status s = reader.NoUnknownKeys(); !s.ok()) return s;
  // PyTorch's fill_ into its float32 scale tensor rounds the same way. A
  // scale of 0 (or one that rounds to 0 in float32) is refused: its inverse
  // is inf, so every step of the job would be skipped forever (the header
  // says why a run-time underflow is still allowed).
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
  growth_tracker_ = growth_tracker;
  bad_steps_ = bad_steps;
  hysteresis_left_ = hysteresis_left;
  iteration_ = iteration;
  last_overflow_iteration_ = last_overflow_iteration;
  return absl::OkStatus();
}

}  // namespace ampd::engine::amp
