// Cross-entropy over rows of logits (N, V), in fp32, one warp per row:
//   lse = max + log(sum exp(x - max))      (max-shifted: no overflow)
//   loss = multiplier * mean over rows of (lse - x[label])
//   dlogits = grad_scale * multiplier / N * (softmax(x) - onehot(label))
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
                                     void* dlogits, float* partials, int* error_flags) {
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
      if (lane == 0) {
        volatile int* word = error_flags;
        *word = *word | kErrorCrossEntropyLabel;
      }
      for (int64_t c = lane; c < vocab; c += 32) StoreAs(dlogits, base + c, dtype, 0.0f);
      continue;
    }
    float mx = -INFINITY;
    for (int64_t c = lane; c < vocab; c += 32) mx = fmaxf(mx, LoadAs(logits, base + c, dtype));
    mx = WarpMax(mx);
    float sum = 0.0f;
    for (int64_t c = lane; c < vocab; c += 32) sum += expf(LoadAs(logits, base + c, dtype) - mx);
    sum = WarpSum(sum);
    const float lse = mx + logf(sum);
    for (int64_t c = lane; c < vocab; c += 32) {
      const float p = expf(LoadAs(logits, base + c, dtype) - mx) / sum;
      StoreAs(dlogits, base + c, dtype, coef * (c == label ? p - 1.0f : p));
    }
    loss_sum += lse - LoadAs(logits, base + label, dtype);
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
  const float fn = static_cast<float>(rows);
  const float coef = grad_scale * multiplier / fn;
  cross_entropy_kernel<<<blocks, kThreads, 0, stream>>>(
      logits, dtype, labels, label_dtype, rows, vocab, coef, dlogits, partials, error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  finalize_loss_kernel<><<<1, kThreads, 0, stream>>>(partials, blocks, fn, multiplier, loss);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
