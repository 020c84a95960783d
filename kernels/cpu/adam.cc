// The fused Adam / AdamW step (torch.optim.Adam and AdamW's formulas): for
// each parameter, read the scaled gradient in its working dtype, unscale
// and clip it in fp32 (GradTransform), update the fp32 master weights and
// both moments, and recast the working copy. The skip decision (found_inf)
// and the clip coefficient (norm_sq) are read from their device scalars
// here, so a skipped step writes nothing at all. One pass per parameter,
// split over the backend's thread pool, reads the gradient and writes
// master, state and working copy together.
#include <cmath>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/optimizer_common.h"

namespace ampd::kernels::cpu {

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

}  // namespace ampd::kernels::cpu
