// LoraMerge and LoraGrads on the CPU oracle against float64: the merged
// weight W + s B A, and dA, dB against central differences of a loss
// through the merged projection, accumulation over micro-batches, and the
// shape checks.
#include "server/engine/model/decoder/decoder_lora.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using kernels::Tensor;

constexpr int64_t kOut = 6, kIn = 5, kRank = 3, kRows = 4;
constexpr float kScale = 2.5f;  // alpha / r

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

class LoraMath : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend("cpu");
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }
  Tensor Upload(const std::vector<float>& v, const kernels::Shape& shape) {
    auto t = backend_->Allocate(DType::kF32, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(backend_->CopyFromHost(v.data(), v.size() * 4, *t).ok());
    return *std::move(t);
  }
  std::vector<float> Download(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    EXPECT_TRUE(backend_->CopyToHost(t, v.data(), v.size() * 4).ok());
    return v;
  }
  std::unique_ptr<kernels::Backend> backend_;
};

// W + s B A in float64, (out, in) row-major.
std::vector<double> Merged(const std::vector<float>& w, const std::vector<double>& a,
                           const std::vector<double>& b) {
  std::vector<double> m(w.begin(), w.end());
  for (int64_t o = 0; o < kOut; ++o) {
    for (int64_t i = 0; i < kIn; ++i) {
      for (int64_t r = 0; r < kRank; ++r)
        m[o * kIn + i] += kScale * b[o * kRank + r] * a[r * kIn + i];
    }
  }
  return m;
}

TEST_F(LoraMath, MergeAddsTheScaledProduct) {
  const std::vector<float> w = Random(kOut * kIn, 1), a = Random(kRank * kIn, 2),
                           b = Random(kOut * kRank, 3);
  Tensor tw = Upload(w, {kOut, kIn});
  ASSERT_TRUE(
      model::LoraMerge(*backend_, kScale, Upload(a, {kRank, kIn}), Upload(b, {kOut, kRank}), tw)
          .ok());
  const std::vector<double> expected =
      Merged(w, std::vector<double>(a.begin(), a.end()), std::vector<double>(b.begin(), b.end()));
  const std::vector<float> got = Download(tw);
  for (size_t k = 0; k < got.size(); ++k) EXPECT_NEAR(got[k], expected[k], 1e-5) << k;
  // B = 0 (PEFT's init): the merged weight is W, bit for bit.
  Tensor again = Upload(w, {kOut, kIn});
  ASSERT_TRUE(model::LoraMerge(*backend_, kScale, Upload(a, {kRank, kIn}),
                               Upload(std::vector<float>(kOut * kRank, 0.0f), {kOut, kRank}), again)
                  .ok());
  EXPECT_EQ(Download(again), w);
}

TEST_F(LoraMath, GradsMatchCentralDifferencesAndAccumulate) {
  const std::vector<float> w = Random(kOut * kIn, 4), a = Random(kRank * kIn, 5),
                           b = Random(kOut * kRank, 6), x = Random(kRows * kIn, 7),
                           dy = Random(kRows * kOut, 8);
  // L = sum(dy * (x W_eff^T)), whose dL/dW_eff = dy^T x.
  auto loss = [&](const std::vector<double>& ad, const std::vector<double>& bd) {
    const std::vector<double> m = Merged(w, ad, bd);
    double l = 0.0;
    for (int64_t n = 0; n < kRows; ++n) {
      for (int64_t o = 0; o < kOut; ++o) {
        double y = 0.0;
        for (int64_t i = 0; i < kIn; ++i) y += x[n * kIn + i] * m[o * kIn + i];
        l += dy[n * kOut + o] * y;
      }
    }
    return l;
  };
  Tensor g = backend_->Allocate(DType::kF32, {kOut, kIn}).value();
  ASSERT_TRUE(
      backend_->Gemm(true, false, 1.0f, Upload(dy, {kRows, kOut}), Upload(x, {kRows, kIn}), 0.0f, g)
          .ok());
  const Tensor ta = Upload(a, {kRank, kIn}), tb = Upload(b, {kOut, kRank});
  // Garbage in the gradients: beta 0 must overwrite it.
  Tensor da = Upload(Random(kRank * kIn, 9), {kRank, kIn});
  Tensor db = Upload(Random(kOut * kRank, 10), {kOut, kRank});
  ASSERT_TRUE(model::LoraGrads(*backend_, kScale, g, ta, tb, 0.0f, da, db).ok());
  const std::vector<float> got_a = Download(da), got_b = Download(db);

  const std::vector<double> a0(a.begin(), a.end()), b0(b.begin(), b.end());
  const double h = 1e-4;
  auto check = [&](const std::vector<float>& got, bool of_a) {
    for (size_t k = 0; k < got.size(); ++k) {
      std::vector<double> ap = a0, am = a0, bp = b0, bm = b0;
      (of_a ? ap : bp)[k] += h;
      (of_a ? am : bm)[k] -= h;
      const double fd = (loss(ap, bp) - loss(am, bm)) / (2 * h);
      EXPECT_NEAR(got[k], fd, 1e-4 * (1.0 + std::abs(fd))) << (of_a ? "dA " : "dB ") << k;
    }
  };
  check(got_a, true);
  check(got_b, false);

  // A second micro-batch with beta 1 adds its own.
  ASSERT_TRUE(model::LoraGrads(*backend_, kScale, g, ta, tb, 1.0f, da, db).ok());
  const std::vector<float> twice_a = Download(da), twice_b = Download(db);
  for (size_t k = 0; k < got_a.size(); ++k) EXPECT_EQ(twice_a[k], 2.0f * got_a[k]) << k;
  for (size_t k = 0; k < got_b.size(); ++k) EXPECT_EQ(twice_b[k], 2.0f * got_b[k]) << k;
}

TEST_F(LoraMath, ShapesAreChecked) {
  const Tensor a = Upload(Random(kRank * kIn, 1), {kRank, kIn});
  const Tensor b = Upload(Random(kOut * kRank, 2), {kOut, kRank});
  Tensor wrong = Upload(Random(kIn * kOut, 3), {kIn, kOut});
  const absl::Status merge = model::LoraMerge(*backend_, kScale, a, b, wrong);
  EXPECT_EQ(merge.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(merge.message(), "lora: A (3, 5), B (6, 3) and W (5, 6)")) << merge;
  Tensor g = Upload(Random(kOut * kIn, 4), {kOut, kIn});
  Tensor da = Upload(Random(kRank * kIn, 5), {kRank, kIn});
  Tensor db = Upload(Random(kOut * kRank, 6), {kRank, kOut});
  const absl::Status grads = model::LoraGrads(*backend_, kScale, g, a, b, 0.0f, da, db);
  EXPECT_EQ(grads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(grads.message(), "dB (3, 6)")) << grads;
}

}  // namespace
}  // namespace ampd::engine
