// The fused attention kernels' own properties on the GPU, beyond matching
// the CPU oracle's values (cuda_ops_test.cc, backend_ops_test.cc):
// - bitwise reproducible run to run, forward and backward (no atomics; the
//   backward's scratch reused across calls of other shapes);
// - a prefix of a sequence gives the longer sequence's rows bit for bit
//   (out and lse), what a KV-cached decode relies on;
// - the generic kernels where the tensor-core ones do not apply (an
//   unaligned view, head sizes other than 64 and 128) and more (b, h) pairs
//   than a grid's y dimension holds, against the oracle.
// - the register-tile kernels (the default) and the wmma ones
//   (CudaBackendOptions::attention_wmma) against the oracle and each
//   other, at GPT-2 small's shape and at ragged T and D = 128, with both
//   kernels' times at GPT-2 small's full shape printed.
// Each runs the tensor-core kernels (fp16/bf16 with D = 64 and 128; both
// kinds) and the generic ones (fp32, D = 16).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"

namespace ampd::kernels::cuda_test {
namespace {

// A second CUDA backend that runs the wmma attention kernels.
std::unique_ptr<Backend> WmmaBackend() {
  cuda::CudaBackendOptions options;
  options.attention_wmma = true;
  absl::StatusOr<std::unique_ptr<Backend>> be = cuda::CreateCudaBackend(0, options);
  EXPECT_TRUE(be.ok()) << be.status();
  return be.ok() ? *std::move(be) : nullptr;
}

// rtol frac, and atol frac times the largest |value| of the oracle's output
// (as cuda_ops_test.cc's attention comparison).
Tolerance Scaled(const std::vector<float>& want, float frac) {
  float max_abs = 0.0f;
  for (float v : want) max_abs = std::max(max_abs, std::fabs(v));
  return {frac, frac * max_abs};
}

struct Dims {
  int64_t b, t, c, heads;
};

// out, lse and dqkv of one forward and backward on `be`, as raw bytes.
struct AttnBytes {
  std::vector<uint8_t> out, lse, dqkv;
};
AttnBytes ForwardBackward(Backend& be, DType dt, const Dims& s, const std::vector<float>& qv,
                          const std::vector<float>& gv) {
  Tensor qkv = Upload(be, dt, {s.b, s.t, 3 * s.c}, qv);
  Tensor out = *be.Allocate(dt, {s.b, s.t, s.c});
  Tensor lse = *be.Allocate(DType::kF32, {s.b, s.heads, s.t});
  Tensor g = Upload(be, dt, {s.b, s.t, s.c}, gv);
  Tensor dqkv = *be.Allocate(dt, {s.b, s.t, 3 * s.c});
  EXPECT_TRUE(be.AttentionForward(qkv, s.heads, out, lse).ok());
  EXPECT_TRUE(be.AttentionBackward(qkv, out, g, lse, s.heads, dqkv).ok());
  return {DownloadBytes(be, out), DownloadBytes(be, lse), DownloadBytes(be, dqkv)};
}

// D = 64 and 128 (the tensor-core sizes in fp16/bf16) and 16 (generic);
// GPT-2 small's heads at its full context.
const Dims kShapes[] = {{2, 200, 128, 2}, {1, 130, 256, 2}, {2, 150, 32, 2}, {1, 1024, 768, 12}};

TEST_P(CudaDTypeTest, AttentionIsBitwiseReproducible) {
  const DType dt = GetParam();
  std::unique_ptr<Backend> wmma = WmmaBackend();
  ASSERT_NE(wmma, nullptr);
  for (Backend* be : {gpu_.get(), wmma.get()}) {
    SCOPED_TRACE(be == gpu_.get() ? "register-tile kernels" : "wmma kernels");
    for (const Dims& s : kShapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << s.t << " D=" << s.c / s.heads);
      const std::vector<float> qv = RandomValues(s.b * s.t * 3 * s.c, 80, -2, 2, dt);
      const std::vector<float> gv = RandomValues(s.b * s.t * s.c, 81, -1, 1, dt);
      const AttnBytes first = ForwardBackward(*be, dt, s, qv, gv);
      for (int i = 0; i < 3; ++i) {
        // Another shape in between: the backward's scratch is reused at
        // another size, and the kernels run on other tiles.
        const Dims other{3, 70 + i, s.c, s.heads};
        (void)ForwardBackward(*be, dt, other,
                              RandomValues(other.b * other.t * 3 * other.c, 82 + i, -2, 2, dt),
                              RandomValues(other.b * other.t * other.c, 90 + i, -1, 1, dt));
        const AttnBytes again = ForwardBackward(*be, dt, s, qv, gv);
        ASSERT_EQ(again.out, first.out) << i;
        ASSERT_EQ(again.lse, first.lse) << i;
        ASSERT_EQ(again.dqkv, first.dqkv) << i;
      }
    }
  }
}

// The first t rows of a forward at T are rows 0 .. t-1 of the forward at
// the longer T, bit for bit, on `gpu`.
void ExpectPrefixRowsAreTheLongerSequencesBits(Backend& gpu, DType dt) {
  const size_t elem = SizeOf(dt);
  for (const Dims& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "D=" << s.c / s.heads);
    const std::vector<float> qv = RandomValues(s.b * s.t * 3 * s.c, 84, -2, 2, dt);
    Tensor long_qkv = Upload(gpu, dt, {s.b, s.t, 3 * s.c}, qv);
    Tensor long_out = *gpu.Allocate(dt, {s.b, s.t, s.c});
    Tensor long_lse = *gpu.Allocate(DType::kF32, {s.b, s.heads, s.t});
    AMPD_EXPECT_OK(gpu.AttentionForward(long_qkv, s.heads, long_out, long_lse));
    const std::vector<uint8_t> all_out = DownloadBytes(gpu, long_out);
    const std::vector<uint8_t> all_lse = DownloadBytes(gpu, long_lse);
    for (int64_t t : {int64_t{1}, int64_t{2}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{128},
                      int64_t{129}, s.t - 1}) {
      SCOPED_TRACE(::testing::Message() << "t=" << t);
      std::vector<float> prefix;
      for (int64_t b = 0; b < s.b; ++b) {
        const auto row0 = qv.begin() + b * s.t * 3 * s.c;
        prefix.insert(prefix.end(), row0, row0 + t * 3 * s.c);
      }
      Tensor qkv = Upload(gpu, dt, {s.b, t, 3 * s.c}, prefix);
      Tensor out = *gpu.Allocate(dt, {s.b, t, s.c});
      Tensor lse = *gpu.Allocate(DType::kF32, {s.b, s.heads, t});
      AMPD_EXPECT_OK(gpu.AttentionForward(qkv, s.heads, out, lse));
      const std::vector<uint8_t> got_out = DownloadBytes(gpu, out);
      const std::vector<uint8_t> got_lse = DownloadBytes(gpu, lse);
      const size_t out_rows = static_cast<size_t>(t * s.c) * elem;  // t tokens
      const size_t lse_rows = static_cast<size_t>(t) * 4;           // t queries of a head
      for (int64_t b = 0; b < s.b; ++b) {
        ASSERT_TRUE(std::equal(got_out.begin() + b * out_rows, got_out.begin() + (b + 1) * out_rows,
                               all_out.begin() + static_cast<size_t>(b * s.t * s.c) * elem))
            << "out of batch row " << b;
        for (int64_t h = 0; h < s.heads; ++h) {
          const int64_t bh = b * s.heads + h;
          ASSERT_TRUE(std::equal(got_lse.begin() + bh * lse_rows,
                                 got_lse.begin() + (bh + 1) * lse_rows,
                                 all_lse.begin() + static_cast<size_t>(bh * s.t) * 4))
              << "lse of batch row " << b << ", head " << h;
        }
      }
    }
  }
}

TEST_P(CudaDTypeTest, AttentionPrefixRowsAreTheLongerSequencesBits) {
  const DType dt = GetParam();
  std::unique_ptr<Backend> wmma = WmmaBackend();
  ASSERT_NE(wmma, nullptr);
  for (Backend* be : {gpu_.get(), wmma.get()}) {
    SCOPED_TRACE(be == gpu_.get() ? "register-tile kernels" : "wmma kernels");
    ExpectPrefixRowsAreTheLongerSequencesBits(*be, dt);
  }
}

// Views one element into a buffer (2-byte or 4-byte aligned only, so the
// 16-byte tile loads do not apply) and 70000 (b, h) pairs (more than
// gridDim.y's 65535): the same values as the oracle.
TEST_P(CudaDTypeTest, AttentionOfUnalignedViewsAndManyHeadsMatchesCpu) {
  const DType dt = GetParam();
  const float frac = dt == DType::kF32 ? 1e-4f : dt == DType::kF16 ? 6e-3f : 4e-2f;
  auto within = [frac](const std::vector<float>& want, const std::vector<float>& got) {
    float max_abs = 0.0f;
    for (float v : want) max_abs = std::max(max_abs, std::fabs(v));
    return AllClose(want, got, {frac, frac * max_abs});
  };
  for (const Dims& s : {Dims{2, 90, 128, 2}, Dims{35000, 2, 8, 2}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.b << " T=" << s.t);
    const int64_t nq = s.b * s.t * 3 * s.c, no = s.b * s.t * s.c;
    const std::vector<float> qv = RandomValues(nq + 1, 86, -2, 2, dt);
    const std::vector<float> gv = RandomValues(no + 1, 87, -1, 1, dt);
    std::vector<std::vector<float>> out, lse, dqkv;
    std::vector<float> cpu_out, cpu_lse;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      // Every operand a view at element 1 of a buffer one element longer.
      Tensor qbuf = Upload(*be, dt, {nq + 1}, qv);
      Tensor gbuf = Upload(*be, dt, {no + 1}, gv);
      Tensor obuf = *be->Allocate(dt, {no + 1});
      Tensor dbuf = *be->Allocate(dt, {nq + 1});
      Tensor qkv = *qbuf.View(1, {s.b, s.t, 3 * s.c});
      Tensor g = *gbuf.View(1, {s.b, s.t, s.c});
      Tensor o = *obuf.View(1, {s.b, s.t, s.c});
      Tensor dq = *dbuf.View(1, {s.b, s.t, 3 * s.c});
      Tensor l = *be->Allocate(DType::kF32, {s.b, s.heads, s.t});
      AMPD_EXPECT_OK(be->AttentionForward(qkv, s.heads, o, l));
      out.push_back(Download(*be, o));
      lse.push_back(Download(*be, l));
      if (be == cpu_.get()) {
        cpu_out = out.back();
        cpu_lse = lse.back();
      }
      Tensor fo = Upload(*be, dt, {s.b, s.t, s.c}, cpu_out);
      Tensor fl = Upload(*be, DType::kF32, {s.b, s.heads, s.t}, cpu_lse);
      AMPD_EXPECT_OK(be->AttentionBackward(qkv, fo, g, fl, s.heads, dq));
      dqkv.push_back(Download(*be, dq));
    }
    EXPECT_TRUE(within(out[0], out[1])) << "out";
    EXPECT_TRUE(AllClose(lse[0], lse[1], {1e-5f, 1e-5f})) << "lse";
    EXPECT_TRUE(within(dqkv[0], dqkv[1])) << "dqkv";
  }
}

// The register-tile kernels (gpu_, the default) and the wmma ones against
// the oracle, and against each other, in fp16 and bf16: GPT-2 small's
// heads at its context (D = 64, T = 1024), T not a multiple of the 64-key
// block, one token, D = 128, and more (b, h) pairs than gridDim.y holds.
// Both backwards differentiate the oracle's forward.
TEST_F(CudaVsCpuTest, AttentionRegisterTileAndWmmaKernelsMatchCpu) {
  std::unique_ptr<Backend> wmma = WmmaBackend();
  ASSERT_NE(wmma, nullptr);
  for (DType dt : {DType::kF16, DType::kBF16}) {
    const float frac = dt == DType::kF16 ? 6e-3f : 4e-2f;
    for (const Dims& s : {Dims{1, 1024, 768, 12}, Dims{2, 300, 192, 3}, Dims{3, 1, 128, 2},
                          Dims{2, 65, 256, 2}, Dims{1, 1000, 256, 2}, Dims{33000, 2, 128, 2}}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dt) << " B=" << s.b << " T=" << s.t << " D=" << s.c / s.heads);
      const std::vector<float> qv = RandomValues(s.b * s.t * 3 * s.c, 74, -1, 1, dt);
      const std::vector<float> gv = RandomValues(s.b * s.t * s.c, 75, -1, 1, dt);
      std::vector<std::vector<float>> out, lse, dqkv;
      std::vector<float> cpu_out, cpu_lse;
      for (Backend* be : {cpu_.get(), gpu_.get(), wmma.get()}) {
        Tensor qkv = Upload(*be, dt, {s.b, s.t, 3 * s.c}, qv);
        Tensor o = *be->Allocate(dt, {s.b, s.t, s.c});
        Tensor l = *be->Allocate(DType::kF32, {s.b, s.heads, s.t});
        AMPD_EXPECT_OK(be->AttentionForward(qkv, s.heads, o, l));
        out.push_back(Download(*be, o));
        lse.push_back(Download(*be, l));
        if (be == cpu_.get()) {
          cpu_out = out.back();
          cpu_lse = lse.back();
        }
        Tensor fo = Upload(*be, dt, {s.b, s.t, s.c}, cpu_out);
        Tensor fl = Upload(*be, DType::kF32, {s.b, s.heads, s.t}, cpu_lse);
        Tensor g = Upload(*be, dt, {s.b, s.t, s.c}, gv);
        Tensor dq = *be->Allocate(dt, {s.b, s.t, 3 * s.c});
        AMPD_EXPECT_OK(be->AttentionBackward(qkv, fo, g, fl, s.heads, dq));
        dqkv.push_back(Download(*be, dq));
      }
      const char* names[] = {"cpu", "register-tile", "wmma"};
      for (int k = 1; k <= 2; ++k) {
        SCOPED_TRACE(names[k]);
        EXPECT_TRUE(AllClose(out[0], out[k], Scaled(out[0], frac))) << "out";
        EXPECT_TRUE(AllClose(lse[0], lse[k], {1e-5f, 1e-5f})) << "lse";
        EXPECT_TRUE(AllClose(dqkv[0], dqkv[k], Scaled(dqkv[0], frac))) << "dqkv";
      }
      // The two kernels differ from each other only in the order of fp32
      // sums inside a block (and exp's last bits).
      EXPECT_TRUE(AllClose(out[2], out[1], Scaled(out[2], frac))) << "out, register-tile vs wmma";
      EXPECT_TRUE(AllClose(dqkv[2], dqkv[1], Scaled(dqkv[2], frac)))
          << "dqkv, register-tile vs wmma";
    }
  }
}

// CudaDTypeTest is instantiated over every float dtype once, in
// cuda_ops_test.cc; that covers the cases here too.

}  // namespace
}  // namespace ampd::kernels::cuda_test
