// CPU GEMM against a float64 reference: F32, F16 and BF16 inputs, every
// transpose combination, alpha and beta, c in the input dtype or F32. The
// tolerance is in units of the output dtype's epsilon: half an ulp for the
// one final rounding plus the fp32 accumulation error bound.
#include <gtest/gtest.h>

#include <cmath>
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
using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;

struct GemmCase {
  DType in;
  DType out;
  bool trans_a;
  bool trans_b;
};

std::string CaseName(const ::testing::TestParamInfo<GemmCase>& info) {
  const GemmCase& c = info.param;
  return std::string(DTypeName(c.in)) + "_to_" + std::string(DTypeName(c.out)) +
         (c.trans_a ? "_Ta" : "_Na") + (c.trans_b ? "_Tb" : "_Nb");
}

class GemmTest : public ::testing::TestWithParam<GemmCase> {
 protected:
  std::unique_ptr<Backend> be_ = CreateCpuBackend();
};

TEST_P(GemmTest, MatchesFloat64Reference) {
  const GemmCase& p = GetParam();
  std::mt19937_64 rng(1234 + static_cast<int>(p.in) * 10 + static_cast<int>(p.out));
  struct Dims {
    int64_t m, n, k;
    float alpha, beta;
  };
  // Small odd shapes and one big enough for OpenBLAS to block and thread.
  for (const Dims d : {Dims{3, 5, 7, 1.0f, 0.0f}, Dims{17, 9, 33, 0.75f, 0.5f},
                       Dims{64, 96, 200, -1.25f, 1.0f}, Dims{1, 1, 1, 2.0f, -3.0f}}) {
    const Shape a_shape = p.trans_a ? Shape{d.k, d.m} : Shape{d.m, d.k};
    const Shape b_shape = p.trans_b ? Shape{d.n, d.k} : Shape{d.k, d.n};
    const std::vector<double> av =
        RandomValues(rng, p.in, static_cast<size_t>(d.m * d.k), -2.0, 2.0);
    const std::vector<double> bv =
        RandomValues(rng, p.in, static_cast<size_t>(d.k * d.n), -2.0, 2.0);
    const std::vector<double> cv =
        RandomValues(rng, p.out, static_cast<size_t>(d.m * d.n), -4.0, 4.0);
    Tensor a = MakeTensor(*be_, p.in, a_shape, av);
    Tensor b = MakeTensor(*be_, p.in, b_shape, bv);
    Tensor c = MakeTensor(*be_, p.out, {d.m, d.n}, cv);
    ASSERT_TRUE(be_->Gemm(p.trans_a, p.trans_b, d.alpha, a, b, d.beta, c).ok());
    const std::vector<double> got = ReadTensor(*be_, c);
    const double eps_out = Eps(p.out);
    for (int64_t i = 0; i < d.m; ++i) {
      for (int64_t j = 0; j < d.n; ++j) {
        double sum = 0.0;
        double magnitude = 0.0;  // sum of |terms|, which bounds the fp32 accumulation error
        for (int64_t l = 0; l < d.k; ++l) {
          const double x = p.trans_a ? av[static_cast<size_t>(l * d.m + i)]
                                     : av[static_cast<size_t>(i * d.k + l)];
          const double y = p.trans_b ? bv[static_cast<size_t>(j * d.k + l)]
                                     : bv[static_cast<size_t>(l * d.n + j)];
          sum += x * y;
          magnitude += std::fabs(x * y);
        }
        const double c_old = cv[static_cast<size_t>(i * d.n + j)];
        const double want = d.alpha * sum + d.beta * c_old;
        magnitude = std::fabs(d.alpha) * magnitude + std::fabs(d.beta * c_old);
        // Half an ulp of the output dtype for the final rounding (zero extra
        // for F32 beyond accumulation) plus (K + 2) fp32 roundings of the sum.
        const double tol = (p.out == DType::kF32 ? 0.0 : 0.5 * eps_out * std::fabs(want)) +
                           static_cast<double>(d.k + 2) * kEps32 * magnitude;
        ASSERT_NEAR(got[static_cast<size_t>(i * d.n + j)], want, tol)
            << "m=" << d.m << " n=" << d.n << " k=" << d.k << " at (" << i << ", " << j << ")";
      }
    }
  }
}

std::vector<GemmCase> AllCases() {
  std::vector<GemmCase> cases;
  for (const DType in : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const DType out : {in, DType::kF32}) {
      if (in == DType::kF32 && !cases.empty()) continue;  // F32 -> F32 once
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) cases.push_back({in, out, ta, tb});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllDTypesAndTransposes, GemmTest, ::testing::ValuesIn(AllCases()),
                         CaseName);

// The fp16 result is the fp32 sum rounded once: 2048 + 1 + 1 is 2050 in
// fp32, while rounding after each product would leave 2048 (2049 ties to even).
TEST(GemmRounding, SixteenBitOutputIsRoundedOnce) {
  auto be = CreateCpuBackend();
  Tensor a = MakeTensor(*be, DType::kF16, {1, 3}, {2048.0, 1.0, 1.0});
  Tensor b = MakeTensor(*be, DType::kF16, {3, 1}, {1.0, 1.0, 1.0});
  Tensor c = MakeTensor(*be, DType::kF16, {1, 1}, {0.0});
  ASSERT_TRUE(be->Gemm(false, false, 1.0f, a, b, 0.0f, c).ok());
  EXPECT_EQ(ReadTensor(*be, c)[0], 2050.0);
  // beta * c joins the sum before that one rounding: 2048 + 1 (from beta*c) + 1 + ... .
  Tensor a2 = MakeTensor(*be, DType::kF16, {1, 1}, {1.0});
  Tensor b2 = MakeTensor(*be, DType::kF16, {1, 1}, {1.0});
  Tensor c2 = MakeTensor(*be, DType::kF16, {1, 1}, {2048.0});
  ASSERT_TRUE(be->Gemm(false, false, 1.0f, a2, b2, 1.0f, c2).ok());
  EXPECT_EQ(ReadTensor(*be, c2)[0], 2048.0);  // 2049 is a tie, even is 2048
  ASSERT_TRUE(be->Gemm(false, false, 2.0f, a2, b2, 1.0f, c2).ok());
  EXPECT_EQ(ReadTensor(*be, c2)[0], 2050.0);
  // Overflow of the rounded result becomes inf in fp16.
  Tensor big = MakeTensor(*be, DType::kF16, {1, 2}, {60000.0, 60000.0});
  Tensor ones = MakeTensor(*be, DType::kF16, {2, 1}, {1.0, 1.0});
  Tensor out = MakeTensor(*be, DType::kF16, {1, 1}, {0.0});
  ASSERT_TRUE(be->Gemm(false, false, 1.0f, big, ones, 0.0f, out).ok());
  EXPECT_TRUE(std::isinf(ReadTensor(*be, out)[0]));
}

// beta == 0 never reads c (the BLAS convention), so a freshly allocated c
// holding NaN bit patterns is overwritten, not propagated.
TEST(GemmRounding, BetaZeroIgnoresNaNInC) {
  auto be = CreateCpuBackend();
  for (const DType dt : testing::kFloatTypes) {
    Tensor a = MakeTensor(*be, dt, {2, 2}, {1.0, 2.0, 3.0, 4.0});
    Tensor b = MakeTensor(*be, dt, {2, 2}, {0.5, -1.0, 1.5, 2.0});
    Tensor c = MakeTensor(*be, dt, {2, 2}, {NAN, NAN, NAN, NAN});
    ASSERT_TRUE(be->Gemm(false, false, 1.0f, a, b, 0.0f, c).ok());
    EXPECT_EQ(ReadTensor(*be, c), (std::vector<double>{3.5, 3.0, 7.5, 5.0})) << DTypeName(dt);
  }
  // K == 0: the product is empty, c = beta * c.
  Tensor a = MakeTensor(*be, DType::kF32, {2, 0}, {});
  Tensor b = MakeTensor(*be, DType::kF32, {0, 2}, {});
  Tensor c = MakeTensor(*be, DType::kF32, {2, 2}, {1.0, 2.0, 3.0, 4.0});
  ASSERT_TRUE(be->Gemm(false, false, 1.0f, a, b, 0.5f, c).ok());
  EXPECT_EQ(ReadTensor(*be, c), (std::vector<double>{0.5, 1.0, 1.5, 2.0}));
}

TEST(GemmErrors, ShapeAndDTypeMismatchesAreInvalidArgument) {
  auto be = CreateCpuBackend();
  Tensor a = MakeTensor(*be, DType::kF16, {2, 5}, std::vector<double>(10, 1.0));
  Tensor b = MakeTensor(*be, DType::kF16, {3, 4}, std::vector<double>(12, 1.0));
  Tensor c = MakeTensor(*be, DType::kF16, {2, 4}, std::vector<double>(8, 1.0));
  const absl::Status inner = be->Gemm(false, false, 1.0f, a, b, 0.0f, c);
  ExpectInvalid(inner);
  EXPECT_NE(inner.message().find("F16(3, 4)"), std::string::npos) << inner;
  EXPECT_NE(inner.message().find("F16(2, 5)"), std::string::npos) << inner;
  EXPECT_NE(inner.message().find("inner dims differ"), std::string::npos) << inner;

  Tensor b_ok = MakeTensor(*be, DType::kF16, {5, 4}, std::vector<double>(20, 1.0));
  Tensor b_bf16 = MakeTensor(*be, DType::kBF16, {5, 4}, std::vector<double>(20, 1.0));
  ExpectInvalid(be->Gemm(false, false, 1.0f, a, b_bf16, 0.0f, c));  // mixed input dtypes
  Tensor c_bf16 = MakeTensor(*be, DType::kBF16, {2, 4}, std::vector<double>(8, 1.0));
  ExpectInvalid(be->Gemm(false, false, 1.0f, a, b_ok, 0.0f, c_bf16));  // c neither F32 nor F16
  Tensor c_wrong = MakeTensor(*be, DType::kF16, {4, 2}, std::vector<double>(8, 1.0));
  ExpectInvalid(be->Gemm(false, false, 1.0f, a, b_ok, 0.0f, c_wrong));  // c shape
  Tensor rank1 = MakeTensor(*be, DType::kF16, {10}, std::vector<double>(10, 1.0));
  ExpectInvalid(be->Gemm(false, false, 1.0f, rank1, b_ok, 0.0f, c));  // rank
  Tensor ints = MakeTensor(*be, DType::kI32, {2, 5}, std::vector<double>(10, 1.0));
  ExpectInvalid(be->Gemm(false, false, 1.0f, ints, b_ok, 0.0f, c));  // integer input
  ExpectInvalid(be->Gemm(true, false, 1.0f, a, b_ok, 0.0f, c));      // a^T is (5, 2)
  // The valid call next to them succeeds.
  EXPECT_TRUE(be->Gemm(false, false, 1.0f, a, b_ok, 0.0f, c).ok());
  EXPECT_EQ(ReadTensor(*be, c), std::vector<double>(8, 5.0));
}

}  // namespace
}  // namespace ampd::kernels
