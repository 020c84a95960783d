// Which optimizer a job uses and its hyperparameters (PyTorch's names and
// defaults), plus gradient clipping. The math lives in the Backend's fused
// update; this is configuration and validation.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace ampd::engine::optim {

enum class OptimizerKind { kSgd, kAdam, kAdamW };

absl::string_view OptimizerName(OptimizerKind kind);  // "sgd", "adam", "adamw"

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  kernels::SgdConfig sgd;
  kernels::AdamConfig adam;  // for kAdam and kAdamW (decoupled_weight_decay follows kind)
  // Clip the global L2 norm of the unscaled gradients to this; <= 0 disables.
  float max_grad_norm = 0.0f;
};

// lr >= 0 and finite, betas in [0, 1), eps > 0, weight_decay >= 0,
// momentum >= 0, nesterov needs momentum > 0 and dampening == 0 (PyTorch's
// rules); max_grad_norm finite. Messages name the field ("adam.beta1").
absl::Status ValidateOptimizerSpec(const OptimizerSpec& spec);

}  // namespace ampd::engine::optim
