// CUDA and cuBLAS error codes turned into absl::Status, with the file, line
// and expression that failed, so that no device error is ever an exit() or
// an abort(). Included by .cu files, so it stays C++17.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace ampd::kernels::cuda {

// cudaErrorMemoryAllocation -> ResourceExhausted, anything else -> Internal;
// the message is "file:line: expr: cudaErrorName: description".
absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file, int line);
absl::Status CublasErrorToStatus(cublasStatus_t status, const char* expr, const char* file,
                                 int line);

}  // namespace ampd::kernels::cuda

// Returns from the enclosing function (which returns absl::Status or a
// StatusOr) when the CUDA runtime call fails. The runtime also latches a
// non-sticky error for cudaGetLastError; it is cleared here, since it is
// already reported, so that the next launch check (which reads
// cudaGetLastError) does not blame an unrelated, successful launch.
#define AMPD_CUDA_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                   \
    const cudaError_t ampd_cuda_error_ = (expr);                                         \
    if (ampd_cuda_error_ != cudaSuccess) {                                               \
      (void)cudaGetLastError();                                                          \
      return ::ampd::kernels::cuda::CudaErrorToStatus(ampd_cuda_error_, #expr, __FILE__, \
                                                      __LINE__);                         \
    }                                                                                    \
  } while (0)

// After a <<<...>>> launch: a bad configuration is reported here, at the
// launch site; faults inside the kernel surface at the next synchronising call.
#define AMPD_CUDA_RETURN_IF_LAUNCH_FAILED() AMPD_CUDA_RETURN_IF_ERROR(cudaGetLastError())

#define AMPD_CUBLAS_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                        \
    const cublasStatus_t ampd_cublas_status_ = (expr);                                        \
    if (ampd_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                       \
      return ::ampd::kernels::cuda::CublasErrorToStatus(ampd_cublas_status_, #expr, __FILE__, \
                                                        __LINE__);                            \
    }                                                                                         \
  } while (0)

// Propagates a non-OK absl::Status.
#define AMPD_CUDA_RETURN_IF_NOT_OK(expr)         \
  do {                                           \
    const ::absl::Status ampd_status_ = (expr);  \
    if (!ampd_status_.ok()) return ampd_status_; \
  } while (0)
