// AddBias: y (N, C) += bias (C) broadcast over rows; the sum is formed in
// fp32 and rounded once to y's dtype. A template per (bias, y) dtype pair;
// when C is a multiple of the vector width (so no vector straddles a row)
// and both are aligned, y and the bias move 16 bytes (of the wider dtype)
// per access.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename B, typename Y>
__global__ void add_bias_kernel(const B* bias, Y* y, int64_t rows, int64_t cols, bool vectorized) {
  // bias (cols), y (rows, cols)
  constexpr int N = VecWidth<B, Y>();
  GridStride<N>(
      rows * cols, vectorized,
      [&](int64_t i) {
        const Vec<B, N> bs = LoadVec<N>(bias, i % cols);
        Vec<Y, N> ys = LoadVec<N>(y, i);
#pragma unroll
        for (int j = 0; j < N; ++j) ys.v[j] = FromFloat<Y>(ToFloat(ys.v[j]) + ToFloat(bs.v[j]));
        StoreVec<N>(y, i, ys);
      },
      [&](int64_t i) { y[i] = FromFloat<Y>(ToFloat(y[i]) + ToFloat(bias[i % cols])); });
}

}  // namespace

absl::Status LaunchAddBias(const void* bias, DType bias_dtype, void* y, DType y_dtype, int64_t rows,
                           int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DispatchFloat(bias_dtype, [&](auto bias_tag) {
    return DispatchFloat(y_dtype, [&](auto y_tag) {
      using B = decltype(bias_tag);
      using Y = decltype(y_tag);
      constexpr int N = VecWidth<B, Y>();
      const B* bt = static_cast<const B*>(bias);
      Y* yt = static_cast<Y*>(y);
      const bool vectorized = cols % N == 0 && VecAligned<N>(bt) && VecAligned<N>(yt);
      add_bias_kernel<B, Y><<<GridForVec<N>(rows * cols, vectorized), kThreads, 0, stream>>>(
          bt, yt, rows, cols, vectorized);
      AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cuda
