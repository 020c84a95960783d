// CopyColumns (the contract in kernels/backend.h): a (rows, cols) block of
// one matrix copied into a block of another, as bytes (any dtype, no
// rounding). One launch, grid-stride over the block's units in row-major
// order, so consecutive threads move consecutive units of a row (coalesced
// reads and writes). The unit is 16 bytes when both blocks' starts, both
// row strides and the block's width in bytes are multiples of 16, else one
// element; the bytes written are the same either way.
#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int64_t kVectorBytes = 16;

template <typename U>
__global__ void copy_columns_kernel(const U* __restrict__ src, int64_t src_stride,
                                    U* __restrict__ dst, int64_t dst_stride, int64_t rows,
                                    int64_t units) {
  // src: the block's first unit, rows src_stride units apart; dst likewise
  // with dst_stride; each row `units` units wide.
  const int64_t n = rows * units;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / units;
    const int64_t u = i - r * units;
    dst[r * dst_stride + u] = src[r * src_stride + u];
  }
}

// The copy in units of U (sizeof(U) divides every byte count passed).
template <typename U>
absl::Status Launch(const void* src, int64_t src_stride, void* dst, int64_t dst_stride,
                    int64_t rows, int64_t block_bytes, cudaStream_t stream) {
  constexpr auto kUnit = static_cast<int64_t>(sizeof(U));
  const int64_t units = block_bytes / kUnit;
  copy_columns_kernel<U><<<GridFor(rows * units), kThreads, 0, stream>>>(
      static_cast<const U*>(src), src_stride / kUnit, static_cast<U*>(dst), dst_stride / kUnit,
      rows, units);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchCopyColumns(const void* src, int64_t src_stride, void* dst, int64_t dst_stride,
                               int64_t rows, int64_t block_bytes, int64_t elem_bytes,
                               cudaStream_t stream) {
  if (rows == 0 || block_bytes == 0) return absl::OkStatus();
  const auto src_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src));
  const auto dst_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst));
  // Every byte offset the kernel forms is a sum of these, so one test on
  // their OR decides whether every 16-byte access is aligned.
  if (((src_addr | dst_addr | src_stride | dst_stride | block_bytes) % kVectorBytes) == 0) {
    return Launch<uint4>(src, src_stride, dst, dst_stride, rows, block_bytes, stream);
  }
  switch (elem_bytes) {
    case 1:
      return Launch<uint8_t>(src, src_stride, dst, dst_stride, rows, block_bytes, stream);
    case 2:
      return Launch<uint16_t>(src, src_stride, dst, dst_stride, rows, block_bytes, stream);
    case 4:
      return Launch<uint32_t>(src, src_stride, dst, dst_stride, rows, block_bytes, stream);
    case 8:
      return Launch<uint2>(src, src_stride, dst, dst_stride, rows, block_bytes, stream);
    default:
      return absl::InternalError("LaunchCopyColumns: element size must be 1, 2, 4 or 8 bytes");
  }
}

}  // namespace ampd::kernels::cuda
