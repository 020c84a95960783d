// Fill (dst = value, rounded once to dst's dtype), FillTensors (the same
// over a list of tensors, one launch per kFillTensorsPerLaunch of them) and
// Scale (y = alpha * y, what a GEMM with K == 0 reduces to), 16 bytes per
// access where aligned.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename T>
__global__ void fill_kernel(T* dst, int64_t n, float value, bool vectorized) {
  // (n) every element gets the same rounded value.
  constexpr int N = VecWidth<T>();
  const T v = FromFloat<T>(value);
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.v[j] = v;
        StoreVec<N>(dst, i, out);
      },
      [&](int64_t i) { dst[i] = v; });
}

template <typename T>
__global__ void scale_kernel(T* y, int64_t n, float alpha, bool vectorized) {
  constexpr int N = VecWidth<T>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        Vec<T, N> ys = LoadVec<N>(y, i);
#pragma unroll
        for (int j = 0; j < N; ++j) ys.v[j] = FromFloat<T>(alpha * ToFloat(ys.v[j]));
        StoreVec<N>(y, i, ys);
      },
      [&](int64_t i) { y[i] = FromFloat<T>(alpha * ToFloat(y[i])); });
}

// FillTensors: each thread stores kSlotsPerThread 16-byte slots, a block
// 16 KiB (4096 bf16 elements), consecutive threads on consecutive slots.
constexpr int kSlotsPerThread = 4;
constexpr int64_t kSlotsPerBlock = int64_t{kThreads} * kSlotsPerThread;

using FillChunk = TensorChunk<FillSpan, kFillTensorsPerLaunch>;
static_assert(sizeof(FillChunk) <= 4096, "a FillTensors chunk must fit the kernel parameters");

__global__ void fill_tensors_kernel(const __grid_constant__ FillChunk chunk) {
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const FillSpan& f = chunk.entry[t];
  const auto begin = reinterpret_cast<uintptr_t>(f.data);
  const uintptr_t base = begin & ~uintptr_t{15};
  const uintptr_t end = base + 16 * static_cast<uintptr_t>(f.n - 1) + f.last_bytes;
  const uint32_t p = f.pattern;
  const uint4 word = make_uint4(p, p, p, p);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kSlotsPerBlock;
  for (int k = 0; k < kSlotsPerThread; ++k) {
    const int64_t s = first + k * kThreads + threadIdx.x;
    if (s >= f.n) break;
    const uintptr_t lo = base + 16 * static_cast<uintptr_t>(s);
    if (lo >= begin && lo + 16 <= end) {
      *reinterpret_cast<uint4*>(lo) = word;
      continue;
    }
    // A slot the tensor starts or ends inside: only its own 2-byte halves,
    // each the pattern's half for that address (little-endian: the low
    // half of a 4-byte element is at the address that is 0 mod 4).
    const uintptr_t from = lo > begin ? lo : begin;
    const uintptr_t to = lo + 16 < end ? lo + 16 : end;
    for (uintptr_t a = from; a < to; a += 2) {
      *reinterpret_cast<uint16_t*>(a) = static_cast<uint16_t>((a & 2) != 0 ? p >> 16 : p);
    }
  }
}

}  // namespace

absl::Status LaunchFillTensors(const FillSpan* spans, int count, cudaStream_t stream) {
  AMPD_CUDA_RETURN_IF_ERROR(ForEachChunk<kFillTensorsPerLaunch>(
      spans, count, kSlotsPerBlock, [&](const FillChunk& chunk) {
        fill_tensors_kernel<<<chunk.block_start[chunk.count], kThreads, 0, stream>>>(chunk);
        return cudaGetLastError();
      }));
  return absl::OkStatus();
}

absl::Status LaunchFill(void* dst, DType dtype, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    T* d = static_cast<T*>(dst);
    const bool vectorized = VecAligned<N>(d);
    fill_kernel<T><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(d, n, value, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

absl::Status LaunchScale(void* y, DType dtype, int64_t n, float alpha, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    T* d = static_cast<T*>(y);
    const bool vectorized = VecAligned<N>(d);
    scale_kernel<T><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(d, n, alpha, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
