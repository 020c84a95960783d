// FillRandom: counter-based Philox draws (kernels/philox.h) written straight
// into an F32 device tensor, one Philox block per thread, no host round
// trip. The draw functions are the CPU backend's, so both write the same
// bits for the same (seed, stream, offset).
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/philox.h"

namespace ampd::kernels::cuda {
namespace {

// Draws per Philox block: 4 uniform words, or one Box-Muller pair.
template <bool kUniform>
constexpr uint64_t kPerBlock = kUniform ? 4 : 2;

// dst (n) = draws offset .. offset + n - 1. Thread t computes Philox block
// first_block + t and writes the draws of it that fall inside dst.
template <bool kUniform>
__global__ void fill_random_kernel(float* dst, int64_t n, RandomFill f, uint64_t first_block,
                                   uint64_t blocks) {
  constexpr uint64_t kPer = kPerBlock<kUniform>;
  for (uint64_t t = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; t < blocks;
       t += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t block = first_block + t;
    const philox::Block b = philox::StreamBlock(f.seed, f.stream, block);
    float v[kPer];
    if constexpr (kUniform) {
      for (int w = 0; w < 4; ++w) v[w] = philox::UniformFromWord(b.v[w], f.lo, f.hi);
    } else {
      philox::NormalPairFromBlock(b, f.mean, f.stddev, v[0], v[1]);
    }
    for (uint64_t k = 0; k < kPer; ++k) {
      const uint64_t draw = block * kPer + k;
      // i = draw - offset, skipped outside [0, n) (first and last block).
      if (draw < f.offset) continue;
      const uint64_t i = draw - f.offset;
      if (i < static_cast<uint64_t>(n)) dst[i] = v[k];
    }
  }
}

template <bool kUniform>
absl::Status Launch(float* dst, int64_t n, const RandomFill& f, cudaStream_t stream) {
  constexpr uint64_t kPer = kPerBlock<kUniform>;
  // The op checks guarantee offset + n - 1 fits in uint64.
  const uint64_t first_block = f.offset / kPer;
  const uint64_t last_block = (f.offset + static_cast<uint64_t>(n) - 1) / kPer;
  const uint64_t blocks = last_block - first_block + 1;
  fill_random_kernel<kUniform><<<GridFor(static_cast<int64_t>(blocks)), kThreads, 0, stream>>>(
      dst, n, f, first_block, blocks);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchFillRandom(float* dst, int64_t n, const RandomFill& fill, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return fill.distribution == RandomDistribution::kUniform ? Launch<true>(dst, n, fill, stream)
                                                           : Launch<false>(dst, n, fill, stream);
}

}  // namespace ampd::kernels::cuda
