// Loss-scaling and fused-optimizer ops on cuda:0 against the CPU oracle:
// UnscaleAndCheck (norm, in-place, a single inf or NaN anywhere in a list of
// tensors; the norm bitwise reproducible), Adam/AdamW and SGD with
// unscaling, clipping and working-copy recast, and the skip paths (found_inf,
// or a bad id earlier in the step), which must leave every byte unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

// Sizes straddle the multi-tensor tile edges (1024 and 2048 elements).
const std::vector<int64_t> kParamSizes = {1, 1023, 1024, 2049, 5000, 70000};

// One parameter's tensors on one backend.
struct Param {
  Tensor master, working, grad, m, v;
};

std::vector<Param> MakeParams(Backend& b, DType grad_dtype, bool with_working, uint32_t seed) {
  std::vector<Param> params;
  for (size_t i = 0; i < kParamSizes.size(); ++i) {
    const int64_t n = kParamSizes[i];
    const uint32_t s = seed + 10 * static_cast<uint32_t>(i);
    const auto w = RandomValues(n, s, -1, 1, DType::kF32);
    Param p;
    p.master = Upload(b, DType::kF32, {n}, w);
    if (with_working) p.working = Upload(b, grad_dtype, {n}, w);
    // Scaled gradients as a loss scale of 1024 would leave them.
    p.grad = Upload(b, grad_dtype, {n}, RandomValues(n, s + 1, -1024, 1024, grad_dtype));
    p.m = Upload(b, DType::kF32, {n}, RandomValues(n, s + 2, -0.1f, 0.1f, DType::kF32));
    p.v = Upload(b, DType::kF32, {n}, RandomValues(n, s + 3, 1e-4f, 1e-2f, DType::kF32));
    params.push_back(std::move(p));
  }
  return params;
}

std::vector<ParamRef> Refs(std::vector<Param>& params, bool with_working, bool with_state) {
  std::vector<ParamRef> refs;
  for (Param& p : params) {
    refs.push_back(ParamRef{&p.master, with_working ? &p.working : nullptr, &p.grad,
                            with_state ? &p.m : nullptr, with_state ? &p.v : nullptr});
  }
  return refs;
}

Tensor Scalar(Backend& b, float v) { return Upload(b, DType::kF32, {1}, {v}); }

void ExpectParamsClose(Backend& cpu, std::vector<Param>& c, Backend& gpu, std::vector<Param>& g,
                       bool with_working, DType dt) {
  // A handful of fp32 operations per element: a few fp32 ulps.
  const Tolerance f32{4e-6f, 1e-7f};
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_TRUE(AllClose(Download(cpu, c[i].master), Download(gpu, g[i].master), f32)) << i;
    EXPECT_TRUE(AllClose(Download(cpu, c[i].m), Download(gpu, g[i].m), f32)) << i;
    EXPECT_TRUE(AllClose(Download(cpu, c[i].v), Download(gpu, g[i].v), f32)) << i;
    if (with_working) {
      // The recast may land on the other side of a rounding boundary when
      // the fp32 masters differ by an ulp: one ulp of the working dtype.
      EXPECT_TRUE(AllClose(Download(cpu, c[i].working), Download(gpu, g[i].working),
                           ElementwiseTolerance(dt)))
          << i;
    }
  }
}

TEST_P(CudaDTypeTest, UnscaleAndCheckNormAndInPlace) {
  const DType dt = GetParam();
  std::vector<Tensor> cg, gg;
  for (size_t i = 0; i < kParamSizes.size(); ++i) {
    const auto v = RandomValues(kParamSizes[i], 200 + static_cast<uint32_t>(i), -512, 512, dt);
    cg.push_back(Upload(*cpu_, dt, {kParamSizes[i]}, v));
    gg.push_back(Upload(*gpu_, dt, {kParamSizes[i]}, v));
  }
  std::vector<Tensor*> cp, gp;
  for (size_t i = 0; i < cg.size(); ++i) {
    cp.push_back(&cg[i]);
    gp.push_back(&gg[i]);
  }
  for (bool in_place : {false, true}) {
    Tensor cf = Scalar(*cpu_, 0), gf = Scalar(*gpu_, 0);
    Tensor cn = Scalar(*cpu_, 3.0f), gn = Scalar(*gpu_, 3.0f);  // += onto a non-zero start
    AMPD_EXPECT_OK(cpu_->UnscaleAndCheck(cp, 1.0f / 1024, in_place, cf, &cn));
    AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(gp, 1.0f / 1024, in_place, gf, &gn));
    EXPECT_EQ(Download(*gpu_, gf)[0], 0.0f);
    // ~80k squares summed in a different order: relative 1e-5.
    EXPECT_TRUE(AllClose(Download(*cpu_, cn), Download(*gpu_, gn), {1e-5f, 0.0f}));
    for (size_t i = 0; i < cg.size(); ++i) {
      EXPECT_EQ(DownloadBytes(*cpu_, cg[i]), DownloadBytes(*gpu_, gg[i])) << i;
    }
  }
}

// found_inf tests g * inv_scale, as the CPU oracle does: an inv_scale of inf
// (a scale that underflowed to 0) or one that overflows a finite gradient
// fires, zero gradients included; inv_scale 0 does not.
TEST_P(CudaDTypeTest, FoundInfOnNonFiniteUnscaledProductMatchesCpu) {
  const DType dt = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> values = {
      std::vector<float>(3000, 0.0f), RandomValues(3000, 310, -8, 8, dt), {0.0f, 4.0f, 1.0f}};
  for (const auto& v : values) {
    for (float inv_scale : {inf, 0x1.0p127f, 0x1.0p100f, 0.0f}) {
      const auto n = static_cast<int64_t>(v.size());
      Tensor cg = Upload(*cpu_, dt, {n}, v), gg = Upload(*gpu_, dt, {n}, v);
      Tensor* cl[] = {&cg};
      Tensor* gl[] = {&gg};
      Tensor cf = Scalar(*cpu_, 0), gf = Scalar(*gpu_, 0);
      AMPD_EXPECT_OK(cpu_->UnscaleAndCheck(cl, inv_scale, false, cf, nullptr));
      AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(gl, inv_scale, false, gf, nullptr));
      EXPECT_EQ(Download(*gpu_, gf)[0], Download(*cpu_, cf)[0])
          << "inv_scale " << inv_scale << " n " << n;
    }
  }
}

TEST_P(CudaDTypeTest, FoundInfDetectsASingleNonFiniteAnywhere) {
  const DType dt = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> host;
  std::vector<Tensor> grads;
  for (size_t i = 0; i < kParamSizes.size(); ++i) {
    host.push_back(RandomValues(kParamSizes[i], 300 + static_cast<uint32_t>(i), -8, 8, dt));
    grads.push_back(Upload(*gpu_, dt, {kParamSizes[i]}, host.back()));
  }
  std::vector<Tensor*> ptrs;
  for (Tensor& g : grads) ptrs.push_back(&g);
  Tensor found = Scalar(*gpu_, 0);
  AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(ptrs, 1.0f, false, found, nullptr));
  ASSERT_EQ(Download(*gpu_, found)[0], 0.0f) << "finite gradients flagged";
  for (size_t t = 0; t < grads.size(); ++t) {
    const int64_t n = kParamSizes[t];
    for (int64_t pos : {int64_t{0}, n / 2, n - 1, int64_t{1023}, int64_t{2048}}) {
      if (pos >= n) continue;
      for (float bad : {inf, -inf, nan}) {
        std::vector<float> poisoned = host[t];
        poisoned[static_cast<size_t>(pos)] = bad;
        grads[t] = Upload(*gpu_, dt, {n}, poisoned);
        ptrs[t] = &grads[t];
        Tensor f = Scalar(*gpu_, 0);
        AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(ptrs, 0.5f, false, f, nullptr));
        EXPECT_EQ(Download(*gpu_, f)[0], 1.0f) << "tensor " << t << " pos " << pos << " " << bad;
      }
      grads[t] = Upload(*gpu_, dt, {n}, host[t]);
      ptrs[t] = &grads[t];
    }
  }
}

TEST_P(CudaDTypeTest, AdamWMatchesCpuWithUnscaleAndClip) {
  const DType dt = GetParam();
  const bool working = dt != DType::kF32;  // fp32 jobs have no working copy
  for (bool decoupled : {true, false}) {
    std::vector<Param> c = MakeParams(*cpu_, dt, working, 400);
    std::vector<Param> g = MakeParams(*gpu_, dt, working, 400);
    AdamConfig config;
    config.lr = 1e-3f;
    config.weight_decay = 0.01f;
    config.decoupled_weight_decay = decoupled;
    for (int64_t step = 1; step <= 3; ++step) {
      Tensor cf = Scalar(*cpu_, 0), gf = Scalar(*gpu_, 0);
      // The norm of the unscaled grads is large enough that clipping bites.
      Tensor cn = Scalar(*cpu_, 250000.0f), gn = Scalar(*gpu_, 250000.0f);
      GradTransform ct{1.0f / 1024, &cf, &cn, 100.0f};
      GradTransform gt{1.0f / 1024, &gf, &gn, 100.0f};
      auto cr = Refs(c, working, true);
      auto gr = Refs(g, working, true);
      AMPD_EXPECT_OK(cpu_->AdamUpdate(cr, config, step, ct));
      AMPD_EXPECT_OK(gpu_->AdamUpdate(gr, config, step, gt));
    }
    ExpectParamsClose(*cpu_, c, *gpu_, g, working, dt);
  }
}

TEST_P(CudaDTypeTest, SgdMatchesCpu) {
  const DType dt = GetParam();
  const bool working = dt != DType::kF32;
  struct Case {
    float momentum, dampening;
    bool nesterov;
  };
  for (const Case& k : {Case{0.0f, 0.0f, false}, Case{0.9f, 0.1f, false}, Case{0.9f, 0.0f, true}}) {
    std::vector<Param> c = MakeParams(*cpu_, dt, working, 500);
    std::vector<Param> g = MakeParams(*gpu_, dt, working, 500);
    SgdConfig config;
    config.lr = 0.01f;
    config.momentum = k.momentum;
    config.dampening = k.dampening;
    config.nesterov = k.nesterov;
    config.weight_decay = 1e-4f;
    for (int step = 0; step < 3; ++step) {
      Tensor cf = Scalar(*cpu_, 0), gf = Scalar(*gpu_, 0);
      GradTransform ct{1.0f / 1024, &cf, nullptr, 0.0f};
      GradTransform gt{1.0f / 1024, &gf, nullptr, 0.0f};
      const bool with_state = k.momentum != 0.0f;
      auto cr = Refs(c, working, with_state);
      auto gr = Refs(g, working, with_state);
      AMPD_EXPECT_OK(cpu_->SgdUpdate(cr, config, step == 0, ct));
      AMPD_EXPECT_OK(gpu_->SgdUpdate(gr, config, step == 0, gt));
    }
    ExpectParamsClose(*cpu_, c, *gpu_, g, working, dt);
  }
}

// Bytes of every tensor of every parameter.
std::vector<std::vector<uint8_t>> Snapshot(Backend& b, std::vector<Param>& params, bool working) {
  std::vector<std::vector<uint8_t>> out;
  for (Param& p : params) {
    out.push_back(DownloadBytes(b, p.master));
    out.push_back(DownloadBytes(b, p.m));
    out.push_back(DownloadBytes(b, p.v));
    if (working) out.push_back(DownloadBytes(b, p.working));
  }
  return out;
}

TEST_P(CudaDTypeTest, SkippedStepLeavesEverythingBitwiseUnchanged) {
  const DType dt = GetParam();
  const bool working = dt != DType::kF32;
  std::vector<Param> g = MakeParams(*gpu_, dt, working, 600);
  const auto before = Snapshot(*gpu_, g, working);
  Tensor found = Scalar(*gpu_, 1.0f);  // as UnscaleAndCheck leaves it after an overflow
  Tensor norm = Scalar(*gpu_, std::numeric_limits<float>::infinity());
  const GradTransform t{1.0f / 65536, &found, &norm, 1.0f};
  auto refs = Refs(g, working, true);
  AdamConfig adam;
  adam.weight_decay = 0.1f;
  AMPD_EXPECT_OK(gpu_->AdamUpdate(refs, adam, 7, t));
  EXPECT_EQ(Snapshot(*gpu_, g, working), before) << "AdamUpdate wrote on a skipped step";
  SgdConfig sgd;
  sgd.momentum = 0.9f;
  AMPD_EXPECT_OK(gpu_->SgdUpdate(refs, sgd, false, t));
  EXPECT_EQ(Snapshot(*gpu_, g, working), before) << "SgdUpdate wrote on a skipped step";
}

TEST_P(CudaDTypeTest, NormSqIsBitwiseReproducible) {
  // Two-stage reduction (per-block partials, then one fixed-order block):
  // the same gradients must give the same bits every time, which a
  // per-block atomicAdd does not guarantee. More than kChunkTensors (24)
  // tensors, so the partials span several launches.
  const DType dt = GetParam();
  std::vector<Tensor> grads;
  for (int i = 0; i < 30; ++i) {
    const int64_t n = 70001 + 977 * i;
    grads.push_back(
        Upload(*gpu_, dt, {n}, RandomValues(n, 700 + static_cast<uint32_t>(i), -512, 512, dt)));
  }
  std::vector<Tensor*> ptrs;
  for (Tensor& g : grads) ptrs.push_back(&g);
  std::vector<uint8_t> first;
  for (int run = 0; run < 3; ++run) {
    Tensor found = Scalar(*gpu_, 0);
    Tensor norm = Scalar(*gpu_, 0.25f);
    AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(ptrs, 1.0f / 1024, false, found, &norm));
    const std::vector<uint8_t> bits = DownloadBytes(*gpu_, norm);
    if (run == 0) {
      first = bits;
    } else {
      EXPECT_EQ(bits, first) << "run " << run;
    }
  }
}

TEST_F(CudaVsCpuTest, BadEmbeddingIdSkipsTheFollowingOptimizerStep) {
  // A bad id is reported only at the next synchronisation, but the fused
  // optimizer reads the device error word and must not update on that step.
  const DType dt = DType::kF16;
  std::vector<Param> g = MakeParams(*gpu_, dt, true, 800);
  const auto before = Snapshot(*gpu_, g, true);
  Tensor table = Upload(*gpu_, DType::kF32, {4, 8}, RandomValues(32, 801, -1, 1, DType::kF32));
  Tensor ids = UploadIds(*gpu_, DType::kI32, {2}, {1, 4});
  Tensor out = *gpu_->Allocate(DType::kF32, {2, 8});
  AMPD_EXPECT_OK(gpu_->EmbeddingForward(ids, table, out));  // queued; no error yet
  Tensor found = Scalar(*gpu_, 0.0f);
  const GradTransform t{1.0f / 1024, &found, nullptr, 0.0f};
  auto refs = Refs(g, true, true);
  AMPD_EXPECT_OK(gpu_->AdamUpdate(refs, AdamConfig{}, 1, t));
  SgdConfig sgd;
  sgd.momentum = 0.9f;
  AMPD_EXPECT_OK(gpu_->SgdUpdate(refs, sgd, true, t));
  const absl::Status s = gpu_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "ids")) << s;
  EXPECT_EQ(Snapshot(*gpu_, g, true), before) << "an optimizer updated after a bad id";
  // The word was cleared by the report: the next step updates again.
  AMPD_EXPECT_OK(gpu_->AdamUpdate(refs, AdamConfig{}, 1, t));
  EXPECT_NE(Snapshot(*gpu_, g, true), before);
}

TEST_F(CudaVsCpuTest, OptimizerValidationNamesTheOperand) {
  Tensor master = *gpu_->Allocate(DType::kF32, {10});
  Tensor grad = *gpu_->Allocate(DType::kF16, {10});
  Tensor m = *gpu_->Allocate(DType::kF32, {10});
  Tensor bad_v = *gpu_->Allocate(DType::kF16, {10});
  Tensor found = Scalar(*gpu_, 0);
  const ParamRef p{&master, nullptr, &grad, &m, &bad_v};
  absl::Status s = gpu_->AdamUpdate({&p, 1}, AdamConfig{}, 1, GradTransform{1, &found, nullptr, 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "params[0].state1")) << s;
  s = gpu_->AdamUpdate({&p, 1}, AdamConfig{}, 1, GradTransform{});
  EXPECT_TRUE(Mentions(s, "found_inf")) << s;
  s = gpu_->AdamUpdate({&p, 1}, AdamConfig{}, 0, GradTransform{1, &found, nullptr, 0});
  EXPECT_TRUE(Mentions(s, "step")) << s;
  const ParamRef no_buf{&master, nullptr, &grad, nullptr, nullptr};
  SgdConfig sgd;
  sgd.momentum = 0.9f;
  s = gpu_->SgdUpdate({&no_buf, 1}, sgd, true, GradTransform{1, &found, nullptr, 0});
  EXPECT_TRUE(Mentions(s, "params[0].state0")) << s;
  Tensor not_scalar = *gpu_->Allocate(DType::kF32, {4});
  Tensor* list[] = {&master, nullptr};
  s = gpu_->UnscaleAndCheck(list, 1.0f, false, found, nullptr);
  EXPECT_TRUE(Mentions(s, "grads[1]")) << s;
  s = gpu_->UnscaleAndCheck({}, 1.0f, false, not_scalar, nullptr);
  EXPECT_TRUE(Mentions(s, "found_inf")) << s;
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
