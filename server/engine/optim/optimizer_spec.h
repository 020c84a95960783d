// Which optimizer a job uses and its hyperparameters (PyTorch's names and
// defaults), plus gradient clipping. The math lives in the Backend's fused
// update; this is configuration and validation.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace ampd::engine::optim {

enum class OptimizerKind { kSgd, kAdam, kAdamW };

absl::string_view OptimizerName(OptimizerKind kind);  // "sgd", "adam", "adamw"

// Build one with DefaultOptimizerSpec(kind), then set what differs: the
// per-kind defaults live there and nowhere else.
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  kernels::SgdConfig sgd;
  // For kAdam and kAdamW. Its decoupled_weight_decay is not read: the kind
  // decides it (AdamUpdateConfig).
  kernels::AdamConfig adam;
  // Clip the global L2 norm of the unscaled gradients to this; <= 0 disables.
  float max_grad_norm = 0.0f;
};

// PyTorch's defaults for `kind`: torch.optim.SGD's (lr 1e-2, no momentum or
// weight decay), torch.optim.Adam's (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight_decay 0) and torch.optim.AdamW's (the same but weight_decay 1e-2);
// no gradient clipping.
OptimizerSpec DefaultOptimizerSpec(OptimizerKind kind);

// The fused Adam update's config for an Adam or AdamW spec: spec.adam with
// decoupled_weight_decay set from the kind (AdamW decouples, Adam adds the
// decay to the gradient).
kernels::AdamConfig AdamUpdateConfig(const OptimizerSpec& spec);

// lr >= 0 and finite, betas in [0, 1), eps > 0, weight_decay >= 0,
// momentum >= 0, nesterov needs momentum > 0 and dampening == 0 (PyTorch's
// rules); max_grad_norm finite. Messages name the field ("adam.beta1").
absl::Status ValidateOptimizerSpec(const OptimizerSpec& spec);

}  // namespace ampd::engine::optim
