// The CUDA backend: cuBLAS GEMM and hand-written kernels (one op per .cu
// file in this folder) behind the Backend interface, one stream per backend
// instance, device memory from a caching pool shared by all backends on the
// same GPU (memory_pool.h). Compared op by op with the CPU oracle in
// tests/cuda/.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace ampd::kernels::cuda {

// Visible CUDA devices; 0 when there is no GPU or no usable driver (never an
// error: that is how a CPU-only machine answers).
int DeviceCount();

// A new backend with its own stream and cuBLAS handle on `device`.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace ampd::kernels::cuda
