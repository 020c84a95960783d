// OptimizerState: the per-parameter buffers of the chosen optimizer (Adam's
// exp_avg/exp_avg_sq, SGD's momentum_buffer), the count of applied steps,
// and the call into the Backend's fused update. Kept apart from the model so
// the state dict and the update see one owner of the optimizer's numbers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/engine/config/optimizer_spec.h"

namespace ampd::engine::optim {

// The fused updates' configs for a spec: spec.sgd as is, and spec.adam with
// decoupled_weight_decay set from the kind (AdamW decouples, Adam adds the
// decay to the gradient).
kernels::SgdConfig SgdUpdateConfig(const OptimizerSpec& spec);
kernels::AdamConfig AdamUpdateConfig(const OptimizerSpec& spec);

// What one update may change of the spec's hyperparameters (an OptimStep's
// or a Step's learning rate): each one given replaces the spec's for that
// update. beta1, beta2 and eps are Adam's and AdamW's; the caller refuses
// them for SGD.
struct UpdateOverrides {
  std::optional<float> lr;
  std::optional<float> beta1;
  std::optional<float> beta2;
  std::optional<float> eps;
  std::optional<float> weight_decay;
};

class OptimizerState {
 public:
  // One entry per parameter, in model order: its name ("model.0.weight") and
  // shape. Buffers start at zero, as PyTorch's lazily created ones do.
  static absl::StatusOr<OptimizerState> Create(const OptimizerSpec& spec,
                                               const std::vector<std::string>& param_names,
                                               const std::vector<kernels::Shape>& shapes,
                                               kernels::Backend& backend);

  const OptimizerSpec& spec() const { return spec_; }
  // Buffer names per parameter, as state_dict.h spells them: {"exp_avg",
  // "exp_avg_sq"}, {"momentum_buffer"} or none (SGD without momentum).
  const std::vector<std::string>& buffer_names() const { return buffer_names_; }
  // buffers()[p][b]: buffer b of parameter p, F32, the parameter's shape.
  std::vector<std::vector<kernels::Tensor>>& buffers() { return buffers_; }
  const std::vector<std::vector<kernels::Tensor>>& buffers() const { return buffers_; }

  // Updates applied so far (bias correction, SGD's first step).
  int64_t applied_steps() const { return applied_steps_; }
  void set_applied_steps(int64_t steps) { applied_steps_ = steps; }

  // Points refs[p].state0/state1 at parameter p's buffers (refs' master,
  // working and grad are the caller's).
  void Bind(std::vector<kernels::ParamRef>& refs);

  // The fused update for the step that would be number applied_steps() + 1;
  // on the device it is skipped entirely when transform.found_inf is set.
  // Does not advance applied_steps(): the caller does once it has read
  // found_inf back. `overrides` replace the configured hyperparameters.
  absl::Status Apply(kernels::Backend& backend, absl::Span<const kernels::ParamRef> refs,
                     const UpdateOverrides& overrides,
                     const kernels::GradTransform& transform) const;

 private:
  OptimizerSpec spec_;
  std::vector<std::string> buffer_names_;
  std::vector<std::vector<kernels::Tensor>> buffers_;
  int64_t applied_steps_ = 0;
};

}  // namespace ampd::engine::optim
