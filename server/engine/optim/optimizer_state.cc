// Optimizer buffers and the dispatch to the Backend's fused Adam/SGD update.
#include "server/engine/optim/optimizer_state.h"

#include <utility>

#include "common/status_macros.h"

namespace ampd::engine::optim {

absl::StatusOr<OptimizerState> OptimizerState::Create(const OptimizerSpec& spec,
                                                      const std::vector<std::string>& param_names,
                                                      const std::vector<kernels::Shape>& shapes,
                                                      kernels::Backend& backend) {
  AMPD_RETURN_IF_ERROR(ValidateOptimizerSpec(spec));
  if (param_names.size() != shapes.size()) {
    return absl::InternalError("OptimizerState: one name per parameter shape expected");
  }
  OptimizerState state;
  state.spec_ = spec;
  if (spec.kind == OptimizerKind::kSgd) {
    // PyTorch keeps no momentum_buffer when momentum == 0.
    if (spec.sgd.momentum > 0.0f) state.buffer_names_ = {"momentum_buffer"};
  } else {
    state.buffer_names_ = {"exp_avg", "exp_avg_sq"};
  }
  state.buffers_.resize(shapes.size());
  for (size_t p = 0; p < shapes.size(); ++p) {
    for (size_t b = 0; b < state.buffer_names_.size(); ++b) {
      AMPD_ASSIGN_OR_RETURN(kernels::Tensor t, backend.Allocate(kernels::DType::kF32, shapes[p]));
      AMPD_RETURN_IF_ERROR(backend.Fill(t, 0.0f));
      state.buffers_[p].push_back(std::move(t));
    }
  }
  return state;
}

void OptimizerState::Bind(std::vector<kernels::ParamRef>& refs) {
  for (size_t p = 0; p < refs.size() && p < buffers_.size(); ++p) {
    refs[p].state0 = buffers_[p].empty() ? nullptr : &buffers_[p][0];
    refs[p].state1 = buffers_[p].size() > 1 ? &buffers_[p][1] : nullptr;
  }
}

kernels::SgdConfig SgdUpdateConfig(const OptimizerSpec& spec) {
  kernels::SgdConfig config;
  config.lr = spec.sgd.lr;
  config.momentum = spec.sgd.momentum;
  config.dampening = spec.sgd.dampening;
  config.weight_decay = spec.sgd.weight_decay;
  config.nesterov = spec.sgd.nesterov;
  return config;
}

kernels::AdamConfig AdamUpdateConfig(const OptimizerSpec& spec) {
  kernels::AdamConfig config;
  config.lr = spec.adam.lr;
  config.beta1 = spec.adam.beta1;
  config.beta2 = spec.adam.beta2;
  config.eps = spec.adam.eps;
  config.weight_decay = spec.adam.weight_decay;
  config.decoupled_weight_decay = spec.kind == OptimizerKind::kAdamW;
  return config;
}

absl::Status OptimizerState::Apply(kernels::Backend& backend,
                                   absl::Span<const kernels::ParamRef> refs,
                                   const UpdateOverrides& overrides,
                                   const kernels::GradTransform& transform) const {
  if (spec_.kind == OptimizerKind::kSgd) {
    kernels::SgdConfig config = SgdUpdateConfig(spec_);
    if (overrides.lr.has_value()) config.lr = *overrides.lr;
    if (overrides.weight_decay.has_value()) config.weight_decay = *overrides.weight_decay;
    // PyTorch initialises the momentum buffer to g on the first update.
    return backend.SgdUpdate(refs, config, applied_steps_ == 0, transform);
  }
  kernels::AdamConfig config = AdamUpdateConfig(spec_);
  if (overrides.lr.has_value()) config.lr = *overrides.lr;
  if (overrides.beta1.has_value()) config.beta1 = *overrides.beta1;
  if (overrides.beta2.has_value()) config.beta2 = *overrides.beta2;
  if (overrides.eps.has_value()) config.eps = *overrides.eps;
  if (overrides.weight_decay.has_value()) config.weight_decay = *overrides.weight_decay;
  return backend.AdamUpdate(refs, config, applied_steps_ + 1, transform);
}

}  // namespace ampd::engine::optim
