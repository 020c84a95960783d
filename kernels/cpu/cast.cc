// Cast between float dtypes: each element widened exactly to fp32 and
// rounded once to the destination dtype, split over the backend's thread
// pool; no element's arithmetic depends on the split.
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

template <typename SrcTag, typename DstTag>
void CastLoop(const typename SrcTag::Storage* src, typename DstTag::Storage* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = DstTag::Store(SrcTag::Load(src[i]));
}

}  // namespace

absl::Status Cast(ThreadPool& pool, const Tensor& src, Tensor& dst) {
  if (absl::Status s = ValidateCast(src, dst); !s.ok()) return s;
  // Widening is exact and narrowing rounds once; fp16 <-> bf16 goes through
  // fp32, which holds both exactly, so it too is a single rounding.
  return VisitFloat(src.dtype(), [&](auto src_tag) {
    using SrcTag = decltype(src_tag);
    return VisitFloat(dst.dtype(), [&](auto dst_tag) {
      using DstTag = decltype(dst_tag);
      const auto* in = Ptr<SrcTag>(src);
      auto* out = Ptr<DstTag>(dst);
      pool.ParallelFor(src.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        CastLoop<SrcTag, DstTag>(in + begin, out + begin, end - begin);
      });
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cpu
