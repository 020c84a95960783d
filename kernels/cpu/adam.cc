// The fused optimizer step: for each parameter, read the scaled gradient in
// its working dtype, unscale and clip it in fp32 (GradTransform), apply
// torch.optim.Adam/AdamW or SGD to the fp32 master weights and state, and
// recast the working copy. The skip decision (found_inf) and the clip
// coefficient (norm_sq) are read from their device scalars here, so a
// skipped step writes nothing at all. One pass per parameter, split over
// the backend's thread pool, reads the gradient and writes master, state and
// working copy together.
#include <cmath>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// torch.nn.utils.clip_grad_norm_'s coefficient, clamped to 1. A NaN norm
// gives 1 (the comparison is false), but a NaN norm comes from a non-finite
// gradient, which has set found_inf and skipped the step already.
float ClipCoef(const GradTransform& tr) {
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

bool Skip(const GradTransform& tr) { return tr.found_inf->data_as<float>()[0] != 0.0f; }

}  // namespace

absl::Status AdamUpdate(ThreadPool& pool, absl::Span<const ParamRef> params,
                        const AdamConfig& config, int64_t step, const GradTransform& transform) {
  // Everything is validated before anything is written.
  if (absl::Status s = ValidateAdamUpdate(params, step, transform); !s.ok()) return s;
  if (Skip(transform)) return absl::OkStatus();

  const float clip = ClipCoef(transform);
  // Scalars as PyTorch's non-capturable Adam forms them: bias corrections in
  // double on the host, then used as fp32 scalars by the tensor math.
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(config.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(config.beta2), step);
  const float step_size = static_cast<float>(config.lr / bias_correction1);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float beta1 = config.beta1;
  const float beta2 = config.beta2;
  const float one_minus_beta1 = 1.0f - beta1;
  const float one_minus_beta2 = 1.0f - beta2;
  const float wd = config.weight_decay;
  const float decay = 1.0f - config.lr * wd;  // AdamW's multiplicative decay
  const bool decoupled = config.decoupled_weight_decay;

  const float eps = config.eps;
  for (const ParamRef& p : params) {
    float* w = p.master->data_as<float>();
    float* m = p.state0->data_as<float>();
    float* v = p.state1->data_as<float>();
    ForEachParamElement(pool, p, transform.inv_scale, clip, [&](float gi, int64_t i) {
      float wi = w[i];
      if (wd != 0.0f) {
        if (decoupled) {
          wi *= decay;
        } else {
          gi += wd * wi;
        }
      }
      const float mi = beta1 * m[i] + one_minus_beta1 * gi;
      const float vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
      const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
      wi -= step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
      w[i] = wi;
      return wi;
    });
  }
  return absl::OkStatus();
}

absl::Status SgdUpdate(ThreadPool& pool, absl::Span<const ParamRef> params, const SgdConfig& config,
                       bool first_step, const GradTransform& transform) {
  if (absl::Status s = ValidateSgdUpdate(params, config, transform); !s.ok()) return s;
  if (Skip(transform)) return absl::OkStatus();

  const bool use_momentum = config.momentum != 0.0f;  // state0 was required exactly then
  const float clip = ClipCoef(transform);
  const float lr = config.lr;
  const float wd = config.weight_decay;
  const float momentum = config.momentum;
  const float one_minus_dampening = 1.0f - config.dampening;
  const bool nesterov = config.nesterov;
  for (const ParamRef& p : params) {
    float* w = p.master->data_as<float>();
    float* buf = use_momentum ? p.state0->data_as<float>() : nullptr;
    ForEachParamElement(pool, p, transform.inv_scale, clip, [&](float gi, int64_t i) {
      if (wd != 0.0f) gi += wd * w[i];
      if (use_momentum) {
        // PyTorch: the first step's buffer is a copy of g (no dampening).
        const float b = first_step ? gi : momentum * buf[i] + one_minus_dampening * gi;
        buf[i] = b;
        gi = nesterov ? gi + momentum * b : b;
      }
      w[i] -= lr * gi;
      return w[i];
    });
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
