// MSE loss: loss = multiplier * (sum((pred - target)^2) * (1/n)) and, in the
// same pass, dpred = ((multiplier * 2 * (1/n)) (pred - target)) * grad_scale
// rounded to pred's dtype (the CPU oracle's operation order: the scale comes
// last so that a scale near float32's top cannot make the coefficient inf and
// a zero difference NaN; kernels/cpu/mse_loss.cc says why). n == 0 is
// refused by the backend (the mean of no elements). The sum is two-stage (per-block partials, then
// one block), so the loss is bitwise reproducible run to run, unlike an atomicAdd.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/loss_common.cuh"

namespace ampd::kernels::cuda {
namespace {

__global__ void mse_loss_kernel(const void* pred, DType dtype, const float* target, int64_t n,
                                float coef, float grad_scale, void* dpred, float* partials) {
  // pred, dpred (n) pred's dtype; target (n) F32; partials (gridDim.x)
  float sum = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float d = LoadAs(pred, i, dtype) - target[i];
    sum += d * d;
    StoreAs(dpred, i, dtype, (coef * d) * grad_scale);
  }
  sum = BlockSum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

}  // namespace

absl::Status LaunchMseLoss(const void* pred, DType dtype, const float* target, int64_t n,
                           float multiplier, float grad_scale, float* loss, void* dpred,
                           float* partials, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(GridFor(n), int64_t{kMaxReductionBlocks}));
  // Multiplied by the reciprocal in the CPU oracle's order, so that dpred
  // (one product per element) is bitwise the CPU's.
  const float inv_count = 1.0f / static_cast<float>(n);
  const float coef = multiplier * 2.0f * inv_count;
  mse_loss_kernel<<<blocks, kThreads, 0, stream>>>(pred, dtype, target, n, coef, grad_scale, dpred,
                                                   partials);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  finalize_loss_kernel<><<<1, kThreads, 0, stream>>>(partials, blocks, inv_count, multiplier, loss);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
