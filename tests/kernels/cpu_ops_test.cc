// Every non-GEMM, non-optimizer op of the CPU backend against float64
// references: memory, scalar reads and casts, the elementwise add, bias add
// and its gradient, activations
// forward and backward, LayerNorm forward and backward, embedding forward and
// backward, MSE and cross-entropy, and the log2 gradient histogram; plus the
// InvalidArgument paths. Tolerances: half an ulp of the output dtype for the
// one final rounding, plus a bound on the fp32 arithmetic before it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::Eps;
using testing::ExpectInvalid;
using testing::kEps32;
using testing::kFloatTypes;
using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;
using testing::RefF32;
using testing::RefStore;

// |rounded fp32 result - exact| bound: half an ulp of dtype at the result,
// fp16's subnormal half-quantum, and the caller's bound on the fp32 error.
double Tol(DType dtype, double ref, double fp32_error) {
  const double subnormal = dtype == DType::kF16 ? std::ldexp(1.0, -25) : 1e-38;
  return 0.5 * Eps(dtype) * std::fabs(ref) + fp32_error + subnormal;
}

class CpuOpsTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{20240611};  // fixed: failures reproduce
};

// ---- memory, fill, cast -------------------------------------------------------

TEST_F(CpuOpsTest, AllocateTracksBytesAndRejectsBadShapes) {
  const int64_t before = be_->BytesInUse();
  {
    absl::StatusOr<Tensor> a = be_->Allocate(DType::kF16, {3, 5});
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->nbytes(), 30u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ(be_->BytesInUse(), before + 30);
    absl::StatusOr<Tensor> b = be_->Allocate(DType::kI64, {4});
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(be_->BytesInUse(), before + 62);
  }
  EXPECT_EQ(be_->BytesInUse(), before);
  ExpectInvalid(be_->Allocate(DType::kF32, {2, -1}).status());
  EXPECT_EQ(be_->name(), "cpu");
  EXPECT_TRUE(be_->Synchronize().ok());
}

TEST_F(CpuOpsTest, CopiesCheckSizes) {
  Tensor t = MakeTensor(*be_, DType::kF32, {2, 2}, {1.5, -2.0, 3.25, 4.0});
  std::vector<float> host(3);
  ExpectInvalid(be_->CopyToHost(t, host.data(), 12));
  ExpectInvalid(be_->CopyFromHost(host.data(), 12, t));
  Tensor u = MakeTensor(*be_, DType::kF32, {4}, {0.5, 0.5, 0.5, 0.5});
  ASSERT_TRUE(be_->Copy(t, u).ok());
  EXPECT_EQ(ReadTensor(*be_, u), (std::vector<double>{1.5, -2.0, 3.25, 4.0}));
  Tensor h = MakeTensor(*be_, DType::kF16, {4}, {0.5, 0.5, 0.5, 0.5});
  ExpectInvalid(be_->Copy(t, h));
  Tensor small = MakeTensor(*be_, DType::kF32, {3}, {1.0, 2.0, 3.0});
  ExpectInvalid(be_->Copy(t, small));
}

TEST_F(CpuOpsTest, FillRoundsOnce) {
  for (const DType dt : kFloatTypes) {
    Tensor t = MakeTensor(*be_, dt, {3}, {1.0, 2.0, 3.0});
    ASSERT_TRUE(be_->Fill(t, 0.1f).ok());
    const double want = RefStore(dt, RefF32(0.1));
    EXPECT_EQ(ReadTensor(*be_, t), std::vector<double>(3, want)) << DTypeName(dt);
    ASSERT_TRUE(be_->Fill(t, 1e6f).ok());
    EXPECT_EQ(ReadTensor(*be_, t)[0], RefStore(dt, 1e6)) << DTypeName(dt);  // inf for fp16
  }
  Tensor ints = MakeTensor(*be_, DType::kI32, {2}, {1.0, 2.0});
  ExpectInvalid(be_->Fill(ints, 0.0f));
}

TEST_F(CpuOpsTest, CastMatchesReferenceRounding) {
  // fp32 values across fp16's whole range, subnormals and overflow included.
  std::vector<double> v;
  std::uniform_real_distribution<double> log_mag(-27.0, 17.0);
  for (int i = 0; i < 4000; ++i) {
    const double x = RefF32(std::exp2(log_mag(rng_)) * (i % 2 ? -1.0 : 1.0));
    v.push_back(x);
  }
  v.push_back(-0.0);
  v.push_back(65519.0);
  Tensor src = MakeTensor(*be_, DType::kF32, {static_cast<int64_t>(v.size())}, v);
  for (const DType dt : kFloatTypes) {
    Tensor dst =
        MakeTensor(*be_, dt, {static_cast<int64_t>(v.size())}, std::vector<double>(v.size(), 1.0));
    ASSERT_TRUE(be_->Cast(src, dst).ok());
    const std::vector<double> got = ReadTensor(*be_, dst);
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(got[i], RefStore(dt, v[i])) << DTypeName(dt) << " " << v[i];
    }
    EXPECT_TRUE(std::signbit(got[v.size() - 2]));
    // Back to F32 (exact) and across 16-bit types (one rounding from fp16).
    Tensor back = MakeTensor(*be_, DType::kF32, {static_cast<int64_t>(v.size())},
                             std::vector<double>(v.size(), 1.0));
    ASSERT_TRUE(be_->Cast(dst, back).ok());
    EXPECT_EQ(ReadTensor(*be_, back), got);
    Tensor bf = MakeTensor(*be_, DType::kBF16, {static_cast<int64_t>(v.size())},
                           std::vector<double>(v.size(), 1.0));
    ASSERT_TRUE(be_->Cast(dst, bf).ok());
    const std::vector<double> got_bf = ReadTensor(*be_, bf);
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got_bf[i], RefStore(DType::kBF16, got[i]));
  }
  Tensor wrong = MakeTensor(*be_, DType::kF16, {3}, {1.0, 2.0, 3.0});
  ExpectInvalid(be_->Cast(src, wrong));
  Tensor ints = MakeTensor(*be_, DType::kI32, {static_cast<int64_t>(v.size())},
                           std::vector<double>(v.size(), 1.0));
  ExpectInvalid(be_->Cast(src, ints));
}

TEST_F(CpuOpsTest, ReadScalarsReadsEachOneElementTensor) {
  // Any shape of one element: the trainer's are (1, 1), the losses' (1).
  Tensor a = MakeTensor(*be_, DType::kF32, {1, 1}, {1.5});
  Tensor b = MakeTensor(*be_, DType::kF32, {1}, {-0.0});
  Tensor c = MakeTensor(*be_, DType::kF32, {1, 1, 1}, {std::ldexp(1.0, 127)});
  Tensor inf = MakeTensor(*be_, DType::kF32, {1}, {INFINITY});
  const Tensor* const scalars[] = {&a, &b, &c, &inf, &a};
  float out[5] = {7, 7, 7, 7, 7};
  ASSERT_TRUE(be_->ReadScalars(scalars, out).ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_TRUE(std::signbit(out[1]));
  EXPECT_EQ(out[2], std::ldexp(1.0f, 127));
  EXPECT_EQ(out[3], INFINITY);
  EXPECT_EQ(out[4], 1.5f);
  EXPECT_TRUE(be_->ReadScalars({}, {}).ok());
}

TEST_F(CpuOpsTest, ReadBackBringsCopiesWithTheScalarsAndChecksTheirSizes) {
  Tensor a = MakeTensor(*be_, DType::kF32, {1, 1}, {2.5});
  Tensor v = MakeTensor(*be_, DType::kF32, {3}, {1.0, -2.0, 4.0});
  const Tensor* const scalars[] = {&a};
  float out[1] = {7};
  float got[3] = {0, 0, 0};
  const HostCopy good[] = {{&v, got, sizeof(got)}};
  ASSERT_TRUE(be_->ReadBack(scalars, out, good).ok());
  EXPECT_EQ(out[0], 2.5f);
  EXPECT_EQ(got[0], 1.0f);
  EXPECT_EQ(got[1], -2.0f);
  EXPECT_EQ(got[2], 4.0f);
  out[0] = 7;
  const HostCopy short_dst[] = {{&v, got, 2 * sizeof(float)}};
  absl::Status s = be_->ReadBack(scalars, out, short_dst);
  ExpectInvalid(s);
  EXPECT_NE(std::string(s.message()).find("copies[0]"), std::string::npos) << s;
  const HostCopy null_src[] = {{&v, got, sizeof(got)}, {nullptr, got, 0}};
  s = be_->ReadBack(scalars, out, null_src);
  EXPECT_NE(std::string(s.message()).find("copies[1]"), std::string::npos) << s;
  EXPECT_EQ(out[0], 7.0f);  // nothing read on a bad call
}

TEST_F(CpuOpsTest, ReadScalarsNamesTheBadOperandAndWritesNothing) {
  Tensor a = MakeTensor(*be_, DType::kF32, {1, 1}, {1.5});
  Tensor two = MakeTensor(*be_, DType::kF32, {2}, {1.0, 2.0});
  Tensor half = MakeTensor(*be_, DType::kF16, {1}, {1.0});
  Tensor unallocated;
  auto expect_names = [&](const absl::Status& s, const std::string& what) {
    ExpectInvalid(s);
    EXPECT_NE(std::string(s.message()).find(what), std::string::npos) << s;
  };
  float out[3] = {7, 7, 7};
  {
    const Tensor* const scalars[] = {&a, &a};
    expect_names(be_->ReadScalars(scalars, out), "out");
  }
  {
    const Tensor* const scalars[] = {&a, &two, &a};
    expect_names(be_->ReadScalars(scalars, out), "scalars[1]");
  }
  {
    const Tensor* const scalars[] = {&a, &a, &half};
    expect_names(be_->ReadScalars(scalars, out), "scalars[2]");
  }
  {
    const Tensor* const scalars[] = {nullptr, &a, &a};
    expect_names(be_->ReadScalars(scalars, out), "scalars[0]");
  }
  {
    // Tensor() has shape () and so one element, but no memory behind it.
    const Tensor* const scalars[] = {&a, &unallocated, &a};
    expect_names(be_->ReadScalars(scalars, out), "scalars[1]");
  }
  // Checked before anything is read: out still holds what the caller put there.
  EXPECT_EQ(out[0], 7.0f);
  EXPECT_EQ(out[1], 7.0f);
  EXPECT_EQ(out[2], 7.0f);
}

// ---- elementwise add ------------------------------------------------------------

TEST_F(CpuOpsTest, AddMatchesReferenceForEveryDTypePair) {
  for (const DType y_dt : kFloatTypes) {
    for (const DType x_dt : kFloatTypes) {
      std::vector<double> x = RandomValues(rng_, x_dt, 6 * 11, -3.0, 3.0);
      std::vector<double> y = RandomValues(rng_, y_dt, 6 * 11, -3.0, 3.0);
      // Edges: exact cancellation to +0, a sum that overflows fp16, a tie
      // in fp16 and bf16 (2049 rounds to even, 2048), fp16 subnormals, and a
      // value that vanishes in the fp32 add itself.
      x[0] = 1.5, y[0] = -1.5;
      x[1] = RefStore(x_dt, 40000.0), y[1] = RefStore(y_dt, 30000.0);
      x[2] = 1.0, y[2] = 2048.0;
      x[3] = std::ldexp(1.0, -24), y[3] = std::ldexp(3.0, -24);
      x[4] = std::ldexp(1.0, -20), y[4] = 1024.0;
      Tensor xt = MakeTensor(*be_, x_dt, {6, 11}, x);
      Tensor yt = MakeTensor(*be_, y_dt, {6, 11}, y);
      ASSERT_TRUE(be_->Add(xt, yt).ok());
      const std::vector<double> got = ReadTensor(*be_, yt);
      for (size_t i = 0; i < got.size(); ++i) {
        // The double sum of two floats is exact; RefF32 is the fp32 add's
        // one rounding and RefStore the store's.
        ASSERT_EQ(got[i], RefStore(y_dt, RefF32(x[i] + y[i])))
            << "x " << DTypeName(x_dt) << " y " << DTypeName(y_dt) << " [" << i << "] " << x[i]
            << " + " << y[i];
      }
      EXPECT_FALSE(std::signbit(got[0]));
      if (y_dt == DType::kF16) {
        EXPECT_EQ(got[1], INFINITY);
      }
      EXPECT_EQ(got[2], y_dt == DType::kF32 ? 2049.0 : 2048.0);
      EXPECT_EQ(got[4], 1024.0);
      // x is read unchanged.
      EXPECT_EQ(ReadTensor(*be_, xt), x);
    }
  }
}

TEST_F(CpuOpsTest, AddAliasedDoubles) {
  for (const DType dt : kFloatTypes) {
    const std::vector<double> v = RandomValues(rng_, dt, 17, -3.0, 3.0);
    Tensor t = MakeTensor(*be_, dt, {17}, v);
    ASSERT_TRUE(be_->Add(t, t).ok());
    const std::vector<double> got = ReadTensor(*be_, t);
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got[i], 2.0 * v[i]) << DTypeName(dt);
  }
}

TEST_F(CpuOpsTest, AddRejectsShapeAndDTypeMismatches) {
  // Same element count, different shape: still refused (a residual add of
  // a transposed tensor is a bug, not a broadcast).
  Tensor x = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  Tensor y = MakeTensor(*be_, DType::kF16, {3, 2}, std::vector<double>(6, 2.0));
  const absl::Status s = be_->Add(x, y);
  ExpectInvalid(s);
  EXPECT_NE(std::string(s.message()).find("Add: x"), std::string::npos) << s;
  EXPECT_EQ(ReadTensor(*be_, y), std::vector<double>(6, 2.0));
  Tensor short_y = MakeTensor(*be_, DType::kF32, {5}, std::vector<double>(5, 2.0));
  ExpectInvalid(be_->Add(x, short_y));
  Tensor ints = MakeTensor(*be_, DType::kI32, {2, 3}, std::vector<double>(6, 1.0));
  ExpectInvalid(be_->Add(ints, x));
  ExpectInvalid(be_->Add(x, ints));
  Tensor unallocated;
  ExpectInvalid(be_->Add(unallocated, x));
}

// ---- bias ---------------------------------------------------------------------

TEST_F(CpuOpsTest, AddBiasMatchesReference) {
  for (const DType dt : kFloatTypes) {
    for (const DType bias_dt : {dt, DType::kF32}) {
      const std::vector<double> y = RandomValues(rng_, dt, 5 * 7, -3.0, 3.0);
      const std::vector<double> b = RandomValues(rng_, bias_dt, 7, -3.0, 3.0);
      Tensor yt = MakeTensor(*be_, dt, {5, 7}, y);
      Tensor bt = MakeTensor(*be_, bias_dt, {7}, b);
      ASSERT_TRUE(be_->AddBias(bt, yt).ok());
      const std::vector<double> got = ReadTensor(*be_, yt);
      for (size_t i = 0; i < got.size(); ++i) {
        // One fp32 add (exact in double, then rounded to float), one store.
        ASSERT_EQ(got[i], RefStore(dt, RefF32(y[i] + b[i % 7]))) << DTypeName(dt) << " " << i;
      }
    }
  }
  Tensor y = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  Tensor b4 = MakeTensor(*be_, DType::kF32, {4}, std::vector<double>(4, 1.0));
  ExpectInvalid(be_->AddBias(b4, y));
  Tensor b2d = MakeTensor(*be_, DType::kF32, {1, 3}, std::vector<double>(3, 1.0));
  ExpectInvalid(be_->AddBias(b2d, y));
}

TEST_F(CpuOpsTest, BiasGradMatchesReference) {
  const int64_t n = 300;
  const int64_t c = 9;
  for (const DType dt : kFloatTypes) {
    const std::vector<double> dy = RandomValues(rng_, dt, static_cast<size_t>(n * c), -2.0, 2.0);
    const std::vector<double> old = RandomValues(rng_, dt, static_cast<size_t>(c), -2.0, 2.0);
    Tensor dyt = MakeTensor(*be_, dt, {n, c}, dy);
    Tensor db = MakeTensor(*be_, dt, {c}, old);
    ASSERT_TRUE(be_->BiasGrad(dyt, 0.5f, db).ok());
    const std::vector<double> got = ReadTensor(*be_, db);
    for (int64_t j = 0; j < c; ++j) {
      double sum = 0.5 * old[static_cast<size_t>(j)];
      double mag = std::fabs(sum);
      for (int64_t i = 0; i < n; ++i) {
        sum += dy[static_cast<size_t>(i * c + j)];
        mag += std::fabs(dy[static_cast<size_t>(i * c + j)]);
      }
      ASSERT_NEAR(got[static_cast<size_t>(j)], sum,
                  Tol(dt, sum, static_cast<double>(n + 2) * kEps32 * mag))
          << DTypeName(dt);
    }
    // beta == 0 overwrites without reading: NaN in dbias does not survive.
    Tensor fresh = MakeTensor(*be_, dt, {c}, std::vector<double>(static_cast<size_t>(c), NAN));
    ASSERT_TRUE(be_->BiasGrad(dyt, 0.0f, fresh).ok());
    for (double v : ReadTensor(*be_, fresh)) EXPECT_TRUE(std::isfinite(v));
  }
  Tensor dy = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  Tensor db = MakeTensor(*be_, DType::kF32, {2}, std::vector<double>(2, 1.0));
  ExpectInvalid(be_->BiasGrad(dy, 0.0f, db));
}

// ---- activations --------------------------------------------------------------

double RefAct(Activation act, double x) {
  switch (act) {
    case Activation::kReLU:
      return x > 0 ? x : 0.0;
    case Activation::kGELU:
      return x * 0.5 * std::erfc(-x / std::sqrt(2.0));
    case Activation::kTanh:
      return std::tanh(x);
    case Activation::kGELUTanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
  }
  return NAN;
}
double RefActGrad(Activation act, double x) {
  switch (act) {
    case Activation::kReLU:
      return x > 0 ? 1.0 : 0.0;
    case Activation::kGELU:
      return 0.5 * std::erfc(-x / std::sqrt(2.0)) +
             x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    case Activation::kTanh:
      return 1.0 - std::tanh(x) * std::tanh(x);
    case Activation::kGELUTanh: {
      const double k = std::sqrt(2.0 / M_PI);
      const double t = std::tanh(k * (x + 0.044715 * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
    }
  }
  return NAN;
}

TEST_F(CpuOpsTest, ActivationsMatchReference) {
  for (const DType dt : kFloatTypes) {
    for (const Activation act :
         {Activation::kReLU, Activation::kGELU, Activation::kTanh, Activation::kGELUTanh}) {
      std::vector<double> x = RandomValues(rng_, dt, 257, -5.0, 5.0);
      x[0] = 0.0;  // ReLU's derivative at exactly 0 is 0
      const std::vector<double> dy = RandomValues(rng_, dt, 257, -3.0, 3.0);
      Tensor xt = MakeTensor(*be_, dt, {257}, x);
      Tensor dyt = MakeTensor(*be_, dt, {257}, dy);
      Tensor y = MakeTensor(*be_, dt, {257}, std::vector<double>(257, 7.0));
      Tensor dx = MakeTensor(*be_, dt, {257}, std::vector<double>(257, 7.0));
      ASSERT_TRUE(be_->ActivationForward(act, xt, y).ok());
      ASSERT_TRUE(be_->ActivationBackward(act, xt, dyt, dx).ok());
      const std::vector<double> got_y = ReadTensor(*be_, y);
      const std::vector<double> got_dx = ReadTensor(*be_, dx);
      for (size_t i = 0; i < x.size(); ++i) {
        // fp32 erf/exp/tanh: a few ulps, relative to 1 + |x| (GELU's
        // 1 + erf cancels for negative x, so the bound is absolute).
        const double fn_err = 8 * kEps32 * (1.0 + std::fabs(x[i]));
        const double want_y = RefAct(act, x[i]);
        const double want_dx = dy[i] * RefActGrad(act, x[i]);
        ASSERT_NEAR(got_y[i], want_y, Tol(dt, want_y, fn_err))
            << DTypeName(dt) << " act " << static_cast<int>(act) << " x=" << x[i];
        ASSERT_NEAR(got_dx[i], want_dx, Tol(dt, want_dx, fn_err * std::fabs(dy[i])))
            << DTypeName(dt) << " act " << static_cast<int>(act) << " x=" << x[i];
      }
      if (act == Activation::kReLU) {
        EXPECT_EQ(got_dx[0], 0.0);
      }
    }
  }
}

// GELU relative to its own value, including the small negative tail where
// 0.5 (1 + erf(x / sqrt 2)) cancels (1% wrong at x = -4.5). The reference
// takes erfc's argument and exp's argument as the fp32 code rounds them
// (those roundings are the formula's conditioning, the same on every
// backend) and evaluates the rest in float64; what is left is the fp32
// erfc/exp/multiply/add roundings, a few ulps of the value for the forward
// and of the two terms |Phi| + |x phi| for the derivative, whose sum
// cancels near its zero at x = -0.75.
TEST_F(CpuOpsTest, GeluIsAccurateRelativeToItsValue) {
  constexpr int kPoints = 24001;
  constexpr float kInvSqrt2 = 0.70710678118654752440f;
  std::vector<double> x(kPoints);
  for (int i = 0; i < kPoints; ++i) x[i] = static_cast<float>(-12.0 + 24.0 * i / (kPoints - 1));
  Tensor xt = MakeTensor(*be_, DType::kF32, {kPoints}, x);
  Tensor ones = MakeTensor(*be_, DType::kF32, {kPoints}, std::vector<double>(kPoints, 1.0));
  Tensor y = MakeTensor(*be_, DType::kF32, {kPoints}, std::vector<double>(kPoints, 7.0));
  Tensor dx = MakeTensor(*be_, DType::kF32, {kPoints}, std::vector<double>(kPoints, 7.0));
  ASSERT_TRUE(be_->ActivationForward(Activation::kGELU, xt, y).ok());
  ASSERT_TRUE(be_->ActivationBackward(Activation::kGELU, xt, ones, dx).ok());
  const std::vector<double> got_y = ReadTensor(*be_, y);
  const std::vector<double> got_dx = ReadTensor(*be_, dx);
  for (int i = 0; i < kPoints; ++i) {
    const auto xf = static_cast<float>(x[i]);
    const double phi = 0.5 * std::erfc(static_cast<double>(-xf * kInvSqrt2));
    const double pdf = std::exp(static_cast<double>(-0.5f * xf * xf)) / std::sqrt(2.0 * M_PI);
    const double want_y = x[i] * phi;
    const double want_dx = phi + x[i] * pdf;
    ASSERT_NEAR(got_y[i], want_y, 4 * kEps32 * std::fabs(want_y) + 1e-44) << "x=" << x[i];
    ASSERT_NEAR(got_dx[i], want_dx, 4 * kEps32 * (std::fabs(phi) + std::fabs(x[i] * pdf)) + 1e-44)
        << "x=" << x[i];
  }
}

TEST_F(CpuOpsTest, ReluEdgeCases) {
  Tensor x = MakeTensor(*be_, DType::kF16, {4}, {NAN, -0.0, 0.0, -65504.0});
  Tensor dy = MakeTensor(*be_, DType::kF16, {4}, {1.0, INFINITY, 2.0, NAN});
  Tensor y = MakeTensor(*be_, DType::kF16, {4}, {1.0, 1.0, 1.0, 1.0});
  Tensor dx = MakeTensor(*be_, DType::kF16, {4}, {1.0, 1.0, 1.0, 1.0});
  ASSERT_TRUE(be_->ActivationForward(Activation::kReLU, x, y).ok());
  ASSERT_TRUE(be_->ActivationBackward(Activation::kReLU, x, dy, dx).ok());
  const std::vector<double> got_y = ReadTensor(*be_, y);
  EXPECT_TRUE(std::isnan(got_y[0]));  // NaN propagates forward, as torch.relu
  EXPECT_EQ(got_y[1], 0.0);
  EXPECT_EQ(got_y[3], 0.0);
  // Derivative at x <= 0 selects 0 even for an inf/NaN upstream gradient.
  EXPECT_EQ(ReadTensor(*be_, dx), (std::vector<double>{0.0, 0.0, 0.0, 0.0}));
}

TEST_F(CpuOpsTest, ActivationShapeAndDTypeErrors) {
  Tensor x = MakeTensor(*be_, DType::kF16, {2, 3}, std::vector<double>(6, 0.5));
  Tensor y_shape = MakeTensor(*be_, DType::kF16, {3, 2}, std::vector<double>(6, 0.5));
  Tensor y_dtype = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 0.5));
  ExpectInvalid(be_->ActivationForward(Activation::kGELU, x, y_shape));
  ExpectInvalid(be_->ActivationForward(Activation::kGELU, x, y_dtype));
  ExpectInvalid(be_->ActivationBackward(Activation::kTanh, x, y_dtype, x));
  Tensor ints = MakeTensor(*be_, DType::kI32, {2, 3}, std::vector<double>(6, 1.0));
  ExpectInvalid(be_->ActivationForward(Activation::kReLU, ints, ints));
}

// ---- layernorm ----------------------------------------------------------------

TEST_F(CpuOpsTest, LayerNormForwardBackwardMatchReference) {
  const int64_t n = 6;
  const int64_t c = 37;
  const float eps = 1e-5f;
  for (const DType dt : kFloatTypes) {
    for (const bool affine : {true, false}) {
      // An offset mean makes the two-pass statistics matter.
      const std::vector<double> x = RandomValues(rng_, dt, static_cast<size_t>(n * c), 2.0, 8.0);
      const std::vector<double> gamma = RandomValues(rng_, dt, static_cast<size_t>(c), 0.5, 1.5);
      const std::vector<double> beta = RandomValues(rng_, dt, static_cast<size_t>(c), -1.0, 1.0);
      const std::vector<double> dy = RandomValues(rng_, dt, static_cast<size_t>(n * c), -1.0, 1.0);
      const std::vector<double> dg0 = RandomValues(rng_, dt, static_cast<size_t>(c), -1.0, 1.0);
      const std::vector<double> db0 = RandomValues(rng_, dt, static_cast<size_t>(c), -1.0, 1.0);
      Tensor xt = MakeTensor(*be_, dt, {n, c}, x);
      Tensor gt = MakeTensor(*be_, dt, {c}, gamma);
      Tensor bt = MakeTensor(*be_, dt, {c}, beta);
      Tensor dyt = MakeTensor(*be_, dt, {n, c}, dy);
      Tensor y = MakeTensor(*be_, dt, {n, c}, std::vector<double>(x.size(), 3.0));
      Tensor dx = MakeTensor(*be_, dt, {n, c}, std::vector<double>(x.size(), 3.0));
      Tensor mean = MakeTensor(*be_, DType::kF32, {n}, std::vector<double>(n, 3.0));
      Tensor rstd = MakeTensor(*be_, DType::kF32, {n}, std::vector<double>(n, 3.0));
      Tensor dg = MakeTensor(*be_, dt, {c}, dg0);
      Tensor db = MakeTensor(*be_, dt, {c}, db0);
      ASSERT_TRUE(be_->LayerNormForward(xt, affine ? &gt : nullptr, affine ? &bt : nullptr, eps, y,
                                        mean, rstd)
                      .ok());
      ASSERT_TRUE(be_->LayerNormBackward(xt, affine ? &gt : nullptr, mean, rstd, dyt, dx,
                                         affine ? &dg : nullptr, affine ? &db : nullptr)
                      .ok());
      const std::vector<double> got_y = ReadTensor(*be_, y);
      const std::vector<double> got_dx = ReadTensor(*be_, dx);
      const std::vector<double> got_mean = ReadTensor(*be_, mean);
      const std::vector<double> got_rstd = ReadTensor(*be_, rstd);
      std::vector<double> want_dg(dg0), want_db(db0), mag_dg(c, 0.0);
      for (int64_t i = 0; i < n; ++i) {
        double mu = 0.0;
        for (int64_t j = 0; j < c; ++j) mu += x[static_cast<size_t>(i * c + j)];
        mu /= static_cast<double>(c);
        double var = 0.0;
        for (int64_t j = 0; j < c; ++j) {
          const double d = x[static_cast<size_t>(i * c + j)] - mu;
          var += d * d;
        }
        var /= static_cast<double>(c);
        const double rs = 1.0 / std::sqrt(var + eps);
        ASSERT_NEAR(got_mean[static_cast<size_t>(i)], mu, 1e-6 * std::fabs(mu));
        ASSERT_NEAR(got_rstd[static_cast<size_t>(i)], rs, 1e-5 * rs);
        std::vector<double> xhat(c), dxhat(c);
        double mean_dxhat = 0.0, mean_dxhat_xhat = 0.0;
        for (int64_t j = 0; j < c; ++j) {
          const size_t k = static_cast<size_t>(i * c + j);
          const size_t jj = static_cast<size_t>(j);
          xhat[jj] = (x[k] - mu) * rs;
          const double g = affine ? gamma[jj] : 1.0;
          const double want = xhat[jj] * g + (affine ? beta[jj] : 0.0);
          ASSERT_NEAR(got_y[k], want, Tol(dt, want, 1e-5 * (1.0 + std::fabs(xhat[jj]))))
              << DTypeName(dt) << " affine=" << affine << " (" << i << ", " << j << ")";
          dxhat[jj] = dy[k] * g;
          mean_dxhat += dxhat[jj] / static_cast<double>(c);
          mean_dxhat_xhat += dxhat[jj] * xhat[jj] / static_cast<double>(c);
          want_dg[jj] += dy[k] * xhat[jj];
          want_db[jj] += dy[k];
          mag_dg[jj] += std::fabs(dy[k] * xhat[jj]) + std::fabs(dy[k]);
        }
        for (int64_t j = 0; j < c; ++j) {
          const size_t k = static_cast<size_t>(i * c + j);
          const size_t jj = static_cast<size_t>(j);
          const double want = rs * (dxhat[jj] - mean_dxhat - xhat[jj] * mean_dxhat_xhat);
          ASSERT_NEAR(got_dx[k], want, Tol(dt, want, 2e-5 * rs * (1.0 + std::fabs(xhat[jj]))))
              << DTypeName(dt) << " affine=" << affine << " (" << i << ", " << j << ")";
        }
      }
      const std::vector<double> got_dg = ReadTensor(*be_, dg);
      const std::vector<double> got_db = ReadTensor(*be_, db);
      for (int64_t j = 0; j < c; ++j) {
        const size_t jj = static_cast<size_t>(j);
        if (affine) {
          ASSERT_NEAR(got_dg[jj], want_dg[jj], Tol(dt, want_dg[jj], 1e-5 * (1 + mag_dg[jj])));
          ASSERT_NEAR(got_db[jj], want_db[jj], Tol(dt, want_db[jj], 1e-5 * (1 + mag_dg[jj])));
        } else {  // not passed, so untouched
          ASSERT_EQ(got_dg[jj], dg0[jj]);
          ASSERT_EQ(got_db[jj], db0[jj]);
        }
      }
    }
  }
}

TEST_F(CpuOpsTest, LayerNormErrors) {
  Tensor x = MakeTensor(*be_, DType::kF16, {2, 4}, std::vector<double>(8, 0.5));
  Tensor y = MakeTensor(*be_, DType::kF16, {2, 4}, std::vector<double>(8, 0.5));
  Tensor g5 = MakeTensor(*be_, DType::kF16, {5}, std::vector<double>(5, 1.0));
  Tensor g32 = MakeTensor(*be_, DType::kF32, {4}, std::vector<double>(4, 1.0));
  Tensor mean = MakeTensor(*be_, DType::kF32, {2}, {0.0, 0.0});
  Tensor rstd = MakeTensor(*be_, DType::kF32, {2}, {1.0, 1.0});
  Tensor rstd3 = MakeTensor(*be_, DType::kF32, {3}, {1.0, 1.0, 1.0});
  Tensor mean16 = MakeTensor(*be_, DType::kF16, {2}, {0.0, 0.0});
  ExpectInvalid(be_->LayerNormForward(x, &g5, nullptr, 1e-5f, y, mean, rstd));
  ExpectInvalid(be_->LayerNormForward(x, &g32, nullptr, 1e-5f, y, mean, rstd));
  ExpectInvalid(be_->LayerNormForward(x, nullptr, nullptr, 1e-5f, y, mean, rstd3));
  ExpectInvalid(be_->LayerNormForward(x, nullptr, nullptr, 1e-5f, y, mean16, rstd));
  Tensor dg = MakeTensor(*be_, DType::kF16, {4}, std::vector<double>(4, 0.0));
  // dgamma without gamma.
  ExpectInvalid(be_->LayerNormBackward(x, nullptr, mean, rstd, y, y, &dg, nullptr));
  Tensor dy_shape = MakeTensor(*be_, DType::kF16, {4, 2}, std::vector<double>(8, 0.5));
  ExpectInvalid(be_->LayerNormBackward(x, nullptr, mean, rstd, dy_shape, y, nullptr, nullptr));
}

// ---- embedding ----------------------------------------------------------------

TEST_F(CpuOpsTest, EmbeddingForwardCopiesRows) {
  const int64_t v = 11;
  const int64_t c = 6;
  for (const DType dt : kFloatTypes) {
    for (const DType id_dt : {DType::kI32, DType::kI64}) {
      const std::vector<double> table = RandomValues(rng_, dt, static_cast<size_t>(v * c), -1, 1);
      const std::vector<double> ids = {3, 0, 10, 3, 7};
      Tensor tt = MakeTensor(*be_, dt, {v, c}, table);
      Tensor it = MakeTensor(*be_, id_dt, {5}, ids);
      Tensor out = MakeTensor(*be_, dt, {5, c}, std::vector<double>(5 * c, 9.0));
      ASSERT_TRUE(be_->EmbeddingForward(it, tt, out).ok());
      const std::vector<double> got = ReadTensor(*be_, out);
      for (size_t i = 0; i < ids.size(); ++i) {
        for (int64_t j = 0; j < c; ++j) {
          ASSERT_EQ(got[i * c + static_cast<size_t>(j)],
                    table[static_cast<size_t>(ids[i]) * c + static_cast<size_t>(j)]);
        }
      }
      // Out of range either way is InvalidArgument and writes nothing.
      for (const double bad : {static_cast<double>(v), -1.0}) {
        Tensor bad_ids = MakeTensor(*be_, id_dt, {5}, {1, 2, bad, 4, 5});
        const absl::Status s = be_->EmbeddingForward(bad_ids, tt, out);
        ExpectInvalid(s);
        EXPECT_NE(s.message().find("ids[2]"), std::string::npos) << s;
        EXPECT_EQ(ReadTensor(*be_, out), got);
      }
    }
  }
  Tensor tt = MakeTensor(*be_, DType::kF32, {4, 2}, std::vector<double>(8, 1.0));
  Tensor fids = MakeTensor(*be_, DType::kF32, {2}, {0.0, 1.0});
  Tensor out = MakeTensor(*be_, DType::kF32, {2, 2}, std::vector<double>(4, 1.0));
  ExpectInvalid(be_->EmbeddingForward(fids, tt, out));  // float ids
  Tensor ids = MakeTensor(*be_, DType::kI32, {2}, {0.0, 1.0});
  Tensor out16 = MakeTensor(*be_, DType::kF16, {2, 2}, std::vector<double>(4, 1.0));
  ExpectInvalid(be_->EmbeddingForward(ids, tt, out16));  // dtype differs from table
  Tensor out3 = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  ExpectInvalid(be_->EmbeddingForward(ids, tt, out3));  // columns differ
}

TEST_F(CpuOpsTest, EmbeddingBackwardScattersAndSums) {
  const int64_t v = 9;
  const int64_t c = 5;
  const std::vector<double> ids = {4, 1, 4, 8, 0, 4, 1};
  for (const DType dt : kFloatTypes) {
    const std::vector<double> dout =
        RandomValues(rng_, dt, ids.size() * static_cast<size_t>(c), -1, 1);
    const std::vector<double> table0 = RandomValues(rng_, dt, static_cast<size_t>(v * c), -1, 1);
    Tensor it = MakeTensor(*be_, DType::kI64, {static_cast<int64_t>(ids.size())}, ids);
    Tensor dt_out = MakeTensor(*be_, dt, {static_cast<int64_t>(ids.size()), c}, dout);
    Tensor table = MakeTensor(*be_, dt, {v, c}, table0);
    ASSERT_TRUE(be_->EmbeddingBackward(it, dt_out, table).ok());
    std::vector<double> want(table0);
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int64_t j = 0; j < c; ++j) {
        want[static_cast<size_t>(ids[i]) * c + static_cast<size_t>(j)] +=
            dout[i * c + static_cast<size_t>(j)];
      }
    }
    const std::vector<double> got = ReadTensor(*be_, table);
    for (size_t k = 0; k < want.size(); ++k) {
      ASSERT_NEAR(got[k], want[k], Tol(dt, want[k], 8 * kEps32 * 4)) << DTypeName(dt) << " " << k;
    }
    Tensor bad = MakeTensor(*be_, DType::kI64, {static_cast<int64_t>(ids.size())},
                            {0, 1, 2, 3, 4, 5, static_cast<double>(v)});
    ExpectInvalid(be_->EmbeddingBackward(bad, dt_out, table));
    EXPECT_EQ(ReadTensor(*be_, table), got);
  }
  // A repeated id is summed in fp32 and rounded once: 2048 + 1 + 1 + 1 is
  // 2051 -> 2052 in fp16, where rounding per occurrence would stay at 2048.
  Tensor it = MakeTensor(*be_, DType::kI32, {3}, {2, 2, 2});
  Tensor ones = MakeTensor(*be_, DType::kF16, {3, 1}, {1.0, 1.0, 1.0});
  Tensor table = MakeTensor(*be_, DType::kF16, {3, 1}, {0.5, 0.25, 2048.0});
  ASSERT_TRUE(be_->EmbeddingBackward(it, ones, table).ok());
  EXPECT_EQ(ReadTensor(*be_, table), (std::vector<double>{0.5, 0.25, 2052.0}));
}

// ---- losses -------------------------------------------------------------------

TEST_F(CpuOpsTest, MseLossMatchesReference) {
  const int64_t n = 40;
  const int64_t c = 30;
  const float multiplier = 0.75f;
  const float grad_scale = 1024.0f;
  for (const DType dt : kFloatTypes) {
    const std::vector<double> p = RandomValues(rng_, dt, static_cast<size_t>(n * c), -2, 2);
    const std::vector<double> t =
        RandomValues(rng_, DType::kF32, static_cast<size_t>(n * c), -2, 2);
    Tensor pt = MakeTensor(*be_, dt, {n, c}, p);
    Tensor tt = MakeTensor(*be_, DType::kF32, {n, c}, t);
    Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {5.0});
    Tensor dp = MakeTensor(*be_, dt, {n, c}, std::vector<double>(p.size(), 5.0));
    ASSERT_TRUE(be_->MseLoss(pt, tt, multiplier, grad_scale, loss, dp).ok());
    double sum = 0.0;
    for (size_t i = 0; i < p.size(); ++i) sum += (p[i] - t[i]) * (p[i] - t[i]);
    const double count = static_cast<double>(p.size());
    const double want_loss = multiplier * sum / count;  // not scaled by grad_scale
    EXPECT_NEAR(ReadTensor(*be_, loss)[0], want_loss, 1e-5 * want_loss) << DTypeName(dt);
    const std::vector<double> got = ReadTensor(*be_, dp);
    for (size_t i = 0; i < p.size(); ++i) {
      const double want = grad_scale * multiplier * 2.0 * (p[i] - t[i]) / count;
      ASSERT_NEAR(got[i], want, Tol(dt, want, 4 * kEps32 * std::fabs(want))) << DTypeName(dt);
    }
  }
  Tensor p = MakeTensor(*be_, DType::kF16, {2, 3}, std::vector<double>(6, 1.0));
  Tensor t16 = MakeTensor(*be_, DType::kF16, {2, 3}, std::vector<double>(6, 1.0));
  Tensor t_shape = MakeTensor(*be_, DType::kF32, {3, 2}, std::vector<double>(6, 1.0));
  Tensor t = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  Tensor loss2 = MakeTensor(*be_, DType::kF32, {2}, {0.0, 0.0});
  Tensor dp32 = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 1.0));
  ExpectInvalid(be_->MseLoss(p, t16, 1.0f, 1.0f, loss, p));
  ExpectInvalid(be_->MseLoss(p, t_shape, 1.0f, 1.0f, loss, p));
  ExpectInvalid(be_->MseLoss(p, t, 1.0f, 1.0f, loss2, p));
  ExpectInvalid(be_->MseLoss(p, t, 1.0f, 1.0f, loss, dp32));
}

// A loss scale near float32's top must not turn a zero loss gradient into
// NaN (inf * 0): the scale is applied after the 2m/count (m/N) coefficient.
// Differences that do overflow when scaled still give inf, as they must.
TEST_F(CpuOpsTest, LossGradientAtTheTopOfTheScaleRange) {
  const float top = 0x1.0p127f;
  for (const DType dt : kFloatTypes) {
    SCOPED_TRACE(DTypeName(dt));
    // MSE, one element (count 1: 2 * m / count = 2 > 1), pred == target.
    Tensor p = MakeTensor(*be_, dt, {1, 1}, {0.5});
    Tensor t = MakeTensor(*be_, DType::kF32, {1, 1}, {0.5});
    Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {0.0});
    Tensor dp = MakeTensor(*be_, dt, {1, 1}, {5.0});
    ASSERT_TRUE(be_->MseLoss(p, t, 1.0f, top, loss, dp).ok());
    EXPECT_EQ(ReadTensor(*be_, dp)[0], 0.0);
    EXPECT_EQ(ReadTensor(*be_, loss)[0], 0.0);
    // (2, 2): 2/count = 0.5, so 0.25 * 0.5 * 2^127 = 2^124 is exact; the
    // fp16 store overflows it to inf, which is what the scaler must see.
    Tensor p4 = MakeTensor(*be_, dt, {2, 2}, {0.25, 0.0, 1.0, -1.0});
    Tensor t4 = MakeTensor(*be_, DType::kF32, {2, 2}, {0.0, 0.0, 1.0, -1.0});
    Tensor dp4 = MakeTensor(*be_, dt, {2, 2}, std::vector<double>(4, 5.0));
    ASSERT_TRUE(be_->MseLoss(p4, t4, 1.0f, top, loss, dp4).ok());
    const std::vector<double> got = ReadTensor(*be_, dp4);
    EXPECT_EQ(got[0], RefStore(dt, std::ldexp(1.0, 124)));
    EXPECT_EQ(got[1], 0.0);
    EXPECT_EQ(got[2], 0.0);
    EXPECT_EQ(got[3], 0.0);
    // Cross-entropy, multiplier 4 over 2 rows: m/N = 2, yet a row whose
    // softmax is exactly one-hot (the other logits underflow exp) has a zero
    // gradient, not NaN.
    Tensor z = MakeTensor(*be_, dt, {2, 2}, {0.0, -200.0, -200.0, 0.0});
    Tensor labels = MakeTensor(*be_, DType::kI32, {2}, {0.0, 1.0});
    Tensor dz = MakeTensor(*be_, dt, {2, 2}, std::vector<double>(4, 5.0));
    ASSERT_TRUE(be_->CrossEntropyLoss(z, labels, 4.0f, top, loss, dz).ok());
    for (const double v : ReadTensor(*be_, dz)) EXPECT_EQ(v, 0.0);
  }
}

TEST_F(CpuOpsTest, CrossEntropyMatchesReference) {
  const int64_t n = 7;
  const int64_t v = 13;
  const float multiplier = 1.5f;
  const float grad_scale = 4096.0f;
  for (const DType dt : kFloatTypes) {
    for (const DType label_dt : {DType::kI32, DType::kI64}) {
      std::vector<double> z = RandomValues(rng_, dt, static_cast<size_t>(n * v), -6, 6);
      // A row of huge logits: stable only with the max subtracted.
      for (int64_t j = 0; j < v; ++j) {
        z[static_cast<size_t>(j)] = RefStore(dt, 60000.0 - 8.0 * static_cast<double>(j));
      }
      std::vector<double> labels(static_cast<size_t>(n));
      std::uniform_int_distribution<int> pick(0, static_cast<int>(v) - 1);
      for (double& l : labels) l = pick(rng_);
      Tensor zt = MakeTensor(*be_, dt, {n, v}, z);
      Tensor lt = MakeTensor(*be_, label_dt, {n}, labels);
      Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {5.0});
      Tensor dz = MakeTensor(*be_, dt, {n, v}, std::vector<double>(z.size(), 5.0));
      ASSERT_TRUE(be_->CrossEntropyLoss(zt, lt, multiplier, grad_scale, loss, dz).ok());
      double total = 0.0;
      std::vector<double> want_dz(z.size());
      for (int64_t i = 0; i < n; ++i) {
        double max = -INFINITY;
        for (int64_t j = 0; j < v; ++j) max = std::max(max, z[static_cast<size_t>(i * v + j)]);
        double sum = 0.0;
        for (int64_t j = 0; j < v; ++j) sum += std::exp(z[static_cast<size_t>(i * v + j)] - max);
        const size_t label = static_cast<size_t>(labels[static_cast<size_t>(i)]);
        total += std::log(sum) + max - z[static_cast<size_t>(i * v) + label];
        for (int64_t j = 0; j < v; ++j) {
          const size_t k = static_cast<size_t>(i * v + j);
          const double softmax = std::exp(z[k] - max) / sum;
          want_dz[k] = grad_scale * multiplier *
                       (softmax - (static_cast<size_t>(j) == label ? 1.0 : 0.0)) /
                       static_cast<double>(n);
        }
      }
      const double want_loss = multiplier * total / static_cast<double>(n);
      EXPECT_NEAR(ReadTensor(*be_, loss)[0], want_loss, 1e-5 * std::fabs(want_loss) + 1e-6)
          << DTypeName(dt);
      const std::vector<double> got = ReadTensor(*be_, dz);
      const double coef = grad_scale * multiplier / static_cast<double>(n);
      for (size_t k = 0; k < got.size(); ++k) {
        ASSERT_NEAR(got[k], want_dz[k], Tol(dt, want_dz[k], 1e-5 * coef))
            << DTypeName(dt) << " " << k;
      }
    }
  }
  Tensor z = MakeTensor(*be_, DType::kF32, {2, 3}, {0.5, 1.0, -1.0, 2.0, 0.25, 0.0});
  Tensor loss = MakeTensor(*be_, DType::kF32, {1}, {0.0});
  Tensor dz = MakeTensor(*be_, DType::kF32, {2, 3}, std::vector<double>(6, 0.0));
  Tensor bad = MakeTensor(*be_, DType::kI32, {2}, {0.0, 3.0});
  ExpectInvalid(be_->CrossEntropyLoss(z, bad, 1.0f, 1.0f, loss, dz));
  Tensor neg = MakeTensor(*be_, DType::kI64, {2}, {-1.0, 0.0});
  ExpectInvalid(be_->CrossEntropyLoss(z, neg, 1.0f, 1.0f, loss, dz));
  Tensor short_labels = MakeTensor(*be_, DType::kI32, {1}, {0.0});
  ExpectInvalid(be_->CrossEntropyLoss(z, short_labels, 1.0f, 1.0f, loss, dz));
  Tensor float_labels = MakeTensor(*be_, DType::kF32, {2}, {0.0, 1.0});
  ExpectInvalid(be_->CrossEntropyLoss(z, float_labels, 1.0f, 1.0f, loss, dz));
}

// ---- histogram ----------------------------------------------------------------

// Independent bin rule from the contract, via log2 in double.
int RefBin(double g) {
  const double a = std::fabs(g);
  if (a == 0.0) return 0;
  if (!std::isfinite(a)) return kGradHistogramBins - 1;
  const double l = std::floor(std::log2(a));
  if (l < kGradHistogramMinLog2) return 1;
  if (l >= kGradHistogramMaxLog2) return kGradHistogramBins - 1;
  return 2 + static_cast<int>(l) - kGradHistogramMinLog2;
}

TEST_F(CpuOpsTest, HistogramBinsMatchContract) {
  ASSERT_EQ(kGradHistogramBins, 53);
  // Edges: zeros, below/at 2^-30, the top octave, 2^20, inf, NaN, subnormals.
  const std::vector<double> edges = {0.0,
                                     -0.0,
                                     std::ldexp(1.0, -30),
                                     -std::ldexp(1.0, -30),
                                     std::nextafter(static_cast<float>(std::ldexp(1.0, -30)), 0.0f),
                                     std::ldexp(1.0, -149),
                                     std::ldexp(1.0, 19),
                                     RefF32(std::ldexp(1.0, 20) * (1 - 1e-7)),
                                     std::ldexp(1.0, 20),
                                     RefF32(-1e30),
                                     INFINITY,
                                     -INFINITY,
                                     NAN,
                                     1.0,
                                     0.75};
  const std::vector<int> want_edge_bins = {0, 0, 2, 2, 1, 1, 51, 51, 52, 52, 52, 52, 52, 32, 31};
  Tensor e = MakeTensor(*be_, DType::kF32, {static_cast<int64_t>(edges.size())}, edges);
  // fp16 random values over its whole range, zeros included.
  std::vector<double> h = RandomValues(rng_, DType::kF16, 500, -1.0, 1.0);
  std::uniform_real_distribution<double> exp_dist(-26.0, 16.0);
  for (size_t i = 0; i < h.size(); ++i)
    h[i] = RefStore(DType::kF16, h[i] * std::exp2(exp_dist(rng_)));
  h[0] = 0.0;
  h[1] = INFINITY;
  const std::vector<double> b = RandomValues(rng_, DType::kBF16, 300, -1e7, 1e7);
  Tensor ht = MakeTensor(*be_, DType::kF16, {20, 25}, h);
  Tensor bt = MakeTensor(*be_, DType::kBF16, {300}, b);
  std::vector<double> want(kGradHistogramBins, 5.0);  // accumulates onto 5 each
  Tensor counts = MakeTensor(*be_, DType::kI64, {kGradHistogramBins}, want);
  for (size_t i = 0; i < edges.size(); ++i) {
    ASSERT_EQ(RefBin(edges[i]), want_edge_bins[i]) << edges[i];
    want[static_cast<size_t>(want_edge_bins[i])] += 1;
  }
  for (double x : h) want[static_cast<size_t>(RefBin(x))] += 1;
  for (double x : b) want[static_cast<size_t>(RefBin(x))] += 1;
  const Tensor* list[] = {&e, &ht, &bt};
  ASSERT_TRUE(be_->GradLog2Histogram(list, counts).ok());
  EXPECT_EQ(ReadTensor(*be_, counts), want);

  Tensor wrong_size = MakeTensor(*be_, DType::kI64, {52}, std::vector<double>(52, 0.0));
  ExpectInvalid(be_->GradLog2Histogram(list, wrong_size));
  Tensor wrong_dtype =
      MakeTensor(*be_, DType::kI32, {kGradHistogramBins}, std::vector<double>(53, 0.0));
  ExpectInvalid(be_->GradLog2Histogram(list, wrong_dtype));
  Tensor ints = MakeTensor(*be_, DType::kI32, {2}, {1.0, 2.0});
  const Tensor* bad_list[] = {&e, &ints};
  ExpectInvalid(be_->GradLog2Histogram(bad_list, counts));
}

}  // namespace
}  // namespace ampd::kernels
