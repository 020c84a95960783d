// The CPU backend's ops for GPT-style transformers against float64
// references written here: GELU's tanh approximation, causal
// self-attention forward and backward, and the chunked token cross-entropy
// with ignore_index. Each backward is also checked in fp32 against central
// differences of its own forward, so a gradient that matches a wrong
// reference still fails. Then the refusals: bad labels, shapes and head
// counts are InvalidArgument naming the operand.
//
// The attention references repeat the intermediate roundings the op
// contract fixes (scores and probabilities stored in att's dtype, dP and dS
// in datt's), in double; the tolerances allow the one-ulp flips a
// differently ordered fp32 sum can cause at each of those roundings,
// propagated to the outputs, plus the fp32 summation error bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

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

const AttnDims kAttnDimss[] = {
    {2, 5, 8, 2},    // small, odd T
    {1, 1, 12, 3},   // T = 1: each query sees only itself
    {3, 13, 24, 4},  // non-power-of-two T, D = 6
    {2, 32, 64, 1},  // one head, D = 64
};

TEST_F(CpuGptOpsTest, AttentionMatchesReferenceInEveryDtype) {
  for (const DType dt : kFloatTypes) {
    for (const AttnDims& s : kAttnDimss) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " B=" << s.b << " T=" << s.t
                                        << " C=" << s.c << " H=" << s.heads);
      const Shape qkv_shape = {s.b, s.t, 3 * s.c};
      const Shape att_shape = {s.b, s.heads, s.t, s.t};
      const Shape out_shape = {s.b, s.t, s.c};
      const std::vector<double> qkv =
          RandomValues(rng_, dt, static_cast<size_t>(NumElements(qkv_shape)), -1.5, 1.5);
      const std::vector<double> dout =
          RandomValues(rng_, dt, static_cast<size_t>(NumElements(out_shape)), -1.0, 1.0);
      Tensor qkvt = MakeTensor(*be_, dt, qkv_shape, qkv);
      Tensor att = Filled(dt, att_shape, 7.0);  // every element must be written
      Tensor out = Filled(dt, out_shape, 7.0);
      ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, att, out).ok());
      const std::vector<double> got_att = ReadTensor(*be_, att);
      const AttnForwardRef fwd = RefAttnForward(dt, s, qkv);
      ExpectApprox(got_att, fwd.att, "att");
      ExpectApprox(ReadTensor(*be_, out), fwd.out, "out");
      // Masked probabilities are exactly zero.
      for (int64_t bh = 0; bh < s.b * s.heads; ++bh) {
        for (int64_t t = 0; t < s.t; ++t) {
          for (int64_t j = t + 1; j < s.t; ++j) {
            ASSERT_EQ(got_att[static_cast<size_t>((bh * s.t + t) * s.t + j)], 0.0);
          }
        }
      }

      Tensor doutt = MakeTensor(*be_, dt, out_shape, dout);
      Tensor datt = Filled(dt, att_shape, 7.0);
      Tensor dqkv = Filled(dt, qkv_shape, 7.0);
      ASSERT_TRUE(be_->AttentionBackward(qkvt, att, doutt, s.heads, datt, dqkv).ok());
      const AttnBackwardRef bwd = RefAttnBackward(dt, s, qkv, got_att, dout);
      ExpectApprox(ReadTensor(*be_, datt), bwd.datt, "datt");
      ExpectApprox(ReadTensor(*be_, dqkv), bwd.dqkv, "dqkv");
    }
  }
}

// With T = 1 the only probability is 1, so out is v and the gradients of q
// and k vanish: exact in every dtype.
TEST_F(CpuGptOpsTest, AttentionOfOneTokenCopiesV) {
  for (const DType dt : kFloatTypes) {
    const AttnDims s{2, 1, 6, 2};
    const std::vector<double> qkv = RandomValues(rng_, dt, 2 * 18, -2.0, 2.0);
    Tensor qkvt = MakeTensor(*be_, dt, {2, 1, 18}, qkv);
    Tensor att = Filled(dt, {2, 2, 1, 1}, 7.0);
    Tensor out = Filled(dt, {2, 1, 6}, 7.0);
    ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, att, out).ok());
    EXPECT_EQ(ReadTensor(*be_, att), std::vector<double>(4, 1.0));
    const std::vector<double> got = ReadTensor(*be_, out);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t c = 0; c < 6; ++c) {
        EXPECT_EQ(got[static_cast<size_t>(b * 6 + c)], qkv[static_cast<size_t>(b * 18 + 12 + c)]);
      }
    }
  }
}

// fp32 attention backward against central differences of the forward op:
// L = sum(out * w) with w = dout, perturbing each element of qkv.
TEST_F(CpuGptOpsTest, AttentionBackwardIsTheForwardsDerivative) {
  const AttnDims s{2, 5, 8, 2};
  const Shape qkv_shape = {s.b, s.t, 3 * s.c};
  const Shape att_shape = {s.b, s.heads, s.t, s.t};
  const Shape out_shape = {s.b, s.t, s.c};
  const std::vector<double> qkv = RandomValues(rng_, DType::kF32, 2 * 5 * 24, -1.0, 1.0);
  const std::vector<double> w = RandomValues(rng_, DType::kF32, 2 * 5 * 8, -1.0, 1.0);
  Tensor att = Filled(DType::kF32, att_shape, 0.0);
  Tensor out = Filled(DType::kF32, out_shape, 0.0);
  auto loss = [&](const std::vector<double>& in) {
    Tensor t = MakeTensor(*be_, DType::kF32, qkv_shape, in);
    EXPECT_TRUE(be_->AttentionForward(t, s.heads, att, out).ok());
    const std::vector<double> o = ReadTensor(*be_, out);
    double l = 0.0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * w[i];
    return l;
  };
  Tensor qkvt = MakeTensor(*be_, DType::kF32, qkv_shape, qkv);
  ASSERT_TRUE(be_->AttentionForward(qkvt, s.heads, att, out).ok());
  Tensor wt = MakeTensor(*be_, DType::kF32, out_shape, w);
  Tensor datt = Filled(DType::kF32, att_shape, 0.0);
  Tensor dqkv = Filled(DType::kF32, qkv_shape, 0.0);
  ASSERT_TRUE(be_->AttentionBackward(qkvt, att, wt, s.heads, datt, dqkv).ok());
  const std::vector<double> grad = ReadTensor(*be_, dqkv);
  constexpr double kH = 1.0 / 256;
  int nonzero = 0;
  for (size_t i = 0; i < qkv.size(); ++i) {
    std::vector<double> plus = qkv, minus = qkv;
    plus[i] = static_cast<float>(qkv[i] + kH);  // inputs must be fp32 values
    minus[i] = static_cast<float>(qkv[i] - kH);
    const double fd = (loss(plus) - loss(minus)) / (plus[i] - minus[i]);
    // The forward's fp32 rounding (~1e-6 over 40 outputs) over 2h, plus the
    // h^2 truncation of a smooth function of inputs below 1.
    EXPECT_NEAR(grad[i], fd, 3e-4 + 2e-3 * std::fabs(fd)) << "qkv[" << i << "]";
    if (std::fabs(grad[i]) > 1e-3) ++nonzero;
  }
  // Every q, k and v element but the first query's q (which only ever sees
  // itself) moves the loss.
  EXPECT_GT(nonzero, static_cast<int>(qkv.size()) * 3 / 4);
}

TEST_F(CpuGptOpsTest, AttentionRefusesBadOperandsNamingThem) {
  const DType dt = DType::kF32;
  Tensor qkv = Filled(dt, {2, 4, 24}, 0.5);
  Tensor att = Filled(dt, {2, 2, 4, 4}, 0.0);
  Tensor out = Filled(dt, {2, 4, 8}, 0.0);
  ASSERT_TRUE(be_->AttentionForward(qkv, 2, att, out).ok());
  ExpectInvalidNaming(be_->AttentionForward(qkv, 3, att, out), "n_head");  // 3 does not divide 8
  ExpectInvalidNaming(be_->AttentionForward(qkv, 0, att, out), "n_head");
  Tensor qkv_odd = Filled(dt, {2, 4, 25}, 0.5);
  ExpectInvalidNaming(be_->AttentionForward(qkv_odd, 1, att, out), "qkv");
  Tensor qkv_2d = Filled(dt, {8, 24}, 0.5);
  ExpectInvalidNaming(be_->AttentionForward(qkv_2d, 2, att, out), "qkv");
  Tensor qkv_int = MakeTensor(*be_, DType::kI32, {2, 4, 24}, std::vector<double>(192, 1.0));
  ExpectInvalidNaming(be_->AttentionForward(qkv_int, 2, att, out), "qkv");
  Tensor att_bad = Filled(dt, {2, 2, 4, 3}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, att_bad, out), "att");
  Tensor att_heads = Filled(dt, {2, 4, 4, 4}, 0.0);  // n_head 4 in att, 2 asked
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, att_heads, out), "att");
  Tensor out_half = Filled(DType::kF16, {2, 4, 8}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, att, out_half), "out");
  Tensor out_bad = Filled(dt, {2, 4, 24}, 0.0);
  ExpectInvalidNaming(be_->AttentionForward(qkv, 2, att, out_bad), "out");
  // An output aliasing qkv (two views of one workspace) is refused.
  Tensor workspace = Filled(dt, {2 * 4 * 24 + 2 * 4 * 8}, 0.0);
  absl::StatusOr<Tensor> qkv_view = workspace.View(0, {2, 4, 24});
  absl::StatusOr<Tensor> out_alias = workspace.View(100, {2, 4, 8});
  ASSERT_TRUE(qkv_view.ok() && out_alias.ok());
  ExpectInvalidNaming(be_->AttentionForward(*qkv_view, 2, att, *out_alias), "overlaps qkv");

  Tensor dout = Filled(dt, {2, 4, 8}, 0.25);
  Tensor datt = Filled(dt, {2, 2, 4, 4}, 0.0);
  Tensor dqkv = Filled(dt, {2, 4, 24}, 0.0);
  ASSERT_TRUE(be_->AttentionBackward(qkv, att, dout, 2, datt, dqkv).ok());
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, dout, 3, datt, dqkv), "n_head");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att_bad, dout, 2, datt, dqkv), "att");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, out_bad, 2, datt, dqkv), "dout");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, dout, 2, att_bad, dqkv), "datt");
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, dout, 2, datt, out), "dqkv");
  Tensor dqkv_half = Filled(DType::kF16, {2, 4, 24}, 0.0);
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, dout, 2, datt, dqkv_half), "dqkv");
  // datt must not be att itself (the backward reads P while it writes dS).
  ExpectInvalidNaming(be_->AttentionBackward(qkv, att, dout, 2, att, dqkv), "datt");
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
    std::vector<double> att, out, datt, dqkv, dz, loss;
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
    Tensor att = Filled(dt, {b, heads, t, t}, 7.0);
    Tensor out = Filled(dt, {b, t, c}, 7.0);
    Tensor datt = Filled(dt, {b, heads, t, t}, 7.0);
    Tensor dqkv = Filled(dt, {b, t, 3 * c}, 7.0);
    Tensor loss = Filled(DType::kF32, {1}, 0.0);
    EXPECT_TRUE(be_->AttentionForward(qkv, heads, att, out).ok());
    EXPECT_TRUE(be_->AttentionBackward(qkv, att, dout, heads, datt, dqkv).ok());
    EXPECT_TRUE(be_->CrossEntropyChunk(z, lt, kIgnore, 1.0f / rows, 1.0f / rows, loss, z).ok());
    return Run{ReadTensor(*be_, att),  ReadTensor(*be_, out), ReadTensor(*be_, datt),
               ReadTensor(*be_, dqkv), ReadTensor(*be_, z),   ReadTensor(*be_, loss)};
  };
  const Run first = run(8, 64, 128, 4, 512, 256, 1);
  for (double v : first.dqkv) ASSERT_TRUE(std::isfinite(v));
  for (int i = 0; i < 5; ++i) {
    (void)run(3, 17 + i, 48, 2 + i % 2, 40 + i, 300, 100 + i);  // other shapes in between
    const Run again = run(8, 64, 128, 4, 512, 256, 1);
    ASSERT_EQ(again.att, first.att) << i;
    ASSERT_EQ(again.out, first.out) << i;
    ASSERT_EQ(again.datt, first.datt) << i;
    ASSERT_EQ(again.dqkv, first.dqkv) << i;
    ASSERT_EQ(again.dz, first.dz) << i;
    ASSERT_EQ(again.loss, first.loss) << i;
  }
}

}  // namespace
}  // namespace ampd::kernels
