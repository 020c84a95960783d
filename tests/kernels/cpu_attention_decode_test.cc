// AttentionDecode on the CPU oracle: every decoded row is the causal
// AttentionForward's row for the same position, bit for bit, in every
// float dtype, for plain multi-head and grouped-query attention (H = 4 with
// Hkv = 4, 2, 1), D = 16 and 64, and every position 0 .. 149 (one key to
// more than two key blocks), with several sequences at different positions
// in one call and the cache past each position filled with NaN
// (attention_decode_check.h). Then the refusals, each InvalidArgument
// naming its operand, and S = 0 as a no-op.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/attention_decode_check.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::DecodeDims;
using testing::DecodeRowsAreTheForwardsBits;
using testing::kFloatTypes;
using testing::MakeTensor;

TEST(CpuAttentionDecodeTest, RowsAreTheForwardsBitsInEveryDtype) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  uint64_t seed = 7100;
  for (const DType dt : kFloatTypes) {
    for (const int64_t kv_heads : {4, 2, 1}) {
      for (const int64_t head_dim : {16, 64}) {
        SCOPED_TRACE(::testing::Message()
                     << DTypeName(dt) << " Hkv=" << kv_heads << " D=" << head_dim);
        EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*be, dt, {4, kv_heads, head_dim, 150}, seed++));
      }
    }
  }
}

// A D beyond one channel slice of the CUDA generic kernel, an odd head
// count and one sequence per call: the same property.
TEST(CpuAttentionDecodeTest, RowsAreTheForwardsBitsAtOtherShapes) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*be, DType::kBF16, {6, 3, 160, 70, 2}, 7200));
  EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*be, DType::kF32, {3, 3, 8, 130, 1}, 7201));
}

// Sliding windows (Gemma 3's local layers, with its set scale): inside a
// key block, exactly one block, across blocks, and of one key. The keys
// outside each query's window are NaN in the cache, so none is read into
// the row.
TEST(CpuAttentionDecodeTest, WindowedRowsAreTheForwardsBits) {
  std::unique_ptr<Backend> be = CreateCpuBackend();
  uint64_t seed = 7400;
  for (const DType dt : kFloatTypes) {
    for (const int64_t window : {1, 37, 64, 100}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " window=" << window);
      DecodeDims dims{4, 2, 64, 150};
      dims.options.window = window;
      dims.options.scale = 0.0625f;
      EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*be, dt, dims, seed++));
    }
  }
}

// The thread count does not change the bits (one (s, h) per chunk).
TEST(CpuAttentionDecodeTest, RowsAreTheForwardsBitsOnOneThread) {
  std::unique_ptr<Backend> be = CreateCpuBackend(1);
  EXPECT_TRUE(DecodeRowsAreTheForwardsBits(*be, DType::kF16, {4, 2, 64, 130}, 7300));
}

void ExpectInvalidNaming(const absl::Status& s, const std::string& operand) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(operand), std::string::npos)
      << "message does not name " << operand << ": " << s.message();
}

class CpuAttentionDecodeRefusals : public ::testing::Test {
 protected:
  Tensor Zeros(DType dt, const Shape& shape) {
    return MakeTensor(*be_, dt, shape,
                      std::vector<double>(static_cast<size_t>(NumElements(shape)), 0.0));
  }
  absl::Status Decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos,
                      int64_t heads, int64_t kv_heads, Tensor& out) {
    return be_->AttentionDecode(q, k, v, pos, heads, kv_heads, out);
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  // S = 2, H = 4, Hkv = 2, D = 8, T_max = 5.
  Tensor q_ = Zeros(DType::kF32, {2, 32});
  Tensor k_ = Zeros(DType::kF32, {2, 5, 16});
  Tensor v_ = Zeros(DType::kF32, {2, 5, 16});
  Tensor pos_ = MakeTensor(*be_, DType::kI64, {2}, {0, 4});
  Tensor out_ = Zeros(DType::kF32, {2, 32});
};

TEST_F(CpuAttentionDecodeRefusals, AcceptsTheValidCall) {
  EXPECT_TRUE(Decode(q_, k_, v_, pos_, 4, 2, out_).ok());
}

TEST_F(CpuAttentionDecodeRefusals, NamesTheBadOperand) {
  Tensor q_rank3 = Zeros(DType::kF32, {2, 1, 32});
  ExpectInvalidNaming(Decode(q_rank3, k_, v_, pos_, 4, 2, out_), "q");
  Tensor q_int = Zeros(DType::kI32, {2, 32});
  ExpectInvalidNaming(Decode(q_int, k_, v_, pos_, 4, 2, out_), "q");
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 5, 1, out_), "q");  // 5 heads do not divide 32
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 4, 3, out_), "kv_heads");
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 0, 1, out_), "heads");
  Tensor k_f16 = Zeros(DType::kF16, {2, 5, 16});
  ExpectInvalidNaming(Decode(q_, k_f16, v_, pos_, 4, 2, out_), "k_cache");
  Tensor k_wide = Zeros(DType::kF32, {2, 5, 32});  // Hkv D of 4 kv heads
  ExpectInvalidNaming(Decode(q_, k_wide, v_, pos_, 4, 2, out_), "k_cache");
  Tensor k_seqs = Zeros(DType::kF32, {3, 5, 16});
  ExpectInvalidNaming(Decode(q_, k_seqs, v_, pos_, 4, 2, out_), "k_cache");
  Tensor v_short = Zeros(DType::kF32, {2, 4, 16});  // T_max differs from k_cache's
  ExpectInvalidNaming(Decode(q_, k_, v_short, pos_, 4, 2, out_), "v_cache");
  Tensor pos_f32 = Zeros(DType::kF32, {2});
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_f32, 4, 2, out_), "positions");
  Tensor pos_3 = MakeTensor(*be_, DType::kI32, {3}, {0, 1, 2});
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_3, 4, 2, out_), "positions");
  Tensor out_bf16 = Zeros(DType::kBF16, {2, 32});
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 4, 2, out_bf16), "out");
  Tensor out_short = Zeros(DType::kF32, {2, 16});
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 4, 2, out_short), "out");
  ExpectInvalidNaming(Decode(q_, k_, v_, pos_, 4, 2, q_), "out");  // out over q
}

TEST_F(CpuAttentionDecodeRefusals, RefusesAPositionOutsideTheCache) {
  const std::vector<double> before = testing::ReadTensor(*be_, out_);
  for (const std::vector<double>& bad :
       {std::vector<double>{0, 5}, std::vector<double>{-1, 0}, std::vector<double>{4, 1000}}) {
    for (const DType idt : {DType::kI32, DType::kI64}) {
      Tensor pos = MakeTensor(*be_, idt, {2}, bad);
      const absl::Status s = Decode(q_, k_, v_, pos, 4, 2, out_);
      ExpectInvalidNaming(s, "positions");
      EXPECT_NE(std::string(s.message()).find("T_max = 5"), std::string::npos) << s;
    }
  }
  EXPECT_EQ(testing::ReadTensor(*be_, out_), before) << "a refused call wrote out";
}

TEST_F(CpuAttentionDecodeRefusals, NoSequencesIsANoOp) {
  Tensor q = Zeros(DType::kF16, {0, 32});
  Tensor k = Zeros(DType::kF16, {0, 5, 16});
  Tensor v = Zeros(DType::kF16, {0, 5, 16});
  Tensor pos = Zeros(DType::kI32, {0});
  Tensor out = Zeros(DType::kF16, {0, 32});
  EXPECT_TRUE(Decode(q, k, v, pos, 4, 2, out).ok());
}

}  // namespace
}  // namespace ampd::kernels
