// UnscaleAndCheck's max_abs on the GPU against the CPU oracle: the same
// bits for every dtype and size (a max is exact, so the kernel's block
// maxima and atomicMax order cannot change it), a start value that is only
// ever raised, NaN skipped and inf kept, with found_inf and norm_sq computed
// in the same launch as before.
#include <cmath>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

const std::vector<int64_t> kSizes = {1, 1023, 1024, 2049, 5000, 70000};

Tensor Scalar(Backend& b, float v) { return Upload(b, DType::kF32, {1}, {v}); }

TEST_F(CudaVsCpuTest, UnscaleAndCheckMaxAbsMatchesCpu) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<Tensor> cg, gg;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      const auto v = RandomValues(kSizes[i], 300 + static_cast<uint32_t>(i), -512, 512, dt);
      cg.push_back(Upload(*cpu_, dt, {kSizes[i]}, v));
      gg.push_back(Upload(*gpu_, dt, {kSizes[i]}, v));
    }
    std::vector<Tensor*> cp, gp;
    for (size_t i = 0; i < cg.size(); ++i) {
      cp.push_back(&cg[i]);
      gp.push_back(&gg[i]);
    }
    for (float start : {0.0f, 1e9f}) {
      Tensor cf = Scalar(*cpu_, 0), gf = Scalar(*gpu_, 0);
      Tensor cn = Scalar(*cpu_, 0), gn = Scalar(*gpu_, 0);
      Tensor cm = Scalar(*cpu_, start), gm = Scalar(*gpu_, start);
      AMPD_EXPECT_OK(cpu_->UnscaleAndCheck(cp, 1.0f / 1024, false, cf, &cn, &cm));
      AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(gp, 1.0f / 1024, false, gf, &gn, &gm));
      const float want = Download(*cpu_, cm)[0];
      EXPECT_GT(want, 0.0f);
      EXPECT_EQ(Download(*gpu_, gm)[0], want) << DTypeName(dt) << " start " << start;
      EXPECT_EQ(Download(*gpu_, gf)[0], 0.0f);
      EXPECT_TRUE(AllClose(Download(*cpu_, cn), Download(*gpu_, gn), {1e-5f, 0.0f}));
    }
  }
}

TEST_F(CudaVsCpuTest, UnscaleAndCheckMaxAbsSkipsNaNKeepsInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v(5000, 0.25f);
  v[17] = nan;
  v[4000] = -3.0f;
  Tensor g = Upload(*gpu_, DType::kF32, {5000}, v);
  std::vector<Tensor*> list = {&g};
  Tensor found = Scalar(*gpu_, 0), max_abs = Scalar(*gpu_, 0);
  AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(list, 1.0f, false, found, nullptr, &max_abs));
  EXPECT_EQ(Download(*gpu_, found)[0], 1.0f);
  EXPECT_EQ(Download(*gpu_, max_abs)[0], 3.0f);

  v[17] = std::numeric_limits<float>::infinity();
  Tensor h = Upload(*gpu_, DType::kF32, {5000}, v);
  list = {&h};
  max_abs = Scalar(*gpu_, 0);
  AMPD_EXPECT_OK(gpu_->UnscaleAndCheck(list, 1.0f, false, found, nullptr, &max_abs));
  EXPECT_TRUE(std::isinf(Download(*gpu_, max_abs)[0]));
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
