// The CPU backend's ops for GPT-style transformers against float64
// references written here: GELU's tanh approximation, causal
// self-attention forward and backward, and the chunked token cross-entropy
// with ignore_index. Each backward is also checked in fp32 against central
// differences of its own forward, so a gradient that matches a wrong
// reference still fails. Then the refusals: bad labels, shapes and head
// counts are InvalidArgument naming the operand.
//
// The attention references follow the op contract in double (the blockwise
// online softmax, P rounded to the working dtype before P.V, the backward's
// P and dS rounded before their products); the tolerances allow the fp32
// error of scores, exp and sums, and the one-ulp flips it can cause where a
// value is rounded to the dtype, propagated to the outputs. Beside them, the
// property a KV-cached decode relies on: a prefix's rows are the longer
// sequence's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/gpt_reference.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::AttnBackwardRef;
using testing::AttnDims;
using testing::AttnForwardRef;
using testing::Bounded;
using testing::DenormMin;
using testing::Eps;
using testing::ExpectInvalid;
using testing::kEps32;
using testing::kFloatTypes;
using testing::kU32;
using testing::MakeTensor;
using testing::RandomValues;
using testing::ReadTensor;
using testing::RefAttnBackward;
using testing::RefAttnForward;
using testing::RefGeluTanh;
using testing::RefStore;

void ExpectInvalidNaming(const absl::Status& s, const std::string& operand) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(operand), std::string::npos)
      << "message does not name " << operand << ": " << s.message();
}

class CpuGptOpsTest : public ::testing::Test {
 protected:
  Tensor Filled(DType dt, const Shape& shape, double v) {
    return MakeTensor(*be_, dt, shape,
                      std::vector<double>(static_cast<size_t>(NumElements(shape)), v));
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{20261123};  // fixed: failures reproduce
};

// ---- GELU, tanh approximation -----------------------------------------------------

TEST_F(CpuGptOpsTest, GeluTanhMatchesReferenceInEveryDtype) {
  for (const DType dt : kFloatTypes) {
    const std::vector<double> x = RandomValues(rng_, dt, 1001, -7.0, 7.0);
    const std::vector<double> dy = RandomValues(rng_, dt, 1001, -2.0, 2.0);
    Tensor xt = MakeTensor(*be_, dt, {1001}, x);
    Tensor dyt = MakeTensor(*be_, dt, {1001}, dy);
    Tensor y = Filled(dt, {1001}, 7.0);
    Tensor dx = Filled(dt, {1001}, 7.0);
    ASSERT_TRUE(be_->ActivationForward(Activation::kGELUTanh, xt, y).ok());
    ASSERT_TRUE(be_->ActivationBackward(Activation::kGELUTanh, xt, dyt, dx).ok());
    const std::vector<double> got_y = ReadTensor(*be_, y);
    const std::vector<double> got_dx = ReadTensor(*be_, dx);
    const double k = std::sqrt(2.0 / M_PI);
    for (size_t i = 0; i < x.size(); ++i) {
      const double t = std::tanh(k * (x[i] + 0.044715 * x[i] * x[i] * x[i]));
      const double grad =
          0.5 * (1.0 + t) + 0.5 * x[i] * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x[i] * x[i]);
      // fp32: the argument's few roundings move tanh by ~4 u (1 + |x|^3),
      // which 0.5 x (1 + t) scales by |x|; 1 + t and 1 - t^2 cancel to an
      // absolute error of a few u. Then one rounding to the dtype.
      const double ax = std::fabs(x[i]);
      const double fp32 = 16 * kEps32 * (1.0 + ax) * (1.0 + ax * ax * ax * 0.05 + ax);
      ASSERT_NEAR(got_y[i], RefGeluTanh(x[i]),
                  0.5 * Eps(dt) * std::fabs(RefGeluTanh(x[i])) + fp32 + DenormMin(dt))
          << DTypeName(dt) << " x=" << x[i];
      const double want_dx = dy[i] * grad;
      ASSERT_NEAR(got_dx[i], want_dx,
                  0.5 * Eps(dt) * std::fabs(want_dx) + fp32 * std::fabs(dy[i]) + DenormMin(dt))
          << DTypeName(dt) << " x=" << x[i];
    }
  }
}

// The backward against central differences of the forward op itself.
TEST_F(CpuGptOpsTest, GeluTanhBackwardIsTheForwardsDerivative) {
  constexpr int kPoints = 161;
  constexpr float kH = 1.0f / 64;  // exact in fp32, so x +- h is too for these x
  std::vector<double> x(kPoints), xp(kPoints), xm(kPoints);
  for (int i = 0; i < kPoints; ++i) {
    x[i] = -5.0 + 10.0 * i / (kPoints - 1);
    x[i] = static_cast<float>(x[i]);
    xp[i] = static_cast<float>(x[i] + kH);
    xm[i] = static_cast<float>(x[i] - kH);
  }
  auto forward = [&](const std::vector<double>& in) {
    Tensor t = MakeTensor(*be_, DType::kF32, {kPoints}, in);
    Tensor y = Filled(DType::kF32, {kPoints}, 0.0);
    EXPECT_TRUE(be_->ActivationForward(Activation::kGELUTanh, t, y).ok());
    return ReadTensor(*be_, y);
  };
  const std::vector<double> yp = forward(xp);
  const std::vector<double> ym = forward(xm);
  Tensor xt = MakeTensor(*be_, DType::kF32, {kPoints}, x);
  Tensor ones = Filled(DType::kF32, {kPoints}, 1.0);
  Tensor dx = Filled(DType::kF32, {kPoints}, 0.0);
  ASSERT_TRUE(be_->ActivationBackward(Activation::kGELUTanh, xt, ones, dx).ok());
  const std::vector<double> got = ReadTensor(*be_, dx);
  for (int i = 0; i < kPoints; ++i) {
    const double fd = (yp[i] - ym[i]) / (xp[i] - xm[i]);
    // Truncation h^2/6 |f'''| (|f'''| < 2) plus the forward's rounding over 2h.
    EXPECT_NEAR(got[i], fd, 1e-4 + 1e-3 * std::fabs(fd)) << "x=" << x[i];
  }
}

// ---- causal self-attention ------------------------------------------------------

void ExpectApprox(const std::vector<double>& got, const Bounded& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], ref.want[i], ref.bound[i]) << what << " [" << i << "]";
  }
}

// T = 1; T below, at and across the key block (64) with odd tails; D from
// 4 to 128; one and several heads and batch rows.
const AttnDims kAttnDimss[] = {
    {2, 5, 8, 2},     // small, odd T
    {1, 1, 12, 3},    // T = 1: each query sees only itself
    {3, 13, 24, 4},   // non-power-of-two T, D = 6
    {2, 32, 64, 1},   // one head, D = 64
    {2, 130, 32, 2},  // three key blocks, the last of 2 keys; D = 16
    {1, 70, 128, 1},  // D = 128 across a block boundary
};

TEST_F(CpuGptOpsTest, AttentionMatchesReferenceInEveryDtype) {
  for (const DType dt : kFloatTypes) {
    for (const AttnDims& s : kAttnDimss) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " B=" << s.b << " T=" << s.t
                                        << " C=" << s.c << " H=" << s.heads);
      const Shape qkv_shape = {s.b, s.t, 3 * s.c};
      const Shape lse_shape = {s.b, s.heads, s.t};
      const Shape out_shape = {s.b, s.t, s.c};
      const std::vector<double> qkv =
          RandomValues(rng_, dt, static_cast<size_t>(NumElements(qkv_shape)), -1.5, 1.5);
      const std::vector<double> dout =
          RandomValues(rng_, dt, static_cast<size_t>(NumElements(out_shape)), -1.0, 1.0);
      Tensor qkvt = MakeTensor(*be_, dt, qkv_shape, qkv);
      Tensor out = Filled(dt, out_shape, 7.0);  // every element must be written
      Tensor lse = Filled(DType::kF32, lse_shape, 7.0);
      ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, out, lse).ok());
      const std::vector<double> got_out = ReadTensor(*be_, out);
      const std::vector<double> got_lse = ReadTensor(*be_, lse);
      const AttnForwardRef fwd = RefAttnForward(dt, s, qkv);
      ExpectApprox(got_out, fwd.out, "out");
      ExpectApprox(got_lse, fwd.lse, "lse");

      // The backward of the oracle's own forward (its out and lse as stored).
      Tensor doutt = MakeTensor(*be_, dt, out_shape, dout);
      Tensor dqkv = Filled(dt, qkv_shape, 7.0);
      ASSERT_TRUE(be_->AttentionBackward(qkvt, out, doutt, lse, s.heads, dqkv).ok());
      const AttnBackwardRef bwd = RefAttnBackward(dt, s, qkv, got_out, got_lse, dout);
      ExpectApprox(ReadTensor(*be_, dqkv), bwd.dqkv, "dqkv");
    }
  }
}

// With T = 1 the only probability is 1, so out is v, lse is the one score
// (log 1 = 0), and the gradients of q and k vanish: exact in every dtype.
TEST_F(CpuGptOpsTest, AttentionOfOneTokenCopiesV) {
  for (const DType dt : kFloatTypes) {
    const AttnDims s{2, 1, 6, 2};
    const std::vector<double> qkv = RandomValues(rng_, dt, 2 * 18, -2.0, 2.0);
    Tensor qkvt = MakeTensor(*be_, dt, {2, 1, 18}, qkv);
    Tensor out = Filled(dt, {2, 1, 6}, 7.0);
    Tensor lse = Filled(DType::kF32, {2, 2, 1}, 7.0);
    ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, out, lse).ok());
    const std::vector<double> got = ReadTensor(*be_, out);
    const std::vector<double> got_lse = ReadTensor(*be_, lse);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t c = 0; c < 6; ++c) {
        EXPECT_EQ(got[static_cast<size_t>(b * 6 + c)], qkv[static_cast<size_t>(b * 18 + 12 + c)]);
      }
      for (int64_t h = 0; h < 2; ++h) {
        float dot = 0.0f;  // the score as the oracle sums it: channels in order
        for (int64_t d = 0; d < 3; ++d) {
          dot += static_cast<float>(qkv[static_cast<size_t>(b * 18 + h * 3 + d)]) *
                 static_cast<float>(qkv[static_cast<size_t>(b * 18 + 6 + h * 3 + d)]);
        }
        EXPECT_EQ(got_lse[static_cast<size_t>(b * 2 + h)],
                  dot * static_cast<float>(testing::AttnScale(testing::AttnDims{1, 1, 6, 2})));
      }
    }
    Tensor dout = MakeTensor(*be_, dt, {2, 1, 6}, RandomValues(rng_, dt, 12, -1.0, 1.0));
    Tensor dqkv = Filled(dt, {2, 1, 18}, 7.0);
    ASSERT_TRUE(be_->AttentionBackward(qkvt, out, dout, lse, s.heads, dqkv).ok());
    const std::vector<double> grad = ReadTensor(*be_, dqkv);
    const std::vector<double> g = ReadTensor(*be_, dout);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t c = 0; c < 12; ++c) EXPECT_EQ(grad[static_cast<size_t>(b * 18 + c)], 0.0);
      for (int64_t c = 0; c < 6; ++c) {
        EXPECT_EQ(grad[static_cast<size_t>(b * 18 + 12 + c)], g[static_cast<size_t>(b * 6 + c)]);
      }
    }
  }
}

// The contract's every step in plain float (kernels/backend.h), in the
// order the oracle fixes (dot products over channels in order, the block's
// P summed in two halves of 32 keys, products in key or query order): the
// oracle must give these bits exactly, so a missing rounding of P or dS, a
// shifted key block or a reordered sum fails here even where it stays
// within the float64 reference's tolerance.
struct AttnEmulated {
  std::vector<float> out, lse, dqkv;
};
AttnEmulated EmulateAttention(DType dt, const AttnDims& s, const std::vector<double>& qkv,
                              const std::vector<double>& dout) {
  const int64_t dd = s.c / s.heads, bk = kAttentionKeyBlock;
  const float scale = AttentionScale(dd);
  auto round = [dt](float x) { return static_cast<float>(RefStore(dt, x)); };
  auto at = [&](int64_t b, int64_t t, int64_t col) {
    return static_cast<float>(qkv[static_cast<size_t>((b * s.t + t) * 3 * s.c + col)]);
  };
  auto dot = [&](int64_t b, int64_t t, int64_t h, int64_t j, int64_t part) {
    float sum = 0.0f;
    for (int64_t d = 0; d < dd; ++d)
      sum += at(b, t, h * dd + d) * at(b, j, part * s.c + h * dd + d);
    return sum;
  };
  AttnEmulated r;
  r.out.assign(static_cast<size_t>(s.b * s.t * s.c), 0.0f);
  r.lse.assign(static_cast<size_t>(s.b * s.heads * s.t), 0.0f);
  r.dqkv.assign(qkv.size(), 0.0f);
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t t = 0; t < s.t; ++t) {
        float m = -INFINITY, l = 0.0f;
        std::vector<float> acc(static_cast<size_t>(dd), 0.0f);
        for (int64_t k0 = 0; k0 <= t; k0 += bk) {
          const int64_t n = std::min(bk, t + 1 - k0);
          std::vector<float> sc(static_cast<size_t>(n));
          float m_new = m;
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = dot(b, t, h, k0 + j, 1) * scale;
            m_new = std::fmax(m_new, sc[j]);
          }
          const float alpha = std::exp(m - m_new);
          float half0 = 0.0f, half1 = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = std::exp(sc[j] - m_new);
            (j < 32 ? half0 : half1) += sc[j];
          }
          l = l * alpha + (half0 + half1);
          for (int64_t d = 0; d < dd; ++d) {
            acc[d] *= alpha;
            for (int64_t j = 0; j < n; ++j)
              acc[d] += round(sc[j]) * at(b, k0 + j, 2 * s.c + h * dd + d);
          }
          m = m_new;
        }
        for (int64_t d = 0; d < dd; ++d) {
          r.out[static_cast<size_t>((b * s.t + t) * s.c + h * dd + d)] = round(acc[d] / l);
        }
        r.lse[static_cast<size_t>((b * s.heads + h) * s.t + t)] = m + std::log(l);
      }
      // The backward of that forward, from the stored out and lse.
      auto go = [&](int64_t t, int64_t d) {
        return static_cast<float>(dout[static_cast<size_t>((b * s.t + t) * s.c + h * dd + d)]);
      };
      std::vector<float> delta(static_cast<size_t>(s.t), 0.0f);
      for (int64_t t = 0; t < s.t; ++t) {
        for (int64_t d = 0; d < dd; ++d) {
          delta[t] += go(t, d) * r.out[static_cast<size_t>((b * s.t + t) * s.c + h * dd + d)];
        }
      }
      std::vector<float> p(static_cast<size_t>(s.t * s.t)), ds(p.size());
      for (int64_t t = 0; t < s.t; ++t) {
        const float lse_t = r.lse[static_cast<size_t>((b * s.heads + h) * s.t + t)];
        for (int64_t j = 0; j <= t; ++j) {
          float dp = 0.0f;
          for (int64_t d = 0; d < dd; ++d) dp += go(t, d) * at(b, j, 2 * s.c + h * dd + d);
          const float pf = std::exp(dot(b, t, h, j, 1) * scale - lse_t);
          p[static_cast<size_t>(t * s.t + j)] = round(pf);
          ds[static_cast<size_t>(t * s.t + j)] = round(pf * (dp - delta[t]));
        }
      }
      for (int64_t d = 0; d < dd; ++d) {
        for (int64_t t = 0; t < s.t; ++t) {
          float dq = 0.0f;  // keys in order
          for (int64_t j = 0; j <= t; ++j) {
            dq += ds[static_cast<size_t>(t * s.t + j)] * at(b, j, s.c + h * dd + d);
          }
          float dk = 0.0f, dv = 0.0f;  // queries in order
          for (int64_t i = t; i < s.t; ++i) {
            dk += ds[static_cast<size_t>(i * s.t + t)] * at(b, i, h * dd + d);
            dv += p[static_cast<size_t>(i * s.t + t)] * go(i, d);
          }
          const size_t row = static_cast<size_t>((b * s.t + t) * 3 * s.c + h * dd + d);
          r.dqkv[row] = round(dq * scale);
          r.dqkv[row + static_cast<size_t>(s.c)] = round(dk * scale);
          r.dqkv[row + static_cast<size_t>(2 * s.c)] = round(dv);
        }
      }
    }
  }
  return r;
}

TEST_F(CpuGptOpsTest, AttentionFollowsTheContractStepByStep) {
  for (const DType dt : kFloatTypes) {
    for (const AttnDims& s : {AttnDims{2, 130, 32, 2}, AttnDims{1, 9, 12, 3}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " T=" << s.t);
      const std::vector<double> qkv =
          RandomValues(rng_, dt, static_cast<size_t>(s.b * s.t * 3 * s.c), -2.0, 2.0);
      const std::vector<double> dout =
          RandomValues(rng_, dt, static_cast<size_t>(s.b * s.t * s.c), -1.0, 1.0);
      Tensor qkvt = MakeTensor(*be_, dt, {s.b, s.t, 3 * s.c}, qkv);
      Tensor out = Filled(dt, {s.b, s.t, s.c}, 7.0);
      Tensor lse = Filled(DType::kF32, {s.b, s.heads, s.t}, 7.0);
      ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, out, lse).ok());
      Tensor doutt = MakeTensor(*be_, dt, {s.b, s.t, s.c}, dout);
      Tensor dqkv = Filled(dt, {s.b, s.t, 3 * s.c}, 7.0);
      ASSERT_TRUE(be_->AttentionBackward(qkvt, out, doutt, lse, s.heads, dqkv).ok());
      const AttnEmulated want = EmulateAttention(dt, s, qkv, dout);
      auto as_double = [](const std::vector<float>& v) {
        return std::vector<double>(v.begin(), v.end());
      };
      EXPECT_EQ(ReadTensor(*be_, out), as_double(want.out));
      EXPECT_EQ(ReadTensor(*be_, lse), as_double(want.lse));
      EXPECT_EQ(ReadTensor(*be_, dqkv), as_double(want.dqkv));
    }
  }
}

// The property a KV-cached decode needs: the forward of the first t tokens
// gives, bit for bit, rows 0 .. t-1 of the forward of a longer sequence
// with the same prefix, for t below, at and across key-block boundaries.
TEST_F(CpuGptOpsTest, AttentionPrefixRowsAreTheLongerSequencesBits) {
  for (const DType dt : kFloatTypes) {
    const int64_t batch = 2, seq = 150, c = 32, heads = 2;
    const size_t elem = SizeOf(dt);
    const std::vector<double> qkv =
        RandomValues(rng_, dt, static_cast<size_t>(batch * seq * 3 * c), -2.0, 2.0);
    Tensor long_qkv = MakeTensor(*be_, dt, {batch, seq, 3 * c}, qkv);
    Tensor long_out = Filled(dt, {batch, seq, c}, 0.0);
    Tensor long_lse = Filled(DType::kF32, {batch, heads, seq}, 0.0);
    ASSERT_TRUE(be_->AttentionForward(long_qkv, heads, long_out, long_lse).ok());
    const std::vector<unsigned char> all_out = testing::RawBytes(*be_, long_out);
    const std::vector<unsigned char> all_lse = testing::RawBytes(*be_, long_lse);
    for (int64_t t : {1, 2, 63, 64, 65, 127, 128, 129, 149}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " t=" << t);
      std::vector<double> prefix;
      for (int64_t b = 0; b < batch; ++b) {
        const auto row0 = qkv.begin() + b * seq * 3 * c;
        prefix.insert(prefix.end(), row0, row0 + t * 3 * c);
      }
      Tensor qkvt = MakeTensor(*be_, dt, {batch, t, 3 * c}, prefix);
      Tensor out = Filled(dt, {batch, t, c}, 0.0);
      Tensor lse = Filled(DType::kF32, {batch, heads, t}, 0.0);
      ASSERT_TRUE(be_->AttentionForward(qkvt, heads, out, lse).ok());
      const std::vector<unsigned char> got_out = testing::RawBytes(*be_, out);
      const std::vector<unsigned char> got_lse = testing::RawBytes(*be_, lse);
      // Row-blocks of t tokens (out) and of t queries per head (lse).
      const size_t out_rows = static_cast<size_t>(t * c) * elem;
      const size_t lse_rows = static_cast<size_t>(t) * 4;
      for (int64_t b = 0; b < batch; ++b) {
        ASSERT_TRUE(std::equal(got_out.begin() + b * out_rows, got_out.begin() + (b + 1) * out_rows,
                               all_out.begin() + static_cast<size_t>(b * seq * c) * elem))
            << "out of batch row " << b;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t bh = b * heads + h;
          ASSERT_TRUE(std::equal(got_lse.begin() + bh * lse_rows,
                                 got_lse.begin() + (bh + 1) * lse_rows,
                                 all_lse.begin() + static_cast<size_t>(bh * seq) * 4))
              << "lse of batch row " << b << ", head " << h;
        }
      }
    }
  }
}

// fp32 attention backward against central differences of the forward op:
// L = sum(out * w) with w = dout, perturbing each element of qkv. T spans
// two key blocks, so the online softmax's rescaling is differentiated too.
TEST_F(CpuGptOpsTest, AttentionBackwardIsTheForwardsDerivative) {
  for (const AttnDims& s : {AttnDims{2, 5, 8, 2}, AttnDims{1, 67, 4, 1}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.t);
    const Shape qkv_shape = {s.b, s.t, 3 * s.c};
    const Shape lse_shape = {s.b, s.heads, s.t};
    const Shape out_shape = {s.b, s.t, s.c};
    const size_t n = static_cast<size_t>(NumElements(qkv_shape));
    const std::vector<double> qkv = RandomValues(rng_, DType::kF32, n, -1.0, 1.0);
    const std::vector<double> w =
        RandomValues(rng_, DType::kF32, static_cast<size_t>(NumElements(out_shape)), -1.0, 1.0);
    Tensor out = Filled(DType::kF32, out_shape, 0.0);
    Tensor lse = Filled(DType::kF32, lse_shape, 0.0);
    auto loss = [&](const std::vector<double>& in) {
      Tensor t = MakeTensor(*be_, DType::kF32, qkv_shape, in);
      EXPECT_TRUE(be_->AttentionForward(t, s.heads, out, lse).ok());
      const std::vector<double> o = ReadTensor(*be_, out);
      double l = 0.0;
      for (size_t i = 0; i < o.size(); ++i) l += o[i] * w[i];
      return l;
    };
    Tensor qkvt = MakeTensor(*be_, DType::kF32, qkv_shape, qkv);
    ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, out, lse).ok());
    Tensor wt = MakeTensor(*be_, DType::kF32, out_shape, w);
    Tensor dqkv = Filled(DType::kF32, qkv_shape, 0.0);
    ASSERT_TRUE(be_->AttentionBackward(qkvt, out, wt, lse, s.heads, dqkv).ok());
    const std::vector<double> grad = ReadTensor(*be_, dqkv);
    constexpr double kH = 1.0 / 256;
    int nonzero = 0;
    // Every element on the short case; on the long one a stride through
    // q, k and v of the rows on both sides of the block boundary.
    const size_t step = s.t > 8 ? 5 : 1;
    int checked = 0;
    for (size_t i = 0; i < n; i += step) {
      std::vector<double> plus = qkv, minus = qkv;
      plus[i] = static_cast<float>(qkv[i] + kH);  // inputs must be fp32 values
      minus[i] = static_cast<float>(qkv[i] - kH);
      const double fd = (loss(plus) - loss(minus)) / (plus[i] - minus[i]);
      // The forward's fp32 rounding (~1e-6 over the outputs) over 2h, plus
      // the h^2 truncation of a smooth function of inputs below 1.
      EXPECT_NEAR(grad[i], fd, 3e-4 + 2e-3 * std::fabs(fd)) << "qkv[" << i << "]";
      if (std::fabs(grad[i]) > 1e-3) ++nonzero;
      ++checked;
    }
    // Every q, k and v element but the first query's q (which only ever
    // sees itself) moves the loss.
    EXPECT_GT(nonzero, checked * 3 / 4);
  }
}

TEST_F(CpuGptOpsTest, AttentionRefusesBadOperandsNamingThem) {
  const DType dt = DType::kF32;
  Tensor qkv = Filled(dt, {2, 4, 24}, 0.5);
  Tensor out = Filled(dt, {2, 4, 8}, 0.0);
  Tensor lse = Filled(DType::kF32, {2, 2, 4}, 0.0);
  ASSERT_TRUE(be_->AttentionForward(qkv, 2, out, lse).ok());
  ExpectInvalidNaming(be_->AttentionForward(qkv, 3, out, lse), "n_head");  // 3 does not divide 8
  ExpectInvalidNaming(be_->AttentionForward(qkv, 0, out, lse), "n_head");
  Tensor qkv_odd = Filled(dt, {2, 4, 25}, 0.5);
  ExpectInvalidNaming(be_->AttentionForward(qkv_odd, 1, out, lse), "qkv");
  Tensor qkv_2d = Filled(dt, {8, 24}, 0.5);
  ExpectInvalidNaming(be_->AttentionForward(qkv_2d, 2, out, lse), "qkv");
  Tensor qkv_int = MakeTensor(*be_, DType::kI32, {2, 4, 24}, std::vector<double>(192, 1.0));
  ExpectInvalidNaming(be_->AttentionForward(qkv_int, 2, out, lse), "qkv");
  Tensor lse_bad = Filled(DType::kF32, {2, 2, 3}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, out, lse_bad), "lse");
  Tensor lse_heads = Filled(DType::kF32, {2, 4, 4}, 0.0);  // n_head 4 in lse, 2 asked
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, out, lse_heads), "lse");
  Tensor lse_half = Filled(DType::kF16, {2, 2, 4}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, out, lse_half), "lse");
  Tensor out_half = Filled(DType::kF16, {2, 4, 8}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, out_half, lse), "out");
  Tensor out_bad = Filled(dt, {2, 4, 24}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, out_bad, lse), "out");
  // An output aliasing qkv (two views of one workspace) is refused.
  Tensor workspace = Filled(dt, {2 * 4 * 24 + 2 * 4 * 8}, 0.0);
  absl::StatusOr<Tensor> qkv_view = workspace.View(0, {2, 4, 24});
  absl::StatusOr<Tensor> out_alias = workspace.View(100, {2, 4, 8});
  absl::StatusOr<Tensor> lse_alias = workspace.View(10, {2, 2, 4});
  ASSERT_TRUE(qkv_view.ok() && out_alias.ok() && lse_alias.ok());
  ExpectInvalidNaming(be_->AttentionForward(*qkv_view, 2, *out_alias, lse), "overlaps qkv");
  ExpectInvalidNaming(be_->AttentionForward(*qkv_view, 2, out, *lse_alias), "overlaps qkv");

  Tensor dout = Filled(dt, {2, 4, 8}, 0.25);
  Tensor dqkv = Filled(dt, {2, 4, 24}, 0.0);
  ASSERT_TRUE(be_->AttentionBackward(qkv, out, dout, lse, 2, dqkv).ok());
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, dout, lse, 3, dqkv), "n_head");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out_bad, dout, lse, 2, dqkv), "out");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, out_bad, lse, 2, dqkv), "dout");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, dout, lse_bad, 2, dqkv), "lse");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, dout, lse, 2, out), "dqkv");
  Tensor dqkv_half = Filled(DType::kF16, {2, 4, 24}, 0.0);
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, dout, lse, 2, dqkv_half), "dqkv");
  // dqkv must not be qkv itself (the backward reads q, k, v while it writes).
  ExpectInvalidNaming(be_->AttentionBackward(qkv, out, dout, lse, 2, qkv), "dqkv");
}

// ---- chunked token cross-entropy ---------------------------------------------------

constexpr int64_t kIgnore = -100;

struct CeRef {
  double loss = 0.0;         // sum over kept rows of -log softmax[label] (unscaled)
  std::vector<double> grad;  // softmax - onehot, 0 for ignored rows (unscaled)
};

CeRef RefCrossEntropy(const std::vector<double>& z, const std::vector<int64_t>& labels,
                      int64_t classes) {
  CeRef r;
  r.grad.assign(z.size(), 0.0);
  for (size_t n = 0; n < labels.size(); ++n) {
    if (labels[n] == kIgnore) continue;
    const double* row = &z[n * static_cast<size_t>(classes)];
    double max = -INFINITY;
    for (int64_t v = 0; v < classes; ++v) max = std::max(max, row[v]);
    double sum = 0.0;
    for (int64_t v = 0; v < classes; ++v) sum += std::exp(row[v] - max);
    r.loss += std::log(sum) - (row[labels[n]] - max);
    for (int64_t v = 0; v < classes; ++v) {
      r.grad[n * static_cast<size_t>(classes) + static_cast<size_t>(v)] =
          std::exp(row[v] - max) / sum - (v == labels[n] ? 1.0 : 0.0);
    }
  }
  return r;
}

Tensor Labels(Backend& be, DType dtype, const std::vector<int64_t>& labels) {
  std::vector<double> v(labels.begin(), labels.end());
  return MakeTensor(be, dtype, {static_cast<int64_t>(labels.size())}, v);
}

TEST_F(CpuGptOpsTest, CrossEntropyChunkMatchesReference) {
  const int64_t rows = 37, classes = 50;
  for (const DType dt : kFloatTypes) {
    for (const DType label_dt : {DType::kI32, DType::kI64}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " labels " << DTypeName(label_dt));
      const std::vector<double> z =
          RandomValues(rng_, dt, static_cast<size_t>(rows * classes), -6.0, 6.0);
      std::vector<int64_t> labels(static_cast<size_t>(rows));
      std::uniform_int_distribution<int64_t> pick(0, classes - 1);
      for (int64_t n = 0; n < rows; ++n) labels[n] = n % 5 == 2 ? kIgnore : pick(rng_);
      labels[0] = classes - 1;  // the edges of the range
      labels[1] = 0;
      const int64_t kept =
          std::count_if(labels.begin(), labels.end(), [](int64_t l) { return l != kIgnore; });
      const float loss_scale = 1.0f / static_cast<float>(kept);
      const float grad_scale = 1024.0f / static_cast<float>(kept);
      Tensor zt = MakeTensor(*be_, dt, {rows, classes}, z);
      Tensor lt = Labels(*be_, label_dt, labels);
      Tensor loss = Filled(DType::kF32, {1}, 0.75);  // accumulated into
      Tensor dz = Filled(dt, {rows, classes}, 7.0);
      ASSERT_TRUE(be_->CrossEntropyChunk(zt, lt, kIgnore, loss_scale, grad_scale, loss, dz).ok());
      const CeRef ref = RefCrossEntropy(z, labels, classes);
      // Each row's loss is log(sum) - shift: fp32 exp/log and a V-term sum,
      // a few u of its magnitude (<= 12 + log V); then rows are added one by one.
      const double want = 0.75 + ref.loss * loss_scale;
      EXPECT_NEAR(ReadTensor(*be_, loss)[0], want, (classes + rows + 16) * kU32 * (want + 20.0));
      const std::vector<double> got = ReadTensor(*be_, dz);
      for (size_t i = 0; i < got.size(); ++i) {
        const double w = grad_scale * ref.grad[i];
        ASSERT_NEAR(
            got[i], w,
            0.5 * Eps(dt) * std::fabs(w) + (classes + 8) * kU32 * grad_scale + DenormMin(dt))
            << i;
      }
      for (int64_t n = 0; n < rows; ++n) {
        if (labels[n] != kIgnore) continue;
        for (int64_t v = 0; v < classes; ++v) ASSERT_EQ(got[n * classes + v], 0.0) << n;
      }
    }
  }
}

// Chunks of one batch accumulate into the loss exactly as one call over all
// rows does, and in place (dlogits == logits) gives the same gradient.
TEST_F(CpuGptOpsTest, CrossEntropyChunksAccumulateAndRunInPlace) {
  const int64_t rows = 12, classes = 9;
  for (const DType dt : kFloatTypes) {
    const std::vector<double> z =
        RandomValues(rng_, dt, static_cast<size_t>(rows * classes), -4.0, 4.0);
    std::vector<int64_t> labels = {3, kIgnore, 0, 8, 8, kIgnore, kIgnore, 1, 2, 5, 4, 7};
    const float loss_scale = 1.0f / 9.0f;
    const float grad_scale = 4096.0f / 9.0f;
    Tensor zt = MakeTensor(*be_, dt, {rows, classes}, z);
    Tensor lt = Labels(*be_, DType::kI64, labels);
    Tensor whole_loss = Filled(DType::kF32, {1}, 0.0);
    Tensor whole_dz = Filled(dt, {rows, classes}, 7.0);
    ASSERT_TRUE(
        be_->CrossEntropyChunk(zt, lt, kIgnore, loss_scale, grad_scale, whole_loss, whole_dz).ok());

    // In place over chunks of 5, 0 and 7 rows of one logits buffer.
    Tensor buf = MakeTensor(*be_, dt, {rows, classes}, z);
    Tensor chunk_loss = Filled(DType::kF32, {1}, 0.0);
    int64_t begin = 0;
    for (const int64_t n : {int64_t{5}, int64_t{0}, int64_t{7}}) {
      absl::StatusOr<Tensor> zc = buf.View(begin * classes, {n, classes});
      absl::StatusOr<Tensor> lc = lt.View(begin, {n});
      ASSERT_TRUE(zc.ok() && lc.ok());
      ASSERT_TRUE(
          be_->CrossEntropyChunk(*zc, *lc, kIgnore, loss_scale, grad_scale, chunk_loss, *zc).ok());
      begin += n;
    }
    EXPECT_EQ(ReadTensor(*be_, chunk_loss), ReadTensor(*be_, whole_loss)) << DTypeName(dt);
    EXPECT_EQ(ReadTensor(*be_, buf), ReadTensor(*be_, whole_dz)) << DTypeName(dt);
    // The accumulated loss is the mean over the 9 kept rows.
    EXPECT_NEAR(ReadTensor(*be_, whole_loss)[0], RefCrossEntropy(z, labels, classes).loss / 9.0,
                1e-5);
  }
}

// A chunk whose rows are all ignored adds nothing and zeroes its gradient.
TEST_F(CpuGptOpsTest, CrossEntropyChunkOfIgnoredRowsAddsNothing) {
  Tensor zt = Filled(DType::kBF16, {3, 4}, 2.5);
  Tensor lt = Labels(*be_, DType::kI32, {kIgnore, kIgnore, kIgnore});
  Tensor loss = Filled(DType::kF32, {1}, 1.25);
  ASSERT_TRUE(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss, zt).ok());
  EXPECT_EQ(ReadTensor(*be_, loss)[0], 1.25);
  EXPECT_EQ(ReadTensor(*be_, zt), std::vector<double>(12, 0.0));
}

// fp32 gradient against central differences of the loss the op adds up.
TEST_F(CpuGptOpsTest, CrossEntropyChunkGradientIsTheLossDerivative) {
  const int64_t rows = 6, classes = 7;
  const std::vector<double> z =
      RandomValues(rng_, DType::kF32, static_cast<size_t>(rows * classes), -3.0, 3.0);
  const std::vector<int64_t> labels = {6, 0, kIgnore, 3, 3, 1};
  Tensor lt = Labels(*be_, DType::kI32, labels);
  const float scale = 0.2f;  // 1 / kept rows
  auto loss = [&](const std::vector<double>& in) {
    Tensor zt = MakeTensor(*be_, DType::kF32, {rows, classes}, in);
    Tensor l = Filled(DType::kF32, {1}, 0.0);
    Tensor dz = Filled(DType::kF32, {rows, classes}, 0.0);
    EXPECT_TRUE(be_->CrossEntropyChunk(zt, lt, kIgnore, scale, scale, l, dz).ok());
    return ReadTensor(*be_, l)[0];
  };
  Tensor zt = MakeTensor(*be_, DType::kF32, {rows, classes}, z);
  Tensor l = Filled(DType::kF32, {1}, 0.0);
  Tensor dz = Filled(DType::kF32, {rows, classes}, 7.0);
  ASSERT_TRUE(be_->CrossEntropyChunk(zt, lt, kIgnore, scale, scale, l, dz).ok());
  const std::vector<double> grad = ReadTensor(*be_, dz);
  constexpr double kH = 1.0 / 128;
  for (size_t i = 0; i < z.size(); ++i) {
    std::vector<double> plus = z, minus = z;
    plus[i] = static_cast<float>(z[i] + kH);  // inputs must be fp32 values
    minus[i] = static_cast<float>(z[i] - kH);
    const double fd = (loss(plus) - loss(minus)) / (plus[i] - minus[i]);
    // fp32 loss (~1e-6 of ~2) over 2h, plus h^2 |f'''| / 6 (< 1e-5 here).
    EXPECT_NEAR(grad[i], fd, 2e-4 + 1e-3 * std::fabs(fd)) << "logits[" << i << "]";
  }
}

TEST_F(CpuGptOpsTest, CrossEntropyChunkRefusesBadLabelsAndShapesNamingThem) {
  Tensor zt = Filled(DType::kF16, {4, 5}, 0.5);
  Tensor dz = Filled(DType::kF16, {4, 5}, 9.0);
  Tensor loss = Filled(DType::kF32, {1}, 3.0);
  // A label of V, or a negative one other than ignore_index: nothing written.
  for (const std::vector<int64_t>& bad :
       {std::vector<int64_t>{0, 1, 5, 2}, std::vector<int64_t>{0, -1, 2, 3},
        std::vector<int64_t>{kIgnore, 1, 2, -99}}) {
    Tensor lt = Labels(*be_, DType::kI64, bad);
    ExpectInvalidNaming(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss, dz), "labels[");
    EXPECT_EQ(ReadTensor(*be_, loss)[0], 3.0);
    EXPECT_EQ(ReadTensor(*be_, dz), std::vector<double>(20, 9.0));
  }
  // -100 is a label like any other when ignore_index is something else.
  Tensor minus100 = Labels(*be_, DType::kI32, {0, 1, kIgnore, 2});
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, minus100, -1, 1.0f, 1.0f, loss, dz), "labels[2]");

  Tensor lt = Labels(*be_, DType::kI32, {0, 1, 2, 3});
  ASSERT_TRUE(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss, dz).ok());
  Tensor short_labels = Labels(*be_, DType::kI32, {0, 1, 2});
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, short_labels, kIgnore, 1.0f, 1.0f, loss, dz),
                      "labels");
  Tensor float_labels = Filled(DType::kF32, {4}, 1.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, float_labels, kIgnore, 1.0f, 1.0f, loss, dz),
                      "labels");
  Tensor dz_f32 = Filled(DType::kF32, {4, 5}, 0.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss, dz_f32), "dlogits");
  Tensor dz_shape = Filled(DType::kF16, {4, 6}, 0.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss, dz_shape),
                      "dlogits");
  Tensor loss_f16 = Filled(DType::kF16, {1}, 0.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(zt, lt, kIgnore, 1.0f, 1.0f, loss_f16, dz), "loss");
  Tensor z_1d = Filled(DType::kF16, {20}, 0.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(z_1d, lt, kIgnore, 1.0f, 1.0f, loss, dz), "logits");
  Tensor no_classes = Filled(DType::kF16, {4, 0}, 0.0);
  ExpectInvalidNaming(be_->CrossEntropyChunk(no_classes, lt, kIgnore, 1.0f, 1.0f, loss, no_classes),
                      "logits");
  // dlogits shifted by one row over logits: neither in place nor disjoint.
  Tensor buf = Filled(DType::kF16, {5, 5}, 0.5);
  absl::StatusOr<Tensor> z0 = buf.View(0, {4, 5});
  absl::StatusOr<Tensor> z1 = buf.View(5, {4, 5});
  ASSERT_TRUE(z0.ok() && z1.ok());
  ExpectInvalidNaming(be_->CrossEntropyChunk(*z0, lt, kIgnore, 1.0f, 1.0f, loss, *z1), "dlogits");
}

// The shapes a tiny GPT trains with on the CPU (batch 8 x 64 tokens, 128
// channels, 4 heads; 512 rows of a 256-token vocabulary), called again and
// again with a call of other shapes in between, as the layers of a model
// and its evaluation batches interleave: the per-thread scratch the ops
// reuse must carry nothing from one call to the next, so every repeat
// writes the same bytes. (The test's time is also the oracle's speed on
// these shapes: about 1 ms per op on two cores.)
TEST_F(CpuGptOpsTest, RepeatedCallsAtTinyGptShapesGiveTheSameBytes) {
  const DType dt = DType::kBF16;
  struct Run {
    std::vector<double> out, lse, dqkv, dz, loss;
  };
  auto run = [&](int64_t b, int64_t t, int64_t c, int64_t heads, int64_t rows, int64_t classes,
                 uint64_t seed) {
    std::mt19937_64 rng(seed);
    Tensor qkv = MakeTensor(*be_, dt, {b, t, 3 * c},
                            RandomValues(rng, dt, static_cast<size_t>(b * t * 3 * c), -1.0, 1.0));
    Tensor dout = MakeTensor(*be_, dt, {b, t, c},
                             RandomValues(rng, dt, static_cast<size_t>(b * t * c), -1.0, 1.0));
    Tensor z = MakeTensor(*be_, dt, {rows, classes},
                          RandomValues(rng, dt, static_cast<size_t>(rows * classes), -3.0, 3.0));
    std::vector<int64_t> labels(static_cast<size_t>(rows));
    for (int64_t n = 0; n < rows; ++n) labels[n] = n % 9 == 4 ? kIgnore : (n * 37) % classes;
    Tensor lt = Labels(*be_, DType::kI32, labels);
    Tensor out = Filled(dt, {b, t, c}, 7.0);
    Tensor lse = Filled(DType::kF32, {b, heads, t}, 7.0);
    Tensor dqkv = Filled(dt, {b, t, 3 * c}, 7.0);
    Tensor loss = Filled(DType::kF32, {1}, 0.0);
    EXPECT_TRUE(be_->AttentionForward(qkv, heads, out, lse).ok());
    EXPECT_TRUE(be_->AttentionBackward(qkv, out, dout, lse, heads, dqkv).ok());
    EXPECT_TRUE(be_->CrossEntropyChunk(z, lt, kIgnore, 1.0f / rows, 1.0f / rows, loss, z).ok());
    return Run{ReadTensor(*be_, out), ReadTensor(*be_, lse), ReadTensor(*be_, dqkv),
               ReadTensor(*be_, z), ReadTensor(*be_, loss)};
  };
  const Run first = run(8, 64, 128, 4, 512, 256, 1);
  for (double v : first.dqkv) ASSERT_TRUE(std::isfinite(v));
  for (int i = 0; i < 5; ++i) {
    (void)run(3, 17 + i, 48, 2 + i % 2, 40 + i, 300, 100 + i);  // other shapes in between
    const Run again = run(8, 64, 128, 4, 512, 256, 1);
    ASSERT_EQ(again.out, first.out) << i;
    ASSERT_EQ(again.lse, first.lse) << i;
    ASSERT_EQ(again.dqkv, first.dqkv) << i;
    ASSERT_EQ(again.dz, first.dz) << i;
    ASSERT_EQ(again.loss, first.loss) << i;
  }
}

}  // namespace
}  // namespace ampd::kernels
