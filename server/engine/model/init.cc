// The RandomFill descriptions of PyTorch's default initialisation.
#include "server/engine/model/init.h"

#include <cmath>

namespace ampd::engine::model {

float LinearInitBound(int64_t fan_in) {
  return fan_in > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in))) : 0.0f;
}

kernels::RandomFill LinearUniformInit(uint64_t seed, uint64_t stream, int64_t fan_in) {
  const float bound = LinearInitBound(fan_in);
  kernels::RandomFill f;
  f.distribution = kernels::RandomDistribution::kUniform;
  f.lo = -bound;
  f.hi = bound;
  f.seed = seed;
  f.stream = stream;
  return f;
}

kernels::RandomFill StandardNormalInit(uint64_t seed, uint64_t stream) {
  kernels::RandomFill f;
  f.distribution = kernels::RandomDistribution::kNormal;
  f.mean = 0.0f;
  f.stddev = 1.0f;
  f.seed = seed;
  f.stream = stream;
  return f;
}

kernels::RandomFill NormalInit(uint64_t seed, uint64_t stream, float stddev) {
  kernels::RandomFill f = StandardNormalInit(seed, stream);
  f.stddev = stddev;
  return f;
}

}  // namespace ampd::engine::model
