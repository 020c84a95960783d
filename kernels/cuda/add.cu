// AddScaled: y = scale * (y + x) elementwise, same shape; x and y may be
// different float dtypes. Both are widened exactly to fp32, added, scaled
// and rounded once (RNE) to y's dtype, the same single rounding as the CPU
// oracle (a power-of-two scale is exact in fp32; scale 1 is a plain add).
// A template per (x, y) dtype pair, 16 bytes of the wider one per access.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename X, typename Y>
__global__ void add_scaled_kernel(const X* x, float scale, Y* y, int64_t n, bool vectorized) {
  // x (n), y (n): each thread reads its elements of y before writing them,
  // so x == y (y = 2y) is safe. The sum and the product round separately,
  // as the oracle's do (--fmad=false: no FMA contraction).
  constexpr int N = VecWidth<X, Y>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<X, N> xs = LoadVec<N>(x, i);
        Vec<Y, N> ys = LoadVec<N>(y, i);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float sum = ToFloat(xs.v[j]) + ToFloat(ys.v[j]);
          ys.v[j] = FromFloat<Y>(sum * scale);
        }
        StoreVec<N>(y, i, ys);
      },
      [&](int64_t i) {
        const float sum = ToFloat(x[i]) + ToFloat(y[i]);
        y[i] = FromFloat<Y>(sum * scale);
      });
}

}  // namespace

absl::Status LaunchAddScaled(const void* x, DType x_dtype, float scale, void* y, DType y_dtype,
                             int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(x_dtype, [&](auto x_tag) {
    return DispatchFloat(y_dtype, [&](auto y_tag) {
      using X = decltype(x_tag);
      using Y = decltype(y_tag);
      constexpr int N = VecWidth<X, Y>();
      const X* xt = static_cast<const X*>(x);
      Y* yt = static_cast<Y*>(y);
      const bool vectorized = VecAligned<N>(xt) && VecAligned<N>(yt);
      add_scaled_kernel<X, Y>
          <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(xt, scale, yt, n, vectorized);
      AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cuda
