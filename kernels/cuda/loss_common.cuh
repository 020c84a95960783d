// The second stage of the deterministic loss reductions: one block adds the
// per-block partial sums in a fixed order and writes
//   loss[0] = multiplier * (sum * inv_count)
// with inv_count = 1 / count rounded on the host: the CPU oracle's
// (kernels/cpu/mse_loss.cc, cross_entropy.cc) exact operation order; or,
// for the chunked loss that several launches add into, loss[0] += sum.
#pragma once

#include "kernels/cuda/device_common.cuh"

namespace ampd::kernels::cuda {

// A template so that the header may define it in every .cu that includes it.
template <int kUnused = 0>
__global__ void finalize_loss_kernel(const float* partials, int num_partials, float inv_count,
                                     float multiplier, float* loss) {
  float sum = 0.0f;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  sum = BlockSum(sum);
  if (threadIdx.x == 0) loss[0] = multiplier * (sum * inv_count);
}

template <int kUnused = 0>
__global__ void accumulate_loss_kernel(const float* partials, int num_partials, float* loss) {
  float sum = 0.0f;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  sum = BlockSum(sum);
  if (threadIdx.x == 0) loss[0] += sum;
}

}  // namespace ampd::kernels::cuda
