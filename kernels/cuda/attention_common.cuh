// What the fused attention kernels (attention_forward.cu,
// attention_backward.cu, attention_backward_mma.cu) share: the shape of one
// call as the kernels read it, the tiles of the tensor-core kernels (64
// queries or keys, the contract's key block, in shared memory with padded
// rows), the 16-byte tile loads and row stores, and the launch geometry.
// CUDA C++17, host and device.
//
// Tensor-core kernels: 4 warps per CTA; warp w owns rows 16w .. 16w + 15 of
// the CTA's 64-row tile (queries in the forward and dQ passes, keys in the
// dK/dV pass), so the row-wise softmax work between two products only needs
// the warp's own rows, and the CTA synchronises only around tile loads.
// Inside a warp, lane 2r + half owns row r of the strip and columns
// 32 half .. 32 half + 31 of a 64-column block (or channels
// half D/2 .. of the output row).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/attention_params.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

inline constexpr int kAttnTile = kAttentionKeyBlock;  // rows of a query or key tile
static_assert(kAttnTile == 64, "the lane layout (2 lanes x 32 columns a row) assumes 64");
inline constexpr int kAttnMmaWarps = kAttnTile / 16;  // one 16-row strip each
inline constexpr int kAttnMmaThreads = 32 * kAttnMmaWarps;
// Generic kernels: one warp per row, 4 rows per CTA, each lane holding
// kAttnGenericChannels channels of the row's output (a slice of
// 32 * kAttnGenericChannels channels per grid z index).
inline constexpr int kAttnGenericWarps = 4;
inline constexpr int kAttnGenericChannels = 4;
inline constexpr int kAttnGenericSlice = 32 * kAttnGenericChannels;
// gridDim.y bound; the kernels loop over (b, h) pairs beyond it.
inline constexpr int64_t kAttnMaxGridY = 65535;

// One call's shape. The op checks (kernels/op_checks.cc) keep T, 3C and
// n_head within int.
struct AttnShape {
  int t = 0;        // T
  int d = 0;        // D = C / n_head
  int heads = 0;    // n_head
  int64_t c = 0;    // C
  int64_t bh = 0;   // B * n_head
  float scale = 0;  // AttentionScaleOf(options, D)
  int window = 0;   // options.window: 0, or query t sees keys t - window < s <= t

  // Row of token s of batch row b in a (B, T, X) tensor.
  __host__ __device__ int64_t Token(int64_t b, int64_t s) const { return b * t + s; }
  __host__ __device__ int Tiles() const { return (t + kAttnTile - 1) / kAttnTile; }
  // The first key query q sees (AttentionFirstKey).
  __host__ __device__ int FirstKey(int q) const {
    return window > 0 && q >= window ? q - window + 1 : 0;
  }
  // One past the last query that sees key s (T without a window).
  __host__ __device__ int QueryEnd(int s) const {
    return window > 0 && s < t - window ? s + window : t;
  }
};

inline AttnShape MakeAttnShape(int64_t batch, int64_t seq, int64_t channels, int64_t heads,
                               const AttentionOptions& options) {
  AttnShape g;
  g.t = static_cast<int>(seq);
  g.d = static_cast<int>(channels / heads);
  g.heads = static_cast<int>(heads);
  g.c = channels;
  g.bh = batch * heads;
  g.scale = AttentionScaleOf(options, channels / heads);
  g.window = static_cast<int>(options.window);
  return g;
}

inline unsigned AttnGridY(int64_t bh) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(bh, kAttnMaxGridY)));
}

// The 16-byte alignment the tensor-core kernels' vector loads and stores
// need of a base pointer (row strides are multiples of 16 bytes when D is).
inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- tensor-core tiles ----------------------------------------------------
// Row strides in shared memory, padded by 16 bytes against bank conflicts;
// wmma needs 16-bit strides in multiples of 8 elements and fp32 ones in
// multiples of 4, and every tile begins on 128 bytes.
template <int D>
struct AttnMmaLayout {
  static constexpr int kLdTile = D + 8;           // 16-bit (64, D) tiles: q, k, v, dout
  static constexpr int kLdScore = kAttnTile + 4;  // fp32 (16, 64) strips: S, dP
  static constexpr int kLdProb = kAttnTile + 8;   // 16-bit (16 or 64, 64) strips: P, dS
  static constexpr int kLdAcc = D + 4;            // fp32 (rows, D) accumulators
  static constexpr int kTileBytes = kAttnTile * kLdTile * 2;
  static constexpr int kStripBytes = 16 * kLdProb * 2;
  // Per warp: two fp32 (16, 64) strips (S and dP), reused to stage a (16, D)
  // fp32 result on its way out.
  static constexpr int kWarpScratchBytes = std::max(2 * 16 * kLdScore * 4, 16 * kLdAcc * 4);
  static_assert(kTileBytes % 128 == 0 && kStripBytes % 128 == 0, "tiles start on 128 bytes");
  static_assert(kWarpScratchBytes % 128 == 0, "warp scratch starts on 128 bytes");
};

// Loads rows [0, valid) of a (64, D) tile of 16-bit T from global memory
// (row stride ld elements) into shared memory (row stride AttnMmaLayout's
// kLdTile), 16 bytes at a time; rows valid .. 63 are zero-filled, so
// padding keys and queries add exact zeros to every product.
template <typename T, int D>
__device__ __forceinline__ void LoadAttnTile(T* tile, const T* g, int64_t ld, int valid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kLd = AttnMmaLayout<D>::kLdTile;
  for (int i = threadIdx.x; i < kAttnTile * kChunks; i += blockDim.x) {
    const int r = i / kChunks;
    const int ch = i % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < valid) v = *reinterpret_cast<const uint4*>(g + r * ld + ch * 8);
    *reinterpret_cast<uint4*>(tile + r * kLd + ch * 8) = v;
  }
}

// The bits of a 16-bit float.
__device__ __forceinline__ uint32_t Bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t Bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Writes f(src[i]) for i < n (a multiple of 8), each rounded once to the
// 16-bit T, to contiguous global memory, 16 bytes at a time (dst 16-byte
// aligned). f is the row's last fp32 operation (a division by l, a
// multiplication by the scale).
template <typename T, typename F>
__device__ __forceinline__ void StoreAttnRow(T* dst, const float* src, int n, F f) {
  for (int i = 0; i < n; i += 8) {
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      w[e] = Bits16(FromFloat<T>(f(src[i + 2 * e]))) |
             (Bits16(FromFloat<T>(f(src[i + 2 * e + 1]))) << 16);
    }
    *reinterpret_cast<uint4*>(dst + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The lane layout of a warp's 16-row strip (see the file comment).
struct AttnLane {
  int row;   // 0 .. 15 within the strip
  int half;  // 0 or 1: columns 32 half .. 32 half + 31
};
__device__ __forceinline__ AttnLane AttnLaneOf(int lane) { return {lane >> 1, lane & 1}; }

// The sum of the two halves' partial sums, in the order half 0 + half 1 on
// both lanes of a row (what the CPU oracle computes).
__device__ __forceinline__ float SumOfHalves(float mine, int half) {
  const float other = __shfl_xor_sync(0xffffffffu, mine, 1);
  return half == 0 ? mine + other : other + mine;
}

// ---- the tensor-core backward (attention_backward_mma.cu) -------------------
// Whether it takes this call: fp16/bf16, D = 64 or 128, 16-byte aligned
// tensors, and its shared memory within the device's.
bool AttentionBackwardMmaApplies(DType dtype, const AttnShape& g, const void* qkv, const void* dout,
                                 const void* dqkv, const AttentionKernelConfig& config);
// The dK/dV and dQ passes, after Delta (B, H, T) has been written.
absl::Status LaunchAttentionBackwardMma(const void* qkv, const void* dout, const float* lse,
                                        const float* delta, DType dtype, const AttnShape& g,
                                        void* dqkv, cudaStream_t stream);
absl::Status ConfigureAttentionBackwardMma(const AttentionKernelConfig& config);

}  // namespace ampd::kernels::cuda
