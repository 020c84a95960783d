// Deterministic uniform/normal draws and PyTorch's default init bounds.
#include "server/engine/model/init.h"

#include <cmath>

namespace ampd::engine::model {

double InitRng::Uniform01() {
  // Top 53 bits -> [0, 1) exactly representable in a double.
  return static_cast<double>(engine_() >> 11) * 0x1.0p-53;
}

float InitRng::Uniform(float lo, float hi) {
  const double u = Uniform01();
  return static_cast<float>(static_cast<double>(lo) +
                            (static_cast<double>(hi) - static_cast<double>(lo)) * u);
}

float InitRng::Normal() {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double u1 = 1.0 - Uniform01();  // (0, 1]: log stays finite
  const double u2 = Uniform01();
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
}

void FillLinearUniform(InitRng& rng, int64_t fan_in, std::vector<float>& values) {
  const float bound =
      fan_in > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in))) : 0.0f;
  for (float& v : values) v = rng.Uniform(-bound, bound);
}

void FillNormal(InitRng& rng, std::vector<float>& values) {
  for (float& v : values) v = rng.Normal();
}

}  // namespace ampd::engine::model
