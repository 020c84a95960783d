// Fill (dst = value, rounded once to dst's dtype) and Scale (y = alpha * y,
// what a GEMM with K == 0 reduces to), 16 bytes per access where aligned.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename T>
__global__ void fill_kernel(T* dst, int64_t n, float value, bool vectorized) {
  // (n) every element gets the same rounded value.
  constexpr int N = VecWidth<T>();
  const T v = FromFloat<T>(value);
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.v[j] = v;
        StoreVec<N>(dst, i, out);
      },
      [&](int64_t i) { dst[i] = v; });
}

template <typename T>
__global__ void scale_kernel(T* y, int64_t n, float alpha, bool vectorized) {
  constexpr int N = VecWidth<T>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        Vec<T, N> ys = LoadVec<N>(y, i);
#pragma unroll
        for (int j = 0; j < N; ++j) ys.v[j] = FromFloat<T>(alpha * ToFloat(ys.v[j]));
        StoreVec<N>(y, i, ys);
      },
      [&](int64_t i) { y[i] = FromFloat<T>(alpha * ToFloat(y[i])); });
}

}  // namespace

absl::Status LaunchFill(void* dst, DType dtype, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    T* d = static_cast<T*>(dst);
    const bool vectorized = VecAligned<N>(d);
    fill_kernel<T><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(d, n, value, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

absl::Status LaunchScale(void* y, DType dtype, int64_t n, float alpha, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    T* d = static_cast<T*>(y);
    const bool vectorized = VecAligned<N>(d);
    scale_kernel<T><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(d, n, alpha, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
