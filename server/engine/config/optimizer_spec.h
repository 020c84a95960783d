// Which optimizer a job uses and its hyperparameters (PyTorch's names and
// defaults), plus gradient clipping. The math lives in the Backend's fused
// update; this is configuration and validation.
#pragma once

#include <cstdint>

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

enum class LrScheduleKind { kConstant, kWarmupCosine };

absl::string_view LrScheduleName(LrScheduleKind kind);  // "constant", "warmup_cosine"

// How the learning rate moves with the count a of optimizer updates applied
// before a step (skipped steps do not advance it). Constant: the optimizer's
// lr. Warmup-cosine, nanoGPT's get_lr(a) with learning_rate = lr:
//   a < warmup_steps:   lr * (a + 1) / (warmup_steps + 1)
//   a > decay_steps:    min_lr
//   otherwise:          min_lr + 0.5 * (1 + cos(pi * r)) * (lr - min_lr),
//                       r = (a - warmup_steps) / (decay_steps - warmup_steps)
// The warmup-cosine fields are read only by that schedule.
struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;
  float min_lr = 0.0f;
};

// Build one with DefaultOptimizerSpec(kind), then set what differs: the
// per-kind defaults live there and nowhere else.
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdamW;
  SgdHyperparams sgd;
  AdamHyperparams adam;  // for kAdam and kAdamW
  // Clip the global L2 norm of the unscaled gradients to this; <= 0 disables.
  float max_grad_norm = 0.0f;
  LrSchedule lr_schedule;
};

// PyTorch's defaults for `kind`: torch.optim.SGD's (lr 1e-2, no momentum or
// weight decay), torch.optim.Adam's (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
// weight_decay 0) and torch.optim.AdamW's (the same but weight_decay 1e-2);
// no gradient clipping.
OptimizerSpec DefaultOptimizerSpec(OptimizerKind kind);

// lr >= 0 and finite, betas in [0, 1), eps > 0, weight_decay >= 0,
// momentum >= 0, nesterov needs momentum > 0 and dampening == 0 (PyTorch's
// rules); max_grad_norm finite; for warmup-cosine, warmup_steps >= 0,
// decay_steps > warmup_steps and min_lr finite and >= 0. Messages name the
// field ("adam.beta1", "decay_steps").
absl::Status ValidateOptimizerSpec(const OptimizerSpec& spec);

// The configured lr of the spec's kind (sgd.lr or adam.lr).
float BaseLearningRate(const OptimizerSpec& spec);

// The schedule's learning rate for the update that follows `applied_steps`
// applied updates (nanoGPT's get_lr(applied_steps)), computed in double and
// rounded once to float.
float ScheduledLearningRate(const OptimizerSpec& spec, int64_t applied_steps);

}  // namespace ampd::engine::optim
