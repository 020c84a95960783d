// Device-side helpers shared by the kernels: fp32 loads and single-rounding
// stores per dtype, warp/block sums, grid sizing, and the multi-tensor
// "chunk" that lets one launch cover a list of tensors. CUDA C++17.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

constexpr int kThreads = 256;
// Grid-stride kernels need no more than this many blocks to fill an H100
// (132 SMs x 8 resident blocks of 256 threads, with headroom).
constexpr int64_t kMaxGridBlocks = 4096;

inline unsigned GridFor(int64_t n, int64_t per_block = kThreads) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxGridBlocks)));
}

// ---- element access --------------------------------------------------------
// Stores round once, nearest-even, like kernels/float16.h: __float2half_rn
// and __float2bfloat16_rn are IEEE RNE with overflow to inf and subnormals.
// Only NaN payloads may differ from the CPU (CUDA writes the canonical NaN).
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Runtime-dtype access for kernels that are not worth a template per dtype:
// the switch is uniform across the grid, so it never diverges.
__device__ __forceinline__ float LoadAs(const void* p, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// v rounded to dtype and widened back (identity for F32).
__device__ __forceinline__ float RoundAs(float v, DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return __half2float(__float2half_rn(v));
    case DType::kBF16:
      return __bfloat162float(__float2bfloat16_rn(v));
    default:
      return v;
  }
}

__device__ __forceinline__ void StoreAs(void* p, int64_t i, DType dtype, float v) {
  switch (dtype) {
    case DType::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

// ---- 128-bit access ----------------------------------------------------------
// Elementwise kernels move 16 bytes per load and store where the data
// allows it: Vec<T, N> is N consecutive elements aligned as one access, N
// chosen so the widest operand's vector is 16 bytes (8 fp16/bf16 or 4
// fp32; a narrower operand of a mixed-dtype op then moves 8 bytes). The
// arithmetic per element is unchanged, so vectorised results are bitwise
// those of the scalar loop, which still handles the tail and any operand
// that is not aligned.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, typename U = T>
__host__ __device__ constexpr int VecWidth() {
  return static_cast<int>(16 / (sizeof(T) > sizeof(U) ? sizeof(T) : sizeof(U)));
}

// Host and device: whether p is aligned for Vec<T, N> accesses.
template <int N, typename T>
__host__ __device__ __forceinline__ bool VecAligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> LoadVec(const T* p, int64_t i) {
  return *reinterpret_cast<const Vec<T, N>*>(p + i);
}
template <int N, typename T>
__device__ __forceinline__ void StoreVec(T* p, int64_t i, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p + i) = v;
}

// Grid-stride over [0, n): vector(i) for each i = 0, N, 2N, ... below
// n - n % N when `vectorized`, then scalar(i) for every index left. Each
// index is handled exactly once, by one thread, which reads its elements
// before writing them (in-place use stays safe).
template <int N, typename VectorFn, typename ScalarFn>
__device__ __forceinline__ void GridStride(int64_t n, bool vectorized, VectorFn&& vector,
                                           ScalarFn&& scalar) {
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t done = 0;
  if (vectorized) {
    const int64_t vectors = n / N;
    for (int64_t v = first; v < vectors; v += stride) vector(v * N);
    done = vectors * N;
  }
  for (int64_t i = done + first; i < n; i += stride) scalar(i);
}

// Blocks for GridStride over n elements, N at a time.
template <int N>
inline unsigned GridForVec(int64_t n, bool vectorized) {
  return GridFor(vectorized ? (n + N - 1) / N : n);
}

// Calls fn(T{}) on the host with T the storage type of a float dtype, to
// pick a kernel template's instantiation.
template <typename Fn>
decltype(auto) DispatchFloat(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16:
      return fn(__half{});
    case DType::kBF16:
      return fn(__nv_bfloat16{});
    default:
      return fn(float{});
  }
}

__device__ __forceinline__ int64_t LoadIndex(const void* ids, int64_t i, DType dtype) {
  return dtype == DType::kI32 ? static_cast<int64_t>(static_cast<const int32_t*>(ids)[i])
                              : static_cast<const int64_t*>(ids)[i];
}

// ---- reductions ------------------------------------------------------------
__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. Fixed reduction order: deterministic.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  float total = lane < warps ? warp_sums[lane] : 0.0f;
  return WarpSum(total);
}

// The block's max of v >= 0 (fmaxf drops NaN; 0 fills the missing warps),
// for every thread. Same shape and constraints as BlockSum.
__device__ __forceinline__ float BlockMaxNonNegative(float v) {
  __shared__ float warp_maxes[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpMax(v);
  __syncthreads();  // warp_maxes may still be read by a previous call
  if (lane == 0) warp_maxes[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  return WarpMax(lane < warps ? warp_maxes[lane] : 0.0f);
}

// ---- warp-per-row reductions with 16-byte loads ------------------------------
// A warp that reduces a row lets lane l own columns l, l + 32, l + 64, ...
// and add them in that order before the fixed-order WarpSum; the bits of
// the result depend on that order. ForEachOwnColumn keeps it while loading
// 16 bytes per lane: each tile of 32 N columns is loaded as one vector per
// lane, widened into the warp's shared `stage` (32 N floats per array) and
// read back strided, so lane l still visits columns l, l + 32, ... in
// increasing order; the columns past the last whole tile (which starts at
// a multiple of 32) are read one by one. fn(c, values...) gets each of the
// lane's columns with the fp32 values of every row array at c. Every lane
// of the warp must call it (the tiles synchronise the warp); vectorized
// needs cols % N == 0 and every row pointer 16-byte aligned.
template <int N, typename T, typename Fn>
__device__ __forceinline__ void ForEachOwnColumn(const T* row, int64_t cols, bool vectorized,
                                                 float* stage, Fn&& fn) {
  const int lane = threadIdx.x & 31;
  int64_t c0 = 0;
  if (vectorized) {
    for (; c0 + 32 * N <= cols; c0 += 32 * N) {
      const Vec<T, N> v = LoadVec<N>(row, c0 + lane * N);
#pragma unroll
      for (int j = 0; j < N; ++j) stage[lane * N + j] = ToFloat(v.v[j]);
      __syncwarp();
#pragma unroll
      for (int j = 0; j < N; ++j) fn(c0 + lane + 32 * j, stage[lane + 32 * j]);
      __syncwarp();  // the stage is rewritten by the next tile
    }
  }
  for (int64_t c = c0 + lane; c < cols; c += 32) fn(c, ToFloat(row[c]));
}

// The same over two row arrays of one shape (x and dy); stage holds 2 x 32 N floats.
template <int N, typename T, typename Fn>
__device__ __forceinline__ void ForEachOwnColumn(const T* row_a, const T* row_b, int64_t cols,
                                                 bool vectorized, float* stage, Fn&& fn) {
  const int lane = threadIdx.x & 31;
  float* stage_b = stage + 32 * N;
  int64_t c0 = 0;
  if (vectorized) {
    for (; c0 + 32 * N <= cols; c0 += 32 * N) {
      const Vec<T, N> va = LoadVec<N>(row_a, c0 + lane * N);
      const Vec<T, N> vb = LoadVec<N>(row_b, c0 + lane * N);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        stage[lane * N + j] = ToFloat(va.v[j]);
        stage_b[lane * N + j] = ToFloat(vb.v[j]);
      }
      __syncwarp();
#pragma unroll
      for (int j = 0; j < N; ++j) {
        fn(c0 + lane + 32 * j, stage[lane + 32 * j], stage_b[lane + 32 * j]);
      }
      __syncwarp();
    }
  }
  for (int64_t c = c0 + lane; c < cols; c += 32) fn(c, ToFloat(row_a[c]), ToFloat(row_b[c]));
}

// ---- multi-tensor launches -------------------------------------------------
// A chunk lists up to kChunkTensors tensors (kCapacity where an op's entries
// are small enough for more) and, for each, the first block that works on
// it; block b handles tile (b - block_start[t]) of tensor t. It travels as a
// __grid_constant__ kernel parameter (< 4 KiB), so a list of tensors costs
// one launch per kCapacity tensors and no host->device copy.
constexpr int kChunkTensors = 24;

template <typename Entry, int kCapacity = kChunkTensors>
struct TensorChunk {
  int count = 0;
  int block_start[kCapacity + 1] = {};
  Entry entry[kCapacity];
};

template <typename Entry, int kCapacity>
__device__ __forceinline__ int ChunkTensorOf(const TensorChunk<Entry, kCapacity>& chunk,
                                             int block) {
  int t = 0;
  while (t + 1 < chunk.count && block >= chunk.block_start[t + 1]) ++t;
  return t;
}

// Splits entries[0, count) (each with a member n) into chunks of tiles of
// `tile` elements and calls launch(chunk) for each; empty tensors are skipped.
template <int kCapacity = kChunkTensors, typename Entry, typename LaunchFn>
cudaError_t ForEachChunk(const Entry* entries, int count, int64_t tile, LaunchFn launch) {
  constexpr int64_t kMaxBlocksPerLaunch = int64_t{1} << 30;
  TensorChunk<Entry, kCapacity> chunk;
  for (int i = 0; i < count; ++i) {
    if (entries[i].n <= 0) continue;
    const int64_t blocks = (entries[i].n + tile - 1) / tile;
    if (chunk.count == kCapacity ||
        (chunk.count > 0 && chunk.block_start[chunk.count] + blocks > kMaxBlocksPerLaunch)) {
      const cudaError_t error = launch(chunk);
      if (error != cudaSuccess) return error;
      chunk.count = 0;
    }
    chunk.entry[chunk.count] = entries[i];
    chunk.block_start[chunk.count + 1] = static_cast<int>(chunk.block_start[chunk.count] + blocks);
    ++chunk.count;
  }
  return chunk.count > 0 ? launch(chunk) : cudaSuccess;
}

// Calls fn(T{}) with T the storage type of a float dtype.
template <typename Fn>
__device__ __forceinline__ void VisitFloat(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16:
      fn(__half{});
      break;
    case DType::kBF16:
      fn(__nv_bfloat16{});
      break;
    default:
      fn(float{});
      break;
  }
}

}  // namespace ampd::kernels::cuda
