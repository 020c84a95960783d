// Weight initialisation on the CPU backend: a seed gives the same weights
// whatever the backend's thread count, each parameter is its own Philox
// stream (parameter k draws stream k), and the distributions are PyTorch's
// defaults: Linear weight and bias uniform in +-1/sqrt(fan_in), LayerNorm
// ones and zeros, Embedding N(0, 1).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/engine/model/init.h"

namespace ampd::engine {
namespace {

using model::LayerKind;
using model::Precision;
using namespace ampd::engine::testing;

JobConfig InitConfig(uint64_t seed) {
  JobConfig config = DefaultJobConfig(Precision::kFp32);
  // Parameters 0 (embedding), 1-2 (Linear 48->300), 3-4 (LayerNorm), 5 (Linear 300->7, no bias).
  config.model.layers = {Embedding(1000, 48), Linear(48, 300), Act(LayerKind::kReLU),
                         LayerNorm(300), Linear(300, 7, false)};
  config.model.loss = model::LossKind::kCrossEntropy;
  config.seed = seed;
  return config;
}

checkpoint::StateDict StateWith(const JobConfig& config, int threads) {
  auto trainer = Trainer::Create(config, kernels::CreateCpuBackend(threads));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return {};
  auto state = (*trainer)->ExportState();
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? *std::move(state) : checkpoint::StateDict{};
}

std::vector<float> Values(const checkpoint::StateDict& s, const std::string& name) {
  const HostTensor* t = s.Find(name);
  EXPECT_NE(t, nullptr) << name;
  return t == nullptr ? std::vector<float>{} : ToFloats(*t);
}

TEST(ModelInit, SameSeedSameWeightsWhateverTheThreadCount) {
  const checkpoint::StateDict one = StateWith(InitConfig(42), 1);
  ASSERT_FALSE(one.tensors.empty());
  for (int threads : {2, 3, 8}) {
    EXPECT_EQ(StateDiff(one, StateWith(InitConfig(42), threads)), "") << threads << " threads";
  }
  const checkpoint::StateDict other = StateWith(InitConfig(43), 2);
  EXPECT_NE(Values(one, "model.1.weight"), Values(other, "model.1.weight"));
  EXPECT_NE(Values(one, "model.0.weight"), Values(other, "model.0.weight"));
}

// Parameter k's master is FillRandom of stream k with init.h's description.
TEST(ModelInit, ParameterKDrawsStreamK) {
  const uint64_t seed = 7;
  const checkpoint::StateDict s = StateWith(InitConfig(seed), 2);
  auto cpu = kernels::CreateCpuBackend(1);
  auto expect = [&](const std::string& name, int64_t n, const kernels::RandomFill& fill) {
    kernels::Tensor t = *cpu->Allocate(kernels::DType::kF32, {n});
    ASSERT_TRUE(cpu->FillRandom(t, fill).ok());
    std::vector<float> want(static_cast<size_t>(n));
    ASSERT_TRUE(cpu->CopyToHost(t, want.data(), want.size() * sizeof(float)).ok());
    EXPECT_EQ(Values(s, name), want) << name;
  };
  expect("model.0.weight", 1000 * 48, model::StandardNormalInit(seed, 0));
  expect("model.1.weight", 300 * 48, model::LinearUniformInit(seed, 1, 48));
  expect("model.1.bias", 300, model::LinearUniformInit(seed, 2, 48));
  expect("model.4.weight", 7 * 300, model::LinearUniformInit(seed, 5, 300));
}

TEST(ModelInit, PyTorchDefaultDistributions) {
  const checkpoint::StateDict s = StateWith(InitConfig(3), 2);
  // Linear: uniform in [-b, b), b = 1/sqrt(fan_in); mean within 6 standard
  // errors of 0, variance within 6 standard errors of b^2 / 3.
  struct LinearParam {
    const char* name;
    int64_t fan_in;
  };
  for (const LinearParam& p : {LinearParam{"model.1.weight", 48}, LinearParam{"model.1.bias", 48},
                               LinearParam{"model.4.weight", 300}}) {
    const std::vector<float> v = Values(s, p.name);
    ASSERT_FALSE(v.empty());
    const double b = 1.0 / std::sqrt(static_cast<double>(p.fan_in));
    double sum = 0, sq = 0;
    for (float x : v) {
      ASSERT_GE(x, -static_cast<float>(b)) << p.name;
      ASSERT_LT(x, static_cast<float>(b)) << p.name;
      sum += x;
      sq += static_cast<double>(x) * x;
    }
    const double n = static_cast<double>(v.size());
    const double var = b * b / 3.0, mu4 = b * b * b * b / 5.0;
    EXPECT_NEAR(sum / n, 0.0, 6.0 * std::sqrt(var / n)) << p.name;
    EXPECT_NEAR(sq / n, var, 6.0 * std::sqrt((mu4 - var * var) / n)) << p.name;
  }
  for (float x : Values(s, "model.3.weight")) ASSERT_EQ(x, 1.0f);
  for (float x : Values(s, "model.3.bias")) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(s.Find("model.4.bias"), nullptr);
  // Embedding: N(0, 1) over 48000 draws.
  const std::vector<float> e = Values(s, "model.0.weight");
  double sum = 0, sq = 0;
  for (float x : e) {
    sum += x;
    sq += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(e.size());
  EXPECT_NEAR(sum / n, 0.0, 6.0 / std::sqrt(n));
  EXPECT_NEAR(sq / n, 1.0, 6.0 * std::sqrt(2.0 / n));
}

}  // namespace
}  // namespace ampd::engine
