// The CUDA backend: cuBLAS GEMM, cuBLASLt GEMMs with epilogues (the Linear
// ops, gemm_lt.h) and hand-written kernels (one op per .cu file in this
// folder) behind the Backend interface, one stream per backend
// instance, device memory from a caching pool shared by all backends on the
// same GPU (memory_pool.h). Compared op by op with the CPU oracle in
// tests/cuda/.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace ampd::kernels::cuda {

// Visible CUDA devices; 0 when there is no GPU or no usable driver (never an
// error: that is how a CPU-only machine answers).
int DeviceCount();

struct CudaBackendOptions {
  // The Linear ops fuse their bias, GELU and bias gradient into cuBLASLt
  // epilogues where cuBLASLt has an algorithm. false: always the separate
  // path (a GEMM, then the epilogue's own kernel), which tests compare with
  // the fused one; both meet the same contract (kernels/backend.h).
  bool gemm_epilogues = true;
  // Fused attention in fp16/bf16 with heads of 64 or 128 channels: false
  // (the default), the register-tile kernels (mma.sync with S, P and the
  // accumulators in registers); true, the earlier wmma kernels, which stage
  // S, P and O through shared memory (slower). Both meet the contract of
  // kernels/backend.h; tests compare them.
  bool attention_wmma = false;
};

// A new backend with its own stream and cuBLAS/cuBLASLt handles on `device`.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options = {});

// The cuBLASLt epilogue plans a CUDA backend has made so far, one line
// each: the GEMM (epilogue, dtypes, m, n, k, transposes) and whether it
// runs fused or on separate kernels, and why. Empty for another backend.
std::vector<std::string> GemmEpiloguePlans(const Backend& backend);

}  // namespace ampd::kernels::cuda
