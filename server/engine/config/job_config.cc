// JobConfig validation (each part's own validator, its message prefixed with
// the part's field name) and the per-precision defaults.
#include "server/engine/config/job_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/checked_math.h"
#include "common/status_macros.h"

namespace ampd::engine {

// A GPT's blocks share scales beyond the groups the scaler (and its
// per-layer metric) takes.
static_assert(model::kMaxGptScaleGroups == amp::kMaxLayerScaleGroups);

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
  if (!config.base_model.empty()) AMPD_RETURN_IF_ERROR(CheckBaseModelName(config.base_model));
  AMPD_RETURN_IF_ERROR(Prefixed("model", model::ValidateModelSpec(config.model)));
  AMPD_RETURN_IF_ERROR(Prefixed("optimizer", optim::ValidateOptimizerSpec(config.optimizer)));
  AMPD_RETURN_IF_ERROR(Prefixed("scaler", config.scaler.Validate()));
  AMPD_RETURN_IF_ERROR(Prefixed("distributed", dist::ValidateDistributedSpec(config.distributed)));
  if (config.scaler.per_layer_scales) {
    // A distributed job's ranks would each need every group's scale
    // reduced across them, which the step does not do.
    if (config.distributed.enabled()) {
      return absl::InvalidArgumentError(
          "scaler.per_layer_scales: not available for distributed jobs (world_size > 1)");
    }
    const int64_t groups = model::LayerScaleGroups(config.model);
    if (groups > amp::kMaxLayerScaleGroups) {
      return absl::InvalidArgumentError(
          absl::StrCat("scaler.per_layer_scales: the model has ", groups,
                       " layer groups (one per Linear layer), more than the ",
                       amp::kMaxLayerScaleGroups, " supported"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidJobConfig> ValidJobConfig::Check(JobConfig config) {
  AMPD_RETURN_IF_ERROR(ValidateJobConfig(config));
  return ValidJobConfig(std::move(config));
}

int64_t EstimateJobBytes(const JobConfig& config) {
  const int64_t params = model::ParameterCount(config.model);
  const auto working = static_cast<int64_t>(codec::SizeOf(model::WorkingDType(config.precision)));
  int64_t optimizer = 0;
  switch (config.optimizer.kind) {
    case optim::OptimizerKind::kSgd:
      optimizer = config.optimizer.sgd.momentum > 0 ? 4 : 0;
      break;
    case optim::OptimizerKind::kAdam:
    case optim::OptimizerKind::kAdamW:
      optimizer = 8;  // exp_avg + exp_avg_sq
      break;
  }
  // Trainable: master fp32 + working copy + gradients + optimizer state.
  // Frozen (a LoRA job's base): the working copy alone.
  const int64_t frozen = model::FrozenParameterCount(config.model);
  // (Not params - frozen: either count may have saturated.)
  const int64_t trainable =
      frozen > 0 ? model::LoraParameterCount(*config.model.decoder()) : params;
  return SaturatingAdd(SaturatingMul(trainable, 4 + 2 * working + optimizer),
                       SharesBase(config) ? 0 : SaturatingMul(frozen, working));
}

bool SharesBase(const JobConfig& config) {
  return !config.base_model.empty() && model::FrozenParameterCount(config.model) > 0;
}

int64_t SharedBaseBytes(const JobConfig& config) {
  if (!SharesBase(config)) return 0;
  const auto working = static_cast<int64_t>(codec::SizeOf(model::WorkingDType(config.precision)));
  return SaturatingMul(model::FrozenParameterCount(config.model), working);
}

absl::Status CheckBaseModelName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxBaseModelNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "base_model: must be 1 to ", kMaxBaseModelNameBytes, " bytes, got ", name.size()));
  }
  if (name.front() == '/') {
    return absl::InvalidArgumentError(
        "base_model: an absolute path; name a folder relative to the server's --models-dir");
  }
  if (name.find('\\') != absl::string_view::npos) {
    return absl::InvalidArgumentError("base_model: a backslash is no part of a folder name");
  }
  // Control characters (NUL, newlines, escapes) name no folder anyone made
  // on purpose, and would reach the server's log as they are.
  for (const char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat("base_model: the control character 0x",
                                                     absl::Hex(static_cast<unsigned char>(c)),
                                                     " is no part of a folder name"));
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          "base_model: the component \"", part,
          "\" is not a folder's name (no empty, \".\" or \"..\" components: the base must lie "
          "inside --models-dir)"));
    }
  }
  return absl::OkStatus();
}

JobConfig DefaultJobConfig(model::Precision precision, amp::ScalerPolicy policy,
                           optim::OptimizerKind optimizer) {
  JobConfig config;
  config.precision = precision;
  config.optimizer = optim::DefaultOptimizerSpec(optimizer);
  config.scaler = amp::ScalerConfig::ForPrecisionDefault(model::WorkingDType(precision), policy);
  return config;
}

}  // namespace ampd::engine
