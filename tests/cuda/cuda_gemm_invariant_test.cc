// Batch-invariant GEMMs on the GPU (Backend::SetBatchInvariant,
// kernels/cuda/gemm_invariant.cu): a row's bits must not depend on how
// many rows share the call nor where it sits among them; the values must
// be the GEMM (float64 reference within the dtype's rounding); F32 must be
// the CPU oracle's invariant order bit for bit; the fused Linear ops must
// agree with their cuBLAS/cuBLASLt path; and the mode must toggle cleanly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

// (K, N): K past one 256-long run and no multiple of any tile (16, 32), N
// no multiple of any block width (32, 64, 128), so every tile edge is
// zero-filled and every load takes the scalar path; then multiples of 8,
// as a model's widths are, so the 16-bit operands move in 16-byte vectors
// (still partial tiles: 136 is no multiple of 32).
struct Dims {
  int64_t k;
  int64_t n;
};
constexpr Dims kDims[] = {{300, 130}, {320, 136}};
constexpr int64_t kBigM = 257;
constexpr int64_t kRowCounts[] = {1, 2, 3, 7, 16, 64, 257};

// A logical (rows, cols) row-major matrix stored as itself or, when
// `transposed`, as its (cols, rows) transpose: what op(x) = x^T reads.
std::vector<float> Stored(const std::vector<float>& logical, int64_t rows, int64_t cols,
                          bool transposed) {
  if (!transposed) return logical;
  std::vector<float> out(logical.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = logical[r * cols + c];
  }
  return out;
}
Shape StoredShape(int64_t rows, int64_t cols, bool transposed) {
  return transposed ? Shape{cols, rows} : Shape{rows, cols};
}

struct Case {
  bool trans_a;
  bool trans_b;
  DType c_dtype;
  float alpha;
  float beta;
};

std::string Describe(DType ab, const Case& c) {
  return std::string(DTypeName(ab)) + "->" + std::string(DTypeName(c.c_dtype)) +
         (c.trans_a ? " a^T" : "") + (c.trans_b ? " b^T" : "") +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta);
}

std::vector<Case> Cases(DType ab) {
  std::vector<Case> cases;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) cases.push_back({ta, tb, ab, 1.0f, 0.0f});
  }
  // An fp32 result from 16-bit operands (the fused ops' scratch GEMM), and
  // alpha/beta with accumulation into c (a gradient's later micro-batch).
  if (ab != DType::kF32) cases.push_back({false, true, DType::kF32, 1.0f, 0.0f});
  cases.push_back({true, false, ab, 1.5f, 1.0f});
  cases.push_back({false, false, ab, 0.5f, 0.25f});
  return cases;
}

// c (rows, N) = alpha op(a) op(b) + beta c0 on `be`, op(a) the logical rows
// [row0, row0 + rows) of a_full (kBigM, K); returns c's raw bytes.
std::vector<uint8_t> RunRows(Backend& be, DType ab, const Case& cs, int64_t depth, int64_t cols,
                             const std::vector<float>& a_full, const Tensor& b,
                             const std::vector<float>& c0_full, int64_t row0, int64_t rows) {
  const std::vector<float> a_rows(a_full.begin() + row0 * depth,
                                  a_full.begin() + (row0 + rows) * depth);
  Tensor a =
      Upload(be, ab, StoredShape(rows, depth, cs.trans_a), Stored(a_rows, rows, depth, cs.trans_a));
  const std::vector<float> c_rows(c0_full.begin() + row0 * cols,
                                  c0_full.begin() + (row0 + rows) * cols);
  Tensor c = Upload(be, cs.c_dtype, {rows, cols}, c_rows);
  const absl::Status st = be.Gemm(cs.trans_a, cs.trans_b, cs.alpha, a, b, cs.beta, c);
  EXPECT_TRUE(st.ok()) << st;
  return DownloadBytes(be, c);
}

class GemmInvariantTest : public CudaDTypeTest {};

// (a) Every row count and position gives the big call's bits.
TEST_P(GemmInvariantTest, RowsAreBitIdenticalWhateverTheBatch) {
  const DType ab = GetParam();
  AMPD_EXPECT_OK(gpu_->SetBatchInvariant(true));
  for (const auto& [depth, cols] : kDims) {
    SCOPED_TRACE("K " + std::to_string(depth) + ", N " + std::to_string(cols));
    const std::vector<float> a_full = RandomValues(kBigM * depth, 11, -1, 1, ab);
    const std::vector<float> b_logical = RandomValues(depth * cols, 12, -1, 1, ab);
    for (const Case& cs : Cases(ab)) {
      SCOPED_TRACE(Describe(ab, cs));
      const std::vector<float> c0 = RandomValues(kBigM * cols, 13, -4, 4, cs.c_dtype);
      Tensor b = Upload(*gpu_, ab, StoredShape(depth, cols, cs.trans_b),
                        Stored(b_logical, depth, cols, cs.trans_b));
      const std::vector<uint8_t> big = RunRows(*gpu_, ab, cs, depth, cols, a_full, b, c0, 0, kBigM);
      const size_t row_bytes = static_cast<size_t>(cols) * SizeOf(cs.c_dtype);
      for (int64_t rows : kRowCounts) {
        // The block at the end and one in the middle: a row's position within
        // its tile changes, its bits must not.
        for (int64_t row0 : {kBigM - rows, (kBigM - rows) / 2}) {
          const std::vector<uint8_t> got =
              RunRows(*gpu_, ab, cs, depth, cols, a_full, b, c0, row0, rows);
          ASSERT_EQ(got.size(), static_cast<size_t>(rows) * row_bytes);
          EXPECT_EQ(std::memcmp(got.data(), big.data() + row0 * row_bytes, got.size()), 0)
              << rows << " rows from row " << row0 << " differ from the same rows of M = " << kBigM;
        }
      }
    }
  }
}

// (b) The values against a float64 GEMM of the same (dtype-rounded)
// inputs: within the fp32 accumulation's error (a bound in the sum of
// |terms|) plus the one rounding to c's dtype.
TEST_P(GemmInvariantTest, MatchesAFloat64Reference) {
  const DType ab = GetParam();
  AMPD_EXPECT_OK(gpu_->SetBatchInvariant(true));
  for (const auto& [depth, cols] : kDims) {
    SCOPED_TRACE("K " + std::to_string(depth) + ", N " + std::to_string(cols));
    const std::vector<float> a_full = RandomValues(kBigM * depth, 21, -1, 1, ab);
    const std::vector<float> b_logical = RandomValues(depth * cols, 22, -1, 1, ab);
    for (const Case& cs : Cases(ab)) {
      SCOPED_TRACE(Describe(ab, cs));
      const std::vector<float> c0 = RandomValues(kBigM * cols, 23, -4, 4, cs.c_dtype);
      Tensor a = Upload(*gpu_, ab, StoredShape(kBigM, depth, cs.trans_a),
                        Stored(a_full, kBigM, depth, cs.trans_a));
      Tensor b = Upload(*gpu_, ab, StoredShape(depth, cols, cs.trans_b),
                        Stored(b_logical, depth, cols, cs.trans_b));
      Tensor c = Upload(*gpu_, cs.c_dtype, {kBigM, cols}, c0);
      AMPD_EXPECT_OK(gpu_->Gemm(cs.trans_a, cs.trans_b, cs.alpha, a, b, cs.beta, c));
      const std::vector<float> got = Download(*gpu_, c);
      // Relative rounding of c's dtype, and of an fp32 sum: the sequential
      // runs of 256 and the sum of runs, or the mma steps, each add at most
      // one fp32 rounding of the running |sum| per term.
      const double out_eps = cs.c_dtype == DType::kF16    ? std::ldexp(1.0, -11)
                             : cs.c_dtype == DType::kBF16 ? std::ldexp(1.0, -8)
                                                          : std::ldexp(1.0, -24);
      const double acc_eps = (256.0 + depth / 256.0 + 4.0) * std::ldexp(1.0, -24);
      int bad = 0;
      for (int64_t i = 0; i < kBigM && bad < 5; ++i) {
        for (int64_t j = 0; j < cols && bad < 5; ++j) {
          double sum = 0.0, mag = 0.0;
          for (int64_t l = 0; l < depth; ++l) {
            const double t = static_cast<double>(a_full[i * depth + l]) * b_logical[l * cols + j];
            sum += t;
            mag += std::fabs(t);
          }
          const double c_in = c0[i * cols + j];
          const double want = cs.alpha * sum + cs.beta * c_in;
          const double bound =
              std::fabs(cs.alpha) * acc_eps * mag +
              std::fabs(cs.beta * c_in) * std::ldexp(1.0, -23) + out_eps * std::fabs(want) * 1.01 +
              (cs.c_dtype == DType::kF16 ? std::ldexp(1.0, -25) : 0.0);  // subnormals
          const double err = std::fabs(got[i * cols + j] - want);
          if (!(err <= bound)) {
            ++bad;
            ADD_FAILURE() << "c[" << i << "][" << j << "] = " << got[i * cols + j] << ", float64 "
                          << want << ", |err| " << err << " > " << bound;
          }
        }
      }
    }
  }
}

// F32: the CUDA kernel runs the CPU oracle's invariant order, so the two
// backends agree bit for bit (a CUDA job's fp32 log-probs are the CPU's).
// F32 alone: 16-bit operands take tensor-core sums, not the CPU's order.
class GemmInvariantF32Test : public CudaVsCpuTest {};

TEST_F(GemmInvariantF32Test, F32IsTheCpuOracleBitForBit) {
  const DType ab = DType::kF32;
  AMPD_EXPECT_OK(gpu_->SetBatchInvariant(true));
  AMPD_EXPECT_OK(cpu_->SetBatchInvariant(true));
  for (const auto& [depth, cols] : kDims) {
    SCOPED_TRACE("K " + std::to_string(depth) + ", N " + std::to_string(cols));
    const std::vector<float> a_full = RandomValues(kBigM * depth, 31, -1, 1, ab);
    const std::vector<float> b_logical = RandomValues(depth * cols, 32, -1, 1, ab);
    for (const Case& cs : Cases(ab)) {
      SCOPED_TRACE(Describe(ab, cs));
      const std::vector<float> c0 = RandomValues(kBigM * cols, 33, -4, 4, cs.c_dtype);
      std::vector<std::vector<uint8_t>> out;
      for (Backend* be : {gpu_.get(), cpu_.get()}) {
        Tensor b = Upload(*be, ab, StoredShape(depth, cols, cs.trans_b),
                          Stored(b_logical, depth, cols, cs.trans_b));
        out.push_back(RunRows(*be, ab, cs, depth, cols, a_full, b, c0, 0, kBigM));
      }
      EXPECT_TRUE(out[0] == out[1]) << "cuda and cpu invariant GEMMs differ";
    }
  }
}

// The Linear ops at a transformer's shapes, once invariant and once on
// cuBLAS/cuBLASLt (the same backend, the mode toggled), against each other
// and the oracle; and a GEMM+GELU row computed alone equals its batch row.
TEST_P(GemmInvariantTest, FusedOpsAgreeWithTheirCublasPathAndStayRowInvariant) {
  const DType dt = GetParam();
  const int64_t t = 96, c = 256, h = 1024;
  const std::vector<float> x = RandomValues(t * c, 41, -1, 1, dt);
  const std::vector<float> w_fc = RandomValues(c * h, 42, -0.05f, 0.05f, dt);
  const std::vector<float> b_fc = RandomValues(h, 43, -0.5f, 0.5f, dt);
  const std::vector<float> dout = RandomValues(t * h, 44, -0.1f, 0.1f, dt);
  const std::vector<float> saved_pre = RandomValues(t * h, 45, -4, 4, dt);

  struct Outputs {
    std::vector<std::vector<float>> values;
    std::vector<std::string> names;
  };
  auto run = [&](Backend& be, bool invariant) {
    Outputs o;
    EXPECT_TRUE(be.SetBatchInvariant(invariant).ok());
    Tensor tx = Upload(be, dt, {t, c}, x);
    Tensor tw = Upload(be, dt, {c, h}, w_fc);
    Tensor tb = Upload(be, dt, {h}, b_fc);
    Tensor tdout = Upload(be, dt, {t, h}, dout);
    Tensor tpre_in = Upload(be, dt, {t, h}, saved_pre);
    Tensor pre = *be.Allocate(dt, {t, h});
    Tensor post = *be.Allocate(dt, {t, h});
    EXPECT_TRUE(
        be.GemmBiasActivation(false, false, tx, tw, &tb, GemmActivation::kGELUTanh, post, &pre)
            .ok());
    o.values.push_back(Download(be, pre));
    o.names.push_back("GELU pre");
    o.values.push_back(Download(be, post));
    o.names.push_back("GELU out");
    Tensor y = *be.Allocate(dt, {t, c});  // x W^T-style: b^T, bias
    Tensor tb_c = Upload(be, dt, {c}, std::vector<float>(b_fc.begin(), b_fc.begin() + c));
    EXPECT_TRUE(
        be.GemmBiasActivation(false, true, tdout, tw, &tb_c, GemmActivation::kNone, y, nullptr)
            .ok());
    o.values.push_back(Download(be, y));
    o.names.push_back("bias, b^T");
    Tensor dpre = *be.Allocate(dt, {t, h});
    EXPECT_TRUE(be.GemmActivationBackward(false, false, 1.0f, tx, tw, GemmActivation::kGELUTanh,
                                          &tpre_in, dpre)
                    .ok());
    o.values.push_back(Download(be, dpre));
    o.names.push_back("dGELU");
    Tensor dw = *be.Allocate(dt, {c, h});
    Tensor db = *be.Allocate(dt, {h});
    EXPECT_TRUE(be.GemmBiasGrad(true, false, tx, tdout, 0.0f, dw, BiasGradOf::kB, db).ok());
    EXPECT_TRUE(be.GemmBiasGrad(true, false, tx, tdout, 1.0f, dw, BiasGradOf::kB, db).ok());
    o.values.push_back(Download(be, dw));
    o.names.push_back("dW, 2 micro-batches");
    o.values.push_back(Download(be, db));
    o.names.push_back("db, 2 micro-batches");
    EXPECT_TRUE(be.Synchronize().ok());
    return o;
  };
  const Outputs oracle = run(*cpu_, true);
  const Outputs invariant = run(*gpu_, true);
  const Outputs cublas = run(*gpu_, false);
  // Two ulps of a 16-bit dtype of the output's largest magnitude, and for
  // F32 the orders' own difference; cuBLASLt's 16-bit GELU may add ~1e-3.
  const float frac = dt == DType::kF32 ? 2e-5f : dt == DType::kF16 ? 2e-3f : 1.6e-2f;
  for (size_t i = 0; i < oracle.values.size(); ++i) {
    float max_abs = 0.0f;
    for (float v : oracle.values[i]) max_abs = std::max(max_abs, std::fabs(v));
    const bool gelu = oracle.names[i].find("GELU") != std::string::npos;
    const float extra = gelu && dt != DType::kF32 ? 3e-3f : 0.0f;
    const Tolerance tol{frac, frac * max_abs + extra};
    EXPECT_TRUE(AllClose(cublas.values[i], invariant.values[i], tol))
        << oracle.names[i] << ": invariant vs cuBLAS path";
    EXPECT_TRUE(AllClose(oracle.values[i], invariant.values[i], tol))
        << oracle.names[i] << ": invariant vs the CPU oracle";
  }

  // One row of the GELU Linear alone equals that row of the batch.
  AMPD_EXPECT_OK(gpu_->SetBatchInvariant(true));
  Tensor tw = Upload(*gpu_, dt, {c, h}, w_fc);
  Tensor tb = Upload(*gpu_, dt, {h}, b_fc);
  const int64_t row = 37;
  Tensor x1 =
      Upload(*gpu_, dt, {1, c}, std::vector<float>(x.begin() + row * c, x.begin() + (row + 1) * c));
  Tensor pre1 = *gpu_->Allocate(dt, {1, h});
  Tensor post1 = *gpu_->Allocate(dt, {1, h});
  AMPD_EXPECT_OK(
      gpu_->GemmBiasActivation(false, false, x1, tw, &tb, GemmActivation::kGELUTanh, post1, &pre1));
  const std::vector<float> alone = Download(*gpu_, post1);
  const std::vector<float> batch(invariant.values[1].begin() + row * h,
                                 invariant.values[1].begin() + (row + 1) * h);
  EXPECT_TRUE(AllClose(batch, alone, {0.0f, 0.0f})) << "a GELU Linear row alone differs";
}

// Invariant mode makes no cuBLASLt plan; turning it off restores cuBLASLt.
TEST_P(GemmInvariantTest, TheModeTogglesBetweenTheInvariantKernelAndCublas) {
  const DType dt = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> fresh = cuda::CreateCudaBackend(0, {});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Backend& be = **fresh;
  Tensor x = Upload(be, dt, {64, 128}, RandomValues(64 * 128, 51, -1, 1, dt));
  Tensor w = Upload(be, dt, {128, 256}, RandomValues(128 * 256, 52, -1, 1, dt));
  Tensor bias = Upload(be, dt, {256}, RandomValues(256, 53, -1, 1, dt));
  Tensor y = *be.Allocate(dt, {64, 256});
  AMPD_EXPECT_OK(be.SetBatchInvariant(true));
  AMPD_EXPECT_OK(
      be.GemmBiasActivation(false, false, x, w, &bias, GemmActivation::kNone, y, nullptr));
  AMPD_EXPECT_OK(be.Synchronize());
  EXPECT_TRUE(cuda::GemmEpiloguePlans(be).empty()) << "invariant mode reached cuBLASLt";
  AMPD_EXPECT_OK(be.SetBatchInvariant(false));
  AMPD_EXPECT_OK(
      be.GemmBiasActivation(false, false, x, w, &bias, GemmActivation::kNone, y, nullptr));
  AMPD_EXPECT_OK(be.Synchronize());
  EXPECT_FALSE(cuda::GemmEpiloguePlans(be).empty()) << "off: the BIAS epilogue is cuBLASLt's again";
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, GemmInvariantTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16), DTypeParamName);

}  // namespace
}  // namespace ampd::kernels::cuda_test
