// The CPU backend's thread pool and the bit-exactness of the ops it splits:
// every chunk runs exactly once, and Fill, Cast, Add, AddBias, BiasGrad, the
// activations, 16-bit GEMM's widening and rounding, the fused optimizers,
// the histogram and the GPT ops (attention, chunked cross-entropy) write
// the same bytes
// with 1 thread as with 2, 3 or 8, on tensors several chunks long whose
// sizes are not multiples of the chunk.
#include "kernels/cpu/cpu_parallel.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::kFloatTypes;
using testing::MakeTensor;
using testing::RandomValues;
using testing::RawBytes;

TEST(ThreadPoolTest, RunsEveryChunkExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    cpu::ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t chunks : {0, 1, 2, 5, 1000}) {
      // Many calls in a row: a worker that missed or repeated a generation
      // would show up as a count other than 1.
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<std::atomic<int>> runs(static_cast<size_t>(chunks));
        pool.ForEachChunk(chunks, [&](int64_t c) { runs[static_cast<size_t>(c)]++; });
        for (int64_t c = 0; c < chunks; ++c) {
          ASSERT_EQ(runs[static_cast<size_t>(c)].load(), 1)
              << threads << " threads, chunk " << c << " of " << chunks;
        }
      }
    }
  }
}

TEST(ThreadPoolTest, NestedCallsRunInline) {
  cpu::ThreadPool pool(3);
  std::vector<std::atomic<int>> runs(64);
  pool.ForEachChunk(8, [&](int64_t outer) {
    pool.ForEachChunk(8, [&](int64_t inner) { runs[static_cast<size_t>(outer * 8 + inner)]++; });
  });
  for (const std::atomic<int>& r : runs) EXPECT_EQ(r.load(), 1);
}

TEST(ThreadPoolTest, ParallelForCoversTheRangeInGrainSizedPieces) {
  cpu::ThreadPool pool(3);
  const int64_t n = 10007, grain = 1000;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::atomic<int> pieces{0};
  pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(begin % grain, 0);
    EXPECT_EQ(end, std::min(n, begin + grain));
    ++pieces;
    for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)]++;
  });
  EXPECT_EQ(pieces.load(), 11);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << i;
}

// Runs `op` on a fresh backend with `threads` threads and returns the bytes
// of every tensor it reports.
using Op = std::vector<std::vector<unsigned char>> (*)(Backend&, DType);

std::vector<std::vector<unsigned char>> RunWith(int threads, Op op, DType dt) {
  std::unique_ptr<Backend> b = CreateCpuBackend(threads);
  return op(*b, dt);
}

constexpr int64_t kRows = 131, kCols = 1031;  // 135061 elements: 9 chunks, a short last one

Tensor Random(Backend& b, DType dt, const Shape& shape, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  return MakeTensor(b, dt, shape,
                    RandomValues(rng, dt, static_cast<size_t>(NumElements(shape)), lo, hi));
}

std::vector<std::vector<unsigned char>> Elementwise(Backend& b, DType dt) {
  std::vector<std::vector<unsigned char>> out;
  Tensor x = Random(b, dt, {kRows, kCols}, 1, -4, 4);
  Tensor y = Random(b, dt, {kRows, kCols}, 2, -4, 4);
  EXPECT_TRUE(b.Add(x, y).ok());
  out.push_back(RawBytes(b, y));
  Tensor bias = Random(b, dt, {kCols}, 3, -1, 1);
  EXPECT_TRUE(b.AddBias(bias, y).ok());
  out.push_back(RawBytes(b, y));
  Tensor dbias = Random(b, DType::kF32, {kCols}, 4, -1, 1);
  EXPECT_TRUE(b.BiasGrad(y, 0.5f, dbias).ok());
  out.push_back(RawBytes(b, dbias));
  for (DType to : kFloatTypes) {
    Tensor c = *b.Allocate(to, {kRows * kCols});
    EXPECT_TRUE(b.Cast(y, c).ok());
    out.push_back(RawBytes(b, c));
  }
  Tensor f = *b.Allocate(dt, {kRows, kCols});
  EXPECT_TRUE(b.Fill(f, 0.1f).ok());
  out.push_back(RawBytes(b, f));
  for (Activation act :
       {Activation::kReLU, Activation::kGELU, Activation::kTanh, Activation::kGELUTanh}) {
    Tensor a = *b.Allocate(dt, {kRows, kCols});
    EXPECT_TRUE(b.ActivationForward(act, x, a).ok());
    out.push_back(RawBytes(b, a));
    EXPECT_TRUE(b.ActivationBackward(act, x, y, a).ok());
    out.push_back(RawBytes(b, a));
  }
  // 16-bit GEMMs widen their inputs and round their output on the pool.
  Tensor ga = Random(b, dt, {kRows, 64}, 5, -1, 1);
  Tensor gb = Random(b, dt, {64, kCols}, 6, -1, 1);
  EXPECT_TRUE(b.Gemm(false, false, 1.5f, ga, gb, 0.5f, y).ok());
  out.push_back(RawBytes(b, y));
  Tensor counts = *b.Allocate(DType::kI64, {kGradHistogramBins});
  std::vector<int64_t> zeros(kGradHistogramBins, 0);
  EXPECT_TRUE(b.CopyFromHost(zeros.data(), zeros.size() * 8, counts).ok());
  const Tensor* grads[] = {&x, &y, &bias};
  EXPECT_TRUE(b.GradLog2Histogram(grads, counts).ok());
  out.push_back(RawBytes(b, counts));
  return out;
}

std::vector<std::vector<unsigned char>> Optimizers(Backend& b, DType dt) {
  std::vector<std::vector<unsigned char>> out;
  Tensor found_inf = *b.Allocate(DType::kF32, {1});
  EXPECT_TRUE(b.Fill(found_inf, 0.0f).ok());
  Tensor norm_sq = *b.Allocate(DType::kF32, {1});
  EXPECT_TRUE(b.Fill(norm_sq, 9.0f).ok());
  GradTransform tr;
  tr.inv_scale = 0.125f;
  tr.found_inf = &found_inf;
  tr.norm_sq = &norm_sq;
  tr.max_grad_norm = 1.0f;  // clips: sqrt(9) > 1
  for (int adam = 0; adam < 2; ++adam) {
    Tensor master = Random(b, DType::kF32, {kRows, kCols}, 10, -1, 1);
    Tensor working = *b.Allocate(dt, {kRows, kCols});
    Tensor grad = Random(b, dt, {kRows, kCols}, 11, -8, 8);
    Tensor m = Random(b, DType::kF32, {kRows, kCols}, 12, -0.1, 0.1);
    Tensor v = Random(b, DType::kF32, {kRows, kCols}, 13, 0, 0.1);
    ParamRef p{&master, dt == DType::kF32 ? nullptr : &working, &grad, &m, adam ? &v : nullptr};
    for (int step = 1; step <= 2; ++step) {
      if (adam) {
        AdamConfig c;
        c.weight_decay = 0.01f;
        EXPECT_TRUE(b.AdamUpdate({&p, 1}, c, step, tr).ok());
      } else {
        SgdConfig c;
        c.momentum = 0.9f;
        c.weight_decay = 0.01f;
        c.nesterov = true;
        EXPECT_TRUE(b.SgdUpdate({&p, 1}, c, step == 1, tr).ok());
      }
    }
    out.push_back(RawBytes(b, master));
    out.push_back(RawBytes(b, m));
    if (adam) out.push_back(RawBytes(b, v));
    if (p.working != nullptr) out.push_back(RawBytes(b, working));
  }
  return out;
}

// Attention splits over (batch, head) pairs, cross-entropy over rows (in
// place here, with ignored rows, into a loss that accumulates).
std::vector<std::vector<unsigned char>> GptOps(Backend& b, DType dt) {
  std::vector<std::vector<unsigned char>> out;
  const int64_t batch = 3, seq = 70, channels = 48, heads = 4;  // two key blocks
  Tensor qkv = Random(b, dt, {batch, seq, 3 * channels}, 20, -1.5, 1.5);
  Tensor y = *b.Allocate(dt, {batch, seq, channels});
  Tensor lse = *b.Allocate(DType::kF32, {batch, heads, seq});
  EXPECT_TRUE(b.AttentionForward(qkv, heads, y, lse).ok());
  out.push_back(RawBytes(b, y));
  out.push_back(RawBytes(b, lse));
  Tensor dy = Random(b, dt, {batch, seq, channels}, 21, -1, 1);
  Tensor dqkv = *b.Allocate(dt, {batch, seq, 3 * channels});
  EXPECT_TRUE(b.AttentionBackward(qkv, y, dy, lse, heads, dqkv).ok());
  out.push_back(RawBytes(b, dqkv));
  Tensor logits = Random(b, dt, {kRows, 257}, 22, -6, 6);
  std::vector<double> ids(static_cast<size_t>(kRows));
  for (int64_t i = 0; i < kRows; ++i)
    ids[static_cast<size_t>(i)] = i % 7 == 3 ? -100 : i * 31 % 257;
  Tensor labels = MakeTensor(b, DType::kI64, {kRows}, ids);
  Tensor loss = Random(b, DType::kF32, {1}, 23, 0, 1);
  for (int chunk = 0; chunk < 2; ++chunk) {
    EXPECT_TRUE(b.CrossEntropyChunk(logits, labels, -100, 0.01f, 64.0f, loss, logits).ok());
  }
  out.push_back(RawBytes(b, logits));
  out.push_back(RawBytes(b, loss));
  return out;
}

TEST(CpuThreadingTest, GptOpsAreBitExactAcrossThreadCounts) {
  for (DType dt : kFloatTypes) {
    const auto want = RunWith(1, GptOps, dt);
    for (int threads : {2, 3, 8}) {
      EXPECT_EQ(RunWith(threads, GptOps, dt), want)
          << DTypeName(dt) << ", " << threads << " threads";
    }
  }
}

TEST(CpuThreadingTest, ElementwiseOpsAreBitExactAcrossThreadCounts) {
  for (DType dt : kFloatTypes) {
    const auto want = RunWith(1, Elementwise, dt);
    for (int threads : {2, 3, 8}) {
      EXPECT_EQ(RunWith(threads, Elementwise, dt), want)
          << DTypeName(dt) << ", " << threads << " threads";
    }
  }
}

TEST(CpuThreadingTest, OptimizersAreBitExactAcrossThreadCounts) {
  for (DType dt : kFloatTypes) {
    const auto want = RunWith(1, Optimizers, dt);
    for (int threads : {2, 3, 8}) {
      EXPECT_EQ(RunWith(threads, Optimizers, dt), want)
          << DTypeName(dt) << ", " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace ampd::kernels
