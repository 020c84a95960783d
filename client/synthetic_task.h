// A built-in regression task for `ampctl train` and the service tests: a
// fixed random teacher MLP, drawn from the seed, maps Gaussian inputs to
// targets; the student is Linear -> GELU -> Linear with MSE. target_scale
// sets the targets' magnitude: at 32 (ampctl's default) the first fp16 steps overflow at
// PyTorch's init_scale of 65536 and the loss scale visibly backs off.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "ampd/v1/trainer.pb.h"

namespace ampd {

struct SyntheticTaskOptions {
  int64_t in_features = 16;
  int64_t hidden = 64;
  int64_t out_features = 4;
  int64_t batch_size = 64;
  float target_scale = 8.0f;
  uint64_t seed = 0;
};

class SyntheticTask {
 public:
  explicit SyntheticTask(const SyntheticTaskOptions& options);

  // The student model (layers and loss) for a JobConfig.
  v1::ModelSpec Model() const;
  // The next batch: inputs (batch, in) F32, targets (batch, out) F32.
  // Deterministic for a given seed and call count.
  v1::MicroBatch NextBatch();

 private:
  SyntheticTaskOptions options_;
  std::mt19937_64 rng_;
  std::vector<float> w1_;  // (hidden, in)
  std::vector<float> w2_;  // (out, hidden)
};

}  // namespace ampd
