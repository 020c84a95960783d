// UnscaleAndCheck over a list of gradients, one launch per kChunkTensors
// tensors: sets found_inf[0] = 1 when any element is inf or NaN (never
// clears it), adds sum((g * inv_scale)^2) to norm_sq[0] (fp32, one atomicAdd
// per block), and when in_place stores g * inv_scale rounded to g's dtype.
// The non-finite test is on the stored (scaled) value, as PyTorch's
// _amp_foreach_non_finite_check_and_unscale_ does.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kElemsPerThread = 8;
constexpr int64_t kTile = int64_t{kThreads} * kElemsPerThread;

__global__ void unscale_check_kernel(const __grid_constant__ TensorChunk<GradSpan> chunk,
                                     float inv_scale, bool in_place, float* found_inf,
                                     float* norm_sq) {
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const GradSpan& g = chunk.entry[t];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kTile;
  float sum_sq = 0.0f;
  int nonfinite = 0;
  for (int k = 0; k < kElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;  // coalesced across the block
    if (i >= g.n) break;
    const float v = LoadAs(g.data, i, g.dtype);
    nonfinite |= !isfinite(v);
    const float u = v * inv_scale;
    sum_sq += u * u;
    if (in_place) StoreAs(g.data, i, g.dtype, u);
  }
  if (__syncthreads_or(nonfinite) && threadIdx.x == 0) found_inf[0] = 1.0f;
  if (norm_sq != nullptr) {
    sum_sq = BlockSum(sum_sq);
    if (threadIdx.x == 0) atomicAdd(norm_sq, sum_sq);
  }
}

}  // namespace

absl::Status LaunchUnscaleAndCheck(const GradSpan* grads, int count, float inv_scale, bool in_place,
                                   float* found_inf, float* norm_sq, cudaStream_t stream) {
  AMPD_CUDA_RETURN_IF_ERROR(
      ForEachChunk(grads, count, kTile, [&](const TensorChunk<GradSpan>& chunk) {
        unscale_check_kernel<<<chunk.block_start[chunk.count], kThreads, 0, stream>>>(
            chunk, inv_scale, in_place, found_inf, norm_sq);
        return cudaGetLastError();
      }));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
