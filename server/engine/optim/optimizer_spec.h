// Which optimizer a job uses and its hyperparameters (PyTorch's names and
// defaults), plus gradient clipping. The math lives in the Backend's fused
// update; this is configuration and validation.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ampd::engine::optim {

enum class OptimizerKind { kSgd, kAdam, kAdamW };

absl::string_view OptimizerName(OptimizerKind kind);  // "sgd", "adam", "adamw"

// torch.optim.SGD's hyperparameters. Plain values, so that the layers that
// read a job's config (rpc, metrics) need no kernel header; the fused
// update's own config is built from these (optimizer_state.h).
struct SgdHyperparams {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// torch.optim.Adam's and AdamW's hyperparameters. Whether the weight decay
// is decoupled is not among them: the optimizer's kind decides it.
struct AdamHyperparams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// Build one with DefaultOptimizerSpec(kind), then set what differs: the
// per-kind defaults live there and nowhere else.
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  SgdHyperparams sgd;
  AdamHyperparams adam;  // for kAdam and kAdamW
  // Clip the global L2 norm of the unscaled gradients to this; <= 0 disables.
  float max_grad_norm = 0.0f;
};

// PyTorch's defaults for `kind`: torch.optim.SGD's (lr 1e-2, no momentum or
// weight decay), torch.optim.Adam's (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight_decay 0) and torch.optim.AdamW's (the same but weight_decay 1e-2);
// no gradient clipping.
OptimizerSpec DefaultOptimizerSpec(OptimizerKind kind);

// lr >= 0 and finite, betas in [0, 1), eps > 0, weight_decay >= 0,
// momentum >= 0, nesterov needs momentum > 0 and dampening == 0 (PyTorch's
// rules); max_grad_norm finite. Messages name the field ("adam.beta1").
absl::Status ValidateOptimizerSpec(const OptimizerSpec& spec);

}  // namespace ampd::engine::optim
