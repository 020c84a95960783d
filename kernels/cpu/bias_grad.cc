// BiasGrad: the Linear layer's bias gradient, the fp32 column sums of dy
// (plus beta times the old value) rounded once to dbias's dtype. Columns
// are split over the backend's thread pool; each column's rows are added in
// the same order whatever the split.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status BiasGrad(ThreadPool& pool, const Tensor& dy, float beta, Tensor& dbias) {
  if (absl::Status s = ValidateBiasGrad(dy, dbias); !s.ok()) return s;
  const int64_t rows = dy.dim(0);  // N
  const int64_t cols = dy.dim(1);  // C
  // Column sums in fp32, rows added in order 0..N-1 for every column (the
  // row-outer loop keeps the reads contiguous without changing that order).
  // Threads take blocks of whole columns, so each column's order is kept.
  std::vector<float> sum(static_cast<size_t>(cols), 0.0f);  // (C)
  constexpr int64_t kColumnsPerChunk = 256;                 // 1 KiB of fp32 per row read
  const int64_t column_grain =
      rows * cols < kElementwiseGrain ? std::max<int64_t>(cols, 1) : kColumnsPerChunk;
  absl::Status summed = VisitFloat(dy.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(dy);  // (N, C)
    pool.ParallelFor(cols, column_grain, [&](int64_t c0, int64_t c1) {
      for (int64_t n = 0; n < rows; ++n) {
        const auto* row = in + n * cols;
        for (int64_t c = c0; c < c1; ++c) sum[static_cast<size_t>(c)] += Tag::Load(row[c]);
      }
    });
    return absl::OkStatus();
  });
  if (!summed.ok()) return summed;
  return VisitFloat(dbias.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(dbias);  // (C)
    for (int64_t c = 0; c < cols; ++c) {
      // BLAS convention: beta == 0 never reads dbias, so a freshly allocated
      // (unspecified, possibly NaN) buffer is simply overwritten.
      const float prev = beta == 0.0f ? 0.0f : beta * Tag::Load(out[c]);
      out[c] = Tag::Store(sum[static_cast<size_t>(c)] + prev);
    }
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
