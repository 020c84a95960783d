// Fill (dst = value, rounded once to dst's dtype) and Scale (y = alpha * y,
// what a GEMM with K == 0 reduces to).
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename T>
__global__ void fill_kernel(T* dst, int64_t n, float value) {
  // (n) every element gets the same rounded value.
  const T v = FromFloat<T>(value);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = v;
  }
}

template <typename T>
__global__ void scale_kernel(T* y, int64_t n, float alpha) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = FromFloat<T>(alpha * ToFloat(y[i]));
  }
}

}  // namespace

absl::Status LaunchFill(void* dst, DType dtype, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF16:
      fill_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<__half*>(dst), n, value);
      break;
    case DType::kBF16:
      fill_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, value);
      break;
    default:
      fill_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<float*>(dst), n, value);
      break;
  }
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

absl::Status LaunchScale(void* y, DType dtype, int64_t n, float alpha, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF16:
      scale_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<__half*>(y), n, alpha);
      break;
    case DType::kBF16:
      scale_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(y), n, alpha);
      break;
    default:
      scale_kernel<<<GridFor(n), kThreads, 0, stream>>>(static_cast<float*>(y), n, alpha);
      break;
  }
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
