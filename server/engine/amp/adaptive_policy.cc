// The adaptive policy's rules (adaptive_policy.h explains them).
#include "server/engine/amp/adaptive_policy.h"

#include <algorithm>
#include <cmath>

#include "common/grad_histogram.h"

namespace ampd::engine::amp {

double OverflowLimit(int64_t margin_log2) {
  return std::ldexp(kFp16Max, -static_cast<int>(margin_log2));
}

bool FitsMargin(float max_abs, double scale, int64_t margin_log2) {
  // Written as !(a > b) would let a NaN max pass; a NaN or inf max never fits.
  if (!std::isfinite(max_abs)) return false;
  return static_cast<double>(max_abs) * scale <= OverflowLimit(margin_log2);
}

float CalibratedScale(float max_abs, const ScalerConfig& config) {
  double scale = 1.0;
  if (max_abs == 0.0f) {
    scale = config.init_scale;
  } else if (std::isfinite(max_abs)) {
    const double limit = OverflowLimit(config.overflow_margin_log2);
    const double m = std::fabs(static_cast<double>(max_abs));
    // floor(log2(limit / m)), then corrected by one either way: the quotient
    // is rounded, so at an exact power of two it can land one octave off.
    int k = std::ilogb(limit / m);
    while (k > -126 && m * std::ldexp(1.0, k) > limit) --k;
    while (k < 127 && m * std::ldexp(1.0, k + 1) <= limit) ++k;
    k = std::clamp(k, -126, 127);
    scale = std::ldexp(1.0, k);
  }
  if (config.max_scale.has_value()) scale = std::min(scale, *config.max_scale);
  if (config.min_scale.has_value()) scale = std::max(scale, *config.min_scale);
  return static_cast<float>(scale);
}

double UnderflowFraction(absl::Span<const int64_t> histogram) {
  // Bin 0: exact zeros; bin 1: below 2^kGradHistogramMinLog2; bin 2 + j:
  // [2^(min + j), 2^(min + j + 1)). Every bin whose octave lies below 2^-14
  // holds fp16 subnormals.
  constexpr int kLastUnderflowBin = 2 + (kFp16MinNormalLog2 - 1 - kGradHistogramMinLog2);
  int64_t total = 0;
  int64_t under = 0;
  for (size_t b = 0; b < histogram.size(); ++b) {
    total += histogram[b];
    if (static_cast<int>(b) <= kLastUnderflowBin) under += histogram[b];
  }
  return total == 0 ? 0.0 : static_cast<double>(under) / static_cast<double>(total);
}

}  // namespace ampd::engine::amp
