// GemmBiasGrad: a Linear's weight gradient (Gemm with alpha 1) and its bias
// gradient, the fp32 column sums of the dy operand as stored (K, width),
// which is BiasGrad's contract on that operand. The CPU runs the two ops
// in turn; CUDA fuses the sum into the GEMM's epilogue where it can.
#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status GemmBiasGrad(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                          const Tensor& a, const Tensor& b, float beta, Tensor& c, BiasGradOf of,
                          Tensor& dbias) {
  AMPD_RETURN_IF_ERROR(ValidateGemmBiasGrad(trans_a, trans_b, a, b, c, of, dbias));
  AMPD_RETURN_IF_ERROR(Gemm(pool, order, trans_a, trans_b, 1.0f, a, b, beta, c));
  // dy (K, width): a when of is kA (trans_a), b when kB (not trans_b).
  return BiasGrad(pool, of == BiasGradOf::kA ? a : b, beta, dbias);
}

}  // namespace ampd::kernels::cpu
