// The bins of Backend::GradLog2Histogram: bin 0 counts exact zeros, bin 1
// values below 2^kGradHistogramMinLog2, then one bin per power of two up to
// 2^kGradHistogramMaxLog2, and the last bin everything at or above it, inf
// and NaN included. Alone in this header, below the kernels and the engine, so that the
// layers that only read the counts (the engine's API, metrics) can name them.
#pragma once

namespace ampd {

inline constexpr int kGradHistogramMinLog2 = -30;
inline constexpr int kGradHistogramMaxLog2 = 20;
// zero bin + underflow bin + one per octave + overflow bin
inline constexpr int kGradHistogramBins = 2 + (kGradHistogramMaxLog2 - kGradHistogramMinLog2) + 1;

}  // namespace ampd
