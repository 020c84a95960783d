// PyTorch's default parameter initialisation, driven by a deterministic RNG
// of our own: std::mt19937_64's output sequence is fixed by the standard,
// but std::uniform_real_distribution and std::normal_distribution are not,
// so the distributions are written here and a seed gives the same weights
// with every standard library.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace ampd::engine::model {

class InitRng {
 public:
  explicit InitRng(uint64_t seed) : engine_(seed) {}

  // Uniform in [0, 1) with 53 random bits.
  double Uniform01();
  // Uniform in [lo, hi), rounded to float.
  float Uniform(float lo, float hi);
  // Standard normal by Box-Muller (one draw per call, the sine half unused so
  // the sequence does not depend on call parity).
  float Normal();

 private:
  std::mt19937_64 engine_;
};

// torch.nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) on the
// weight gives bound sqrt(6 / ((1 + a^2) fan_in)) = 1/sqrt(fan_in), and the
// bias is uniform in the same +-1/sqrt(fan_in).
void FillLinearUniform(InitRng& rng, int64_t fan_in, std::vector<float>& values);
// torch.nn.Embedding: N(0, 1).
void FillNormal(InitRng& rng, std::vector<float>& values);

}  // namespace ampd::engine::model
