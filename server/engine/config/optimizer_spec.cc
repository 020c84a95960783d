// Optimizer hyperparameter validation with PyTorch's own rules, and the
// learning-rate schedules.
#include "server/engine/config/optimizer_spec.h"

#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace ampd::engine::optim {

absl::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
  }
  return "?";
}

absl::string_view LrScheduleName(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kConstant:
      return "constant";
    case LrScheduleKind::kWarmupCosine:
      return "warmup_cosine";
  }
  return "?";
}

OptimizerSpec DefaultOptimizerSpec(OptimizerKind kind) {
  OptimizerSpec spec;
  spec.kind = kind;
  spec.sgd = SgdHyperparams{};
  spec.adam = AdamHyperparams{};
  spec.adam.weight_decay = kind == OptimizerKind::kAdamW ? 1e-2f : 0.0f;
  return spec;
}

namespace {

absl::Status Bad(absl::string_view field, absl::string_view rule, float value) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": must be ", rule, ", got ", value));
}

bool NonNegative(float v) { return std::isfinite(v) && v >= 0.0f; }

}  // namespace

absl::Status ValidateOptimizerSpec(const OptimizerSpec& spec) {
  switch (spec.kind) {
    case OptimizerKind::kSgd: {
      const SgdHyperparams& c = spec.sgd;
      if (!NonNegative(c.lr)) return Bad("sgd.lr", "finite and >= 0", c.lr);
      if (!NonNegative(c.momentum)) return Bad("sgd.momentum", "finite and >= 0", c.momentum);
      if (!std::isfinite(c.dampening)) return Bad("sgd.dampening", "finite", c.dampening);
      if (!NonNegative(c.weight_decay)) {
        return Bad("sgd.weight_decay", "finite and >= 0", c.weight_decay);
      }
      if (c.nesterov && (c.momentum <= 0.0f || c.dampening != 0.0f)) {
        return absl::InvalidArgumentError("sgd.nesterov: requires momentum > 0 and dampening == 0");
      }
      break;
    }
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const AdamHyperparams& c = spec.adam;
      if (!NonNegative(c.lr)) return Bad("adam.lr", "finite and >= 0", c.lr);
      if (!(c.beta1 >= 0.0f && c.beta1 < 1.0f)) return Bad("adam.beta1", "in [0, 1)", c.beta1);
      if (!(c.beta2 >= 0.0f && c.beta2 < 1.0f)) return Bad("adam.beta2", "in [0, 1)", c.beta2);
      if (!(std::isfinite(c.eps) && c.eps > 0.0f)) return Bad("adam.eps", "finite and > 0", c.eps);
      if (!NonNegative(c.weight_decay)) {
        return Bad("adam.weight_decay", "finite and >= 0", c.weight_decay);
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("kind: unknown optimizer");
  }
  if (!std::isfinite(spec.max_grad_norm)) {
    return Bad("max_grad_norm", "finite", spec.max_grad_norm);
  }
  const LrSchedule& schedule = spec.lr_schedule;
  switch (schedule.kind) {
    case LrScheduleKind::kConstant:
      break;
    case LrScheduleKind::kWarmupCosine:
      if (schedule.warmup_steps < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("warmup_steps: must be >= 0, got ", schedule.warmup_steps));
      }
      if (schedule.decay_steps <= schedule.warmup_steps) {
        return absl::InvalidArgumentError(absl::StrCat("decay_steps: must be > warmup_steps (",
                                                       schedule.warmup_steps, "), got ",
                                                       schedule.decay_steps));
      }
      if (!NonNegative(schedule.min_lr)) {
        return Bad("min_lr", "finite and >= 0", schedule.min_lr);
      }
      break;
    default:
      return absl::InvalidArgumentError("lr_schedule: unknown schedule");
  }
  return absl::OkStatus();
}

float BaseLearningRate(const OptimizerSpec& spec) {
  return spec.kind == OptimizerKind::kSgd ? spec.sgd.lr : spec.adam.lr;
}

float ScheduledLearningRate(const OptimizerSpec& spec, int64_t applied_steps) {
  const double lr = BaseLearningRate(spec);
  const LrSchedule& s = spec.lr_schedule;
  if (s.kind != LrScheduleKind::kWarmupCosine) return static_cast<float>(lr);
  const auto a = static_cast<double>(applied_steps);
  const auto warmup = static_cast<double>(s.warmup_steps);
  const auto decay = static_cast<double>(s.decay_steps);
  const double min_lr = s.min_lr;
  if (a < warmup) return static_cast<float>(lr * (a + 1.0) / (warmup + 1.0));
  if (a > decay) return static_cast<float>(min_lr);
  const double r = (a - warmup) / (decay - warmup);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * r));
  return static_cast<float>(min_lr + coeff * (lr - min_lr));
}

}  // namespace ampd::engine::optim
