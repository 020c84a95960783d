// Every layer's backward and both losses against central finite
// differences, in fp32, through the engine's own Model (the path a Trainer
// step runs): the analytic dL/dw from Backward vs (L(w+h) - L(w-h)) / 2h
// with L from Forward + Loss.
#include <cmath>
#include <memory>
#include <string>

#include "engine_test_util.h"
#include "server/engine/model/layers.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using model::LayerKind;
using namespace ampd::engine::testing;

struct Case {
  std::string name;
  model::ModelSpec spec;
  HostTensor inputs;
  HostTensor targets;
};

class GradientCheck : public ::testing::TestWithParam<int> {};

std::vector<Case> Cases() {
  DataRng rng(7);
  std::vector<Case> cases;
  auto mse = [&](std::string name, std::vector<model::LayerSpec> layers, int64_t in, int64_t out,
                 float multiplier = 1.0f) {
    Case c;
    c.name = std::move(name);
    c.spec.layers = std::move(layers);
    c.spec.loss = model::LossKind::kMse;
    c.spec.loss_multiplier = multiplier;
    const int64_t n = 5;
    c.inputs = F32({n, in}, rng.UniformVector(static_cast<size_t>(n * in), -1.5f, 1.5f));
    c.targets = F32({n, out}, rng.UniformVector(static_cast<size_t>(n * out), -1.0f, 1.0f));
    cases.push_back(std::move(c));
  };
  mse("linear_relu_linear_nobias",
      {Linear(3, 4), Act(LayerKind::kReLU), Linear(4, 2, /*bias=*/false)}, 3, 2);
  mse("linear_gelu_linear", {Linear(3, 4), Act(LayerKind::kGELU), Linear(4, 2)}, 3, 2);
  mse("linear_tanh_linear_multiplier", {Linear(3, 4), Act(LayerKind::kTanh), Linear(4, 2)}, 3, 2,
      2.5f);
  mse("layernorm_first_affine",
      {LayerNorm(3), Linear(3, 4), LayerNorm(4), Act(LayerKind::kGELU), Linear(4, 2)}, 3, 2);
  mse("layernorm_no_affine", {Linear(3, 4), LayerNorm(4, /*affine=*/false), Linear(4, 2)}, 3, 2);
  {
    Case c;
    c.name = "embedding_linear_cross_entropy";
    c.spec.layers = {Embedding(6, 3), Linear(3, 4)};
    c.spec.loss = model::LossKind::kCrossEntropy;
    c.inputs = I32({5}, {0, 3, 5, 3, 1});
    c.targets = I32({5}, {1, 0, 3, 2, 1});
    cases.push_back(std::move(c));
  }
  {
    Case c;
    c.name = "mlp_cross_entropy";
    c.spec.layers = {Linear(3, 5), Act(LayerKind::kTanh), Linear(5, 4)};
    c.spec.loss = model::LossKind::kCrossEntropy;
    c.spec.loss_multiplier = 0.5f;
    c.inputs = F32({5, 3}, rng.UniformVector(15, -1.5f, 1.5f));
    c.targets = I32({5}, {3, 0, 2, 2, 1});
    cases.push_back(std::move(c));
  }
  return cases;
}

// A case's model on the CPU backend, its batch loaded, and a loss scalar.
struct CaseModel {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Model> model;
  model::Workspace* ws = nullptr;
  kernels::Tensor loss;
};

void BuildCaseModel(const Case& c, CaseModel* out) {
  auto backend_or = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend_or.ok()) << backend_or.status();
  out->backend = *std::move(backend_or);
  auto model_or = model::Model::Create(c.spec, model::Precision::kFp32, 3, *out->backend);
  ASSERT_TRUE(model_or.ok()) << model_or.status();
  out->model = *std::move(model_or);
  auto ws_or = out->model->GetWorkspace(c.inputs.shape[0]);
  ASSERT_TRUE(ws_or.ok()) << ws_or.status();
  out->ws = *ws_or;
  ASSERT_TRUE(out->model->LoadBatch(c.inputs, c.targets, *out->ws).ok());
  auto loss_or = out->backend->Allocate(DType::kF32, {1, 1});
  ASSERT_TRUE(loss_or.ok());
  out->loss = *std::move(loss_or);
}

TEST_P(GradientCheck, ReportsEachGradientOnceWhenItIsFinal) {
  const Case c = Cases()[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(c.name);
  CaseModel cm;
  ASSERT_NO_FATAL_FAILURE(BuildCaseModel(c, &cm));
  ASSERT_TRUE(cm.model->ZeroGrads().ok());
  ASSERT_TRUE(cm.model->Forward(*cm.ws).ok());
  ASSERT_TRUE(cm.model->Loss(*cm.ws, 1.0f, cm.loss).ok());
  testing::ExpectGradsReadyOnceAndFinal(*cm.backend, *cm.model, *cm.ws);
}

TEST_P(GradientCheck, AnalyticMatchesCentralDifference) {
  const Case c = Cases()[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(c.name);
  CaseModel cm;
  ASSERT_NO_FATAL_FAILURE(BuildCaseModel(c, &cm));
  kernels::Backend& b = *cm.backend;
  model::Model& m = *cm.model;
  model::Workspace& ws = *cm.ws;
  kernels::Tensor& loss = cm.loss;

  // LayerNorm's init (gamma 1, beta 0) would hide a swapped dgamma/dbeta:
  // move every parameter off its init first.
  DataRng jitter(11);
  for (model::Parameter& p : m.params()) {
    std::vector<float> v(static_cast<size_t>(p.master.numel()));
    ASSERT_TRUE(b.CopyToHost(p.master, v.data(), v.size() * 4).ok());
    for (float& x : v) x += jitter.Uniform(-0.3f, 0.3f);
    ASSERT_TRUE(b.CopyFromHost(v.data(), v.size() * 4, p.master).ok());
  }

  auto eval = [&]() -> double {
    EXPECT_TRUE(m.Forward(ws).ok());
    EXPECT_TRUE(m.Loss(ws, 1.0f, loss).ok());
    float l = 0;
    EXPECT_TRUE(b.CopyToHost(loss, &l, 4).ok());
    return l;
  };
  ASSERT_TRUE(m.ZeroGrads().ok());
  eval();
  ASSERT_TRUE(m.Backward(ws, /*first_micro_batch=*/true).ok());

  int checked = 0;
  for (model::Parameter& p : m.params()) {
    const auto n = static_cast<size_t>(p.master.numel());
    std::vector<float> w(n), g(n);
    ASSERT_TRUE(b.CopyToHost(p.master, w.data(), n * 4).ok());
    ASSERT_TRUE(b.CopyToHost(p.grad, g.data(), n * 4).ok());
    for (size_t i = 0; i < n; ++i) {
      // h = 1e-2: fp32 loss rounding (~1e-7 L) / h stays below 1e-5, and the
      // O(h^2) truncation error is of the same order for these smooth maps.
      const float h = 1e-2f;
      std::vector<float> wp = w;
      wp[i] = w[i] + h;
      ASSERT_TRUE(b.CopyFromHost(wp.data(), n * 4, p.master).ok());
      const double lp = eval();
      wp[i] = w[i] - h;
      ASSERT_TRUE(b.CopyFromHost(wp.data(), n * 4, p.master).ok());
      const double lm = eval();
      ASSERT_TRUE(b.CopyFromHost(w.data(), n * 4, p.master).ok());
      const double fd = (lp - lm) / (2.0 * static_cast<double>(h));
      EXPECT_NEAR(g[i], fd, 2e-3 + 1e-2 * std::fabs(fd)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, m.parameter_count());
}

INSTANTIATE_TEST_SUITE_P(Layers, GradientCheck, ::testing::Range(0, 7),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return Cases()[static_cast<size_t>(param_info.param)].name;
                         });

TEST(Init, PyTorchDefaultDistributionsAndDeterministic) {
  model::ModelSpec spec;
  spec.layers = {Embedding(64, 32), Linear(32, 100), LayerNorm(100)};
  auto backend_or = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend_or.ok());
  kernels::Backend& b = **backend_or;
  auto read = [&](const kernels::Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    EXPECT_TRUE(b.CopyToHost(t, v.data(), v.size() * 4).ok());
    return v;
  };
  auto m1 = model::Model::Create(spec, model::Precision::kBf16, 42, b);
  auto m2 = model::Model::Create(spec, model::Precision::kBf16, 42, b);
  auto m3 = model::Model::Create(spec, model::Precision::kBf16, 43, b);
  ASSERT_TRUE(m1.ok() && m2.ok() && m3.ok());
  const auto& p = (*m1)->params();
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p[0].name, "model.0.weight");
  EXPECT_EQ(p[1].name, "model.1.weight");
  EXPECT_EQ(p[2].name, "model.1.bias");
  EXPECT_EQ(p[3].name, "model.2.weight");
  EXPECT_EQ(p[4].name, "model.2.bias");
  // Embedding N(0, 1): 2048 draws, mean within 4 sigma/sqrt(n), var near 1.
  const std::vector<float> emb = read(p[0].master);
  double sum = 0, sq = 0;
  for (float x : emb) sum += x, sq += static_cast<double>(x) * x;
  const double mean = sum / static_cast<double>(emb.size());
  EXPECT_NEAR(mean, 0.0, 4.0 / std::sqrt(2048.0));
  EXPECT_NEAR(sq / static_cast<double>(emb.size()) - mean * mean, 1.0, 0.1);
  // Linear: +-1/sqrt(32) for weight and bias, and the range is used.
  const float bound = 1.0f / std::sqrt(32.0f);
  for (int idx : {1, 2}) {
    float lo = 1, hi = -1;
    for (float x : read(p[static_cast<size_t>(idx)].master)) {
      EXPECT_LE(std::fabs(x), bound);
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    EXPECT_LT(lo, -0.8f * bound);
    EXPECT_GT(hi, 0.8f * bound);
  }
  for (float x : read(p[3].master)) EXPECT_EQ(x, 1.0f);
  for (float x : read(p[4].master)) EXPECT_EQ(x, 0.0f);
  // Same seed: bitwise equal; another seed: different.
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(read(p[i].master), read((*m2)->params()[i].master));
  }
  EXPECT_NE(read(p[1].master), read((*m3)->params()[1].master));
  EXPECT_EQ((*m1)->parameter_count(), model::ParameterCount(spec));
}

}  // namespace
}  // namespace ampd::engine
