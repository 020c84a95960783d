// JobConfig: everything that defines a training job at creation, with the
// defaults filled in (the "effective config" CreateJob returns).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/model/model_spec.h"
#include "server/engine/optim/optimizer_spec.h"

namespace ampd::engine {

struct JobConfig {
  std::string display_name;
  model::ModelSpec model;
  model::Precision precision = model::Precision::kFp16;
  optim::OptimizerSpec optimizer;
  amp::ScalerConfig scaler;
  uint64_t seed = 0;
};

// Validates every part; the message names the field ("scaler.growth_factor").
absl::Status ValidateJobConfig(const JobConfig& config);

}  // namespace ampd::engine
