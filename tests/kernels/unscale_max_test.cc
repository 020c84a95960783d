// UnscaleAndCheck's max_abs on the CPU oracle: max |g * inv_scale| over a
// list of gradients of mixed dtypes equals a float64 reference exactly (a
// max never rounds), does not depend on the backend's thread count, only
// ever raises the value it is given, skips NaNs, keeps an inf, and is
// checked like the other scalars.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::ExpectInvalid;
using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;

struct GradSpec {
  DType dtype;
  Shape shape;
};

const GradSpec kSpecs[] = {{DType::kF16, {3, 5}},
                           {DType::kF32, {7}},
                           {DType::kBF16, {2, 3, 4}},
                           {DType::kF16, {70000}},
                           {DType::kF32, {33, 37}}};

struct Grads {
  std::vector<Tensor> tensors;
  std::vector<std::vector<double>> values;
  std::vector<Tensor*> Ptrs() {
    std::vector<Tensor*> p;
    for (Tensor& t : tensors) p.push_back(&t);
    return p;
  }
};

Grads MakeGrads(Backend& be, uint64_t seed, double range) {
  std::mt19937_64 rng(seed);
  Grads g;
  for (const GradSpec& s : kSpecs) {
    g.values.push_back(
        RandomValues(rng, s.dtype, static_cast<size_t>(NumElements(s.shape)), -range, range));
    g.tensors.push_back(MakeTensor(be, s.dtype, s.shape, g.values.back()));
  }
  return g;
}

// max |float32(g * inv_scale)| in float64: g and inv_scale are float32
// values, so their double product is exact and one rounding to float32 is
// what the backend's float product gives.
double ReferenceMax(const Grads& g, float inv_scale) {
  double m = 0.0;
  for (const auto& values : g.values) {
    for (double v : values) {
      m = std::max(m, std::fabs(static_cast<double>(static_cast<float>(v * inv_scale))));
    }
  }
  return m;
}

double MaxAbs(Backend& be, Grads& g, float inv_scale, bool in_place, double start) {
  Tensor found = MakeTensor(be, DType::kF32, {1}, {0.0});
  Tensor norm = MakeTensor(be, DType::kF32, {1}, {0.0});
  Tensor max_abs = MakeTensor(be, DType::kF32, {1}, {start});
  const std::vector<Tensor*> p = g.Ptrs();
  EXPECT_TRUE(be.UnscaleAndCheck(p, inv_scale, in_place, found, &norm, &max_abs).ok());
  return ReadTensor(be, max_abs)[0];
}

TEST(UnscaleMax, MatchesFloat64ReferenceExactly) {
  auto be = CreateCpuBackend();
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    for (float inv_scale : {1.0f, 0.125f, 1.0f / 65536.0f, 1.0f / 3.0f}) {
      Grads g = MakeGrads(*be, seed, 1000.0);
      const double want = ReferenceMax(g, inv_scale);
      ASSERT_GT(want, 0.0);
      EXPECT_EQ(MaxAbs(*be, g, inv_scale, /*in_place=*/false, 0.0), want)
          << "seed " << seed << " inv_scale " << inv_scale;
    }
  }
  // In place the max is of the unscaled product too, not of the value stored back.
  Grads g = MakeGrads(*be, 9, 1000.0);
  const double want = ReferenceMax(g, 1.0f / 3.0f);
  EXPECT_EQ(MaxAbs(*be, g, 1.0f / 3.0f, /*in_place=*/true, 0.0), want);
}

TEST(UnscaleMax, IndependentOfThreadCount) {
  std::vector<double> got;
  for (int threads : {1, 2, 7}) {
    auto be = CreateCpuBackend(threads);
    Grads g = MakeGrads(*be, 42, 5e4);
    got.push_back(MaxAbs(*be, g, 0.25f, false, 0.0));
  }
  EXPECT_EQ(got[0], got[1]);
  EXPECT_EQ(got[0], got[2]);
}

TEST(UnscaleMax, RaisesOnlyAndSkipsNaNKeepsInf) {
  auto be = CreateCpuBackend();
  Grads g = MakeGrads(*be, 3, 1.0);
  const double want = ReferenceMax(g, 1.0f);
  EXPECT_EQ(MaxAbs(*be, g, 1.0f, false, 1e6), 1e6);  // a larger start stays
  EXPECT_EQ(MaxAbs(*be, g, 1.0f, false, want / 2), want);

  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor with_nan = MakeTensor(*be, DType::kF32, {3}, {0.5, nan, -2.0});
  Tensor found = MakeTensor(*be, DType::kF32, {1}, {0.0});
  Tensor max_abs = MakeTensor(*be, DType::kF32, {1}, {0.0});
  std::vector<Tensor*> list = {&with_nan};
  ASSERT_TRUE(be->UnscaleAndCheck(list, 1.0f, false, found, nullptr, &max_abs).ok());
  EXPECT_EQ(ReadTensor(*be, found)[0], 1.0);
  EXPECT_EQ(ReadTensor(*be, max_abs)[0], 2.0);

  // A finite gradient times an inv_scale of inf (a loss scale that
  // underflowed to 0) is inf: kept as the max, as found_inf is set.
  Tensor h = MakeTensor(*be, DType::kF16, {2}, {60000.0, 1.0});
  max_abs = MakeTensor(*be, DType::kF32, {1}, {0.0});
  list = {&h};
  ASSERT_TRUE(be->UnscaleAndCheck(list, std::numeric_limits<float>::infinity(), false, found,
                                  nullptr, &max_abs)
                  .ok());
  EXPECT_TRUE(std::isinf(ReadTensor(*be, max_abs)[0]));
}

TEST(UnscaleMax, BadMaxAbsTensorIsInvalid) {
  auto be = CreateCpuBackend();
  Grads g = MakeGrads(*be, 5, 1.0);
  Tensor found = MakeTensor(*be, DType::kF32, {1}, {0.0});
  Tensor two = MakeTensor(*be, DType::kF32, {2}, {0.0, 0.0});
  Tensor half = MakeTensor(*be, DType::kF16, {1}, {0.0});
  const std::vector<Tensor*> p = g.Ptrs();
  ExpectInvalid(be->UnscaleAndCheck(p, 1.0f, false, found, nullptr, &two));
  ExpectInvalid(be->UnscaleAndCheck(p, 1.0f, false, found, nullptr, &half));
}

}  // namespace
}  // namespace ampd::kernels
