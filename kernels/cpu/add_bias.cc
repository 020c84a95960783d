// AddBias: the Linear layer's bias added to every row of y, in fp32 and
// rounded once to y's dtype. Rows are split over the backend's thread pool;
// no element's arithmetic depends on the split.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status AddBias(ThreadPool& pool, const Tensor& bias, Tensor& y) {
  if (absl::Status s = ValidateAddBias(bias, y); !s.ok()) return s;
  const int64_t rows = y.dim(0);  // N
  const int64_t cols = y.dim(1);  // C
  // The bias may be stored in any float dtype (the contract leaves it open);
  // widen it once to fp32 rather than per row.
  std::vector<float> b(static_cast<size_t>(cols));  // (C)
  absl::Status widened = VisitFloat(bias.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    for (int64_t c = 0; c < cols; ++c) b[static_cast<size_t>(c)] = Tag::Load(Ptr<Tag>(bias)[c]);
    return absl::OkStatus();
  });
  if (!widened.ok()) return widened;
  return VisitFloat(y.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(y);  // (N, C)
    const int64_t rows_per_chunk =
        std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1));
    pool.ParallelFor(rows, rows_per_chunk, [&](int64_t first, int64_t last) {
      for (int64_t n = first; n < last; ++n) {
        auto* row = out + n * cols;
        for (int64_t c = 0; c < cols; ++c) {
          row[c] = Tag::Store(Tag::Load(row[c]) + b[static_cast<size_t>(c)]);
        }
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
