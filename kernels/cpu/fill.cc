// Fill: every element of dst set to one value, rounded once to dst's dtype
// and replicated, split over the backend's thread pool.
#include <algorithm>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status Fill(ThreadPool& pool, Tensor& dst, float value) {
  if (absl::Status s = ValidateFill(dst); !s.ok()) return s;
  return VisitFloat(dst.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    // Round once, then replicate the stored pattern.
    const typename Tag::Storage stored = Tag::Store(value);
    auto* out = Ptr<Tag>(dst);
    pool.ParallelFor(dst.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      std::fill(out + begin, out + end, stored);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
