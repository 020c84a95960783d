// Formatting of CUDA / cuBLAS failures (see cuda_status.h).
#include "kernels/cuda/cuda_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ampd::kernels::cuda {

absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file, int line) {
  std::string message = absl::StrCat(file, ":", line, ": ", expr, ": ", cudaGetErrorName(error),
                                     ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(std::move(message));
  return absl::InternalError(std::move(message));
}

absl::Status CublasErrorToStatus(cublasStatus_t status, const char* expr, const char* file,
                                 int line) {
  std::string message = absl::StrCat(file, ":", line, ": ", expr, ": ", cublasGetStatusName(status),
                                     ": ", cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(std::move(message));
  }
  return absl::InternalError(std::move(message));
}

}  // namespace ampd::kernels::cuda
