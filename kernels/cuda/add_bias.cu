// AddBias: y (N, C) += bias (C) broadcast over rows; the sum is formed in
// fp32 and rounded once to y's dtype.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__global__ void add_bias_kernel(const void* bias, DType bias_dtype, void* y, DType y_dtype,
                                int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreAs(y, i, y_dtype, LoadAs(y, i, y_dtype) + LoadAs(bias, i % cols, bias_dtype));
  }
}

}  // namespace

absl::Status LaunchAddBias(const void* bias, DType bias_dtype, void* y, DType y_dtype, int64_t rows,
                           int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  add_bias_kernel<<<GridFor(rows * cols), kThreads, 0, stream>>>(bias, bias_dtype, y, y_dtype, rows,
                                                                 cols);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
