// AddScaled: y = scale * (y + x) elementwise, same shape; x and y may be
// different float dtypes. Both are widened exactly to fp32, added, scaled
// and rounded once (RNE) to y's dtype, the same single rounding as the CPU
// oracle (a power-of-two scale is exact in fp32; scale 1 is a plain add).
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__global__ void add_scaled_kernel(const void* x, DType x_dtype, float scale, void* y, DType y_dtype,
                                  int64_t n) {
  // x (n), y (n): each thread reads its element of y before writing it, so
  // x == y (y = 2y) is safe. The sum and the product round separately, as
  // the oracle's do (--fmad=false: no FMA contraction).
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float sum = LoadAs(x, i, x_dtype) + LoadAs(y, i, y_dtype);
    StoreAs(y, i, y_dtype, sum * scale);
  }
}

}  // namespace

absl::Status LaunchAddScaled(const void* x, DType x_dtype, float scale, void* y, DType y_dtype,
                             int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  add_scaled_kernel<<<GridFor(n), kThreads, 0, stream>>>(x, x_dtype, scale, y, y_dtype, n);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
