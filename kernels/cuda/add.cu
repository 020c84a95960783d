// Add: y += x elementwise, same shape; x and y may be different float
// dtypes. Both are widened exactly to fp32, added once and rounded once
// (RNE) to y's dtype, the same single rounding as the CPU oracle.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__global__ void add_kernel(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n) {
  // x (n), y (n): each thread reads its element of y before writing it, so
  // x == y (y = 2y) is safe.
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreAs(y, i, y_dtype, LoadAs(x, i, x_dtype) + LoadAs(y, i, y_dtype));
  }
}

}  // namespace

absl::Status LaunchAdd(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n,
                       cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  add_kernel<<<GridFor(n), kThreads, 0, stream>>>(x, x_dtype, y, y_dtype, n);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
