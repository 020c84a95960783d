// The CPU backend's ops for Llama/Qwen-family decoders (RMSNorm, rotary
// position embeddings, SwiGLU's gated product): each backward against
// central differences of its own forward in fp32, the rotation's inverse
// against its transpose and its property of undoing the forward, and the
// refusals naming the bad operand. (Float64 references for every dtype, and
// CUDA against this oracle, are backend_ops_test's cases.)
#include <gtest/gtest.h>

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

using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;

void ExpectInvalidNaming(const absl::Status& s, const std::string& operand) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(operand), std::string::npos)
      << "message does not name " << operand << ": " << s.message();
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

class CpuDecoderOpsTest : public ::testing::Test {
 protected:
  Tensor Filled(DType dt, const Shape& shape, double v) {
    return MakeTensor(*be_, dt, shape,
                      std::vector<double>(static_cast<size_t>(NumElements(shape)), v));
  }
  std::vector<double> F32Values(size_t n, double lo, double hi) {
    return RandomValues(rng_, DType::kF32, n, lo, hi);
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{20261126};  // fixed: failures reproduce
};

// L = sum(dy * RmsNorm(x, w)): dL/dx and dL/dw from the backward against
// central differences, element by element, in fp32.
TEST_F(CpuDecoderOpsTest, RmsNormBackwardIsTheForwardsDerivative) {
  const int64_t rows = 3, cols = 24;
  const float eps = 1e-6f;
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<double> x = F32Values(n, -2, 2);
  const std::vector<double> w = F32Values(static_cast<size_t>(cols), 0.5, 1.5);
  const std::vector<double> dy = F32Values(n, -1, 1);
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    Tensor xt = MakeTensor(*be_, DType::kF32, {rows, cols}, xv);
    Tensor wt = MakeTensor(*be_, DType::kF32, {cols}, wv);
    Tensor y = Filled(DType::kF32, {rows, cols}, 0);
    Tensor r = Filled(DType::kF32, {rows}, 0);
    EXPECT_TRUE(be_->RmsNormForward(xt, wt, eps, y, r).ok());
    return Dot(ReadTensor(*be_, y), dy);
  };
  Tensor xt = MakeTensor(*be_, DType::kF32, {rows, cols}, x);
  Tensor wt = MakeTensor(*be_, DType::kF32, {cols}, w);
  Tensor dyt = MakeTensor(*be_, DType::kF32, {rows, cols}, dy);
  Tensor y = Filled(DType::kF32, {rows, cols}, 0);
  Tensor rstd = Filled(DType::kF32, {rows}, 0);
  ASSERT_TRUE(be_->RmsNormForward(xt, wt, eps, y, rstd).ok());
  Tensor dx = Filled(DType::kF32, {rows, cols}, 7);
  Tensor dw = Filled(DType::kF32, {cols}, 0);
  ASSERT_TRUE(be_->RmsNormBackward(xt, wt, rstd, dyt, dx, &dw).ok());
  const std::vector<double> got_dx = ReadTensor(*be_, dx);
  const std::vector<double> got_dw = ReadTensor(*be_, dw);
  const double h = 1.0 / 256;  // x +- h exact in fp32 for these x
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd = (loss(xp, w) - loss(xm, w)) / (2 * h);
    // Truncation h^2/6 |L'''| plus the forward's fp32 rounding over 2h.
    EXPECT_NEAR(got_dx[i], fd, 3e-4 + 1e-3 * std::fabs(fd)) << "x[" << i << "]";
  }
  for (size_t c = 0; c < static_cast<size_t>(cols); ++c) {
    std::vector<double> wp = w, wm = w;
    wp[c] += h;
    wm[c] -= h;
    const double fd = (loss(x, wp) - loss(x, wm)) / (2 * h);
    EXPECT_NEAR(got_dw[c], fd, 3e-4 + 1e-3 * std::fabs(fd)) << "w[" << c << "]";
  }
}

// A frozen weight (dweight null) changes nothing about dx: the same bits
// as with a dweight, in every float dtype, every element written.
TEST_F(CpuDecoderOpsTest, RmsNormBackwardWithoutDweightGivesTheSameDx) {
  const int64_t rows = 9, cols = 40;
  const size_t n = static_cast<size_t>(rows * cols);
  for (DType dt : testing::kFloatTypes) {
    SCOPED_TRACE(DTypeName(dt));
    Tensor x = MakeTensor(*be_, dt, {rows, cols}, RandomValues(rng_, dt, n, -2, 2));
    Tensor w =
        MakeTensor(*be_, dt, {cols}, RandomValues(rng_, dt, static_cast<size_t>(cols), 0.5, 1.5));
    Tensor dy = MakeTensor(*be_, dt, {rows, cols}, RandomValues(rng_, dt, n, -1, 1));
    Tensor y = Filled(dt, {rows, cols}, 0);
    Tensor rstd = Filled(DType::kF32, {rows}, 0);
    ASSERT_TRUE(be_->RmsNormForward(x, w, 1e-6f, y, rstd).ok());
    Tensor dx_trained = Filled(dt, {rows, cols}, 7);
    Tensor dw = Filled(dt, {cols}, 0);
    ASSERT_TRUE(be_->RmsNormBackward(x, w, rstd, dy, dx_trained, &dw).ok());
    Tensor dx_frozen = Filled(dt, {rows, cols}, 7);
    ASSERT_TRUE(be_->RmsNormBackward(x, w, rstd, dy, dx_frozen, nullptr).ok());
    EXPECT_TRUE(testing::RawBytes(*be_, dx_frozen) == testing::RawBytes(*be_, dx_trained));
    size_t sevens = 0;
    for (double v : ReadTensor(*be_, dx_frozen)) sevens += v == 7.0;
    EXPECT_EQ(sevens, 0u) << "dx elements left unwritten";
    // dweight was formed in the first call (not all zero), so the equality
    // above compares a run that summed it with one that did not.
    size_t zeros = 0;
    for (double v : ReadTensor(*be_, dw)) zeros += v == 0.0;
    EXPECT_LT(zeros, static_cast<size_t>(cols));
  }
}

// A row of all zeros normalises to zeros (rstd = 1 / sqrt(eps)), not NaN.
TEST_F(CpuDecoderOpsTest, RmsNormOfZerosIsZero) {
  Tensor x = Filled(DType::kF16, {2, 8}, 0);
  Tensor w = Filled(DType::kF16, {8}, 1);
  Tensor y = Filled(DType::kF16, {2, 8}, 7);
  Tensor r = Filled(DType::kF32, {2}, 0);
  ASSERT_TRUE(be_->RmsNormForward(x, w, 1e-6f, y, r).ok());
  for (double v : ReadTensor(*be_, y)) EXPECT_EQ(v, 0.0);
  for (double v : ReadTensor(*be_, r)) EXPECT_NEAR(v, 1000.0, 1e-2);
}

// The rotation is orthogonal: the inverse undoes the forward (to fp32
// rounding), and it is the transpose: <dy, R x> = <R^T dy, x>.
TEST_F(CpuDecoderOpsTest, RopeInverseIsTheTransposeAndUndoesTheForward) {
  const int64_t batch = 2, seq = 9, head_dim = 8, heads = 3, width = 4 * head_dim;
  const size_t n = static_cast<size_t>(batch * seq * width);
  std::vector<double> freq;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    freq.push_back(static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / head_dim)));
  }
  Tensor f = MakeTensor(*be_, DType::kF32, {head_dim / 2}, freq);
  const std::vector<double> x = F32Values(n, -2, 2);
  const std::vector<double> dy = F32Values(n, -1, 1);
  Tensor xt = MakeTensor(*be_, DType::kF32, {batch, seq, width}, x);
  ASSERT_TRUE(be_->Rope(xt, heads, head_dim, f, nullptr, false).ok());
  const std::vector<double> rx = ReadTensor(*be_, xt);
  ASSERT_TRUE(be_->Rope(xt, heads, head_dim, f, nullptr, true).ok());
  const std::vector<double> back = ReadTensor(*be_, xt);
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(back[i], x[i], 1e-6) << i;
  Tensor dyt = MakeTensor(*be_, DType::kF32, {batch, seq, width}, dy);
  ASSERT_TRUE(be_->Rope(dyt, heads, head_dim, f, nullptr, true).ok());
  const std::vector<double> rtdy = ReadTensor(*be_, dyt);
  EXPECT_NEAR(Dot(dy, rx), Dot(rtdy, x), 1e-4);
  // Columns past the rotated heads (the v head) are untouched, and at
  // position 0 nothing turns.
  for (int64_t r = 0; r < batch * seq; ++r) {
    for (int64_t c = heads * head_dim; c < width; ++c) {
      const size_t i = static_cast<size_t>(r * width + c);
      EXPECT_EQ(rx[i], x[i]) << "row " << r << " col " << c;
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t c = 0; c < heads * head_dim; ++c) {
      const size_t i = static_cast<size_t>(b * seq * width + c);
      EXPECT_EQ(rx[i], x[i]) << "batch " << b << " col " << c;
    }
  }
}

// Explicit positions equal to t give the implicit ones' bits; an offset
// shifts every row (what a KV-cached decode asks for).
TEST_F(CpuDecoderOpsTest, RopePositionsMatchTheImplicitOnes) {
  const int64_t batch = 2, seq = 5, head_dim = 4, width = 8;
  Tensor f = MakeTensor(*be_, DType::kF32, {2}, {1.0, 0.015625});
  const std::vector<double> x = RandomValues(rng_, DType::kBF16, 80, -2, 2);
  std::vector<double> pos, shifted;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      pos.push_back(static_cast<double>(t));
      shifted.push_back(static_cast<double>(t + 3));
    }
  }
  Tensor a = MakeTensor(*be_, DType::kBF16, {batch, seq, width}, x);
  Tensor b = MakeTensor(*be_, DType::kBF16, {batch, seq, width}, x);
  Tensor p = MakeTensor(*be_, DType::kI32, {batch, seq}, pos);
  ASSERT_TRUE(be_->Rope(a, 2, head_dim, f, nullptr, false).ok());
  ASSERT_TRUE(be_->Rope(b, 2, head_dim, f, &p, false).ok());
  EXPECT_EQ(ReadTensor(*be_, a), ReadTensor(*be_, b));
  // Rows 3.. of the implicit call at T = 8 are rows 0.. of the shifted one.
  const std::vector<double> x8 = RandomValues(rng_, DType::kBF16, 8 * width, -2, 2);
  Tensor full = MakeTensor(*be_, DType::kBF16, {1, 8, width}, x8);
  ASSERT_TRUE(be_->Rope(full, 2, head_dim, f, nullptr, false).ok());
  std::vector<double> tail(x8.begin() + 3 * width, x8.end());
  Tensor part = MakeTensor(*be_, DType::kBF16, {1, 5, width}, tail);
  Tensor ps = MakeTensor(*be_, DType::kI64, {1, 5}, {3, 4, 5, 6, 7});
  ASSERT_TRUE(be_->Rope(part, 2, head_dim, f, &ps, false).ok());
  const std::vector<double> got_full = ReadTensor(*be_, full);
  EXPECT_EQ(std::vector<double>(got_full.begin() + 3 * width, got_full.end()),
            ReadTensor(*be_, part));
}

TEST_F(CpuDecoderOpsTest, SiluMulBackwardIsTheForwardsDerivative) {
  const int64_t n = 161;
  std::vector<double> g(n), u(n), ones(n, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>(-8.0 + 16.0 * i / (n - 1));
    u[i] = static_cast<float>(1.5 - 3.0 * static_cast<double>((i * 37) % n) / n);
  }
  auto forward = [&](const std::vector<double>& gv, const std::vector<double>& uv) {
    Tensor gt = MakeTensor(*be_, DType::kF32, {n}, gv);
    Tensor ut = MakeTensor(*be_, DType::kF32, {n}, uv);
    Tensor y = Filled(DType::kF32, {n}, 0);
    EXPECT_TRUE(be_->SiluMulForward(gt, ut, y).ok());
    return ReadTensor(*be_, y);
  };
  const double h = 1.0 / 64;
  std::vector<double> gp(g), gm(g), up(u), um(u);
  for (int64_t i = 0; i < n; ++i) {
    gp[i] = static_cast<float>(g[i] + h);
    gm[i] = static_cast<float>(g[i] - h);
    up[i] = static_cast<float>(u[i] + h);
    um[i] = static_cast<float>(u[i] - h);
  }
  const std::vector<double> ygp = forward(gp, u), ygm = forward(gm, u);
  const std::vector<double> yup = forward(g, up), yum = forward(g, um);
  Tensor gt = MakeTensor(*be_, DType::kF32, {n}, g);
  Tensor ut = MakeTensor(*be_, DType::kF32, {n}, u);
  Tensor dyt = MakeTensor(*be_, DType::kF32, {n}, ones);
  Tensor dg = Filled(DType::kF32, {n}, 7);
  Tensor du = Filled(DType::kF32, {n}, 7);
  ASSERT_TRUE(be_->SiluMulBackward(gt, ut, dyt, dg, du).ok());
  const std::vector<double> got_dg = ReadTensor(*be_, dg);
  const std::vector<double> got_du = ReadTensor(*be_, du);
  for (int64_t i = 0; i < n; ++i) {
    const double fd_g = (ygp[i] - ygm[i]) / (gp[i] - gm[i]);
    const double fd_u = (yup[i] - yum[i]) / (up[i] - um[i]);
    // Truncation h^2/6 |f'''| (silu''' below 0.6 times |u| <= 1.5).
    EXPECT_NEAR(got_dg[i], fd_g, 1e-4 + 1e-3 * std::fabs(fd_g)) << "g=" << g[i];
    EXPECT_NEAR(got_du[i], fd_u, 1e-4 + 1e-3 * std::fabs(fd_u)) << "g=" << g[i];
  }
}

TEST_F(CpuDecoderOpsTest, RefusesBadOperandsNamingThem) {
  Tensor x = Filled(DType::kF16, {4, 8}, 1);
  Tensor w = Filled(DType::kF16, {8}, 1);
  Tensor w_bad = Filled(DType::kF16, {7}, 1);
  Tensor w_f32 = Filled(DType::kF32, {8}, 1);
  Tensor y = Filled(DType::kF16, {4, 8}, 0);
  Tensor r = Filled(DType::kF32, {4}, 0);
  Tensor r_bad = Filled(DType::kF32, {3}, 0);
  ExpectInvalidNaming(be_->RmsNormForward(x, w_bad, 1e-6f, y, r), "weight");
  ExpectInvalidNaming(be_->RmsNormForward(x, w_f32, 1e-6f, y, r), "weight");
  ExpectInvalidNaming(be_->RmsNormForward(x, w, 1e-6f, y, r_bad), "rstd");
  Tensor dw_bad = Filled(DType::kF32, {9}, 0);
  ExpectInvalidNaming(be_->RmsNormBackward(x, w, r, x, y, &dw_bad), "dweight");
  // A frozen weight skips only dweight's checks.
  ExpectInvalidNaming(be_->RmsNormBackward(x, w_bad, r, x, y, nullptr), "weight");
  ExpectInvalidNaming(be_->RmsNormBackward(x, w, r_bad, x, y, nullptr), "rstd");

  // The per-head norm: heads of (4) in rows of 8, from column col.
  Tensor hw = Filled(DType::kF16, {4}, 1);
  Tensor hr = Filled(DType::kF32, {4, 2}, 0);
  EXPECT_TRUE(be_->HeadRmsNormForward(x, 0, 2, hw, 1e-6f, x, hr).ok());              // in place
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, 2, 2, hw, 1e-6f, y, hr), "heads");  // 2 + 8 > 8
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, 0, 0, hw, 1e-6f, y, hr), "heads");
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, -1, 1, hw, 1e-6f, y, hr), "column");
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, 0, 2, w_f32, 1e-6f, y, hr), "weight");
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, 0, 2, hw, 1e-6f, y, r),
                      "rstd");  // (4), not (4, 2)
  ExpectInvalidNaming(be_->HeadRmsNormForward(x, 0, 2, hw, 1e-6f, w, hr), "y");
  ExpectInvalidNaming(be_->HeadRmsNormBackward(x, 0, 2, hw, hr, x, y, &dw_bad), "dweight");
  ExpectInvalidNaming(be_->HeadRmsNormBackward(x, 0, 2, hw, hr, w, y, nullptr), "dy");

  Tensor q = Filled(DType::kBF16, {2, 3, 12}, 1);
  Tensor f = Filled(DType::kF32, {2}, 1);
  Tensor f_bad = Filled(DType::kF32, {3}, 1);
  ExpectInvalidNaming(be_->Rope(q, 3, 4, f_bad, nullptr, false), "inv_freq");
  ExpectInvalidNaming(be_->Rope(q, 4, 4, f, nullptr, false), "heads");
  ExpectInvalidNaming(be_->Rope(q, 3, 3, f, nullptr, false), "head_dim");
  Tensor p_bad = Filled(DType::kF32, {2, 3}, 0);
  ExpectInvalidNaming(be_->Rope(q, 3, 4, f, &p_bad, false), "positions");
  Tensor p_shape = MakeTensor(*be_, DType::kI32, {3, 2}, std::vector<double>(6, 0));
  ExpectInvalidNaming(be_->Rope(q, 3, 4, f, &p_shape, false), "positions");

  Tensor g = Filled(DType::kF32, {5}, 1);
  Tensor u = Filled(DType::kF32, {6}, 1);
  Tensor out = Filled(DType::kF32, {5}, 0);
  ExpectInvalidNaming(be_->SiluMulForward(g, u, out), "up");
  Tensor u5 = Filled(DType::kF32, {5}, 1);
  ExpectInvalidNaming(be_->SiluMulBackward(g, u5, u5, g, out), "dgate");
}

}  // namespace
}  // namespace ampd::kernels
