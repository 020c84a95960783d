// Optimizer hyperparameter validation with PyTorch's own rules.
#include "server/engine/optim/optimizer_spec.h"

#include <cmath>

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
  return absl::OkStatus();
}

}  // namespace ampd::engine::optim
