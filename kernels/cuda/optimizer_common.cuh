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
// of this step raised a bit in the mapped error word (a bad embedding id or
// label, not reported to the host until the next synchronisation). The word
// is read volatile: it lives in host memory and is written by other kernels.
__device__ __forceinline__ bool SkipStep(const TransformArgs& t) {
  if (t.found_inf[0] != 0.0f) return true;
  if (t.error_flags == nullptr) return false;
  const volatile int* word = t.error_flags;
  return *word != 0;
}

__device__ __forceinline__ GradFactor ReadGradFactor(const TransformArgs& t) {
  float clip = 1.0f;
  if (t.norm_sq != nullptr && t.max_grad_norm > 0.0f) {
    clip = fminf(1.0f, t.max_grad_norm / (sqrtf(t.norm_sq[0]) + 1e-6f));
  }
  return {t.inv_scale, clip};
}

}  // namespace ampd::kernels::cuda
