// AttentionDecode on the GPU against the GPU's own AttentionForward (the
// CUDA decode against the CPU oracle is in backend_ops_test.cc):
// - with the default kernels, every decoded row is the forward's row bit
//   for bit (attention_decode_check.h: every position 0 .. T-1, several
//   sequences at different positions per call, NaN past each position in
//   the cache, I32 and I64 positions). fp16/bf16 with D = 64 and 128 run
//   the register-tile forward and its decode twin (MHA, GQA, and a group of
//   32 query heads: two 16-row strips per kv head); D = 16 and fp32 run the
//   generic forward and its twin. Tensors from Allocate are 16-byte
//   aligned, so both sides take the same kernel family;
// - so does a sliding-window call (both sides generic);
// - a position outside [0, T_max) gives that sequence NaN rows and leaves
//   the other sequences' rows as they would be (the CUDA backend cannot
//   refuse device data without a sync).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/attention_decode_check.h"

namespace ampd::kernels::cuda_test {
namespace {

using testing::DecodeDims;
using testing::DecodeRowsAreTheForwardsBits;

TEST_P(CudaDTypeTest, AttentionDecodeRowsAreTheForwardsBits) {
  const DType dt = GetParam();
  const DecodeDims kDims[] = {
      {4, 4, 64, 150},  {4, 2, 64, 150}, {4, 1, 64, 150}, {4, 4, 128, 130},
      {4, 2, 128, 130}, {32, 1, 64, 70}, {4, 2, 16, 150}, {6, 3, 160, 70, 2},
  };
  uint64_t seed = 9100;
  for (const DecodeDims& g : kDims) {
    SCOPED_TRACE(::testing::Message()
                 << "H=" << g.heads << " Hkv=" << g.kv_heads << " D=" << g.head_dim);
    EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*gpu_, dt, g, seed++));
  }
}

// Sliding windows with a set scale (Gemma 3's local layers): the forward
// and the decode take their generic kernels whatever the dtype and D, and
// the rows agree bit for bit; the cache rows outside each window are NaN.
TEST_P(CudaDTypeTest, AttentionDecodeWindowedRowsAreTheForwardsBits) {
  const DType dt = GetParam();
  uint64_t seed = 9200;
  for (const int64_t window : {1, 37, 64, 100}) {
    for (const int64_t head_dim : {64, 128}) {
      SCOPED_TRACE(::testing::Message() << "window=" << window << " D=" << head_dim);
      DecodeDims dims{4, 2, head_dim, 150};
      dims.options.window = window;
      dims.options.scale = 0.0625f;
      EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*gpu_, dt, dims, seed++));
    }
  }
}

TEST_P(CudaDTypeTest, AttentionDecodePositionOutsideTheCacheGivesNaNRows) {
  const DType dt = GetParam();
  const int64_t s_len = 3, t_max = 70, heads = 4, kv_heads = 2;
  for (const int64_t d : {int64_t{64}, int64_t{16}}) {  // the register-tile twin, the generic
    SCOPED_TRACE(::testing::Message() << "D=" << d);
    Tensor q =
        Upload(*gpu_, dt, {s_len, heads * d}, RandomValues(s_len * heads * d, 9200, -2, 2, dt));
    const std::vector<float> kv = RandomValues(s_len * t_max * kv_heads * d, 9201, -2, 2, dt);
    Tensor k = Upload(*gpu_, dt, {s_len, t_max, kv_heads * d}, kv);
    Tensor v = Upload(*gpu_, dt, {s_len, t_max, kv_heads * d}, kv);
    Tensor out = *gpu_->Allocate(dt, {s_len, heads * d});
    Tensor good_out = *gpu_->Allocate(dt, {s_len, heads * d});
    Tensor bad = UploadIds(*gpu_, DType::kI64, {s_len}, {5, t_max, -1});
    Tensor good = UploadIds(*gpu_, DType::kI64, {s_len}, {5, 0, 0});
    AMPD_EXPECT_OK(gpu_->AttentionDecode(q, k, v, bad, heads, kv_heads, out));
    AMPD_EXPECT_OK(gpu_->AttentionDecode(q, k, v, good, heads, kv_heads, good_out));
    const std::vector<float> got = Download(*gpu_, out);
    const std::vector<float> want = Download(*gpu_, good_out);
    const int64_t row = heads * d;
    for (int64_t i = 0; i < row; ++i) {
      ASSERT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "sequence 0, " << i;
    }
    for (int64_t i = row; i < s_len * row; ++i) {
      ASSERT_TRUE(std::isnan(got[static_cast<size_t>(i)])) << "element " << i;
    }
  }
}

}  // namespace
}  // namespace ampd::kernels::cuda_test
