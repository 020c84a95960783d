// WriteKvRows (the contract in kernels/backend.h): every sequence's new key
// and value, column blocks of its fused row, into its own position of a
// layer's K and V caches, in one launch (it replaced two copies per
// sequence and layer). Grid-stride over S x units of a row's W columns;
// the unit is 16 bytes when every address and stride the kernel forms is
// a multiple of 16, else one element: the same bytes either way. A
// sequence whose position is outside [0, T_max) is skipped (the positions
// are device data; the caller keeps them in range).
#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int64_t kVectorBytes = 16;

template <typename U>
__global__ void write_kv_rows_kernel(const U* __restrict__ rows, int64_t row_units, int64_t k_unit,
                                     int64_t v_unit, const void* positions, DType pos_dtype,
                                     int64_t seqs, int64_t t_max, int64_t units,
                                     U* __restrict__ k_cache, U* __restrict__ v_cache) {
  // rows (S, row_units), k_cache and v_cache (S, t_max, units), in units.
  const int64_t n = seqs * units;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t s = i / units;
    const int64_t c = i - s * units;
    const int64_t t = LoadIndex(positions, s, pos_dtype);
    if (t < 0 || t >= t_max) continue;
    const int64_t slot = (s * t_max + t) * units + c;
    const U* row = rows + s * row_units;
    k_cache[slot] = row[k_unit + c];
    v_cache[slot] = row[v_unit + c];
  }
}

template <typename U>
absl::Status Launch(const void* rows, int64_t row_bytes, int64_t k_byte, int64_t v_byte,
                    const void* positions, DType pos_dtype, int64_t seqs, int64_t t_max,
                    int64_t width_bytes, void* k_cache, void* v_cache, cudaStream_t stream) {
  constexpr auto kUnit = static_cast<int64_t>(sizeof(U));
  const int64_t units = width_bytes / kUnit;
  write_kv_rows_kernel<U><<<GridFor(seqs * units), kThreads, 0, stream>>>(
      static_cast<const U*>(rows), row_bytes / kUnit, k_byte / kUnit, v_byte / kUnit, positions,
      pos_dtype, seqs, t_max, units, static_cast<U*>(k_cache), static_cast<U*>(v_cache));
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchWriteKvRows(const void* rows, int64_t row_bytes, int64_t k_byte, int64_t v_byte,
                               const void* positions, DType pos_dtype, int64_t seqs, int64_t t_max,
                               int64_t width_bytes, int64_t elem_bytes, void* k_cache,
                               void* v_cache, cudaStream_t stream) {
  if (seqs == 0 || width_bytes == 0) return absl::OkStatus();
  const auto addr = [](const void* p) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
  };
  // Every byte offset the kernel forms is a sum of multiples of these.
  if (((addr(rows) | addr(k_cache) | addr(v_cache) | row_bytes | k_byte | v_byte | width_bytes) %
       kVectorBytes) == 0) {
    return Launch<uint4>(rows, row_bytes, k_byte, v_byte, positions, pos_dtype, seqs, t_max,
                         width_bytes, k_cache, v_cache, stream);
  }
  switch (elem_bytes) {
    case 1:
      return Launch<uint8_t>(rows, row_bytes, k_byte, v_byte, positions, pos_dtype, seqs, t_max,
                             width_bytes, k_cache, v_cache, stream);
    case 2:
      return Launch<uint16_t>(rows, row_bytes, k_byte, v_byte, positions, pos_dtype, seqs, t_max,
                              width_bytes, k_cache, v_cache, stream);
    case 4:
      return Launch<uint32_t>(rows, row_bytes, k_byte, v_byte, positions, pos_dtype, seqs, t_max,
                              width_bytes, k_cache, v_cache, stream);
    case 8:
      return Launch<uint2>(rows, row_bytes, k_byte, v_byte, positions, pos_dtype, seqs, t_max,
                           width_bytes, k_cache, v_cache, stream);
    default:
      return absl::InternalError("LaunchWriteKvRows: element size must be 1, 2, 4 or 8 bytes");
  }
}

}  // namespace ampd::kernels::cuda
