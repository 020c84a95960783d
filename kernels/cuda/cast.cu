// Cast between float dtypes: widen exactly to fp32, round once (RNE) to the
// destination dtype.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__global__ void cast_kernel(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                            int64_t n) {
  // src (n) -> dst (n)
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreAs(dst, i, dst_dtype, LoadAs(src, i, src_dtype));
  }
}

}  // namespace

absl::Status LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                        cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  cast_kernel<<<GridFor(n), kThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, n);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
