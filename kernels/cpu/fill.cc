// Fill and FillTensors: every element of one tensor (or of each of a list)
// set to one value, rounded once to the tensor's dtype and replicated,
// split over the backend's thread pool.
#include <algorithm>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// dst checked by the caller.
absl::Status FillChecked(ThreadPool& pool, Tensor& dst, float value) {
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

}  // namespace

absl::Status Fill(ThreadPool& pool, Tensor& dst, float value) {
  AMPD_RETURN_IF_ERROR(ValidateFill(dst));
  return FillChecked(pool, dst, value);
}

absl::Status FillTensors(ThreadPool& pool, absl::Span<Tensor* const> dsts, float value) {
  // Every tensor is checked before the first is written.
  AMPD_RETURN_IF_ERROR(ValidateFillTensors(dsts));
  for (Tensor* dst : dsts) AMPD_RETURN_IF_ERROR(FillChecked(pool, *dst, value));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
