// The fused optimizer step: for each parameter, read the scaled gradient in
// its working dtype, unscale and clip it in fp32 (GradTransform), apply
// torch.optim.Adam/AdamW or SGD to the fp32 master weights and state, and
// recast the working copy. The skip decision (found_inf) and the clip
// coefficient (norm_sq) are read from their device scalars here, so a
// skipped step writes nothing at all.
#include <cmath>
#include <vector>

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

// g (n) fp32 = grad * inv_scale * clip_coef, evaluated left to right.
void TransformGrad(const Tensor& grad, float inv_scale, float clip, std::vector<float>& g) {
  g.resize(static_cast<size_t>(grad.numel()));
  (void)VisitFloat(grad.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(grad);
    for (int64_t i = 0; i < grad.numel(); ++i) {
      g[static_cast<size_t>(i)] = Tag::Load(in[i]) * inv_scale * clip;
    }
    return absl::OkStatus();
  });
}

// working (n) = master rounded once to working's dtype.
void Recast(const Tensor& master, Tensor& working) {
  (void)VisitFloat(working.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const float* w = master.data_as<float>();
    auto* out = Ptr<Tag>(working);
    for (int64_t i = 0; i < master.numel(); ++i) out[i] = Tag::Store(w[i]);
    return absl::OkStatus();
  });
}

bool Skip(const GradTransform& tr) { return tr.found_inf->data_as<float>()[0] != 0.0f; }

}  // namespace

absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config, int64_t step,
                        const GradTransform& transform) {
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

  std::vector<float> g;  // (n) transformed gradient
  for (const ParamRef& p : params) {
    TransformGrad(*p.grad, transform.inv_scale, clip, g);
    float* w = p.master->data_as<float>();
    float* m = p.state0->data_as<float>();
    float* v = p.state1->data_as<float>();
    const int64_t n = p.master->numel();
    for (int64_t i = 0; i < n; ++i) {
      float gi = g[static_cast<size_t>(i)];
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
      const float denom = std::sqrt(vi) / bias_correction2_sqrt + config.eps;
      wi -= step_size * (mi / denom);
      m[i] = mi;
      v[i] = vi;
      w[i] = wi;
    }
    if (p.working != nullptr) Recast(*p.master, *p.working);
  }
  return absl::OkStatus();
}

absl::Status SgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config, bool first_step,
                       const GradTransform& transform) {
  if (absl::Status s = ValidateSgdUpdate(params, config, transform); !s.ok()) return s;
  if (Skip(transform)) return absl::OkStatus();

  const bool use_momentum = config.momentum != 0.0f;  // state0 was required exactly then
  const float clip = ClipCoef(transform);
  const float lr = config.lr;
  const float wd = config.weight_decay;
  const float momentum = config.momentum;
  const float one_minus_dampening = 1.0f - config.dampening;
  std::vector<float> g;  // (n) transformed gradient
  for (const ParamRef& p : params) {
    TransformGrad(*p.grad, transform.inv_scale, clip, g);
    float* w = p.master->data_as<float>();
    float* buf = use_momentum ? p.state0->data_as<float>() : nullptr;
    const int64_t n = p.master->numel();
    for (int64_t i = 0; i < n; ++i) {
      float gi = g[static_cast<size_t>(i)];
      if (wd != 0.0f) gi += wd * w[i];
      if (use_momentum) {
        // PyTorch: the first step's buffer is a copy of g (no dampening).
        const float b = first_step ? gi : momentum * buf[i] + one_minus_dampening * gi;
        buf[i] = b;
        gi = config.nesterov ? gi + momentum * b : b;
      }
      w[i] -= lr * gi;
    }
    if (p.working != nullptr) Recast(*p.master, *p.working);
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
