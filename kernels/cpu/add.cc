// AddScaled: the same-shape y = scale * (y + x) (residuals, the step's loss
// sum, a GPT's residual gradient moved between per-layer loss scales), x
// and y any float dtypes. The sum and the product are formed in fp32 and
// rounded once to y's dtype; the elements are split over the backend's
// thread pool.
#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status AddScaled(ThreadPool& pool, const Tensor& x, float scale, Tensor& y) {
  AMPD_RETURN_IF_ERROR(ValidateAdd(x, y));
  // Both loads are exact widenings, so the only roundings are the fp32 add,
  // the fp32 product (exact for a power-of-two scale, the identity for 1)
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
          const float sum = XTag::Load(in[i]) + YTag::Load(out[i]);
          out[i] = YTag::Store(sum * scale);
        }
      });
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cpu
