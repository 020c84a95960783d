// JobConfig validation (each part's own validator, its message prefixed with
// the part's field name) and the per-precision defaults.
#include "server/engine/jobs/job_config.h"

#include "absl/strings/str_cat.h"

namespace ampd::engine {

namespace {

absl::Status Prefixed(absl::string_view prefix, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, ".", s.message()));
}

}  // namespace

absl::Status ValidateJobConfig(const JobConfig& config) {
  switch (config.precision) {
    case model::Precision::kFp32:
    case model::Precision::kFp16:
    case model::Precision::kBf16:
      break;
    default:
      return absl::InvalidArgumentError("precision: unknown precision");
  }
  if (absl::Status s = Prefixed("model", model::ValidateModelSpec(config.model)); !s.ok()) {
    return s;
  }
  if (absl::Status s = Prefixed("optimizer", optim::ValidateOptimizerSpec(config.optimizer));
      !s.ok()) {
    return s;
  }
  return Prefixed("scaler", config.scaler.Validate());
}

JobConfig DefaultJobConfig(model::Precision precision, amp::ScalerPolicy policy) {
  JobConfig config;
  config.precision = precision;
  config.optimizer.kind = optim::OptimizerKind::kAdamW;
  config.optimizer.adam = kernels::AdamConfig{};
  config.optimizer.adam.weight_decay = 1e-2f;  // torch.optim.AdamW's default
  config.scaler = amp::ScalerConfig::ForPrecisionDefault(model::WorkingDType(precision), policy);
  return config;
}

}  // namespace ampd::engine
