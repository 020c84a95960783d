// LoraForward and LoraBackward on the CPU oracle against float64: the
// adapter's term x W^T + s (x A^T) B^T added to the frozen projection's
// output, dA, dB and dx against central differences of a loss through it,
// beta 0 overwriting and beta 1 accumulating the gradients, and the shape
// checks.
#include "server/engine/model/transformer/lora.h"

#include <cmath>
#include <cstdint>
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

// y (N, out) = x W^T + s (x A^T) B^T in float64.
std::vector<double> Adapted(const std::vector<double>& x, const std::vector<float>& w,
                            const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> y(kRows * kOut, 0.0);
  for (int64_t n = 0; n < kRows; ++n) {
    std::vector<double> u(kRank, 0.0);
    for (int64_t r = 0; r < kRank; ++r) {
      for (int64_t i = 0; i < kIn; ++i) u[r] += x[n * kIn + i] * a[r * kIn + i];
    }
    for (int64_t o = 0; o < kOut; ++o) {
      double sum = 0.0;
      for (int64_t i = 0; i < kIn; ++i) sum += x[n * kIn + i] * w[o * kIn + i];
      for (int64_t r = 0; r < kRank; ++r) sum += kScale * u[r] * b[o * kRank + r];
      y[n * kOut + o] = sum;
    }
  }
  return y;
}

std::vector<double> Wide(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST_F(LoraMath, ForwardAddsTheScaledAdapterTerm) {
  const std::vector<float> w = Random(kOut * kIn, 1), a = Random(kRank * kIn, 2),
                           b = Random(kOut * kRank, 3), x = Random(kRows * kIn, 4);
  const Tensor tx = Upload(x, {kRows, kIn});
  // y holds the frozen path's x W^T on entry.
  Tensor y = backend_->Allocate(DType::kF32, {kRows, kOut}).value();
  ASSERT_TRUE(backend_->Gemm(false, true, 1.0f, tx, Upload(w, {kOut, kIn}), 0.0f, y).ok());
  const std::vector<float> base = Download(y);
  Tensor u = Upload(Random(kRows * kRank, 5), {kRows, kRank});
  ASSERT_TRUE(model::LoraForward(*backend_, kScale, tx, Upload(a, {kRank, kIn}),
                                 Upload(b, {kOut, kRank}), u, y)
                  .ok());
  const std::vector<double> expected = Adapted(Wide(x), w, Wide(a), Wide(b));
  const std::vector<float> got = Download(y);
  for (size_t k = 0; k < got.size(); ++k) EXPECT_NEAR(got[k], expected[k], 1e-5) << k;
  // B = 0 (PEFT's init): the output is the frozen projection's, bit for bit.
  Tensor again = Upload(base, {kRows, kOut});
  ASSERT_TRUE(model::LoraForward(*backend_, kScale, tx, Upload(a, {kRank, kIn}),
                                 Upload(std::vector<float>(kOut * kRank, 0.0f), {kOut, kRank}), u,
                                 again)
                  .ok());
  EXPECT_EQ(Download(again), base);
}

TEST_F(LoraMath, BackwardMatchesCentralDifferencesAndAccumulates) {
  const std::vector<float> w = Random(kOut * kIn, 4), a = Random(kRank * kIn, 5),
                           b = Random(kOut * kRank, 6), x = Random(kRows * kIn, 7),
                           dy = Random(kRows * kOut, 8);
  // L = sum(dy * y): dL/dy = dy.
  auto loss = [&](const std::vector<double>& xd, const std::vector<double>& ad,
                  const std::vector<double>& bd) {
    const std::vector<double> y = Adapted(xd, w, ad, bd);
    double l = 0.0;
    for (size_t k = 0; k < y.size(); ++k) l += dy[k] * y[k];
    return l;
  };
  const Tensor tx = Upload(x, {kRows, kIn}), ta = Upload(a, {kRank, kIn}),
               tb = Upload(b, {kOut, kRank}), tdy = Upload(dy, {kRows, kOut});
  Tensor y = Upload(std::vector<float>(kRows * kOut, 0.0f), {kRows, kOut});
  Tensor u = backend_->Allocate(DType::kF32, {kRows, kRank}).value();
  ASSERT_TRUE(model::LoraForward(*backend_, kScale, tx, ta, tb, u, y).ok());
  // dx holds the frozen path's dy W on entry; garbage in dA, dB: beta 0
  // must overwrite it.
  Tensor dx = backend_->Allocate(DType::kF32, {kRows, kIn}).value();
  ASSERT_TRUE(backend_->Gemm(false, false, 1.0f, tdy, Upload(w, {kOut, kIn}), 0.0f, dx).ok());
  Tensor du = backend_->Allocate(DType::kF32, {kRows, kRank}).value();
  Tensor da = Upload(Random(kRank * kIn, 9), {kRank, kIn});
  Tensor db = Upload(Random(kOut * kRank, 10), {kOut, kRank});
  ASSERT_TRUE(
      model::LoraBackward(*backend_, kScale, tx, u, tdy, ta, tb, 0.0f, du, da, db, dx).ok());
  const std::vector<float> got_a = Download(da), got_b = Download(db), got_x = Download(dx);

  const std::vector<double> x0 = Wide(x), a0 = Wide(a), b0 = Wide(b);
  const double h = 1e-4;
  enum Of { kX, kA, kB };
  auto check = [&](const std::vector<float>& got, Of of, const char* what) {
    for (size_t k = 0; k < got.size(); ++k) {
      std::vector<double> xp = x0, xm = x0, ap = a0, am = a0, bp = b0, bm = b0;
      std::vector<double>& plus = of == kX ? xp : of == kA ? ap : bp;
      std::vector<double>& minus = of == kX ? xm : of == kA ? am : bm;
      plus[k] += h;
      minus[k] -= h;
      const double fd = (loss(xp, ap, bp) - loss(xm, am, bm)) / (2 * h);
      EXPECT_NEAR(got[k], fd, 1e-4 * (1.0 + std::abs(fd))) << what << k;
    }
  };
  check(got_x, kX, "dx ");
  check(got_a, kA, "dA ");
  check(got_b, kB, "dB ");

  // A second micro-batch with beta 1 adds its own (doubling is exact).
  ASSERT_TRUE(
      model::LoraBackward(*backend_, kScale, tx, u, tdy, ta, tb, 1.0f, du, da, db, dx).ok());
  const std::vector<float> twice_a = Download(da), twice_b = Download(db);
  for (size_t k = 0; k < got_a.size(); ++k) EXPECT_EQ(twice_a[k], 2.0f * got_a[k]) << k;
  for (size_t k = 0; k < got_b.size(); ++k) EXPECT_EQ(twice_b[k], 2.0f * got_b[k]) << k;
}

TEST_F(LoraMath, ShapesAreChecked) {
  const Tensor a = Upload(Random(kRank * kIn, 1), {kRank, kIn});
  const Tensor b = Upload(Random(kOut * kRank, 2), {kOut, kRank});
  const Tensor x = Upload(Random(kRows * kIn, 3), {kRows, kIn});
  Tensor u = Upload(Random(kRows * kRank, 4), {kRows, kRank});
  Tensor wrong_y = Upload(Random(kRows * kIn, 5), {kRows, kIn});
  const absl::Status forward = model::LoraForward(*backend_, kScale, x, a, b, u, wrong_y);
  EXPECT_EQ(forward.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(forward.message(), "lora: A (3, 5), B (6, 3), x (4, 5), y (4, 5)"))
      << forward;
  const Tensor dy = Upload(Random(kRows * kOut, 6), {kRows, kOut});
  Tensor du = Upload(Random(kRows * kRank, 7), {kRows, kRank});
  Tensor da = Upload(Random(kRank * kIn, 8), {kRank, kIn});
  Tensor db = Upload(Random(kOut * kRank, 9), {kRank, kOut});
  Tensor dx = Upload(Random(kRows * kIn, 10), {kRows, kIn});
  const absl::Status backward =
      model::LoraBackward(*backend_, kScale, x, u, dy, a, b, 0.0f, du, da, db, dx);
  EXPECT_EQ(backward.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(backward.message(), "dB is (3, 6), expected (6, 3)")) << backward;
}

}  // namespace
}  // namespace ampd::engine
