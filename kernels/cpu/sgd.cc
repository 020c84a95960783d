// The fused SGD step (torch.optim.SGD's formulas: weight decay, momentum
// with dampening, Nesterov): for each parameter, read the scaled gradient
// in its working dtype, unscale and clip it in fp32 (GradTransform), update
// the fp32 master weights and the momentum buffer, and recast the working
// copy. A skipped step (found_inf) writes nothing at all. One pass per
// parameter, split over the backend's thread pool.
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/optimizer_common.h"

namespace ampd::kernels::cpu {

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
