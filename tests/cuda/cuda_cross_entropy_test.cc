// The CUDA cross-entropy row engine (kernels/cuda/cross_entropy_rows.cuh)
// against the CPU oracle at the sizes that matter and at its edges: the
// profiled LM-head shapes (GPT-2's 50304-token vocabulary in bf16, a 32768
// vocabulary in fp16) in every dtype, ignored and bad labels there, row
// lengths that are not a multiple of the 16-byte vector (elementwise
// loads), rows that start off a 16-byte boundary (the bits must be those of
// the aligned rows: a row's sum order depends on the row alone), and rows
// longer than one register tile (streamed and re-read, the max raised by a
// later tile, a first tile of -inf).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

constexpr int64_t kIgnore = -100;

// Labels for `rows` rows of `vocab`: every 5th row ignored (when
// `with_ignored`), then the row edges and a group edge (0, V - 1, 7, 8),
// the rest random.
std::vector<int64_t> EdgeLabels(int64_t rows, int64_t vocab, uint32_t seed, bool with_ignored) {
  std::vector<int64_t> ids = RandomIds(rows, seed, vocab);
  const int64_t edges[] = {0, vocab - 1, std::min<int64_t>(7, vocab - 1),
                           std::min<int64_t>(8, vocab - 1)};
  for (int64_t r = 0; r < rows; ++r) {
    if (r < 4) ids[static_cast<size_t>(r)] = edges[r];
    if (with_ignored && r % 5 == 4) ids[static_cast<size_t>(r)] = kIgnore;
  }
  return ids;
}

// The gradient's tolerance: the dtype's rounding, plus an absolute term for
// softmax - 1 at the label, where an ulp of expf or of the row sum is an
// absolute error of `scale`.
Tolerance GradTolerance(DType dt, float scale) {
  const Tolerance e = ElementwiseTolerance(dt);
  return {e.rtol, e.atol + 1e-6f * scale};
}

struct ChunkResult {
  float loss = 0;
  std::vector<float> grad;
  std::vector<uint8_t> grad_bits;
};

ChunkResult RunChunk(Backend& be, DType dt, int64_t rows, int64_t vocab,
                     const std::vector<float>& logits, const std::vector<int64_t>& ids,
                     float loss_scale, float grad_scale, bool in_place) {
  ChunkResult r;
  Tensor x = Upload(be, dt, {rows, vocab}, logits);
  Tensor y = UploadIds(be, DType::kI32, {rows}, ids);
  Tensor l = Upload(be, DType::kF32, {1}, {0.5f});
  Tensor d = in_place ? Tensor() : *be.Allocate(dt, {rows, vocab});
  Tensor& grad = in_place ? x : d;
  const absl::Status s = be.CrossEntropyChunk(x, y, kIgnore, loss_scale, grad_scale, l, grad);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return r;
  r.loss = Download(be, l)[0];
  r.grad = Download(be, grad);
  r.grad_bits = DownloadBytes(be, grad);
  return r;
}

struct MeanResult {
  std::vector<uint8_t> loss_bits;
  float loss = 0;
  std::vector<float> grad;
  std::vector<uint8_t> grad_bits;
};

MeanResult RunMean(Backend& be, DType dt, int64_t rows, int64_t vocab,
                   const std::vector<float>& logits, const std::vector<int64_t>& ids,
                   float multiplier, float grad_scale) {
  MeanResult r;
  Tensor x = Upload(be, dt, {rows, vocab}, logits);
  Tensor y = UploadIds(be, DType::kI64, {rows}, ids);
  Tensor l = *be.Allocate(DType::kF32, {1});
  Tensor d = *be.Allocate(dt, {rows, vocab});
  const absl::Status s = be.CrossEntropyLoss(x, y, multiplier, grad_scale, l, d);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return r;
  r.loss = Download(be, l)[0];
  r.loss_bits = DownloadBytes(be, l);
  r.grad = Download(be, d);
  r.grad_bits = DownloadBytes(be, d);
  return r;
}

TEST_P(CudaDTypeTest, CrossEntropyChunkAtTheProfiledVocabulariesMatchesCpu) {
  // 50304 (GPT-2, one register tile in fp16/bf16, two in fp32) and 32768
  // (the token model); ignored rows and labels at the row and group edges.
  const DType dt = GetParam();
  const int64_t rows = 24;
  for (int64_t vocab : {int64_t{50304}, int64_t{32768}}) {
    SCOPED_TRACE(::testing::Message() << "V=" << vocab);
    const auto lv = RandomValues(rows * vocab, 120, -10, 10, dt);
    const auto ids = EdgeLabels(rows, vocab, 121, /*with_ignored=*/true);
    const float loss_scale = 1.0f / 19, grad_scale = 1024.0f / 19;  // 19 kept rows
    const ChunkResult cpu = RunChunk(*cpu_, dt, rows, vocab, lv, ids, loss_scale, grad_scale, true);
    const ChunkResult gpu = RunChunk(*gpu_, dt, rows, vocab, lv, ids, loss_scale, grad_scale, true);
    EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::fabs(cpu.loss));
    EXPECT_TRUE(AllClose(cpu.grad, gpu.grad, GradTolerance(dt, grad_scale)));
    for (int64_t r = 4; r < rows; r += 5) {  // ignored: exactly 0
      for (int64_t v = 0; v < vocab; ++v) {
        ASSERT_EQ(gpu.grad[static_cast<size_t>(r * vocab + v)], 0.0f) << "row " << r;
      }
    }
    // Into another tensor: the in-place bits.
    const ChunkResult apart =
        RunChunk(*gpu_, dt, rows, vocab, lv, ids, loss_scale, grad_scale, false);
    EXPECT_EQ(apart.grad_bits, gpu.grad_bits);
    EXPECT_NEAR(apart.loss, gpu.loss, 1e-6 * std::fabs(gpu.loss));  // atomics: any row order
  }
}

TEST_P(CudaDTypeTest, CrossEntropyLossAtTheProfiledVocabulariesMatchesCpuAndRepeatsItsBits) {
  const DType dt = GetParam();
  const int64_t rows = 40;
  const float scale = 65536.0f;
  for (int64_t vocab : {int64_t{32768}, int64_t{50304}}) {
    SCOPED_TRACE(::testing::Message() << "V=" << vocab);
    const auto lv = RandomValues(rows * vocab, 122, -8, 8, dt);
    const auto ids = EdgeLabels(rows, vocab, 123, /*with_ignored=*/false);
    const MeanResult cpu = RunMean(*cpu_, dt, rows, vocab, lv, ids, 2.0f, scale);
    const MeanResult gpu = RunMean(*gpu_, dt, rows, vocab, lv, ids, 2.0f, scale);
    EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::fabs(cpu.loss));
    EXPECT_TRUE(AllClose(cpu.grad, gpu.grad, GradTolerance(dt, 2.0f * scale / rows)));
    // The reductions are fixed by the shape: a second run gives the same bits.
    const MeanResult again = RunMean(*gpu_, dt, rows, vocab, lv, ids, 2.0f, scale);
    EXPECT_EQ(again.loss_bits, gpu.loss_bits);
    EXPECT_EQ(again.grad_bits, gpu.grad_bits);
  }
}

TEST_P(CudaDTypeTest, CrossEntropyRowsOfNoWholeVectorMatchCpu) {
  // V not a multiple of the 8 (fp16/bf16) or 4 (fp32) elements of a
  // 16-byte vector: GPT-2's unpadded 50257, and the two smaller row shapes
  // (a block of 256 threads per row, a warp per row).
  const DType dt = GetParam();
  for (int64_t vocab : {int64_t{50257}, int64_t{1003}, int64_t{37}}) {
    SCOPED_TRACE(::testing::Message() << "V=" << vocab);
    const int64_t rows = 21;
    const auto lv = RandomValues(rows * vocab, 124, -10, 10, dt);
    const auto ids = EdgeLabels(rows, vocab, 125, /*with_ignored=*/true);
    const float grad_scale = 256.0f / 17;
    const ChunkResult cpu = RunChunk(*cpu_, dt, rows, vocab, lv, ids, 1.0f / 17, grad_scale, true);
    const ChunkResult gpu = RunChunk(*gpu_, dt, rows, vocab, lv, ids, 1.0f / 17, grad_scale, true);
    EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::fabs(cpu.loss));
    EXPECT_TRUE(AllClose(cpu.grad, gpu.grad, GradTolerance(dt, grad_scale)));
    const auto mean_ids = EdgeLabels(rows, vocab, 126, /*with_ignored=*/false);
    const MeanResult cm = RunMean(*cpu_, dt, rows, vocab, lv, mean_ids, 1.0f, 1024.0f);
    const MeanResult gm = RunMean(*gpu_, dt, rows, vocab, lv, mean_ids, 1.0f, 1024.0f);
    EXPECT_NEAR(gm.loss, cm.loss, 1e-5 * std::fabs(cm.loss));
    EXPECT_TRUE(AllClose(cm.grad, gm.grad, GradTolerance(dt, 1024.0f / rows)));
  }
}

TEST_P(CudaDTypeTest, CrossEntropyRowsOffAVectorBoundaryGiveTheAlignedBits) {
  // The same rows one element into a buffer (2 or 4 bytes off a 16-byte
  // boundary) are loaded element by element, in the groups the vector
  // loads use: loss and gradient are the aligned call's bits.
  const DType dt = GetParam();
  for (int64_t vocab : {int64_t{50304}, int64_t{1000}, int64_t{96}}) {
    SCOPED_TRACE(::testing::Message() << "V=" << vocab);
    const int64_t rows = 9;
    const auto lv = RandomValues(rows * vocab, 127, -10, 10, dt);
    const auto ids = EdgeLabels(rows, vocab, 128, /*with_ignored=*/false);
    std::vector<float> shifted = {0.5f};
    shifted.insert(shifted.end(), lv.begin(), lv.end());
    Tensor buffer = Upload(*gpu_, dt, {rows * vocab + 1}, shifted);
    Tensor x = *buffer.View(1, {rows, vocab});
    Tensor y = UploadIds(*gpu_, DType::kI64, {rows}, ids);
    Tensor out_buffer = *gpu_->Allocate(dt, {rows * vocab + 1});
    Tensor d = *out_buffer.View(1, {rows, vocab});
    Tensor l = *gpu_->Allocate(DType::kF32, {1});
    AMPD_EXPECT_OK(gpu_->CrossEntropyLoss(x, y, 1.0f, 4096.0f, l, d));
    const MeanResult aligned = RunMean(*gpu_, dt, rows, vocab, lv, ids, 1.0f, 4096.0f);
    EXPECT_EQ(DownloadBytes(*gpu_, l), aligned.loss_bits);
    EXPECT_EQ(DownloadBytes(*gpu_, d), aligned.grad_bits);
    // In place, off the boundary: the chunk's gradient bits too.
    Tensor cl = Upload(*gpu_, DType::kF32, {1}, {0.5f});
    Tensor y32 = UploadIds(*gpu_, DType::kI32, {rows}, ids);
    AMPD_EXPECT_OK(gpu_->CrossEntropyChunk(x, y32, kIgnore, 0.25f, 64.0f, cl, x));
    const ChunkResult chunk = RunChunk(*gpu_, dt, rows, vocab, lv, ids, 0.25f, 64.0f, true);
    EXPECT_EQ(DownloadBytes(*gpu_, x), chunk.grad_bits);
    EXPECT_NEAR(Download(*gpu_, cl)[0], chunk.loss, 1e-6 * std::fabs(chunk.loss));
  }
}

TEST_P(CudaDTypeTest, CrossEntropyRowsLongerThanATileMatchCpu) {
  // Rows past one register tile (65536 fp16/bf16 elements, 32768 fp32)
  // are streamed: the max may rise in a later tile (the sum so far is
  // rescaled), and a first tile of -inf (masked logits) adds nothing.
  const DType dt = GetParam();
  const int64_t rows = 4, vocab = 140000;  // 3 tiles in fp16/bf16, 5 in fp32
  std::vector<float> lv = RandomValues(rows * vocab, 129, -10, 10, dt);
  lv[static_cast<size_t>(1 * vocab + vocab - 3)] = 40.0f;  // row 1's max in its last tile
  lv[static_cast<size_t>(2 * vocab + 5)] = 40.0f;          // row 2's in its first
  for (int64_t v = 0; v < 70000; ++v) {                    // row 3: -inf until 70000
    lv[static_cast<size_t>(3 * vocab + v)] = -std::numeric_limits<float>::infinity();
  }
  const std::vector<int64_t> ids = {17, vocab - 3, 139999, 70001};
  const float grad_scale = 512.0f;
  const ChunkResult cpu = RunChunk(*cpu_, dt, rows, vocab, lv, ids, 0.25f, grad_scale, true);
  const ChunkResult gpu = RunChunk(*gpu_, dt, rows, vocab, lv, ids, 0.25f, grad_scale, true);
  ASSERT_TRUE(std::isfinite(cpu.loss));
  EXPECT_NEAR(gpu.loss, cpu.loss, 1e-5 * std::fabs(cpu.loss));
  EXPECT_TRUE(AllClose(cpu.grad, gpu.grad, GradTolerance(dt, grad_scale)));
  const MeanResult cm = RunMean(*cpu_, dt, rows, vocab, lv, ids, 1.0f, 512.0f);
  const MeanResult gm = RunMean(*gpu_, dt, rows, vocab, lv, ids, 1.0f, 512.0f);
  EXPECT_NEAR(gm.loss, cm.loss, 1e-5 * std::fabs(cm.loss));
  EXPECT_TRUE(AllClose(cm.grad, gm.grad, GradTolerance(dt, 512.0f / rows)));
}

TEST_F(CudaVsCpuTest, CrossEntropyBadLabelsAtTheTokenVocabularyAreReportedAndZeroed) {
  // fp16 at V = 32768: rows with labels V and -1 are counted 0 with a zero
  // gradient, the step's read reports them, and the other rows are the
  // oracle's.
  const int64_t rows = 6, vocab = 32768;
  const auto lv = RandomValues(rows * vocab, 130, -6, 6, DType::kF16);
  const std::vector<int64_t> ids = {3, vocab, 0, -1, vocab - 1, 100};
  Tensor x = Upload(*gpu_, DType::kF16, {rows, vocab}, lv);
  Tensor y = UploadIds(*gpu_, DType::kI32, {rows}, ids);
  Tensor l = Upload(*gpu_, DType::kF32, {1}, {0.0f});
  AMPD_EXPECT_OK(gpu_->CrossEntropyChunk(x, y, kIgnore, 1.0f, 8.0f, l, x));
  float got = 0;
  const Tensor* const scalars[] = {&l};
  const absl::Status s = gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(s, "CrossEntropyChunk")) << s;
  // The oracle with the bad rows ignored.
  std::vector<int64_t> kept = ids;
  kept[1] = kIgnore;
  kept[3] = kIgnore;
  const ChunkResult cpu = RunChunk(*cpu_, DType::kF16, rows, vocab, lv, kept, 1.0f, 8.0f, true);
  EXPECT_NEAR(Download(*gpu_, l)[0], cpu.loss - 0.5f, 1e-5 * std::fabs(cpu.loss));
  EXPECT_TRUE(AllClose(cpu.grad, Download(*gpu_, x), GradTolerance(DType::kF16, 8.0f)));
  AMPD_EXPECT_OK(gpu_->ReadScalars(scalars, absl::MakeSpan(&got, 1)));  // cleared
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
