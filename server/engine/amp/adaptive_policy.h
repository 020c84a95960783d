// The adaptive loss-scaling policy's rules, as pure functions of the
// gradient statistics a step measures, so that GradScaler only sequences
// them and tests can pin each rule on constructed numbers.
//
// The three ideas, each missing from the frameworks' scalers:
//  - Calibrated start. A job's first step measures max|g| of the unscaled
//    gradients with one extra backward at S = 1 (a scale that cannot
//    overflow unless the gradients themselves exceed fp16's range) and
//    starts at the largest power of two with max|g| * S <= OverflowLimit.
//    No step is skipped to find the scale, where pytorch's 65536 start
//    skips steps until it has backed off (4 steps for a loss multiplied by
//    100).
//  - Predictive growth. The fused check pass produces max|g| at no extra
//    pass; a scheduled growth is taken only when max|g| * S_grown stays
//    under OverflowLimit, otherwise it is deferred (and counted): the
//    growth a framework would take and then pay for with a skipped step is
//    never taken.
//  - Underflow-aware growth. When a sampled log2 histogram of the stored
//    (scaled) gradients shows more than underflow_threshold of the elements
//    at zero or below fp16's smallest normal (2^-14), the scale grows
//    early, provided the max leaves head-room.
// A real overflow backs off exactly as pytorch does (skip, S *= backoff).
//
// Why these defaults:
//  - margin 2^3: between two steps the gradients' max rarely moves by more
//    than a few times; 8x head-room costs 3 of fp16's 40 octaves (normal and
//    subnormal) and keeps a growth from landing within one doubling of inf.
//  - underflow threshold 2^-10 (about 0.1%): fp16 stores 11 significant
//    bits, so every element already carries a relative rounding error up to
//    2^-11; flushing fewer than 2^-10 of the elements to zero loses less
//    than that rounding does, more starts to cost updates. Exact zeros are
//    counted too (they cannot be told apart from flushed values), which at
//    worst grows the scale up to the margin, where calibration would put it.
//  - cap 2^24 (Apex's default): the calibration sees parameter gradients
//    only; when they are tiny the cap keeps activation gradients, which it
//    does not see, from being scaled without bound.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "server/engine/amp/grad_scaler.h"

namespace ampd::engine::amp {

// fp16's largest finite value.
inline constexpr double kFp16Max = 65504.0;
// The smallest normal fp16 value is 2^-14; below it values are subnormal.
inline constexpr int kFp16MinNormalLog2 = -14;

// 65504 / 2^margin_log2: the largest max|g| * S the policy lets a step reach.
double OverflowLimit(int64_t margin_log2);

// True when a step whose unscaled gradients peak at max_abs would stay
// within the margin at `scale`: max_abs * scale <= OverflowLimit, computed
// in double (exact for a float32 times a power of two).
bool FitsMargin(float max_abs, double scale, int64_t margin_log2);

// The scale a calibrated job starts at, given max|g| of its unscaled
// gradients: the largest power of two 2^k (k in [-126, 127], a normal
// float32) with max_abs * 2^k <= OverflowLimit, then limited to
// [min_scale, max_scale] when set. max_abs == 0 (every gradient zero or
// flushed even at S = 1) keeps init_scale; a non-finite max_abs (the
// gradients overflow at S = 1 already) gives 1 (within the bounds), from
// where a real overflow backs off as usual.
float CalibratedScale(float max_abs, const ScalerConfig& config);

// From a kernels::GradLog2Histogram of the stored gradients (bins: exact
// zeros, below 2^-30, then one octave each from 2^-30): the fraction of
// counted elements that are zero or below 2^-14 (fp16 subnormals), or 0
// when the histogram counted nothing.
double UnderflowFraction(absl::Span<const int64_t> histogram);

}  // namespace ampd::engine::amp
