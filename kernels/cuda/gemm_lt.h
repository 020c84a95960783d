// cuBLASLt matmuls with a fused epilogue, for the Linear ops of the CUDA
// backend (GemmBiasActivation, GemmBiasGrad, GemmActivationBackward): the
// bias, the GELU (with its pre-activation saved) or its derivative, or the
// bias gradient computed inside the GEMM instead of in a pass of its own.
//
// Each distinct call (row-major m, n, k, transposes, dtypes, epilogue,
// pointer alignments) gets a plan at its first use: the matmul descriptor,
// the four layouts and the algorithm cuBLASLt's heuristic picks, or the
// finding that it has none. A warm step therefore asks no heuristic,
// allocates nothing and queries no device: it sets the call's pointers on
// the cached descriptor and enqueues. A call cuBLASLt cannot run is
// answered "not fused" and the caller runs its separate kernels; each plan
// logs one line when made, and Describe lists them, so a GPU run shows
// which path every GEMM took.
//
// Numerics are the backend's GEMM contract: CUBLAS_COMPUTE_32F (fp32
// accumulation, never TF32) with fp32 alpha and beta, and only reduction
// schemes that sum split-K partials in fp32 (CUBLASLT_REDUCTION_SCHEME_NONE
// or _COMPUTE_TYPE: the cuBLASLt form of the cuBLAS handle's
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), so each output is
// rounded once. The epilogue works on the fp32 result before that rounding.
//
// Host C++ (not a .cu): it only calls the cuBLASLt host API.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

// What the epilogue does to the row-major c (m, n) = alpha op(a) op(b) + beta c,
// in fp32, before c is rounded to its dtype.
enum class LtEpilogue : uint8_t {
  kBias,         // c = sum + bias; bias (n) read
  kGeluAuxBias,  // aux = sum + bias, c = gelu_tanh(sum + bias); aux (m, n) written
  kDGelu,        // c = sum * gelu_tanh'(aux); aux (m, n) read
  kBGradA,       // also bias (m) = column sums of a stored (k, m), written
  kBGradB,       // also bias (n) = column sums of b stored (k, n), written
};

const char* LtEpilogueName(LtEpilogue epilogue);

// One matmul in the row-major terms of LaunchGemm (launchers.h): op(a)
// (m, k), op(b) (k, n), c (m, n), each matrix stored densely (a row length
// of its stored column count). m, n, k > 0.
struct LtMatmulArgs {
  bool trans_a = false;
  bool trans_b = false;
  int m = 0;
  int n = 0;
  int k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  DType ab_dtype = DType::kF32;
  void* c = nullptr;
  DType c_dtype = DType::kF32;
  float alpha = 1.0f;
  float beta = 0.0f;  // nonzero: c is read (accumulated into)
  LtEpilogue epilogue = LtEpilogue::kBias;
  void* bias = nullptr;  // read (kBias, kGeluAuxBias) or written (kBGradA/B)
  DType bias_dtype = DType::kF32;
  void* aux = nullptr;  // (m, n) of c_dtype: written (kGeluAuxBias) or read (kDGelu)
};

class LtMatmul {
 public:
  // `name` prefixes the log lines ("cuda:0"). The matmuls use `workspace`
  // (device memory, 256-byte aligned), which the backend's cuBLAS handle
  // shares: both enqueue on the backend's one stream, which orders them.
  static absl::StatusOr<std::unique_ptr<LtMatmul>> Create(std::string name, void* workspace,
                                                          size_t workspace_bytes);
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  // Enqueues the matmul with its epilogue on `stream` and returns true; or
  // returns false, having enqueued nothing, when cuBLASLt has no algorithm
  // for the call (its plan remembers that, so the heuristic is asked once).
  // An error is a failure of a call cuBLASLt accepted.
  absl::StatusOr<bool> Run(const LtMatmulArgs& args, cudaStream_t stream);

  // One line per plan made so far: the call and whether it is fused.
  std::vector<std::string> Describe() const;

 private:
  struct Plan;
  // m, n, k, trans_a, trans_b, ab dtype, c dtype, epilogue, bias dtype, and
  // the alignments (bytes, up to 256) of a, b, c, bias and aux, on which
  // the heuristic's choice depends.
  using Key = std::tuple<int, int, int, bool, bool, int, int, int, int, int, int, int, int, int>;

  LtMatmul(std::string name, cublasLtHandle_t handle, void* workspace, size_t workspace_bytes);
  absl::StatusOr<Plan*> PlanFor(const Key& key, const LtMatmulArgs& args);

  const std::string name_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  mutable std::mutex mu_;  // plans_: Describe may run beside a step
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace ampd::kernels::cuda
