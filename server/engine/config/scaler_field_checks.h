// What each scaler field may hold, one check per kind of value, shared by
// ScalerConfig::Validate (a client's config) and GradScaler::LoadStateDict
// (the hyper-parameters a state dict carries), so a value refused in one is
// refused in the other. Each returns InvalidArgument whose message starts
// with `name`.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ampd::engine::amp {

// A scale (init, floor, cap or loaded): a finite float32 value > 0.
absl::Status CheckScaleValue(double value, absl::string_view name);
// A growth factor: finite and > 1.
absl::Status CheckGrowthFactor(double value, absl::string_view name);
// A backoff factor: in (0, 1).
absl::Status CheckBackoffFactor(double value, absl::string_view name);
// An interval or a hysteresis: >= 1.
absl::Status CheckAtLeastOne(int64_t value, absl::string_view name);
// adaptive's overflow margin: in [0, 15].
absl::Status CheckOverflowMargin(int64_t value, absl::string_view name);
// adaptive's underflow threshold: in [0, 1].
absl::Status CheckUnderflowThreshold(double value, absl::string_view name);
// Per-layer scales multiply gradients by ratios of scales; only powers of
// two make those products exact.
bool IsPowerOfTwo(double value);

}  // namespace ampd::engine::amp
