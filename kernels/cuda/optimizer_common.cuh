// What the fused optimizer kernels share: the per-parameter tile layout and
// the GradTransform read on the device (skip on found_inf, unscale, clip).
#pragma once

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {

constexpr int kOptimizerElemsPerThread = 4;
constexpr int64_t kOptimizerTile = int64_t{kThreads} * kOptimizerElemsPerThread;

// Factor applied to every raw gradient element: inv_scale * clip_coef, with
// clip_coef = min(1, max_norm / (sqrt(norm_sq) + 1e-6)) as
// torch.nn.utils.clip_grad_norm_ computes it. Applied as (g * inv_scale) * clip
// so the rounding matches the two separate multiplications of the reference.
struct GradFactor {
  float inv_scale;
  float clip;
};

// True when the step must write nothing: found_inf is set, or an earlier op
// of this step raised a bit in the device error word (a bad embedding id or
// label, not reported to the host until the step's read). Both live in
// device memory and were written by earlier kernels on the same stream, so
// a plain load sees them; every block reads the same two words, L2 hits.
__device__ __forceinline__ bool SkipStep(const TransformArgs& t) {
  if (t.found_inf[0] != 0.0f) return true;
  return t.error_flags != nullptr && t.error_flags[0] != 0;
}

__device__ __forceinline__ GradFactor ReadGradFactor(const TransformArgs& t) {
  float clip = 1.0f;
  if (t.norm_sq != nullptr && t.max_grad_norm > 0.0f) {
    clip = fminf(1.0f, t.max_grad_norm / (sqrtf(t.norm_sq[0]) + 1e-6f));
  }
  return {t.inv_scale, clip};
}

// The body of every fused optimizer kernel around its per-element math: a
// skipped step returns before any write; otherwise find this block's
// parameter and tile and call tile(grad_tag, work_tag, param, begin, factor),
// specialised for the gradient's and working copy's dtypes once per block.
template <typename TileFn>
__device__ __forceinline__ void OptimizerBlock(const TensorChunk<ParamSpan>& chunk,
                                               const TransformArgs& transform, TileFn&& tile) {
  if (SkipStep(transform)) return;  // skipped step: write nothing
  const GradFactor factor = ReadGradFactor(transform);
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const ParamSpan& p = chunk.entry[t];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kOptimizerTile;
  VisitFloat(p.grad_dtype, [&](auto grad_tag) {
    VisitFloat(p.working == nullptr ? DType::kF32 : p.working_dtype,
               [&](auto work_tag) { tile(grad_tag, work_tag, p, begin, factor); });
  });
}

// Launches `kernel` (an optimizer kernel taking (chunk, args, transform))
// once per chunk of parameters, all on `stream`.
template <typename Args>
cudaError_t LaunchOptimizerChunks(void (*kernel)(TensorChunk<ParamSpan>, Args, TransformArgs),
                                  const ParamSpan* params, int count, const Args& args,
                                  const TransformArgs& transform, cudaStream_t stream) {
  return ForEachChunk(params, count, kOptimizerTile, [&](const TensorChunk<ParamSpan>& chunk) {
    kernel<<<chunk.block_start[chunk.count], kThreads, 0, stream>>>(chunk, args, transform);
    return cudaGetLastError();
  });
}

}  // namespace ampd::kernels::cuda
