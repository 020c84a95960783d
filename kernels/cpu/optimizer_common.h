// What the fused optimizer updates share (the CPU twin of
// kernels/cuda/optimizer_common.cuh): the GradTransform read from its
// scalars (skip on found_inf, the clip coefficient) and the per-element
// pass that reads the gradient, unscales and clips it, lets the optimizer
// update master and state, and recasts the working copy, split over the
// backend's thread pool.
#pragma once

#include <cmath>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

// torch.nn.utils.clip_grad_norm_'s coefficient, clamped to 1. A NaN norm
// gives 1 (the comparison is false), but a NaN norm comes from a non-finite
// gradient, which has set found_inf and skipped the step already.
inline float ClipCoef(const GradTransform& tr) {
  if (tr.norm_sq == nullptr || !(tr.max_grad_norm > 0.0f)) return 1.0f;
  const float norm = std::sqrt(tr.norm_sq->data_as<float>()[0]);
  const float coef = tr.max_grad_norm / (norm + 1e-6f);
  return coef < 1.0f ? coef : 1.0f;
}

// Calls fn(g, i) for every element i of one parameter, split over the pool:
// g = grad[i] * inv_scale * clip_coef (evaluated left to right), and fn
// returns the new master value, which is then rounded once into the working
// copy when there is one. Each element's arithmetic is the same whatever
// thread runs it.
template <typename Fn>
void ForEachParamElement(ThreadPool& pool, const ParamRef& p, float inv_scale, float clip,
                         Fn&& fn) {
  (void)VisitFloat(p.grad->dtype(), [&](auto grad_tag) {
    using GradTag = decltype(grad_tag);
    const auto* grad = Ptr<GradTag>(*p.grad);
    const DType working_dtype = p.working != nullptr ? p.working->dtype() : DType::kF32;
    return VisitFloat(working_dtype, [&](auto working_tag) {
      using WorkingTag = decltype(working_tag);
      auto* working = p.working != nullptr ? Ptr<WorkingTag>(*p.working) : nullptr;
      pool.ParallelFor(p.master->numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const float w = fn(GradTag::Load(grad[i]) * inv_scale * clip, i);
          if (working != nullptr) working[i] = WorkingTag::Store(w);
        }
      });
      return absl::OkStatus();
    });
  });
}

// True when found_inf is set: the update then writes nothing at all.
inline bool Skip(const GradTransform& tr) { return tr.found_inf->data_as<float>()[0] != 0.0f; }

}  // namespace ampd::kernels::cpu
