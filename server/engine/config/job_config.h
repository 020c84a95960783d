// A job's config: everything that defines a training job at creation (the
// model, precision, optimizer, loss scaler, seed and data-parallel group),
// its defaults, its validation (ValidJobConfig, the proof a config passed)
// and the memory estimate admission reads. Part of the engine's face
// (api.h includes it); job_config_codec.h is its checkpoint encoding.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/config/distributed_spec.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/config/optimizer_spec.h"
#include "server/engine/config/scaler_config.h"

namespace ampd::engine {

// Everything that defines a training job at creation, with the defaults
// filled in (the "effective config" CreateJob returns).
struct JobConfig {
  std::string display_name;
  model::ModelSpec model;
  model::Precision precision = model::Precision::kFp16;
  optim::OptimizerSpec optimizer;
  amp::ScalerConfig scaler;
  uint64_t seed = 0;
  dist::DistributedSpec distributed;  // world_size 1: this ampd alone
  // Batch-invariant kernels (kernels::Backend::SetBatchInvariant): a row's
  // bits never depend on the batch it is computed in, so sampled log-probs
  // equal trained ones bit for bit.
  bool batch_invariant = false;
  // A base model of the server's --models-dir (a folder's name relative to
  // it, "Qwen/Qwen2.5-0.5B"): the model is the one its config.json
  // describes and its weights are the folder's. A LoRA job on it shares
  // the base's frozen weights, loaded once, with every other LoRA job on
  // the same base, precision and device; a full job gets its own copy.
  // Empty: the model and seed alone make the job.
  std::string base_model;
};

// The most bytes of a base_model name.
inline constexpr size_t kMaxBaseModelNameBytes = 256;

// base_model's own syntax (InvalidArgument naming "base_model"): 1 to
// kMaxBaseModelNameBytes bytes of '/'-separated components, none empty,
// "." or "..", not absolute, no backslash or NUL. Whether the folder
// exists, and stays inside --models-dir, is the registry's to check.
absl::Status CheckBaseModelName(absl::string_view name);

// Whether the job's frozen base is a shared base model's (base_model with
// LoRA): those bytes are held once for every job on that base.
bool SharesBase(const JobConfig& config);

// The bytes a shared base holds (its frozen parameters in the working
// dtype); 0 unless SharesBase.
int64_t SharedBaseBytes(const JobConfig& config);

// The defaults of a job of this precision, scaler policy and optimizer: the
// optimizer's PyTorch defaults (optim::DefaultOptimizerSpec), and the scaler
// the precision needs: the policy's dynamic defaults for fp16; for bf16 and
// fp32 a static scale of 1 that still detects non-finite gradients and
// skips those steps (amp::ScalerConfig::ForPrecisionDefault). The model is
// left empty. Every caller (the rpc layer included) starts from these and
// sets only what its request names; the engine validates the result.
JobConfig DefaultJobConfig(model::Precision precision,
                           amp::ScalerPolicy policy = amp::ScalerPolicy::kPyTorch,
                           optim::OptimizerKind optimizer = optim::OptimizerKind::kAdamW);

// Validates every part; the message names the field ("scaler.growth_factor",
// "model.layers[2].in_features", "optimizer.adam.beta1", "display_name").
absl::Status ValidateJobConfig(const JobConfig& config);

// A JobConfig that ValidateJobConfig accepted. Holding one is the proof, so
// a create validates once (where the config enters the engine) and the
// layers it is handed to do not check again.
class ValidJobConfig {
 public:
  // ValidateJobConfig's error for an invalid config.
  static absl::StatusOr<ValidJobConfig> Check(JobConfig config);

  const JobConfig& get() const { return config_; }

 private:
  explicit ValidJobConfig(JobConfig config) : config_(std::move(config)) {}
  JobConfig config_;
};

// Estimated bytes a job's weights hold on its backend for its lifetime:
// parameters x (4 for the fp32 master + 2 x the working dtype's size for the
// working copy and the gradient + the optimizer's fp32 state: 8 for
// Adam/AdamW's two moments, 4 for SGD momentum, 0 for plain SGD), except
// the frozen ones of a LoRA job, which hold their working copy alone (and
// nothing when the base is shared: SharedBaseBytes, counted once); an upper
// bound for fp32 jobs, whose forward reads the master directly. Activations
// and buffers depend on the batch: model::WorkspaceBytes counts those, per
// step. Computed with saturating arithmetic, so a spec whose count overflows
// reads INT64_MAX and fails any limit.
int64_t EstimateJobBytes(const JobConfig& config);

}  // namespace ampd::engine
