// The fused optimizer steps against float64 implementations of
// torch.optim.Adam, AdamW and SGD (momentum, dampening, nesterov, weight
// decay), one and several steps, with fp16/bf16/fp32 gradients unscaled
// inside the update; the clipping coefficient; a found_inf step that leaves
// every tensor bitwise unchanged; and argument validation before any write.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::ExpectInvalid;
using testing::kEps32;
using testing::MakeTensor;
using testing::RandomValues;
using testing::RawBytes;
using testing::ReadTensor;
using testing::RefStore;

constexpr float kScale = 1024.0f;  // the loss scale the gradients carry

// One parameter's tensors on the backend and its float64 shadow.
struct Param {
  Shape shape;
  Tensor master, working, grad, state0, state1;
  std::vector<double> w, m, v;  // reference master and state
  bool has_working = false;
};

class OptimizerTest : public ::testing::TestWithParam<DType> {
 protected:
  // Two parameters of different shapes; grads in the parameterised dtype
  // (F32 stands for an fp32 job: no working copy).
  void MakeParams() {
    const DType gdt = GetParam();
    params_.clear();
    for (const Shape& shape : {Shape{4, 6}, Shape{1031}}) {
      Param p;
      p.shape = shape;
      const size_t n = static_cast<size_t>(NumElements(shape));
      p.w = RandomValues(rng_, DType::kF32, n, -1.0, 1.0);
      p.m = RandomValues(rng_, DType::kF32, n, -0.1, 0.1);
      p.v = RandomValues(rng_, DType::kF32, n, 0.001, 0.01);
      p.master = MakeTensor(*be_, DType::kF32, shape, p.w);
      p.state0 = MakeTensor(*be_, DType::kF32, shape, p.m);
      p.state1 = MakeTensor(*be_, DType::kF32, shape, p.v);
      p.has_working = gdt != DType::kF32;
      if (p.has_working) {
        p.working = MakeTensor(*be_, gdt, shape, std::vector<double>(n, 0.5));
      }
      params_.push_back(std::move(p));
    }
  }
  // Fresh scaled gradients; returns their unscaled values per parameter.
  std::vector<std::vector<double>> NewGrads() {
    std::vector<std::vector<double>> unscaled;
    for (Param& p : params_) {
      const size_t n = static_cast<size_t>(NumElements(p.shape));
      std::vector<double> g = RandomValues(rng_, GetParam(), n, -kScale, kScale);
      p.grad = MakeTensor(*be_, GetParam(), p.shape, g);
      for (double& x : g) x = static_cast<double>(static_cast<float>(x) * (1.0f / kScale));
      unscaled.push_back(std::move(g));
    }
    return unscaled;
  }
  std::vector<ParamRef> Refs(bool with_state1) {
    std::vector<ParamRef> refs;
    for (Param& p : params_) {
      refs.push_back({&p.master, p.has_working ? &p.working : nullptr, &p.grad, &p.state0,
                      with_state1 ? &p.state1 : nullptr});
    }
    return refs;
  }
  // Master and state vs the reference; working == master rounded once.
  void ExpectMatches(double w_tol_per_unit, bool check_m, bool check_v) {
    for (Param& p : params_) {
      const std::vector<double> w = ReadTensor(*be_, p.master);
      const std::vector<double> m = ReadTensor(*be_, p.state0);
      const std::vector<double> v = ReadTensor(*be_, p.state1);
      for (size_t i = 0; i < w.size(); ++i) {
        ASSERT_NEAR(w[i], p.w[i], w_tol_per_unit * (1.0 + std::fabs(p.w[i]))) << i;
        if (check_m) {
          ASSERT_NEAR(m[i], p.m[i], 2e-6 * (1.0 + std::fabs(p.m[i]))) << i;
        }
        if (check_v) {
          ASSERT_NEAR(v[i], p.v[i], 1e-5 * std::fabs(p.v[i])) << i;
        }
      }
      if (p.has_working) {
        const std::vector<double> wk = ReadTensor(*be_, p.working);
        for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(wk[i], RefStore(GetParam(), w[i])) << i;
      }
    }
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{777};
  std::vector<Param> params_;
};

// torch.optim.Adam / AdamW in double.
void RefAdam(const AdamConfig& c, int64_t step, double clip, const std::vector<double>& grad,
             Param& p) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(c.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(c.beta2), step);
  for (size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i] * clip;
    if (c.weight_decay != 0.0f) {
      if (c.decoupled_weight_decay) {
        p.w[i] *= 1.0 - static_cast<double>(c.lr) * c.weight_decay;
      } else {
        g += static_cast<double>(c.weight_decay) * p.w[i];
      }
    }
    p.m[i] = c.beta1 * p.m[i] + (1.0 - c.beta1) * g;
    p.v[i] = c.beta2 * p.v[i] + (1.0 - c.beta2) * g * g;
    const double denom = std::sqrt(p.v[i]) / std::sqrt(bc2) + c.eps;
    p.w[i] -= c.lr / bc1 * p.m[i] / denom;
  }
}

// torch.optim.SGD in double.
void RefSgd(const SgdConfig& c, bool first_step, double clip, const std::vector<double>& grad,
            Param& p) {
  for (size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i] * clip;
    if (c.weight_decay != 0.0f) g += static_cast<double>(c.weight_decay) * p.w[i];
    if (c.momentum != 0.0f) {
      p.m[i] = first_step ? g : c.momentum * p.m[i] + (1.0 - c.dampening) * g;
      g = c.nesterov ? g + c.momentum * p.m[i] : p.m[i];
    }
    p.w[i] -= c.lr * g;
  }
}

TEST_P(OptimizerTest, AdamAndAdamWMatchTorchFormulasOverSeveralSteps) {
  AdamConfig adam;
  adam.lr = 1e-2f;
  adam.weight_decay = 0.05f;
  adam.decoupled_weight_decay = false;
  AdamConfig adamw = adam;
  adamw.decoupled_weight_decay = true;
  AdamConfig plain = adam;
  plain.weight_decay = 0.0f;
  plain.beta1 = 0.8f;
  plain.eps = 1e-6f;
  for (const AdamConfig& config : {adam, adamw, plain}) {
    MakeParams();
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    for (int64_t step = 1; step <= 5; ++step) {
      const std::vector<std::vector<double>> g = NewGrads();
      GradTransform tr;
      tr.inv_scale = 1.0f / kScale;
      tr.found_inf = &found;
      ASSERT_TRUE(be_->AdamUpdate(Refs(true), config, step, tr).ok());
      for (size_t i = 0; i < params_.size(); ++i) RefAdam(config, step, 1.0, g[i], params_[i]);
      // Each step moves w by about lr; fp32 keeps that to a few 1e-7 relative.
      ExpectMatches(static_cast<double>(step) * 1e-6, true, true);
    }
  }
}

TEST_P(OptimizerTest, SgdVariantsMatchTorchFormulasOverSeveralSteps) {
  SgdConfig plain;
  plain.lr = 0.05f;
  SgdConfig momentum = plain;
  momentum.momentum = 0.9f;
  momentum.dampening = 0.1f;
  momentum.weight_decay = 0.01f;
  SgdConfig nesterov = plain;
  nesterov.momentum = 0.8f;
  nesterov.nesterov = true;
  for (const SgdConfig& config : {plain, momentum, nesterov}) {
    MakeParams();
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    for (int64_t step = 1; step <= 4; ++step) {
      const std::vector<std::vector<double>> g = NewGrads();
      GradTransform tr;
      tr.inv_scale = 1.0f / kScale;
      tr.found_inf = &found;
      std::vector<ParamRef> refs = Refs(false);
      if (config.momentum == 0.0f) {
        for (ParamRef& r : refs) r.state0 = nullptr;  // plain SGD keeps no buffer
      }
      ASSERT_TRUE(be_->SgdUpdate(refs, config, step == 1, tr).ok());
      for (size_t i = 0; i < params_.size(); ++i) RefSgd(config, step == 1, 1.0, g[i], params_[i]);
      ExpectMatches(static_cast<double>(step) * 4 * kEps32 * 8, config.momentum != 0.0f, false);
    }
  }
}

TEST_P(OptimizerTest, ClipCoefficientScalesTheGradient) {
  SgdConfig config;
  config.lr = 0.1f;
  struct ClipCase {
    double norm_sq;
    float max_norm;
  };
  // Clipped (norm 20 > 5), not clipped (norm 2 < 5: coef clamps at 1), and
  // clipping off (max_grad_norm 0) even with a huge norm.
  for (const ClipCase c : {ClipCase{400.0, 5.0f}, ClipCase{4.0, 5.0f}, ClipCase{1e6, 0.0f}}) {
    MakeParams();
    const std::vector<std::vector<double>> g = NewGrads();
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {c.norm_sq});
    GradTransform tr;
    tr.inv_scale = 1.0f / kScale;
    tr.found_inf = &found;
    tr.norm_sq = &norm;
    tr.max_grad_norm = c.max_norm;
    ASSERT_TRUE(be_->SgdUpdate(Refs(false), config, true, tr).ok());
    const double coef =
        c.max_norm > 0 ? std::min(1.0, c.max_norm / (std::sqrt(c.norm_sq) + 1e-6)) : 1.0;
    for (size_t i = 0; i < params_.size(); ++i) RefSgd(config, true, coef, g[i], params_[i]);
    ExpectMatches(8 * kEps32, false, false);
  }
}

TEST_P(OptimizerTest, FoundInfSkipsEverythingBitwise) {
  for (const double flag : {1.0, static_cast<double>(NAN)}) {
    MakeParams();
    NewGrads();
    std::vector<std::vector<unsigned char>> before;
    for (Param& p : params_) {
      before.push_back(RawBytes(*be_, p.master));
      before.push_back(RawBytes(*be_, p.state0));
      before.push_back(RawBytes(*be_, p.state1));
      if (p.has_working) before.push_back(RawBytes(*be_, p.working));
    }
    Tensor found = MakeTensor(*be_, DType::kF32, {1}, {flag});
    Tensor norm = MakeTensor(*be_, DType::kF32, {1}, {4.0});
    GradTransform tr;
    tr.inv_scale = 1.0f / kScale;
    tr.found_inf = &found;
    tr.norm_sq = &norm;
    tr.max_grad_norm = 1.0f;
    AdamConfig adam;
    adam.weight_decay = 0.1f;
    ASSERT_TRUE(be_->AdamUpdate(Refs(true), adam, 3, tr).ok());
    SgdConfig sgd;
    sgd.momentum = 0.9f;
    sgd.weight_decay = 0.1f;
    ASSERT_TRUE(be_->SgdUpdate(Refs(false), sgd, false, tr).ok());
    size_t k = 0;
    for (Param& p : params_) {
      EXPECT_EQ(RawBytes(*be_, p.master), before[k++]);
      EXPECT_EQ(RawBytes(*be_, p.state0), before[k++]);
      EXPECT_EQ(RawBytes(*be_, p.state1), before[k++]);
      if (p.has_working) {
        EXPECT_EQ(RawBytes(*be_, p.working), before[k++]);
      }
    }
  }
}

TEST_P(OptimizerTest, BadParamsAreRejectedBeforeAnyWrite) {
  MakeParams();
  NewGrads();
  const std::vector<unsigned char> first_master = RawBytes(*be_, params_[0].master);
  Tensor found = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  GradTransform tr;
  tr.inv_scale = 1.0f / kScale;
  tr.found_inf = &found;
  AdamConfig adam;
  SgdConfig momentum;
  momentum.momentum = 0.9f;

  // The second parameter's grad has the wrong element count.
  Tensor short_grad = MakeTensor(*be_, GetParam(), {5}, std::vector<double>(5, 1.0));
  std::vector<ParamRef> refs = Refs(true);
  refs[1].grad = &short_grad;
  ExpectInvalid(be_->AdamUpdate(refs, adam, 1, tr));
  EXPECT_EQ(RawBytes(*be_, params_[0].master), first_master);

  refs = Refs(true);
  refs[1].state1 = nullptr;  // Adam needs exp_avg_sq
  ExpectInvalid(be_->AdamUpdate(refs, adam, 1, tr));
  refs = Refs(true);
  refs[0].state0 = nullptr;  // momentum needs a buffer
  ExpectInvalid(be_->SgdUpdate(refs, momentum, true, tr));
  refs = Refs(true);
  Tensor master16 = MakeTensor(*be_, DType::kF16, {4, 6}, std::vector<double>(24, 1.0));
  refs[0].master = &master16;  // master must be F32
  ExpectInvalid(be_->AdamUpdate(refs, adam, 1, tr));
  refs = Refs(true);
  Tensor state16 = MakeTensor(*be_, DType::kF16, {4, 6}, std::vector<double>(24, 1.0));
  refs[0].state0 = &state16;  // state must be F32
  ExpectInvalid(be_->AdamUpdate(refs, adam, 1, tr));
  refs = Refs(true);
  Tensor working_short = MakeTensor(*be_, DType::kF16, {3}, std::vector<double>(3, 1.0));
  refs[1].working = &working_short;
  ExpectInvalid(be_->SgdUpdate(refs, momentum, true, tr));
  refs = Refs(true);
  ExpectInvalid(be_->AdamUpdate(refs, adam, 0, tr));  // step is 1-based
  GradTransform no_flag = tr;
  no_flag.found_inf = nullptr;
  ExpectInvalid(be_->AdamUpdate(refs, adam, 1, no_flag));
  GradTransform bad_norm = tr;
  Tensor norm16 = MakeTensor(*be_, DType::kF16, {1}, {1.0});
  bad_norm.norm_sq = &norm16;
  ExpectInvalid(be_->SgdUpdate(refs, momentum, true, bad_norm));
  EXPECT_EQ(RawBytes(*be_, params_[0].master), first_master);
}

INSTANTIATE_TEST_SUITE_P(GradDTypes, OptimizerTest,
                         ::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const ::testing::TestParamInfo<DType>& param_info) {
                           return std::string(DTypeName(param_info.param));
                         });

}  // namespace
}  // namespace ampd::kernels
