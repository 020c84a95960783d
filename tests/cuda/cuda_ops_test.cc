// CUDA-specific behaviour of the ops, against the CPU oracle where there is
// one to compare with: the staging of uploads and of the step's one read,
// the device error word (a bad id or label reported by the read that ends
// the step, then cleared), the multi-slab reductions (bitwise reproducible
// run to run, aliasing), raw-bit copies, special values (ReLU's selection,
// a loss scale of 2^127, logits around 1e4), the argument errors, word
// for word, and the GPT ops at GPT-2's sizes (a 50304-token vocabulary,
// 64-channel heads; the fused attention's own properties are in
// cuda_attention_test.cc). Each op's values on random inputs in every dtype are compared
// with the oracle by tests/kernels/backend_ops_test.cc, which runs every op
// on every backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

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

TEST_F(CudaVsCpuTest, BadLabelIsReportedByTheStepsReadAndThenCleared) {
  // The error word lives in device memory and comes home inside
  // ReadScalars' one copy: the read that ends the step reports the bad
  // label, and the word is cleared for the next step.
  Tensor logits = Upload(*gpu_, DType::kF32, {2, 4}, RandomValues(8, 27, -1, 1, DType::kF32));
  Tensor labels = UploadIds(*gpu_, DType::kI32, {2}, {1, 9});
  Tensor loss = *gpu_->Allocate(DType::kF32, {1, 1});
  Tensor dlogits = *gpu_->Allocate(DType::kF32, {2, 4});
  AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(logits, labels, 1.0f, 1.0f, loss, dlogits));
  float got = 0;
  const Tensor* const scalars[] = {&loss};
  const absl::Status s = gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "labels")) << s;
  AMPD_EXPECT_OK(gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1)));
  AMPD_EXPECT_OK(gpu_->Synchronize());
}

TEST_F(CudaVsCpuTest, CopyFromHostIsDoneWithItsSourceWhenItReturns) {
  // Uploads are staged in a pinned arena before the async copy, so the
  // caller may reuse its buffer at once; 12 x 256 KiB outgrow the arena's
  // first 1 MiB within one "step", which drains the stream and grows it.
  const int64_t n = 64 * 1024;  // floats: 256 KiB
  std::vector<float> host(static_cast<size_t>(n));
  std::vector<Tensor> uploaded;
  for (int k = 0; k < 12; ++k) {
    for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = static_cast<float>(k * n + i);
    uploaded.push_back(*gpu_->Allocate(DType::kF32, {n}));
    AMPD_EXPECT_OK(gpu_->CopyFromHost(host.data(), host.size() * sizeof(float), uploaded.back()));
    std::fill(host.begin(), host.end(), -1.0f);  // the caller reuses its buffer
  }
  for (int k = 0; k < 12; ++k) {
    const std::vector<float> got = Download(*gpu_, uploaded[static_cast<size_t>(k)]);
    for (int64_t i = 0; i < n; i += 4099) {
      ASSERT_EQ(got[static_cast<size_t>(i)], static_cast<float>(k * n + i)) << k << " " << i;
    }
  }
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

TEST_P(CudaDTypeTest, BadShapesNameTheOperand) {
  // The checks are kernels/op_checks.h's, shared with the CPU: the CUDA
  // backend must run them before it launches anything.
  const DType dt = GetParam();
  Tensor a = Upload(*gpu_, dt, {10, 100}, RandomValues(1000, 3, -5, 5, dt));
  Tensor short_dst = *gpu_->Allocate(dt, {999});
  absl::Status bad = gpu_->Copy(a, short_dst);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "dst")) << bad;

  Tensor ga = *gpu_->Allocate(dt, {4, 5}), gb = *gpu_->Allocate(dt, {6, 7});
  Tensor gc = *gpu_->Allocate(dt, {4, 7});
  bad = gpu_->Gemm(false, false, 1, ga, gb, 0, gc);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "inner dims")) << bad;

  Tensor y = *gpu_->Allocate(dt, {33, 70});
  Tensor short_bias = *gpu_->Allocate(dt, {69});
  bad = gpu_->AddBias(short_bias, y);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "bias")) << bad;

  Tensor transposed = *gpu_->Allocate(dt, {70, 33});
  bad = gpu_->Add(transposed, y);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(bad, "Add: x")) << bad;
}

TEST_P(CudaDTypeTest, BiasGradTallIsSplitIntoSlabsAndReproducible) {
  // 6000 rows over 3 column blocks: the rows are split into slabs whose
  // partials a second pass adds in a fixed order.
  const DType dt = GetParam();
  const int64_t rows = 6000, cols = 70;
  const auto dyv = RandomValues(rows * cols, 32, -1, 1, dt);
  const auto dbv = RandomValues(cols, 33, -1, 1, dt);
  Tensor cdy = Upload(*cpu_, dt, {rows, cols}, dyv), gdy = Upload(*gpu_, dt, {rows, cols}, dyv);
  Tensor cdb = Upload(*cpu_, dt, {cols}, dbv);
  AMPD_EXPECT_OK(cpu_->BiasGrad(cdy, 0.5f, cdb));
  std::vector<uint8_t> first;
  for (int run = 0; run < 2; ++run) {
    Tensor gdb = Upload(*gpu_, dt, {cols}, dbv);
    AMPD_EXPECT_OK(gpu_->BiasGrad(gdy, 0.5f, gdb));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += static_cast<float>(rows) * 6e-8f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cdb), Download(*gpu_, gdb), tol));
    if (run == 0) {
      first = DownloadBytes(*gpu_, gdb);
    } else {
      EXPECT_EQ(DownloadBytes(*gpu_, gdb), first);
    }
  }
}

TEST_P(CudaDTypeTest, ReluBackwardSelectsBitwiseLikeCpu) {
  // dx = x > 0 ? dy : 0: an inf or NaN dy at x <= 0 gives 0 (a product
  // would give NaN), a negative dy at x <= 0 gives +0 (not -0), NaN x gives 0.
  const DType dt = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> xv = {-1.0f, 0.0f, -0.0f, -2.0f, -3.0f, nan, 2.0f, 1e-3f, -1e-3f};
  std::vector<float> dyv = {inf, -inf, nan, -5.0f, -0.0f, 1.0f, -7.0f, inf, -2.0f};
  const auto rx = RandomValues(1000, 42, -3, 3, dt);
  const auto rdy = RandomValues(1000, 43, -3, 3, dt);
  xv.insert(xv.end(), rx.begin(), rx.end());
  dyv.insert(dyv.end(), rdy.begin(), rdy.end());
  const int64_t n = static_cast<int64_t>(xv.size());
  Tensor cx = Upload(*cpu_, dt, {n}, xv), gx = Upload(*gpu_, dt, {n}, xv);
  Tensor cdy = Upload(*cpu_, dt, {n}, dyv), gdy = Upload(*gpu_, dt, {n}, dyv);
  Tensor cdx = *cpu_->Allocate(dt, {n}), gdx = *gpu_->Allocate(dt, {n});
  AMPD_EXPECT_OK(cpu_->ActivationBackward(Activation::kReLU, cx, cdy, cdx));
  AMPD_EXPECT_OK(gpu_->ActivationBackward(Activation::kReLU, gx, gdy, gdx));
  EXPECT_EQ(DownloadBytes(*cpu_, cdx), DownloadBytes(*gpu_, gdx));
  const std::vector<float> got = Download(*gpu_, gdx);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(got[i], 0.0f) << i;
    EXPECT_FALSE(std::signbit(got[i])) << i;
  }
}

TEST_P(CudaDTypeTest, LayerNormBackwardTallSlabsAliasAndReproducible) {
  // Enough rows for several row slabs in the dgamma/dbeta pass; dx written
  // over dy (the column pass must have read dy first); the result the same
  // bits as the non-aliased call, and the same bits on a second run.
  const DType dt = GetParam();
  const int64_t rows = 4000, cols = 96;
  const auto xv = RandomValues(rows * cols, 55, -2, 4, dt);
  const auto gv = RandomValues(cols, 56, 0.5f, 1.5f, dt);
  const auto dyv = RandomValues(rows * cols, 57, -1, 1, dt);
  const auto pgv = RandomValues(cols, 58, -1, 1, dt);
  Tensor cx = Upload(*cpu_, dt, {rows, cols}, xv), gx = Upload(*gpu_, dt, {rows, cols}, xv);
  Tensor cg = Upload(*cpu_, dt, {cols}, gv), gg = Upload(*gpu_, dt, {cols}, gv);
  Tensor cy = *cpu_->Allocate(dt, {rows, cols}), gy = *gpu_->Allocate(dt, {rows, cols});
  Tensor cm = *cpu_->Allocate(DType::kF32, {rows}), gm = *gpu_->Allocate(DType::kF32, {rows});
  Tensor cr = *cpu_->Allocate(DType::kF32, {rows}), gr = *gpu_->Allocate(DType::kF32, {rows});
  AMPD_EXPECT_OK(cpu_->LayerNormForward(cx, &cg, nullptr, 1e-5f, cy, cm, cr));
  AMPD_EXPECT_OK(gpu_->LayerNormForward(gx, &gg, nullptr, 1e-5f, gy, gm, gr));
  Tensor cdy = Upload(*cpu_, dt, {rows, cols}, dyv);
  Tensor cdx = *cpu_->Allocate(dt, {rows, cols});
  Tensor cdg = Upload(*cpu_, dt, {cols}, pgv), cdb = Upload(*cpu_, dt, {cols}, pgv);
  AMPD_EXPECT_OK(cpu_->LayerNormBackward(cx, &cg, cm, cr, cdy, cdx, &cdg, &cdb));
  std::vector<std::vector<uint8_t>> first;
  for (bool aliased : {false, true}) {
    Tensor gdy = Upload(*gpu_, dt, {rows, cols}, dyv);
    Tensor separate = *gpu_->Allocate(dt, {rows, cols});
    Tensor& gdx = aliased ? gdy : separate;
    Tensor gdg = Upload(*gpu_, dt, {cols}, pgv), gdb = Upload(*gpu_, dt, {cols}, pgv);
    AMPD_EXPECT_OK(gpu_->LayerNormBackward(gx, &gg, gm, gr, gdy, gdx, &gdg, &gdb));
    Tolerance tol = ElementwiseTolerance(dt);
    tol.atol += 1e-5f + static_cast<float>(rows) * 1e-6f;
    EXPECT_TRUE(AllClose(Download(*cpu_, cdg), Download(*gpu_, gdg), tol)) << aliased;
    EXPECT_TRUE(AllClose(Download(*cpu_, cdb), Download(*gpu_, gdb), tol)) << aliased;
    std::vector<std::vector<uint8_t>> bits = {DownloadBytes(*gpu_, gdx), DownloadBytes(*gpu_, gdg),
                                              DownloadBytes(*gpu_, gdb)};
    if (!aliased) {
      first = bits;
    } else {
      EXPECT_EQ(bits, first) << "aliased dx differs, or the reduction is not reproducible";
    }
  }
}

TEST_P(CudaDTypeTest, EmbeddingBackwardIsBitExactForEveryDoutDTypeAndSkewedIds) {
  // A large vocabulary mostly untouched, one id repeated thousands of times
  // (a padding token), others a few times; dout in every float dtype.
  const DType dt = GetParam();
  const int64_t vocab = 30000, cols = 200, n = 6000;
  std::vector<int64_t> ids = RandomIds(n, 63, vocab);
  for (int64_t i = 0; i < n; i += 2) ids[static_cast<size_t>(i)] = 7;
  for (int64_t i = 1; i < n; i += 50) ids[static_cast<size_t>(i)] = vocab - 1;
  const auto tv = RandomValues(vocab * cols, 64, -1, 1, dt);
  for (DType dout_dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const auto dov = RandomValues(n * cols, 65, -1, 1, dout_dt);
    Tensor cid = UploadIds(*cpu_, DType::kI64, {n}, ids);
    Tensor gid = UploadIds(*gpu_, DType::kI64, {n}, ids);
    Tensor ct = Upload(*cpu_, dt, {vocab, cols}, tv), gt = Upload(*gpu_, dt, {vocab, cols}, tv);
    Tensor cdo = Upload(*cpu_, dout_dt, {n, cols}, dov);
    Tensor gdo = Upload(*gpu_, dout_dt, {n, cols}, dov);
    AMPD_EXPECT_OK(cpu_->EmbeddingBackward(cid, cdo, ct));
    AMPD_EXPECT_OK(gpu_->EmbeddingBackward(gid, gdo, gt));
    EXPECT_EQ(DownloadBytes(*cpu_, ct), DownloadBytes(*gpu_, gt)) << DTypeName(dout_dt);
  }
}

TEST_F(CudaVsCpuTest, EmbeddingForwardCopiesRawBits) {
  // NaN payloads survive the gather (a trip through fp32 would canonicalise
  // them), like the CPU's memcpy.
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    const int64_t cols = 4;
    std::vector<uint8_t> raw(static_cast<size_t>(2 * cols) * SizeOf(dt));
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(0xFF - 3 * i);
    Tensor ct = *cpu_->Allocate(dt, {2, cols}), gt = *gpu_->Allocate(dt, {2, cols});
    AMPD_EXPECT_OK(cpu_->CopyFromHost(raw.data(), raw.size(), ct));
    AMPD_EXPECT_OK(gpu_->CopyFromHost(raw.data(), raw.size(), gt));
    Tensor cid = UploadIds(*cpu_, DType::kI32, {3}, {1, 0, 1});
    Tensor gid = UploadIds(*gpu_, DType::kI32, {3}, {1, 0, 1});
    Tensor co = *cpu_->Allocate(dt, {3, cols}), go = *gpu_->Allocate(dt, {3, cols});
    AMPD_EXPECT_OK(cpu_->EmbeddingForward(cid, ct, co));
    AMPD_EXPECT_OK(gpu_->EmbeddingForward(gid, gt, go));
    EXPECT_EQ(DownloadBytes(*cpu_, co), DownloadBytes(*gpu_, go)) << DTypeName(dt);
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

// At a loss scale of 2^127 the scale is applied after the coefficient, on
// both backends: zero differences give 0 (not inf * 0 = NaN), bit for bit.
TEST_P(CudaDTypeTest, LossGradientAtTheTopOfTheScaleRangeMatchesCpu) {
  const DType dt = GetParam();
  const float top = 0x1.0p127f;
  const std::vector<float> pv = {0.25f, 0.0f, 1.0f, -1.0f};
  const std::vector<float> tv = {0.0f, 0.0f, 1.0f, -1.0f};
  Tensor cp = Upload(*cpu_, dt, {2, 2}, pv), gp = Upload(*gpu_, dt, {2, 2}, pv);
  Tensor ct = Upload(*cpu_, DType::kF32, {2, 2}, tv), gt = Upload(*gpu_, DType::kF32, {2, 2}, tv);
  Tensor cl = *cpu_->Allocate(DType::kF32, {1}), gl = *gpu_->Allocate(DType::kF32, {1});
  Tensor cd = *cpu_->Allocate(dt, {2, 2}), gd = *gpu_->Allocate(dt, {2, 2});
  AMPD_EXPECT_OK(cpu_->MseLoss(cp, ct, 4.0f, top, cl, cd));
  AMPD_EXPECT_OK(gpu_->MseLoss(gp, gt, 4.0f, top, gl, gd));
  EXPECT_EQ(DownloadBytes(*cpu_, cd), DownloadBytes(*gpu_, gd));
  const std::vector<float> zv = {0.0f, -200.0f, -200.0f, 0.0f};
  Tensor cz = Upload(*cpu_, dt, {2, 2}, zv), gz = Upload(*gpu_, dt, {2, 2}, zv);
  Tensor cy = UploadIds(*cpu_, DType::kI32, {2}, {0, 1});
  Tensor gy = UploadIds(*gpu_, DType::kI32, {2}, {0, 1});
  AMPD_EXPECT_OK(cpu_->CrossEntropyLoss(cz, cy, 4.0f, top, cl, cd));
  AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(gz, gy, 4.0f, top, gl, gd));
  for (float v : Download(*gpu_, gd)) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(DownloadBytes(*cpu_, cd), DownloadBytes(*gpu_, gd));
}

TEST_P(CudaDTypeTest, CrossEntropyLossInPlaceGivesTheNonAliasedBits) {
  // dlogits == logits: the label logit is read before any store, so loss
  // and gradient are the bits of the non-aliased call.
  const DType dt = GetParam();
  const int64_t rows = 100, vocab = 1000;
  const auto lv = RandomValues(rows * vocab, 90, -8, 8, dt);
  const auto labels = RandomIds(rows, 91, vocab);
  for (DType idt : {DType::kI32, DType::kI64}) {
    Tensor gx = Upload(*gpu_, dt, {rows, vocab}, lv);
    Tensor gy = UploadIds(*gpu_, idt, {rows}, labels);
    Tensor gl = *gpu_->Allocate(DType::kF32, {1}), gd = *gpu_->Allocate(dt, {rows, vocab});
    AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(gx, gy, 1.0f, 65536.0f, gl, gd));
    Tensor gl2 = *gpu_->Allocate(DType::kF32, {1});
    AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(gx, gy, 1.0f, 65536.0f, gl2, gx));
    EXPECT_EQ(DownloadBytes(*gpu_, gl2), DownloadBytes(*gpu_, gl)) << "aliased loss";
    EXPECT_EQ(DownloadBytes(*gpu_, gx), DownloadBytes(*gpu_, gd)) << "aliased dlogits";
  }
}

TEST_F(CudaVsCpuTest, CrossEntropyLossHasNoCancellationForLargeLogits) {
  // Logits around 1e4: max + log(sum) - x[label] would lose every digit
  // of the loss to cancellation; log(sum) - (x[label] - max) keeps them.
  const std::vector<float> lv = {10000.0f, 10001.0f, 9999.0f, 10000.5f};
  Tensor cx = Upload(*cpu_, DType::kF32, {1, 4}, lv), gx = Upload(*gpu_, DType::kF32, {1, 4}, lv);
  Tensor cy = UploadIds(*cpu_, DType::kI64, {1}, {1}), gy = UploadIds(*gpu_, DType::kI64, {1}, {1});
  Tensor cl = *cpu_->Allocate(DType::kF32, {1}), gl = *gpu_->Allocate(DType::kF32, {1});
  Tensor cd = *cpu_->Allocate(DType::kF32, {1, 4}), gd = *gpu_->Allocate(DType::kF32, {1, 4});
  AMPD_EXPECT_OK(cpu_->CrossEntropyLoss(cx, cy, 1.0f, 1.0f, cl, cd));
  AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(gx, gy, 1.0f, 1.0f, gl, gd));
  EXPECT_TRUE(AllClose(Download(*cpu_, cl), Download(*gpu_, gl), {1e-5f, 0.0f}));
}

TEST_F(CudaVsCpuTest, DegenerateShapesAreRefusedWithTheCpuMessages) {
  // Each case: the same InvalidArgument, word for word, on both backends.
  auto expect_same = [](const absl::Status& cpu, const absl::Status& gpu, const char* what) {
    EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument) << what << ": " << cpu;
    EXPECT_EQ(gpu.code(), absl::StatusCode::kInvalidArgument) << what << ": " << gpu;
    EXPECT_EQ(gpu.message(), cpu.message()) << what;
  };
  std::vector<std::unique_ptr<Backend>*> both = {&cpu_, &gpu_};
  std::vector<absl::Status> st;
  // MseLoss on no elements.
  for (auto* b : both) {
    Tensor p = *(*b)->Allocate(DType::kF32, {0, 3}), t = *(*b)->Allocate(DType::kF32, {0, 3});
    Tensor d = *(*b)->Allocate(DType::kF32, {0, 3}), l = *(*b)->Allocate(DType::kF32, {1});
    st.push_back((*b)->MseLoss(p, t, 1.0f, 1.0f, l, d));
  }
  expect_same(st[0], st[1], "MseLoss");
  st.clear();
  // CrossEntropyLoss on no rows.
  for (auto* b : both) {
    Tensor x = *(*b)->Allocate(DType::kF32, {0, 5}), d = *(*b)->Allocate(DType::kF32, {0, 5});
    Tensor y = *(*b)->Allocate(DType::kI64, {0}), l = *(*b)->Allocate(DType::kF32, {1});
    st.push_back((*b)->CrossEntropyLoss(x, y, 1.0f, 1.0f, l, d));
  }
  expect_same(st[0], st[1], "CrossEntropyLoss");
  st.clear();
  // LayerNormForward on zero columns.
  for (auto* b : both) {
    Tensor x = *(*b)->Allocate(DType::kF32, {3, 0}), y = *(*b)->Allocate(DType::kF32, {3, 0});
    Tensor m = *(*b)->Allocate(DType::kF32, {3}), r = *(*b)->Allocate(DType::kF32, {3});
    st.push_back((*b)->LayerNormForward(x, nullptr, nullptr, 1e-5f, y, m, r));
  }
  expect_same(st[0], st[1], "LayerNormForward");
  st.clear();
  // LayerNormBackward asked for dgamma without gamma.
  for (auto* b : both) {
    Tensor x = Upload(**b, DType::kF32, {2, 4}, RandomValues(8, 66, -1, 1, DType::kF32));
    Tensor dy = Upload(**b, DType::kF32, {2, 4}, RandomValues(8, 67, -1, 1, DType::kF32));
    Tensor dx = *(*b)->Allocate(DType::kF32, {2, 4});
    Tensor m = Upload(**b, DType::kF32, {2}, {0.0f, 0.0f});
    Tensor r = Upload(**b, DType::kF32, {2}, {1.0f, 1.0f});
    Tensor dg = Upload(**b, DType::kF32, {4}, {0.0f, 0.0f, 0.0f, 0.0f});
    st.push_back((*b)->LayerNormBackward(x, nullptr, m, r, dy, dx, &dg, nullptr));
  }
  expect_same(st[0], st[1], "LayerNormBackward");
  st.clear();
  // GradLog2Histogram counts of the right size but rank 2.
  for (auto* b : both) {
    Tensor counts = *(*b)->Allocate(DType::kI64, {1, kGradHistogramBins});
    const std::vector<const Tensor*> none;
    st.push_back((*b)->GradLog2Histogram(none, counts));
  }
  expect_same(st[0], st[1], "GradLog2Histogram");
}

// ---- the GPT ops ---------------------------------------------------------------

// rtol, and atol as a fraction of the largest |value| of the oracle's output:
// attention's sums of many products make small elements' errors absolute.
Tolerance ScaledTolerance(const std::vector<float>& want, float frac) {
  float max_abs = 0.0f;
  for (float v : want) max_abs = std::max(max_abs, std::fabs(v));
  return {frac, frac * max_abs};
}

TEST_F(CudaVsCpuTest, CrossEntropyChunkBadLabelIsReportedByTheStepsReadAndIgnored) {
  const std::vector<float> lv = RandomValues(12, 70, -2, 2, DType::kF32);
  Tensor logits = Upload(*gpu_, DType::kF32, {3, 4}, lv);
  Tensor labels = UploadIds(*gpu_, DType::kI64, {3}, {1, 9, -100});
  Tensor loss = Upload(*gpu_, DType::kF32, {1}, {0.0f});
  AMPD_EXPECT_OK(gpu_->CrossEntropyChunk(logits, labels, -100, 1.0f, 1.0f, loss, logits));
  float got = 0;
  const Tensor* const scalars[] = {&loss};
  const absl::Status s = gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "CrossEntropyChunk")) << s;
  // Row 0 alone made the loss; the bad and the ignored rows are zeroed.
  Tensor cx = Upload(*cpu_, DType::kF32, {1, 4}, {lv[0], lv[1], lv[2], lv[3]});
  Tensor cy = UploadIds(*cpu_, DType::kI64, {1}, {1});
  Tensor cl = Upload(*cpu_, DType::kF32, {1}, {0.0f});
  AMPD_EXPECT_OK(cpu_->CrossEntropyChunk(cx, cy, -100, 1.0f, 1.0f, cl, cx));
  EXPECT_TRUE(AllClose(Download(*cpu_, cl), Download(*gpu_, loss), {1e-6f, 0.0f}));
  const std::vector<float> grad = Download(*gpu_, logits);
  for (int i = 4; i < 12; ++i) EXPECT_EQ(grad[static_cast<size_t>(i)], 0.0f) << i;
  AMPD_EXPECT_OK(gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1)));  // cleared
}

TEST_P(CudaDTypeTest, CrossEntropyChunkOverGpt2VocabularyMatchesCpu) {
  // GPT-2's padded vocabulary: each row spans many passes of the block.
  const DType dt = GetParam();
  const int64_t rows = 6, vocab = 50304;
  const std::vector<float> lv = RandomValues(rows * vocab, 71, -10, 10, dt);
  const std::vector<int64_t> ids = {50303, 0, -100, 17, 25000, 3};
  std::vector<float> losses;
  std::vector<std::vector<float>> grads;
  for (Backend* be : {cpu_.get(), gpu_.get()}) {
    Tensor x = Upload(*be, dt, {rows, vocab}, lv);
    Tensor y = UploadIds(*be, DType::kI32, {rows}, ids);
    Tensor l = Upload(*be, DType::kF32, {1}, {0.25f});
    AMPD_EXPECT_OK(be->CrossEntropyChunk(x, y, -100, 0.2f, 1024.0f * 0.2f, l, x));  // in place
    losses.push_back(Download(*be, l)[0]);
    grads.push_back(Download(*be, x));
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * std::fabs(losses[0]));
  const Tolerance elementwise = ElementwiseTolerance(dt);
  EXPECT_TRUE(AllClose(grads[0], grads[1], {elementwise.rtol, elementwise.atol + 1e-6f * 205.0f}));
}

TEST_P(CudaDTypeTest, AttentionAtGpt2HeadSizeMatchesCpu) {
  // D = 64 as in GPT-2 (and 128): T = 100 and 300 are not multiples of the
  // 64-key block, T = 1 is a single key, T = 1024 is GPT-2's context. The
  // 16-bit dtypes take the tensor-core kernels, fp32 the generic ones.
  const DType dt = GetParam();
  struct Case {
    int64_t b, t, c, heads;
  };
  const float frac = dt == DType::kF32 ? 1e-4f : dt == DType::kF16 ? 6e-3f : 4e-2f;
  for (const Case& k :
       {Case{2, 100, 192, 3}, Case{3, 1, 128, 2}, Case{1, 300, 256, 2}, Case{1, 1024, 128, 2}}) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << k.b << " T=" << k.t << " C=" << k.c << " H=" << k.heads);
    const int64_t b = k.b, t = k.t, c = k.c, heads = k.heads;
    const std::vector<float> qv = RandomValues(b * t * 3 * c, 72, -1, 1, dt);
    const std::vector<float> gv = RandomValues(b * t * c, 73, -1, 1, dt);
    std::vector<std::vector<float>> out, lse, dqkv;
    std::vector<float> cpu_out, cpu_lse;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      Tensor qkv = Upload(*be, dt, {b, t, 3 * c}, qv);
      Tensor o = *be->Allocate(dt, {b, t, c});
      Tensor l = *be->Allocate(DType::kF32, {b, heads, t});
      AMPD_EXPECT_OK(be->AttentionForward(qkv, heads, o, l));
      out.push_back(Download(*be, o));
      lse.push_back(Download(*be, l));
      if (be == cpu_.get()) {
        cpu_out = out.back();
        cpu_lse = lse.back();
      }
      // Both backwards differentiate the oracle's forward.
      Tensor fo = Upload(*be, dt, {b, t, c}, cpu_out);
      Tensor fl = Upload(*be, DType::kF32, {b, heads, t}, cpu_lse);
      Tensor g = Upload(*be, dt, {b, t, c}, gv);
      Tensor dq = *be->Allocate(dt, {b, t, 3 * c});
      AMPD_EXPECT_OK(be->AttentionBackward(qkv, fo, g, fl, heads, dq));
      dqkv.push_back(Download(*be, dq));
    }
    EXPECT_TRUE(AllClose(out[0], out[1], ScaledTolerance(out[0], frac))) << "out";
    // lse is fp32 in every dtype: its scores are fp32 sums of the same products.
    EXPECT_TRUE(AllClose(lse[0], lse[1], {1e-5f, 1e-5f})) << "lse";
    EXPECT_TRUE(AllClose(dqkv[0], dqkv[1], ScaledTolerance(dqkv[0], frac))) << "dqkv";
  }
}

TEST_F(CudaVsCpuTest, GptOpsRefuseBadArgumentsWithTheCpuMessages) {
  std::vector<absl::Status> st;
  for (Backend* be : {cpu_.get(), gpu_.get()}) {
    Tensor qkv = *be->Allocate(DType::kBF16, {2, 4, 24});
    Tensor out = *be->Allocate(DType::kBF16, {2, 4, 8});
    Tensor lse = *be->Allocate(DType::kF32, {2, 2, 4});
    Tensor logits = *be->Allocate(DType::kBF16, {3, 5});
    Tensor labels = *be->Allocate(DType::kI32, {2});
    Tensor loss = *be->Allocate(DType::kF32, {1});
    st.push_back(be->AttentionForward(qkv, 3, out, lse));
    st.push_back(be->AttentionBackward(qkv, out, out, lse, 2, qkv));
    st.push_back(be->CrossEntropyChunk(logits, labels, -100, 1.0f, 1.0f, loss, logits));
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(st[i].code(), absl::StatusCode::kInvalidArgument) << st[i];
    EXPECT_EQ(st[i + 3].message(), st[i].message());
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDTypes, CudaDTypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16), DTypeParamName);

}  // namespace
}  // namespace ampd::kernels::cuda_test
