// Batch-invariant GEMMs on the CPU backend (Backend::SetBatchInvariant):
// rows computed in calls of M = 1 .. 257 rows, and on pools of 1 to 3
// threads, are bit-identical to the same rows of one M = 257 call, for every
// transpose, F32/F16/BF16 operands, Gemm and the fused GEMM ops; the sums
// stay within the fp32 accumulation bound of a float64 reference; and
// turning the mode off gives OpenBLAS back bit for bit. With the mode off
// the same comparison is printed, not asserted: OpenBLAS is not invariant
// (it takes a GEMV path for M == 1), but a BLAS that happened to be must
// not fail the build. The CUDA backend, where present, must refuse the mode
// with its reason.
//
// The row comparison catches an order that depends on the batch. Tried by
// hand at K = N = 768: with the kernel's 256-long runs of K shortened to 64
// whenever M < 8, RowsAreBitIdentical... failed for M = 1, 2, 3 and 7
// (697, 1394, 2088 and 4846 elements differing); with runs of 128 in the
// last, padded tile only, for every M below 257 (694 elements at M = 1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_parallel.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::Eps;
using testing::kEps32;
using testing::MakeTensor;
using testing::RandomValues;
using testing::RawBytes;
using testing::ReadTensor;

constexpr int64_t kMaxRows = 257;
constexpr int64_t kRowCounts[] = {1, 2, 3, 7, 16, 64, 257};

struct Case {
  DType dtype;
  bool trans_a;
  bool trans_b;
  int64_t k;
  int64_t n;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(DTypeName(c.dtype)) + (c.trans_a ? "_Ta" : "_Na") +
         (c.trans_b ? "_Tb" : "_Nb") + "_K" + std::to_string(c.k) + "_N" + std::to_string(c.n);
}

// op(a)'s first `rows` rows of the (kMaxRows, K) matrix `full`, stored as
// the call takes them: (rows, K), or (K, rows) when trans_a.
std::vector<double> FirstRows(const std::vector<double>& full, int64_t k, int64_t rows,
                              bool trans_a) {
  std::vector<double> out(static_cast<size_t>(rows * k));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t l = 0; l < k; ++l) {
      out[static_cast<size_t>(trans_a ? l * rows + i : i * k + l)] =
          full[static_cast<size_t>(i * k + l)];
    }
  }
  return out;
}

// The operands of one case, drawn once: op(a) (kMaxRows, K) row-major and
// b as stored ((N, K) when trans_b, else (K, N)).
struct Operands {
  std::vector<double> a;
  std::vector<double> b;
  std::vector<double> bias;  // (N)
  std::vector<double> c0;    // (kMaxRows, N): c's contents before a beta != 0 call
};

Operands Draw(const Case& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Operands o;
  o.a = RandomValues(rng, p.dtype, static_cast<size_t>(kMaxRows * p.k), -2.0, 2.0);
  o.b = RandomValues(rng, p.dtype, static_cast<size_t>(p.k * p.n), -2.0, 2.0);
  o.bias = RandomValues(rng, p.dtype, static_cast<size_t>(p.n), -1.0, 1.0);
  o.c0 = RandomValues(rng, p.dtype, static_cast<size_t>(kMaxRows * p.n), -4.0, 4.0);
  return o;
}

// Which GEMM op a row-invariance run exercises.
enum class Op { kGemm, kGemmBeta, kBiasGelu, kActivationBackward };

// The bytes of c (rows, N) computed by `op` over the first `rows` rows.
std::vector<unsigned char> RunRows(Backend& be, const Case& p, const Operands& o, Op op,
                                   int64_t rows) {
  const Shape a_shape = p.trans_a ? Shape{p.k, rows} : Shape{rows, p.k};
  const Shape b_shape = p.trans_b ? Shape{p.n, p.k} : Shape{p.k, p.n};
  Tensor a = MakeTensor(be, p.dtype, a_shape, FirstRows(o.a, p.k, rows, p.trans_a));
  Tensor b = MakeTensor(be, p.dtype, b_shape, o.b);
  const std::vector<double> c0(o.c0.begin(), o.c0.begin() + rows * p.n);
  Tensor c = MakeTensor(be, p.dtype, {rows, p.n}, c0);
  switch (op) {
    case Op::kGemm:
      EXPECT_TRUE(be.Gemm(p.trans_a, p.trans_b, 1.0f, a, b, 0.0f, c).ok());
      break;
    case Op::kGemmBeta:
      EXPECT_TRUE(be.Gemm(p.trans_a, p.trans_b, -0.75f, a, b, 0.5f, c).ok());
      break;
    case Op::kBiasGelu: {
      Tensor bias = MakeTensor(be, p.dtype, {p.n}, o.bias);
      Tensor pre = MakeTensor(be, p.dtype, {rows, p.n}, c0);
      EXPECT_TRUE(be.GemmBiasActivation(p.trans_a, p.trans_b, a, b, &bias,
                                        GemmActivation::kGELUTanh, c, &pre)
                      .ok());
      std::vector<unsigned char> bytes = RawBytes(be, c);
      const std::vector<unsigned char> pre_bytes = RawBytes(be, pre);
      bytes.insert(bytes.end(), pre_bytes.begin(), pre_bytes.end());
      return bytes;
    }
    case Op::kActivationBackward: {
      Tensor pre = MakeTensor(be, p.dtype, {rows, p.n}, c0);
      EXPECT_TRUE(be.GemmActivationBackward(p.trans_a, p.trans_b, 0.5f, a, b,
                                            GemmActivation::kGELUTanh, &pre, c)
                      .ok());
      break;
    }
  }
  return RawBytes(be, c);
}

// Elements of the first `rows` rows that differ between `small` (rows, N)
// and `full` (kMaxRows, N). kBiasGelu's bytes are c then pre; both halves
// are compared.
int64_t DifferingElements(const std::vector<unsigned char>& small,
                          const std::vector<unsigned char>& full, const Case& p, Op op,
                          int64_t rows) {
  const size_t width = SizeOf(p.dtype);
  const size_t row_bytes = static_cast<size_t>(p.n) * width;
  const int halves = op == Op::kBiasGelu ? 2 : 1;
  int64_t differ = 0;
  for (int h = 0; h < halves; ++h) {
    const size_t small_base = h * static_cast<size_t>(rows) * row_bytes;
    const size_t full_base = h * static_cast<size_t>(kMaxRows) * row_bytes;
    for (size_t e = 0; e < static_cast<size_t>(rows * p.n); ++e) {
      if (std::memcmp(&small[small_base + e * width], &full[full_base + e * width], width) != 0) {
        ++differ;
      }
    }
  }
  return differ;
}

class GemmInvariantTest : public ::testing::TestWithParam<Case> {};

TEST_P(GemmInvariantTest, RowsAreBitIdenticalWhateverTheRowCountAndThreads) {
  const Case& p = GetParam();
  const Operands o = Draw(p, 99 + static_cast<uint64_t>(p.k * 31 + p.n));
  std::unique_ptr<Backend> reference = CreateCpuBackend();
  ASSERT_TRUE(reference->SetBatchInvariant(true).ok());
  for (const Op op : {Op::kGemm, Op::kGemmBeta, Op::kBiasGelu, Op::kActivationBackward}) {
    const std::vector<unsigned char> full = RunRows(*reference, p, o, op, kMaxRows);
    // Every op shares gemm_invariant.cc's threading: plain Gemm covers the
    // thread counts, the rest run on the default pool (keeps the test short).
    // (0: the default pool.)
    const std::vector<int> thread_counts =
        op == Op::kGemm ? std::vector<int>{1, 2, 3} : std::vector<int>{0};
    for (const int threads : thread_counts) {
      std::unique_ptr<Backend> be = threads == 0 ? CreateCpuBackend() : CreateCpuBackend(threads);
      ASSERT_TRUE(be->SetBatchInvariant(true).ok());
      for (const int64_t rows : kRowCounts) {
        const std::vector<unsigned char> got = RunRows(*be, p, o, op, rows);
        EXPECT_EQ(DifferingElements(got, full, p, op, rows), 0)
            << "op " << static_cast<int>(op) << ", M = " << rows << ", " << threads
            << " threads: rows differ from the same rows of the M = " << kMaxRows << " call";
      }
    }
  }
}

// Reported, not asserted: what the default (OpenBLAS) order does with the
// same rows, to show what the mode is for.
TEST_P(GemmInvariantTest, ReportsWhetherBlasIsInvariant) {
  const Case& p = GetParam();
  const Operands o = Draw(p, 99 + static_cast<uint64_t>(p.k * 31 + p.n));
  std::unique_ptr<Backend> be = CreateCpuBackend();
  const std::vector<unsigned char> full = RunRows(*be, p, o, Op::kGemm, kMaxRows);
  std::string report;
  for (const int64_t rows : kRowCounts) {
    const std::vector<unsigned char> got = RunRows(*be, p, o, Op::kGemm, rows);
    report += " M=" + std::to_string(rows) + ":" +
              std::to_string(DifferingElements(got, full, p, Op::kGemm, rows));
  }
  std::cout << "OpenBLAS, " << CaseName(::testing::TestParamInfo<Case>(p, 0))
            << ", elements differing from the M = " << kMaxRows << " call:" << report << "\n";
}

// The invariant order's sums against float64: within the fp32 accumulation
// bound of cpu_gemm_test (K + 2 roundings of the sum of |terms|), plus half
// an ulp of a 16-bit output.
TEST_P(GemmInvariantTest, MatchesFloat64Reference) {
  const Case& p = GetParam();
  const Operands o = Draw(p, 7 + static_cast<uint64_t>(p.k * 31 + p.n));
  std::unique_ptr<Backend> be = CreateCpuBackend();
  ASSERT_TRUE(be->SetBatchInvariant(true).ok());
  const int64_t m = 19;
  const float alpha = -0.75f;
  const float beta = 0.5f;
  const Shape a_shape = p.trans_a ? Shape{p.k, m} : Shape{m, p.k};
  const Shape b_shape = p.trans_b ? Shape{p.n, p.k} : Shape{p.k, p.n};
  Tensor a = MakeTensor(*be, p.dtype, a_shape, FirstRows(o.a, p.k, m, p.trans_a));
  Tensor b = MakeTensor(*be, p.dtype, b_shape, o.b);
  const std::vector<double> c0(o.c0.begin(), o.c0.begin() + m * p.n);
  Tensor c = MakeTensor(*be, p.dtype, {m, p.n}, c0);
  ASSERT_TRUE(be->Gemm(p.trans_a, p.trans_b, alpha, a, b, beta, c).ok());
  const std::vector<double> got = ReadTensor(*be, c);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double sum = 0.0;
      double magnitude = 0.0;
      for (int64_t l = 0; l < p.k; ++l) {
        const double x = o.a[static_cast<size_t>(i * p.k + l)];
        const double y = p.trans_b ? o.b[static_cast<size_t>(j * p.k + l)]
                                   : o.b[static_cast<size_t>(l * p.n + j)];
        sum += x * y;
        magnitude += std::fabs(x * y);
      }
      const double c_old = c0[static_cast<size_t>(i * p.n + j)];
      const double want = alpha * sum + beta * c_old;
      magnitude = std::fabs(alpha) * magnitude + std::fabs(beta * c_old);
      const double tol = (p.dtype == DType::kF32 ? 0.0 : 0.5 * Eps(p.dtype) * std::fabs(want)) +
                         static_cast<double>(p.k + 2) * kEps32 * magnitude;
      ASSERT_NEAR(got[static_cast<size_t>(i * p.n + j)], want, tol)
          << "at (" << i << ", " << j << ")";
    }
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        cases.push_back({dtype, ta, tb, 768, 768});
        cases.push_back({dtype, ta, tb, 37, 19});
      }
    }
  }
  // K past one 256-long run and not a multiple of it.
  cases.push_back({DType::kF32, false, true, 1000, 33});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllDTypesAndTransposes, GemmInvariantTest, ::testing::ValuesIn(AllCases()),
                         CaseName);

// Switching the mode off gives OpenBLAS's bits back, and K == 0 and M == 0
// behave as in the default mode.
TEST(GemmInvariantMode, OffRestoresBlasAndEdgeShapesMatch) {
  std::mt19937_64 rng(5);
  std::unique_ptr<Backend> plain = CreateCpuBackend();
  std::unique_ptr<Backend> toggled = CreateCpuBackend();
  const std::vector<double> av = RandomValues(rng, DType::kF32, 5 * 300, -2.0, 2.0);
  const std::vector<double> bv = RandomValues(rng, DType::kF32, 300 * 7, -2.0, 2.0);
  auto product = [&](Backend& be) {
    Tensor a = MakeTensor(be, DType::kF32, {5, 300}, av);
    Tensor b = MakeTensor(be, DType::kF32, {300, 7}, bv);
    Tensor c = MakeTensor(be, DType::kF32, {5, 7}, std::vector<double>(35, 0.0));
    EXPECT_TRUE(be.Gemm(false, false, 1.0f, a, b, 0.0f, c).ok());
    return RawBytes(be, c);
  };
  ASSERT_TRUE(toggled->SetBatchInvariant(true).ok());
  (void)product(*toggled);
  ASSERT_TRUE(toggled->SetBatchInvariant(false).ok());
  EXPECT_EQ(product(*toggled), product(*plain));

  // K == 0: c = beta * c, and beta == 0 ignores a NaN already in c.
  ASSERT_TRUE(toggled->SetBatchInvariant(true).ok());
  Tensor a = MakeTensor(*toggled, DType::kF32, {2, 0}, {});
  Tensor b = MakeTensor(*toggled, DType::kF32, {0, 2}, {});
  Tensor c = MakeTensor(*toggled, DType::kF32, {2, 2}, {1.0, NAN, 3.0, -4.0});
  ASSERT_TRUE(toggled->Gemm(false, false, 1.0f, a, b, 0.0f, c).ok());
  EXPECT_EQ(ReadTensor(*toggled, c), (std::vector<double>{0.0, 0.0, 0.0, 0.0}));
  Tensor c2 = MakeTensor(*toggled, DType::kF32, {2, 2}, {1.0, 2.0, 3.0, -4.0});
  ASSERT_TRUE(toggled->Gemm(false, false, 1.0f, a, b, 2.0f, c2).ok());
  EXPECT_EQ(ReadTensor(*toggled, c2), (std::vector<double>{2.0, 4.0, 6.0, -8.0}));
  // M == 0 writes nothing and succeeds.
  Tensor a0 = MakeTensor(*toggled, DType::kF32, {0, 3}, {});
  Tensor b0 = MakeTensor(*toggled, DType::kF32, {3, 2}, {1, 2, 3, 4, 5, 6});
  Tensor c0 = MakeTensor(*toggled, DType::kF32, {0, 2}, {});
  EXPECT_TRUE(toggled->Gemm(false, false, 1.0f, a0, b0, 0.0f, c0).ok());
}

// The 16-bit output of the invariant order is still the fp32 sum rounded
// once: 2048 + 1 + 1 is 2050 in fp32, while rounding each step would stay
// at 2048 (2049 ties to even).
TEST(GemmInvariantMode, SixteenBitOutputIsRoundedOnce) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  ASSERT_TRUE(be->SetBatchInvariant(true).ok());
  Tensor a = MakeTensor(*be, DType::kF16, {1, 3}, {2048.0, 1.0, 1.0});
  Tensor b = MakeTensor(*be, DType::kF16, {3, 1}, {1.0, 1.0, 1.0});
  Tensor c = MakeTensor(*be, DType::kF16, {1, 1}, {0.0});
  ASSERT_TRUE(be->Gemm(false, false, 1.0f, a, b, 0.0f, c).ok());
  EXPECT_EQ(ReadTensor(*be, c)[0], 2050.0);
}

// The kernel's tile code for each instruction set this CPU has (AVX-512,
// AVX2, SSE2: different tile shapes and vector widths) computes the same
// bits, rows of short calls included, so the oracle's answer does not
// depend on the machine it runs on.
TEST(GemmInvariantIsa, EveryTileCodeComputesTheSameBits) {
  using cpu::InvariantGemmIsa;
  cpu::ThreadPool pool(2);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  struct Dims {
    int64_t m, k, n;
  };
  for (const Dims d : {Dims{257, 768, 768}, Dims{7, 37, 19}, Dims{45, 1000, 33}}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        std::vector<float> a(static_cast<size_t>(d.m * d.k));
        std::vector<float> b(static_cast<size_t>(d.k * d.n));
        for (float& v : a) v = dist(rng);
        for (float& v : b) v = dist(rng);
        const int64_t lda = ta ? d.m : d.k;
        const int64_t ldb = tb ? d.k : d.n;
        std::vector<float> best(static_cast<size_t>(d.m * d.n));
        cpu::GemmInvariantF32(pool, ta, tb, d.m, d.n, d.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                              best.data());
        for (const InvariantGemmIsa isa :
             {InvariantGemmIsa::kAvx512, InvariantGemmIsa::kAvx2, InvariantGemmIsa::kSse2}) {
          if (!cpu::CpuSupports(isa)) {
            std::cout << "tile code " << static_cast<int>(isa) << " not run: the CPU lacks it\n";
            continue;
          }
          std::vector<float> got(best.size());
          cpu::GemmInvariantF32(pool, ta, tb, d.m, d.n, d.k, 1.0f, a.data(), lda, b.data(), ldb,
                                0.0f, got.data(), isa);
          EXPECT_EQ(std::memcmp(got.data(), best.data(), best.size() * sizeof(float)), 0)
              << "isa " << static_cast<int>(isa) << ", M " << d.m << " K " << d.k << " N " << d.n
              << (ta ? " Ta" : " Na") << (tb ? " Tb" : " Nb");
          // The first row alone (trans_a: its column, stride lda) on this
          // tile code: the same bits as within the whole call.
          std::vector<float> row(static_cast<size_t>(d.n));
          cpu::GemmInvariantF32(pool, ta, tb, 1, d.n, d.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                                row.data(), isa);
          EXPECT_EQ(std::memcmp(row.data(), best.data(), row.size() * sizeof(float)), 0)
              << "isa " << static_cast<int>(isa) << ", one row of K " << d.k << " N " << d.n;
        }
      }
    }
  }
}

// Both backends take the mode (CUDA's GEMMs then run
// kernels/cuda/gemm_invariant.cu instead of cuBLAS) and turn it off again.
// The cuda:0 case skips where the build or machine has no GPU; its bits
// are tested in tests/cuda/cuda_gemm_invariant_test.cc.
TEST(GemmInvariantMode, EachBackendTurnsTheModeOnAndOff) {
  for (const std::string device : {"cpu", "cuda:0"}) {
    absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(device);
    if (!be.ok()) {
      std::cout << device << " not run: " << be.status() << "\n";
      continue;
    }
    EXPECT_TRUE((*be)->SetBatchInvariant(true).ok()) << device;
    EXPECT_TRUE((*be)->SetBatchInvariant(false).ok()) << device;
  }
}

}  // namespace
}  // namespace ampd::kernels
