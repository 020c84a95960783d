// Cast between float dtypes: widen exactly to fp32, round once (RNE) to the
// destination dtype. A template per (src, dst) dtype pair, 16 bytes of the
// wider one per access.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n, bool vectorized) {
  // src (n) -> dst (n)
  constexpr int N = VecWidth<S, D>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<S, N> in = LoadVec<N>(src, i);
        Vec<D, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.v[j] = FromFloat<D>(ToFloat(in.v[j]));
        StoreVec<N>(dst, i, out);
      },
      [&](int64_t i) { dst[i] = FromFloat<D>(ToFloat(src[i])); });
}

}  // namespace

absl::Status LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                        cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(src_dtype, [&](auto src_tag) {
    return DispatchFloat(dst_dtype, [&](auto dst_tag) {
      using S = decltype(src_tag);
      using D = decltype(dst_tag);
      constexpr int N = VecWidth<S, D>();
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      const bool vectorized = VecAligned<N>(s) && VecAligned<N>(d);
      cast_kernel<S, D><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(s, d, n, vectorized);
      AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cuda
