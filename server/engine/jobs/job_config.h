// JobConfig's validation and the memory estimate admission reads; the
// config itself and its defaults are part of the engine's API (api.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/engine/api.h"

namespace ampd::engine {

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
// Adam/AdamW's two moments, 4 for SGD momentum, 0 for plain SGD); an upper
// bound for fp32 jobs, whose forward reads the master directly. Activations
// and buffers depend on the batch: model::WorkspaceBytes counts those, per
// step. Computed with saturating arithmetic, so a spec whose count overflows
// reads INT64_MAX and fails any limit.
int64_t EstimateJobBytes(const JobConfig& config);

}  // namespace ampd::engine
