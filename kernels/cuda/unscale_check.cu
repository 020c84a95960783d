// UnscaleAndCheck over a list of gradients, one launch per kChunkTensors
// tensors: sets found_inf[0] = 1 when any g * inv_scale is inf or NaN (never
// clears it), adds sum((g * inv_scale)^2) to norm_sq[0], and when in_place
// stores g * inv_scale rounded to g's dtype. The norm is two-stage, so it is
// bitwise reproducible (a per-block atomicAdd would add the blocks in
// whatever order they finish): every block writes its fp32 partial to
// scratch (one slot per block of every launch), then one block adds the
// partials in index order and does norm_sq[0] += total. max_abs[0] (when
// given) is raised to the largest |g * inv_scale| in the same read: a
// block max, then one atomicMax per block on the float's bit pattern, which
// orders like the value for non-negative floats and, being a max, gives the
// same bits in any order (NaNs are skipped by fmaxf; an inf is kept).
// The non-finite test is on the unscaled product g * inv_scale: it flags
// every stored inf or NaN, as PyTorch's
// _amp_foreach_non_finite_check_and_unscale_ does, and also a finite g made
// non-finite by an inv_scale of inf (a loss scale that underflowed to 0) or
// one so large that the product overflows, so such a step is skipped rather
// than writing inf or NaN into the master weights.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kElemsPerThread = 8;

constexpr int64_t kTile = int64_t{kThreads} * kElemsPerThread;

__global__ void unscale_check_kernel(const __grid_constant__ TensorChunk<GradSpan> chunk,
                                     float inv_scale, bool in_place, float* found_inf,
                                     float* partials, float* max_abs) {
  // partials (gridDim.x) or nullptr: this launch's slice of the scratch
  // max_abs (1) or nullptr
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const GradSpan& g = chunk.entry[t];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kTile;
  float sum_sq = 0.0f;
  float max = 0.0f;
  int nonfinite = 0;
  for (int k = 0; k < kElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;  // coalesced across the block
    if (i >= g.n) break;
    // The unscaled value is what is checked (the CPU oracle's rule): it is
    // what the optimizer consumes, and it is non-finite whenever the stored
    // value is, and also when inv_scale is inf or overflows a finite g.
    const float u = LoadAs(g.data, i, g.dtype) * inv_scale;
    nonfinite |= !isfinite(u);
    max = fmaxf(max, fabsf(u));
    sum_sq += u * u;
    if (in_place) StoreAs(g.data, i, g.dtype, u);
  }
  if (__syncthreads_or(nonfinite) && threadIdx.x == 0) found_inf[0] = 1.0f;
  if (partials != nullptr) {
    sum_sq = BlockSum(sum_sq);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum_sq;
  }
  if (max_abs != nullptr) {
    max = BlockMaxNonNegative(max);
    if (threadIdx.x == 0 && max > 0.0f) {
      atomicMax(reinterpret_cast<unsigned int*>(max_abs), __float_as_uint(max));
    }
  }
}

constexpr int kFinalizeThreads = 1024;

// One block: thread j adds partials j, j + 1024, ... in order, then a fixed
// tree (BlockSum) combines the threads.
__global__ void norm_sq_finalize_kernel(const float* partials, int64_t count, float* norm_sq) {
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = BlockSum(sum);
  if (threadIdx.x == 0) norm_sq[0] += sum;
}

}  // namespace

int64_t UnscaleAndCheckBlocks(const GradSpan* grads, int count) {
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    if (grads[i].n > 0) blocks += (grads[i].n + kTile - 1) / kTile;
  }
  return blocks;
}

absl::Status LaunchUnscaleAndCheck(const GradSpan* grads, int count, float inv_scale, bool in_place,
                                   float* found_inf, float* norm_sq, float* partials,
                                   float* max_abs, cudaStream_t stream) {
  const int64_t total_blocks = UnscaleAndCheckBlocks(grads, count);
  if (norm_sq != nullptr && total_blocks > 0 && partials == nullptr) {
    return absl::InternalError("LaunchUnscaleAndCheck: norm_sq given but no partials scratch");
  }
  // Chunks are launched in order and each takes the next slice of the
  // scratch, so partial i is always the same block of the same tensor.
  int64_t next_partial = 0;
  AMPD_CUDA_RETURN_IF_ERROR(
      ForEachChunk(grads, count, kTile, [&](const TensorChunk<GradSpan>& chunk) {
        const int blocks = chunk.block_start[chunk.count];
        float* slice = norm_sq != nullptr ? partials + next_partial : nullptr;
        next_partial += blocks;
        unscale_check_kernel<<<blocks, kThreads, 0, stream>>>(chunk, inv_scale, in_place, found_inf,
                                                              slice, max_abs);
        return cudaGetLastError();
      }));
  if (norm_sq != nullptr && total_blocks > 0) {
    norm_sq_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials, total_blocks, norm_sq);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
