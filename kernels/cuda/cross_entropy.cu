// Cross-entropy over rows of logits (N, V), in fp32, one warp per row:
//   row loss = log(sum exp(x - max)) - (x[label] - max)   (max-shifted)
//   loss = multiplier * (sum of row losses * (1/N))
//   dlogits = ((multiplier * (1/N)) (exp(x - max) * (1/sum) - onehot)) * grad_scale
// in the CPU oracle's operation order (the scale last, so a scale near
// float32's top cannot turn a zero gradient into inf * 0 = NaN). dlogits may alias logits.
// Row losses are summed per block in a fixed order, then by one block, so
// the loss is reproducible. A label outside [0, V) sets
// kErrorCrossEntropyLabel (reported by the backend at the next
// Synchronize/CopyToHost); its row contributes 0 and gets a zero gradient.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/loss_common.cuh"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

__global__ void cross_entropy_kernel(const void* logits, DType dtype, const void* labels,
                                     DType label_dtype, int64_t rows, int64_t vocab, float coef,
                                     float grad_scale, void* dlogits, float* partials,
                                     int* error_flags) {
  // logits, dlogits (rows, vocab); labels (rows); partials (gridDim.x)
  __shared__ float warp_loss[kWarpsPerBlock];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float loss_sum = 0.0f;
  for (int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + warp; row < rows;
       row += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t base = row * vocab;
    const int64_t label = LoadIndex(labels, row, label_dtype);
    if (label < 0 || label >= vocab) {
      if (lane == 0) atomicOr(error_flags, kErrorCrossEntropyLabel);
      for (int64_t c = lane; c < vocab; c += 32) StoreAs(dlogits, base + c, dtype, 0.0f);
      continue;
    }
    // Read before the row's first store: dlogits may alias logits, and the
    // lane that stores column `label` need not be the one reading it.
    const float label_logit = LoadAs(logits, base + label, dtype);
    float mx = -INFINITY;
    for (int64_t c = lane; c < vocab; c += 32) mx = fmaxf(mx, LoadAs(logits, base + c, dtype));
    mx = WarpMax(mx);
    float sum = 0.0f;
    for (int64_t c = lane; c < vocab; c += 32) sum += expf(LoadAs(logits, base + c, dtype) - mx);
    sum = WarpSum(sum);
    // Every lane has read the whole row (max and sum above) before any lane
    // stores below: WarpSum's shuffles synchronise the warp.
    const float inv_sum = 1.0f / sum;
    for (int64_t c = lane; c < vocab; c += 32) {
      const float p = expf(LoadAs(logits, base + c, dtype) - mx) * inv_sum;
      StoreAs(dlogits, base + c, dtype, (coef * (c == label ? p - 1.0f : p)) * grad_scale);
    }
    // log(sum) - (x[label] - max), not (max + log(sum)) - x[label]: the
    // latter cancels catastrophically when the logits are large.
    loss_sum += logf(sum) - (label_logit - mx);
  }
  if (lane == 0) warp_loss[warp] = loss_sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_loss[w];
    partials[blockIdx.x] = total;
  }
}

}  // namespace

absl::Status LaunchCrossEntropy(const void* logits, DType dtype, const void* labels,
                                DType label_dtype, int64_t rows, int64_t vocab, float multiplier,
                                float grad_scale, float* loss, void* dlogits, float* partials,
                                int* error_flags, cudaStream_t stream) {
  const int blocks = static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(1, (rows + kWarpsPerBlock - 1) / kWarpsPerBlock),
                        int64_t{kMaxReductionBlocks}));
  // Reciprocals as the CPU oracle multiplies by them (kernels/cpu/cross_entropy.cc).
  const float inv_rows = 1.0f / static_cast<float>(rows);
  const float coef = multiplier * inv_rows;
  cross_entropy_kernel<<<blocks, kThreads, 0, stream>>>(logits, dtype, labels, label_dtype, rows,
                                                        vocab, coef, grad_scale, dlogits, partials,
                                                        error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  finalize_loss_kernel<><<<1, kThreads, 0, stream>>>(partials, blocks, inv_rows, multiplier, loss);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
