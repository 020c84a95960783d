// The CPU backend's CopyColumns: a column block of one matrix copied into a
// column block of another, byte for byte in every dtype (NaN payloads and
// all), every other byte of dst untouched, rows split over the thread pool
// for tall inputs, and each refused argument named. (CUDA against this
// oracle is backend_ops_test's CopyColumns cases.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::RawBytes;

const DType kAllDTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kI32,
                            DType::kI64, DType::kU8,  DType::kBool};

class CpuCopyColumnsTest : public ::testing::Test {
 protected:
  // A tensor of random bytes (any bit pattern: NaNs with payloads,
  // subnormals, Bool bytes other than 0 and 1), so that a copy that goes
  // through a float conversion or a wrong offset cannot go unseen.
  Tensor RandomBytes(DType dt, const Shape& shape) {
    absl::StatusOr<Tensor> t = be_->Allocate(dt, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    std::vector<unsigned char> bytes(t->nbytes());
    for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng_());
    EXPECT_TRUE(be_->CopyFromHost(bytes.data(), bytes.size(), *t).ok());
    return std::move(*t);
  }

  std::unique_ptr<Backend> be_ = CreateCpuBackend();
  std::mt19937_64 rng_{20261127};  // fixed: failures reproduce
};

// dst's bytes after the copy, computed here from the bytes before it.
std::vector<unsigned char> Expected(const std::vector<unsigned char>& src, int64_t src_width,
                                    int64_t src_col, int64_t cols, std::vector<unsigned char> dst,
                                    int64_t dst_width, int64_t dst_col, int64_t rows, size_t elem) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      for (size_t b = 0; b < elem; ++b) {
        dst[static_cast<size_t>(r * dst_width + dst_col + c) * elem + b] =
            src[static_cast<size_t>(r * src_width + src_col + c) * elem + b];
      }
    }
  }
  return dst;
}

// (rows, src width, src_col, cols, dst width, dst_col): blocks at the left
// and right edges, odd offsets and widths, a whole-width copy, and a tall
// block that the pool splits into several chunks.
struct Block {
  int64_t rows, src_width, src_col, cols, dst_width, dst_col;
};
const Block kBlocks[] = {
    {5, 11, 3, 6, 13, 4},  {1, 7, 0, 7, 7, 0},     {4, 9, 8, 1, 3, 2},
    {6, 16, 0, 5, 21, 16}, {3, 40, 17, 23, 23, 0}, {20000, 12, 5, 7, 9, 1},
};

TEST_F(CpuCopyColumnsTest, CopiesTheBlockAndLeavesTheRestOfDst) {
  for (DType dt : kAllDTypes) {
    for (const Block& k : kBlocks) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dt) << " rows " << k.rows << " src (" << k.src_width << ") at "
                   << k.src_col << ", cols " << k.cols << ", dst (" << k.dst_width << ") at "
                   << k.dst_col);
      Tensor src = RandomBytes(dt, {k.rows, k.src_width});
      Tensor dst = RandomBytes(dt, {k.rows, k.dst_width});
      const std::vector<unsigned char> src_before = RawBytes(*be_, src);
      const std::vector<unsigned char> want =
          Expected(src_before, k.src_width, k.src_col, k.cols, RawBytes(*be_, dst), k.dst_width,
                   k.dst_col, k.rows, SizeOf(dt));
      ASSERT_TRUE(be_->CopyColumns(src, k.src_col, k.cols, dst, k.dst_col).ok());
      EXPECT_TRUE(RawBytes(*be_, dst) == want);
      EXPECT_TRUE(RawBytes(*be_, src) == src_before) << "src was written";
    }
  }
}

// cols == 0 writes nothing, wherever the empty block sits (its end may be
// the last column); so do zero rows.
TEST_F(CpuCopyColumnsTest, AnEmptyBlockIsANoOp) {
  Tensor src = RandomBytes(DType::kF16, {4, 6});
  Tensor dst = RandomBytes(DType::kF16, {4, 9});
  const std::vector<unsigned char> before = RawBytes(*be_, dst);
  for (const auto& [src_col, dst_col] : {std::pair{0, 0}, {6, 9}, {3, 5}}) {
    ASSERT_TRUE(be_->CopyColumns(src, src_col, 0, dst, dst_col).ok());
  }
  EXPECT_TRUE(RawBytes(*be_, dst) == before);
  Tensor no_rows_src = RandomBytes(DType::kF32, {0, 6});
  Tensor no_rows_dst = RandomBytes(DType::kF32, {0, 4});
  EXPECT_TRUE(be_->CopyColumns(no_rows_src, 1, 4, no_rows_dst, 0).ok());
}

// Two disjoint views of one buffer are two tensors: a copy between them is
// allowed, and reaches only dst's view.
TEST_F(CpuCopyColumnsTest, CopiesBetweenDisjointViewsOfOneBuffer) {
  Tensor parent = RandomBytes(DType::kBF16, {4, 10});
  const std::vector<unsigned char> before = RawBytes(*be_, parent);
  absl::StatusOr<Tensor> top = parent.View(0, {2, 10});
  absl::StatusOr<Tensor> bottom = parent.View(20, {2, 10});
  ASSERT_TRUE(top.ok() && bottom.ok());
  ASSERT_TRUE(be_->CopyColumns(*top, 1, 4, *bottom, 6).ok());
  std::vector<unsigned char> want = before;
  for (size_t r = 0; r < 2; ++r) {
    std::memcpy(&want[((2 + r) * 10 + 6) * 2], &before[(r * 10 + 1) * 2], 4 * 2);
  }
  EXPECT_TRUE(RawBytes(*be_, parent) == want);
}

// Each refusal is InvalidArgument naming the op and the argument, and
// leaves dst as it was.
TEST_F(CpuCopyColumnsTest, RefusesBadArgumentsNamingThem) {
  Tensor src = RandomBytes(DType::kF32, {4, 6});
  Tensor dst = RandomBytes(DType::kF32, {4, 9});
  Tensor dst_f16 = RandomBytes(DType::kF16, {4, 9});
  Tensor dst_rows = RandomBytes(DType::kF32, {5, 9});
  Tensor src_3d = RandomBytes(DType::kF32, {2, 2, 6});
  Tensor dst_1d = RandomBytes(DType::kF32, {36});
  Tensor no_memory(nullptr, DType::kF32, {4, 9});
  Tensor parent = RandomBytes(DType::kF32, {4, 9});
  absl::StatusOr<Tensor> view_a = parent.View(0, {2, 9});
  absl::StatusOr<Tensor> view_b = parent.View(5, {2, 9});  // shares 13 elements with view_a
  ASSERT_TRUE(view_a.ok() && view_b.ok());
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::vector<unsigned char> dst_before = RawBytes(*be_, dst);
  const std::vector<unsigned char> parent_before = RawBytes(*be_, parent);

  struct Bad {
    const char* what;
    absl::Status status;
    std::string names;  // a word the message must hold besides "CopyColumns"
  };
  const Bad bad[] = {
      {"negative cols", be_->CopyColumns(src, 0, -1, dst, 0), "cols is -1"},
      {"negative src_col", be_->CopyColumns(src, -1, 2, dst, 0), "src_col"},
      {"block past src's end", be_->CopyColumns(src, 5, 2, dst, 0), "src_col"},
      {"cols wider than src", be_->CopyColumns(src, 0, 7, dst, 0), "src_col"},
      {"src_col near int64's max", be_->CopyColumns(src, kMax, 1, dst, 0), "src_col"},
      {"cols at int64's max", be_->CopyColumns(src, 1, kMax, dst, 0), "src_col"},
      {"negative dst_col", be_->CopyColumns(src, 0, 2, dst, -3), "dst_col"},
      {"block past dst's end", be_->CopyColumns(src, 0, 6, dst, 4), "dst_col"},
      {"dst_col near int64's max", be_->CopyColumns(src, 0, 1, dst, kMax), "dst_col"},
      {"dtypes differ", be_->CopyColumns(src, 0, 2, dst_f16, 0), "dtypes differ"},
      {"rows differ", be_->CopyColumns(src, 0, 2, dst_rows, 0), "row counts differ"},
      {"3-D src", be_->CopyColumns(src_3d, 0, 2, dst, 0), "src is F32(2, 2, 6)"},
      {"1-D dst", be_->CopyColumns(src, 0, 2, dst_1d, 0), "dst is F32(36)"},
      {"dst without memory", be_->CopyColumns(src, 0, 2, no_memory, 0), "holds no memory"},
      {"overlapping views", be_->CopyColumns(*view_a, 0, 2, *view_b, 0), "overlaps src"},
      {"src is dst", be_->CopyColumns(dst, 0, 2, dst, 4), "overlaps src"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    EXPECT_EQ(b.status.code(), absl::StatusCode::kInvalidArgument) << b.status;
    const std::string message(b.status.message());
    EXPECT_EQ(message.rfind("CopyColumns: ", 0), 0u) << message;
    EXPECT_NE(message.find(b.names), std::string::npos) << message;
  }
  EXPECT_TRUE(RawBytes(*be_, dst) == dst_before);
  EXPECT_TRUE(RawBytes(*be_, parent) == parent_before);
}

}  // namespace
}  // namespace ampd::kernels
