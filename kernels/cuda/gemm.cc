// Row-major GEMM on cuBLAS. cuBLAS is column-major; a row-major (R, C)
// matrix is the column-major (C, R) matrix, its transpose. So the row-major
//   C (M, N) = op(A) (M, K) @ op(B) (K, N)
// is the column-major C^T (N, M) = op(B)^T @ op(A)^T: call cuBLAS with the
// operands swapped, m and n swapped, and each leading dimension the
// row-major column count. fp16/bf16 inputs accumulate in fp32
// (CUBLAS_COMPUTE_32F); fp32 uses CUBLAS_COMPUTE_32F too, i.e. no TF32: the
// Backend interface has no TF32 switch and the CPU oracle is exact fp32.
#include <cublas_v2.h>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

}  // namespace

absl::Status LaunchGemm(cublasHandle_t handle, bool trans_a, bool trans_b, int m, int n, int k,
                        float alpha, const void* a, int lda, const void* b, int ldb, DType ab_dtype,
                        float beta, void* c, DType c_dtype) {
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
      handle, op_b, op_a, n, m, k, &alpha, b, CudaType(ab_dtype), ldb, a, CudaType(ab_dtype), lda,
      &beta, c, CudaType(c_dtype), n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status LaunchGemmStridedBatched(cublasHandle_t handle, bool trans_a, bool trans_b, int m,
                                      int n, int k, float alpha, const void* a, int lda,
                                      int64_t stride_a, const void* b, int ldb, int64_t stride_b,
                                      DType ab_dtype, float beta, void* c, int ldc,
                                      int64_t stride_c, DType c_dtype, int batch) {
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // The same operand swap as LaunchGemm, batch by batch.
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      handle, op_b, op_a, n, m, k, &alpha, b, CudaType(ab_dtype), ldb, stride_b, a,
      CudaType(ab_dtype), lda, stride_a, &beta, c, CudaType(c_dtype), ldc, stride_c, batch,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
