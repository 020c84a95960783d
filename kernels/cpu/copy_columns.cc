// CopyColumns (the contract in kernels/backend.h): a block of columns of
// one matrix copied into a block of another, one memcpy per row, rows split
// over the pool. A byte copy, so any dtype and no rounding.
#include <algorithm>
#include <cstring>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status CopyColumns(ThreadPool& pool, const Tensor& src, int64_t src_col, int64_t cols,
                         Tensor& dst, int64_t dst_col) {
  AMPD_RETURN_IF_ERROR(ValidateCopyColumns(src, src_col, cols, dst, dst_col));
  const int64_t rows = src.dim(0);  // R
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const size_t elem = SizeOf(src.dtype());
  const size_t src_stride = static_cast<size_t>(src.dim(1)) * elem;  // bytes of a src row
  const size_t dst_stride = static_cast<size_t>(dst.dim(1)) * elem;  // bytes of a dst row
  const size_t block = static_cast<size_t>(cols) * elem;             // bytes copied per row
  const auto* in = static_cast<const unsigned char*>(src.data()) +
                   static_cast<size_t>(src_col) * elem;  // (R, Cs) at column src_col
  auto* out = static_cast<unsigned char*>(dst.data()) +
              static_cast<size_t>(dst_col) * elem;  // (R, Cd) at column dst_col
  // Chunks of at least 64 KiB, so that narrow blocks are not split into
  // chunks too small to pay for their hand-off to a worker.
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>((size_t{64} << 10) / block));
  pool.ParallelFor(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(out + static_cast<size_t>(r) * dst_stride,
                  in + static_cast<size_t>(r) * src_stride, block);
    }
  });
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
