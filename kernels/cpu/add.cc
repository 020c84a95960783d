// Add: the same-shape y += x (residuals, the step's loss sum), x and y any
// float dtypes. The sum is formed in fp32 and rounded once to y's dtype;
// the elements are split over the backend's thread pool.
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status Add(ThreadPool& pool, const Tensor& x, Tensor& y) {
  if (absl::Status s = ValidateAdd(x, y); !s.ok()) return s;
  // Both loads are exact widenings, so the only rounding is the fp32 add
  // and the store into y's dtype, whatever mix of dtypes x and y are.
  return VisitFloat(x.dtype(), [&](auto x_tag) {
    using XTag = decltype(x_tag);
    return VisitFloat(y.dtype(), [&](auto y_tag) {
      using YTag = decltype(y_tag);
      const auto* in = Ptr<XTag>(x);  // same shape as y
      auto* out = Ptr<YTag>(y);
      // x may be y itself (y = 2y): each element is read before it is written.
      pool.ParallelFor(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] = YTag::Store(XTag::Load(in[i]) + YTag::Load(out[i]));
        }
      });
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cpu
