// Each Backend op on cuda:0 compared with the CPU oracle on the same seeded
// random inputs, for every float dtype. Elementwise ops that are one fp32
// operation and one rounding (Fill, Cast, Add, AddBias, ReLU) and
// ReadScalars must match bitwise;
// the rest within a few ulps of the dtype (transcendentals and summation
// order differ between CUDA and glibc/serial loops).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

TEST_P(CudaDTypeTest, FillIsBitExact) {
  const DType dt = GetParam();
  // 65519 rounds down in fp16, 65520 overflows to inf, 1e-8 is an fp16
  // subnormal tie region, 0.1 is inexact everywhere.
  for (float value : {0.1f, -3.7f, 65519.0f, 65520.0f, 1e-8f, 3e-38f}) {
    Tensor c = Upload(*cpu_, dt, {3, 5}, RandomValues(15, 1, -1, 1, dt));
    Tensor g = Upload(*gpu_, dt, {3, 5}, RandomValues(15, 1, -1, 1, dt));
    AMPD_EXPECT_OK(cpu_->Fill(c, value));
    AMPD_EXPECT_OK(gpu_->Fill(g, value));
    EXPECT_EQ(DownloadBytes(*cpu_, c), DownloadBytes(*gpu_, g)) << "value " << value;
  }
}

TEST_P(CudaDTypeTest, CastIsBitExactFromEveryDType) {
  const DType dst = GetParam();
  // Edge values of fp16/bf16 rounding, plus random ones across many octaves.
  std::vector<float> values = {65504.0f,       65519.99f,
                               65520.0f,       -65536.0f,
                               5.9604645e-08f, 2.9802322e-08f,
                               3.0e-08f,       8.940697e-08f,
                               6.1035156e-05f, 6.0975552e-05f,
                               1.0009766f,     1.0048828f,
                               3.3895314e38f,  -std::numeric_limits<float>::infinity(),
                               -0.0f,          1e-40f};
  const std::vector<float> random = RandomValues(4096, 2, -1.0f, 1.0f, DType::kF32);
  for (size_t i = 0; i < random.size(); ++i) {
    values.push_back(random[i] * std::ldexp(1.0f, static_cast<int>(i % 60) - 30));
  }
  const int64_t n = static_cast<int64_t>(values.size());
  for (DType src : {DType::kF32, DType::kF16, DType::kBF16}) {
    Tensor cs = Upload(*cpu_, src, {n}, values);
    Tensor gs = Upload(*gpu_, src, {n}, values);
    Tensor cd = *cpu_->Allocate(dst, {n});
    Tensor gd = *gpu_->Allocate(dst, {n});
    AMPD_EXPECT_OK(cpu_->Cast(cs, cd));
    AMPD_EXPECT_OK(gpu_->Cast(gs, gd));
    EXPECT_EQ(DownloadBytes(*cpu_, cd), DownloadBytes(*gpu_, gd))
        << "cast " << DTypeName(src) << " -> " << DTypeName(dst);
  }
}

TEST_P(CudaDTypeTest, CopyAndRoundTrip) {
  const DType dt = GetParam();
  const std::vector<float> v = RandomValues(1000, 3, -5, 5, dt);
  Tensor a = Upload(*gpu_, dt, {10, 100}, v);
  Tensor b = *gpu_->Allocate(dt, {1000});
  AMPD_EXPECT_OK(gpu_->Copy(a, b));
  EXPECT_EQ(Download(*gpu_, b), v);
  Tensor short_dst = *gpu_->Allocate(dt, {999});
  const absl::Status bad = gpu_->Copy(a, short_dst);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "dst")) << bad;
}

TEST_P(CudaDTypeTest, GemmAllTransposesAndOutputDTypes) {
  const DType dt = GetParam();
  const int64_t m = 37, n = 45, k = 70;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (DType cdt : {DType::kF32, dt}) {
        const Shape ashape = ta ? Shape{k, m} : Shape{m, k};
        const Shape bshape = tb ? Shape{n, k} : Shape{k, n};
        const auto av = RandomValues(m * k, 10, -1, 1, dt);
        const auto bv = RandomValues(k * n, 11, -1, 1, dt);
        const auto cv = RandomValues(m * n, 12, -1, 1, cdt);
        Tensor ca = Upload(*cpu_, dt, ashape, av), ga = Upload(*gpu_, dt, ashape, av);
        Tensor cb = Upload(*cpu_, dt, bshape, bv), gb = Upload(*gpu_, dt, bshape, bv);
        Tensor cc = Upload(*cpu_, cdt, {m, n}, cv), gc = Upload(*gpu_, cdt, {m, n}, cv);
        AMPD_EXPECT_OK(cpu_->Gemm(ta, tb, 0.75f, ca, cb, 0.5f, cc));
        AMPD_EXPECT_OK(gpu_->Gemm(ta, tb, 0.75f, ga, gb, 0.5f, gc));
        // fp32 sums of 70 products of |x| < 1 in another order: ~k * 2^-24
        // absolute; plus one rounding of the output dtype.
        Tolerance tol = ElementwiseTolerance(cdt);
        tol.atol += static_cast<float>(k) * 6e-8f;
        EXPECT_TRUE(AllClose(Download(*cpu_, cc), Download(*gpu_, gc), tol))
            << "trans_a " << ta << " trans_b " << tb << " c " << DTypeName(cdt);
      }
    }
  }
  Tensor a = *gpu_->Allocate(dt, {4, 5}), b = *gpu_->Allocate(dt, {6, 7});
  Tensor c = *gpu_->Allocate(dt, {4, 7});
  const absl::Status bad = gpu_->Gemm(false, false, 1, a, b, 0, c);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "inner dims")) << bad;
}

TEST_P(CudaDTypeTest, AddBiasIsBitExact) {
  const DType dt = GetParam();
  const auto yv = RandomValues(33 * 70, 20, -3, 3, dt);
  const auto bv = RandomValues(70, 21, -3, 3, dt);
  Tensor cy = Upload(*cpu_, dt, {33, 70}, yv), gy = Upload(*gpu_, dt, {33, 70}, yv);
  Tensor cb = Upload(*cpu_, dt, {70}, bv), gb = Upload(*gpu_, dt, {70}, bv);
  AMPD_EXPECT_OK(cpu_->AddBias(cb, cy));
  AMPD_EXPECT_OK(gpu_->AddBias(gb, gy));
  EXPECT_EQ(DownloadBytes(*cpu_, cy), DownloadBytes(*gpu_, gy));
  Tensor short_bias = *gpu_->Allocate(dt, {69});
  const absl::Status bad = gpu_->AddBias(short_bias, gy);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "bias")) << bad;
}

TEST_P(CudaDTypeTest, AddIsBitExactFromEveryXDType) {
  const DType y_dt = GetParam();
  const int64_t rows = 33, cols = 70;
  for (DType x_dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    auto xv = RandomValues(rows * cols, 24, -3, 3, x_dt);
    auto yv = RandomValues(rows * cols, 25, -3, 3, y_dt);
    // Exact cancellation, fp16 overflow, an fp16/bf16 tie (2049), fp16
    // subnormals: the rounding edges where a second rounding would show.
    xv[0] = 1.5f, yv[0] = -1.5f;
    xv[1] = 40000.0f, yv[1] = 30000.0f;
    xv[2] = 1.0f, yv[2] = 2048.0f;
    xv[3] = std::ldexp(1.0f, -24), yv[3] = std::ldexp(3.0f, -24);
    Tensor cx = Upload(*cpu_, x_dt, {rows, cols}, xv), gx = Upload(*gpu_, x_dt, {rows, cols}, xv);
    Tensor cy = Upload(*cpu_, y_dt, {rows, cols}, yv), gy = Upload(*gpu_, y_dt, {rows, cols}, yv);
    AMPD_EXPECT_OK(cpu_->Add(cx, cy));
    AMPD_EXPECT_OK(gpu_->Add(gx, gy));
    EXPECT_EQ(DownloadBytes(*cpu_, cy), DownloadBytes(*gpu_, gy))
        << "x " << DTypeName(x_dt) << " y " << DTypeName(y_dt);
    // Aliased: y += y.
    AMPD_EXPECT_OK(cpu_->Add(cy, cy));
    AMPD_EXPECT_OK(gpu_->Add(gy, gy));
    EXPECT_EQ(DownloadBytes(*cpu_, cy), DownloadBytes(*gpu_, gy)) << "aliased";
  }
  Tensor transposed = *gpu_->Allocate(y_dt, {cols, rows});
  Tensor y = *gpu_->Allocate(y_dt, {rows, cols});
  const absl::Status bad = gpu_->Add(transposed, y);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "Add: x")) << bad;
}

TEST_F(CudaVsCpuTest, ReadScalarsMatchesCpuAfterQueuedWork) {
  // More scalars than the staging buffer starts with, so it grows once;
  // each is written by a queued op the read must wait for.
  const int n = 40;
  const auto v = RandomValues(n, 26, -100, 100, DType::kF32);
  std::vector<Tensor> cs, gs;
  for (int i = 0; i < n; ++i) {
    const std::vector<float> one = {v[static_cast<size_t>(i)]};
    cs.push_back(Upload(*cpu_, DType::kF32, {1, 1}, one));
    gs.push_back(Upload(*gpu_, DType::kF32, {1, 1}, one));
    AMPD_EXPECT_OK(cpu_->Add(cs[0], cs.back()));
    AMPD_EXPECT_OK(gpu_->Add(gs[0], gs.back()));
  }
  std::vector<const Tensor*> cp, gp;
  for (int i = 0; i < n; ++i) cp.push_back(&cs[static_cast<size_t>(i)]);
  for (int i = 0; i < n; ++i) gp.push_back(&gs[static_cast<size_t>(i)]);
  std::vector<float> want(n), got(n, 7.0f);
  AMPD_EXPECT_OK(cpu_->ReadScalars(cp, absl::MakeSpan(want)));
  AMPD_EXPECT_OK(gpu_->ReadScalars(gp, absl::MakeSpan(got)));
  EXPECT_EQ(want, got);
  // The step's three, through the grown buffer again.
  float three[3] = {7, 7, 7};
  const Tensor* const first[] = {gp[5], gp[0], gp[39]};
  AMPD_EXPECT_OK(gpu_->ReadScalars(first, three));
  EXPECT_EQ(three[0], want[5]);
  EXPECT_EQ(three[1], want[0]);
  EXPECT_EQ(three[2], want[39]);
}

TEST_F(CudaVsCpuTest, ReadScalarsNamesTheBadOperand) {
  Tensor a = Upload(*gpu_, DType::kF32, {1}, {1.5f});
  Tensor two = Upload(*gpu_, DType::kF32, {2}, {1.0f, 2.0f});
  Tensor half = Upload(*gpu_, DType::kF16, {1}, {1.0f});
  float out[3] = {7, 7, 7};
  const Tensor* const short_list[] = {&a, &a};
  absl::Status s = gpu_->ReadScalars(short_list, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "out")) << s;
  const Tensor* const wide[] = {&a, &two, &a};
  s = gpu_->ReadScalars(wide, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "scalars[1]")) << s;
  const Tensor* const f16[] = {&a, &a, &half};
  s = gpu_->ReadScalars(f16, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "scalars[2]")) << s;
  const Tensor* const null[] = {nullptr, &a, &a};
  s = gpu_->ReadScalars(null, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "scalars[0]")) << s;
  EXPECT_EQ(out[0], 7.0f);
  EXPECT_EQ(out[1], 7.0f);
  EXPECT_EQ(out[2], 7.0f);
}

TEST_P(CudaDTypeTest, BiasGrad) {
  const DType dt = GetParam();
  const int64_t rows = 300, cols = 70;
  const auto dyv = RandomValues(rows * cols, 30, -1, 1, dt);
  const auto dbv = RandomValues(cols, 31, -1, 1, dt);
  for (float beta : {0.0f, 1.0f}) {
    Tensor cdy = Upload(*cpu_, dt, {rows, cols}, dyv), gdy = Upload(*gpu_, dt, {rows, cols}, dyv);
    Tensor cdb = Upload(*cpu_, dt, {cols}, dbv), gdb = Upload(*gpu_, dt, {cols}, dbv);
    AMPD_EXPECT_OK(cpu_->BiasGrad(cdy, beta, cdb));
    AMPD_EXPECT_OK(gpu_->BiasGrad(gdy, beta, gdb));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += static_cast<float>(rows) * 6e-8f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cdb), Download(*gpu_, gdb), tol)) << "beta " << beta;
  }
}

TEST_P(CudaDTypeTest, ActivationsForwardAndBackward) {
  const DType dt = GetParam();
  const int64_t n = 5000;
  const auto xv = RandomValues(n, 40, -6, 6, dt);
  const auto dyv = RandomValues(n, 41, -2, 2, dt);
  for (Activation act : {Activation::kReLU, Activation::kGELU, Activation::kTanh}) {
    Tensor cx = Upload(*cpu_, dt, {50, 100}, xv), gx = Upload(*gpu_, dt, {50, 100}, xv);
    Tensor cdy = Upload(*cpu_, dt, {50, 100}, dyv), gdy = Upload(*gpu_, dt, {50, 100}, dyv);
    Tensor cy = *cpu_->Allocate(dt, {50, 100}), gy = *gpu_->Allocate(dt, {50, 100});
    Tensor cdx = *cpu_->Allocate(dt, {50, 100}), gdx = *gpu_->Allocate(dt, {50, 100});
    AMPD_EXPECT_OK(cpu_->ActivationForward(act, cx, cy));
    AMPD_EXPECT_OK(gpu_->ActivationForward(act, gx, gy));
    AMPD_EXPECT_OK(cpu_->ActivationBackward(act, cx, cdy, cdx));
    AMPD_EXPECT_OK(gpu_->ActivationBackward(act, gx, gdy, gdx));
    const Tolerance tol = ElementwiseTolerance(dt);
    EXPECT_TRUE(AllClose(Download(*cpu_, cy), Download(*gpu_, gy), tol))
        << "forward " << static_cast<int>(act);
    EXPECT_TRUE(AllClose(Download(*cpu_, cdx), Download(*gpu_, gdx), tol))
        << "backward " << static_cast<int>(act);
  }
}

TEST_P(CudaDTypeTest, LayerNormForwardAndBackward) {
  const DType dt = GetParam();
  const int64_t rows = 67, cols = 300;
  const auto xv = RandomValues(rows * cols, 50, -2, 4, dt);
  const auto gv = RandomValues(cols, 51, 0.5f, 1.5f, dt);
  const auto bv = RandomValues(cols, 52, -0.5f, 0.5f, dt);
  const auto dyv = RandomValues(rows * cols, 53, -1, 1, dt);
  const auto pgv = RandomValues(cols, 54, -1, 1, dt);
  for (bool affine : {true, false}) {
    Tensor cx = Upload(*cpu_, dt, {rows, cols}, xv), gx = Upload(*gpu_, dt, {rows, cols}, xv);
    Tensor cg = Upload(*cpu_, dt, {cols}, gv), gg = Upload(*gpu_, dt, {cols}, gv);
    Tensor cb = Upload(*cpu_, dt, {cols}, bv), gb = Upload(*gpu_, dt, {cols}, bv);
    Tensor cy = *cpu_->Allocate(dt, {rows, cols}), gy = *gpu_->Allocate(dt, {rows, cols});
    Tensor cm = *cpu_->Allocate(DType::kF32, {rows}), gm = *gpu_->Allocate(DType::kF32, {rows});
    Tensor cr = *cpu_->Allocate(DType::kF32, {rows}), gr = *gpu_->Allocate(DType::kF32, {rows});
    AMPD_EXPECT_OK(cpu_->LayerNormForward(cx, affine ? &cg : nullptr, affine ? &cb : nullptr, 1e-5f,
                                          cy, cm, cr));
    AMPD_EXPECT_OK(gpu_->LayerNormForward(gx, affine ? &gg : nullptr, affine ? &gb : nullptr, 1e-5f,
                                          gy, gm, gr));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += 1e-5f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cm), Download(*gpu_, gm), {1e-5f, 1e-6f}));
    EXPECT_TRUE(AllClose(Download(*cpu_, cr), Download(*gpu_, gr), {1e-5f, 1e-6f}));
    EXPECT_TRUE(AllClose(Download(*cpu_, cy), Download(*gpu_, gy), tol)) << "affine " << affine;

    Tensor cdy = Upload(*cpu_, dt, {rows, cols}, dyv), gdy = Upload(*gpu_, dt, {rows, cols}, dyv);
    Tensor cdx = *cpu_->Allocate(dt, {rows, cols}), gdx = *gpu_->Allocate(dt, {rows, cols});
    Tensor cdg = Upload(*cpu_, dt, {cols}, pgv), gdg = Upload(*gpu_, dt, {cols}, pgv);
    Tensor cdb = Upload(*cpu_, dt, {cols}, pgv), gdb = Upload(*gpu_, dt, {cols}, pgv);
    AMPD_EXPECT_OK(cpu_->LayerNormBackward(cx, affine ? &cg : nullptr, cm, cr, cdy, cdx,
                                           affine ? &cdg : nullptr, affine ? &cdb : nullptr));
    AMPD_EXPECT_OK(gpu_->LayerNormBackward(gx, affine ? &gg : nullptr, gm, gr, gdy, gdx,
                                           affine ? &gdg : nullptr, affine ? &gdb : nullptr));
    Tolerance sum_tol = tol;
    sum_tol.atol += static_cast<float>(rows) * 1e-6f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cdx), Download(*gpu_, gdx), sum_tol));
    EXPECT_TRUE(AllClose(Download(*cpu_, cdg), Download(*gpu_, gdg), sum_tol));
    EXPECT_TRUE(AllClose(Download(*cpu_, cdb), Download(*gpu_, gdb), sum_tol));
  }
}

TEST_P(CudaDTypeTest, EmbeddingForwardAndBackward) {
  const DType dt = GetParam();
  const int64_t vocab = 50, cols = 40, n = 500;  // n >> vocab: ids repeat
  const auto tv = RandomValues(vocab * cols, 60, -1, 1, dt);
  const auto dov = RandomValues(n * cols, 61, -1, 1, dt);
  const auto ids = RandomIds(n, 62, vocab);
  for (DType idt : {DType::kI32, DType::kI64}) {
    Tensor cid = UploadIds(*cpu_, idt, {n}, ids), gid = UploadIds(*gpu_, idt, {n}, ids);
    Tensor ct = Upload(*cpu_, dt, {vocab, cols}, tv), gt = Upload(*gpu_, dt, {vocab, cols}, tv);
    Tensor co = *cpu_->Allocate(dt, {n, cols}), go = *gpu_->Allocate(dt, {n, cols});
    AMPD_EXPECT_OK(cpu_->EmbeddingForward(cid, ct, co));
    AMPD_EXPECT_OK(gpu_->EmbeddingForward(gid, gt, go));
    EXPECT_EQ(DownloadBytes(*cpu_, co), DownloadBytes(*gpu_, go));

    Tensor cdo = Upload(*cpu_, dt, {n, cols}, dov), gdo = Upload(*gpu_, dt, {n, cols}, dov);
    AMPD_EXPECT_OK(cpu_->EmbeddingBackward(cid, cdo, ct));
    AMPD_EXPECT_OK(gpu_->EmbeddingBackward(gid, gdo, gt));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += 1e-5f;  // ~10 atomic adds per row in arbitrary order
    EXPECT_TRUE(AllClose(Download(*cpu_, ct), Download(*gpu_, gt), tol)) << DTypeName(idt);
  }
}

TEST_F(CudaVsCpuTest, EmbeddingOutOfRangeIdIsReportedAndWritesNothingOutside) {
  const int64_t vocab = 8, cols = 16;
  Tensor table =
      Upload(*gpu_, DType::kF32, {vocab, cols}, RandomValues(vocab * cols, 70, -1, 1, DType::kF32));
  Tensor ids = UploadIds(*gpu_, DType::kI64, {3}, {1, 1000000, -5});
  Tensor out = *gpu_->Allocate(DType::kF32, {3, cols});
  AMPD_EXPECT_OK(gpu_->EmbeddingForward(ids, table, out));
  const absl::Status s = gpu_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "ids")) << s;
  const std::vector<float> got = Download(*gpu_, out);  // flag cleared: this succeeds
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(got[static_cast<size_t>(cols + c)], 0.0f);
    EXPECT_EQ(got[static_cast<size_t>(2 * cols + c)], 0.0f);
  }
  // The CPU oracle refuses the same ids up front.
  Tensor cids = UploadIds(*cpu_, DType::kI64, {3}, {1, 1000000, -5});
  Tensor ctable = *cpu_->Allocate(DType::kF32, {vocab, cols});
  Tensor cout = *cpu_->Allocate(DType::kF32, {3, cols});
  EXPECT_EQ(cpu_->EmbeddingForward(cids, ctable, cout).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(CudaDTypeTest, MseLoss) {
  const DType dt = GetParam();
  const int64_t rows = 256, cols = 100;
  const auto pv = RandomValues(rows * cols, 80, -2, 2, dt);
  const auto tv = RandomValues(rows * cols, 81, -2, 2, DType::kF32);
  Tensor cp = Upload(*cpu_, dt, {rows, cols}, pv), gp = Upload(*gpu_, dt, {rows, cols}, pv);
  Tensor ct = Upload(*cpu_, DType::kF32, {rows, cols}, tv);
  Tensor gt = Upload(*gpu_, DType::kF32, {rows, cols}, tv);
  Tensor cl = *cpu_->Allocate(DType::kF32, {1}), gl = *gpu_->Allocate(DType::kF32, {1});
  Tensor cd = *cpu_->Allocate(dt, {rows, cols}), gd = *gpu_->Allocate(dt, {rows, cols});
  AMPD_EXPECT_OK(cpu_->MseLoss(cp, ct, 0.5f, 1024.0f, cl, cd));
  AMPD_EXPECT_OK(gpu_->MseLoss(gp, gt, 0.5f, 1024.0f, gl, gd));
  EXPECT_TRUE(AllClose(Download(*cpu_, cl), Download(*gpu_, gl), {1e-5f, 0.0f}));
  EXPECT_TRUE(AllClose(Download(*cpu_, cd), Download(*gpu_, gd), ElementwiseTolerance(dt)));
}

TEST_P(CudaDTypeTest, CrossEntropyLoss) {
  const DType dt = GetParam();
  const int64_t rows = 100, vocab = 1000;
  const auto lv = RandomValues(rows * vocab, 90, -8, 8, dt);
  const auto labels = RandomIds(rows, 91, vocab);
  for (DType idt : {DType::kI32, DType::kI64}) {
    Tensor cx = Upload(*cpu_, dt, {rows, vocab}, lv), gx = Upload(*gpu_, dt, {rows, vocab}, lv);
    Tensor cy = UploadIds(*cpu_, idt, {rows}, labels), gy = UploadIds(*gpu_, idt, {rows}, labels);
    Tensor cl = *cpu_->Allocate(DType::kF32, {1}), gl = *gpu_->Allocate(DType::kF32, {1});
    Tensor cd = *cpu_->Allocate(dt, {rows, vocab}), gd = *gpu_->Allocate(dt, {rows, vocab});
    AMPD_EXPECT_OK(cpu_->CrossEntropyLoss(cx, cy, 1.0f, 65536.0f, cl, cd));
    AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(gx, gy, 1.0f, 65536.0f, gl, gd));
    EXPECT_TRUE(AllClose(Download(*cpu_, cl), Download(*gpu_, gl), {1e-5f, 0.0f}));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += 65536.0f / rows * 1e-7f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cd), Download(*gpu_, gd), tol)) << DTypeName(idt);
  }
}

TEST_P(CudaDTypeTest, GradLog2HistogramCountsExactly) {
  const DType dt = GetParam();
  std::vector<float> values = RandomValues(10000, 100, -1, 1, dt);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] *= std::ldexp(1.0f, static_cast<int>(i % 70) - 40);  // spread over every bin
  }
  // Exact zeros, bin edges and non-finite values.
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.0f, -0.0f, std::ldexp(1.0f, -30), std::ldexp(1.0f, 19), std::ldexp(1.0f, 20),
                  inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
    values.push_back(v);
  }
  const auto other = RandomValues(3000, 101, -100, 100, dt);
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor c1 = Upload(*cpu_, dt, {n}, values), g1 = Upload(*gpu_, dt, {n}, values);
  Tensor c2 = Upload(*cpu_, dt, {3000}, other), g2 = Upload(*gpu_, dt, {3000}, other);
  Tensor cc = *cpu_->Allocate(DType::kI64, {kGradHistogramBins});
  Tensor gc = *gpu_->Allocate(DType::kI64, {kGradHistogramBins});
  std::vector<int64_t> start(kGradHistogramBins);
  for (int b = 0; b < kGradHistogramBins; ++b) start[static_cast<size_t>(b)] = 7 * b + 1;
  AMPD_EXPECT_OK(cpu_->CopyFromHost(start.data(), start.size() * 8, cc));
  AMPD_EXPECT_OK(gpu_->CopyFromHost(start.data(), start.size() * 8, gc));
  const std::vector<const Tensor*> cg = {&c1, &c2}, gg = {&g1, &g2};
  AMPD_EXPECT_OK(cpu_->GradLog2Histogram(cg, cc));
  AMPD_EXPECT_OK(gpu_->GradLog2Histogram(gg, gc));
  EXPECT_EQ(DownloadI64(*cpu_, cc), DownloadI64(*gpu_, gc));
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaDTypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16), DTypeParamName);

}  // namespace
}  // namespace ampd::kernels::cuda_test
