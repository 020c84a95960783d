// PyTorch's default parameter initialisation as counter-based random fills
// (kernels::RandomFill, Philox4x32-10): each parameter tensor draws from its
// own stream of the job's seed, so the backend fills every element
// independently (all CPU threads, or one CUDA thread per draw, straight into
// device memory) and a seed gives the same weights on every backend and
// with any thread count.
#pragma once

#include <cstdint>

#include "kernels/backend.h"

namespace ampd::engine::model {

// torch.nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) on the
// weight gives bound sqrt(6 / ((1 + a^2) fan_in)) = 1/sqrt(fan_in), and the
// bias is uniform in the same +-1/sqrt(fan_in). fan_in 0 gives bound 0.
float LinearInitBound(int64_t fan_in);

// Uniform in [-LinearInitBound(fan_in), LinearInitBound(fan_in)).
kernels::RandomFill LinearUniformInit(uint64_t seed, uint64_t stream, int64_t fan_in);
// torch.nn.Embedding: N(0, 1).
kernels::RandomFill StandardNormalInit(uint64_t seed, uint64_t stream);
// N(0, stddev^2): GPT-2's initialisation as nanoGPT writes it (0.02, and
// 0.02 / sqrt(2 n_layer) for the projections into the residual stream).
kernels::RandomFill NormalInit(uint64_t seed, uint64_t stream, float stddev);

}  // namespace ampd::engine::model
