// What the register-tile attention kernels (attention_flash_forward.cu,
// attention_flash_backward.cu) share: the PTX they are built from
// (mma.sync m16n8k16 with fp32 accumulators, ldmatrix, cp.async; sm_80+),
// the (64, D) shared-memory tiles they stream through, the warp-level tile
// products, and the staged 16-byte stores of a warp's fp32 results.
//
// A CTA is 4 warps over a 64-row tile (queries in the forward and dQ
// passes, keys in the dK/dV pass); warp w owns rows 16w .. 16w + 15 and
// keeps their scores, probabilities and output accumulators in registers
// in the m16n8k16 accumulator layout (kernels/attention_mma_layout.h):
// lane l holds rows l / 4 and l / 4 + 8 of the strip, so a row's max and
// sum are two xor-shuffles inside a quad of lanes. CUDA C++17.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/attention_mma_layout.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

// Shared-memory tiles: 64 rows of D 16-bit values, rows padded by 16 bytes
// so that the 8 rows one ldmatrix matrix reads fall in 8 different 16-byte
// bank groups (row strides of 144 or 272 bytes), and every row starts on
// 16 bytes for cp.async.
template <int D>
struct FlashTile {
  static constexpr int kLd = D + 8;                   // elements per row
  static constexpr int kBytes = kAttnTile * kLd * 2;  // one tile
  static_assert(kBytes % 128 == 0, "tiles start on 128 bytes");
};

// ---- PTX --------------------------------------------------------------------
// Every asm below touches shared memory or orders it, so each is volatile
// with a "memory" clobber: the compiler must not move ordinary shared
// stores (the output staging) across them.

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronous; src_bytes 0 writes 16 zero bytes
// (padding rows) and reads nothing.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 8 16-bit matrices; the lane's row address is `smem`.
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem))
               : "memory");
}
__device__ __forceinline__ void Ldsm4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem))
               : "memory");
}

// d (16 x 8 fp32) += a (16 x 16) b (16 x 8), the 16-bit type T.
template <typename T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values rounded once to T, lo in the lower 16 bits (the operand
// order of mma's packed registers: the lower half is the lower column).
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t Pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo: the lower half
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t Pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- tiles ----------------------------------------------------------------

// Starts loading rows [0, valid) of a (64, D) tile (global row stride ld
// elements, 16-byte aligned rows) into shared memory; rows valid .. 63 are
// zero-filled, so padding keys and queries give exact zeros in every
// product. Part of the caller's next cp.async group.
template <typename T, int D>
__device__ __forceinline__ void AsyncLoadTile(T* tile, const T* g, int64_t ld, int valid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kAttnTile * kChunks; i += kAttnMmaThreads) {
    const int r = i / kChunks;
    const int ch = i % kChunks;
    const bool in = r < valid;
    CpAsync16(tile + r * FlashTile<D>::kLd + ch * 8, g + (in ? r : 0) * ld + ch * 8, in ? 16 : 0);
  }
}

// acc (16 x 8 n8 fp32 tiles) += the warp's 16-row strip of a_tile (rows
// a_row .. a_row + 15, all D columns) times the transpose of rows
// b_row .. b_row + 8 n8 - 1 of b_tile: S = Q K^T, dP = dO V^T and their
// transposes. A and B both come from [row][D] tiles by plain ldmatrix.
template <typename T, int D, int N8>
__device__ __forceinline__ void StripTimesRowsT(float (&acc)[N8][4], const T* a_tile, int a_row,
                                                const T* b_tile, int b_row, int lane) {
  static_assert(N8 % 2 == 0, "n-tiles are loaded in pairs");
  constexpr int kLd = FlashTile<D>::kLd;
  const mma::RowCol ao = mma::LdsmA(lane);
  const mma::RowCol bo = mma::LdsmBFromNK(lane);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    Ldsm4(a, a_tile + (a_row + ao.row) * kLd + kk * 16 + ao.col);
#pragma unroll
    for (int np = 0; np < N8 / 2; ++np) {
      uint32_t b[4];
      Ldsm4(b, b_tile + (b_row + np * 16 + bo.row) * kLd + kk * 16 + bo.col);
      Mma<T>(acc[2 * np], a, b[0], b[1]);
      Mma<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x D fp32, D / 8 tiles) += w (16 x 16 K16 fp32 accumulator tiles
// of 8 columns, 2 K16 of them, rounded to T here) times rows
// b_row .. b_row + 16 K16 - 1 of b_tile (all D columns): O += P V,
// dQ += dS K, dV += P^T dout, dK += dS^T q. B by ldmatrix.trans.
template <typename T, int D, int K16>
__device__ __forceinline__ void AccTimesRows(float (&acc)[D / 8][4], const float (&w)[2 * K16][4],
                                             const T* b_tile, int b_row, int lane) {
  constexpr int kLd = FlashTile<D>::kLd;
  const mma::RowCol bo = mma::LdsmBFromKN(lane);
#pragma unroll
  for (int kk = 0; kk < K16; ++kk) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float* src = w[mma::AccTileOf(kk, r)];
      const int e = mma::AccPairFirst(r);
      a[r] = Pack2<T>(src[e], src[e + 1]);
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      Ldsm4Trans(b, b_tile + (b_row + kk * 16 + bo.row) * kLd + np * 16 + bo.col);
      Mma<T>(acc[2 * np], a, b[0], b[1]);
      Mma<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Writes a warp's 16 x D fp32 accumulators, each as f(half, x) rounded
// once to T (half 0: the lane's row l / 4, half 1: row l / 4 + 8; f is the
// row's last fp32 operation), to rows 0 .. 15 of a global matrix with row
// stride ld (row 0's first column at dst), skipping rows >= valid_rows:
// staged through `stage` (16 rows of D + 8 16-bit values in shared memory
// that only this warp touches) so the global stores are 16 bytes each.
template <typename T, int D, typename F>
__device__ __forceinline__ void StoreStrip(const float (&acc)[D / 8][4], F f, T* stage, T* dst,
                                           int64_t ld, int valid_rows, int lane) {
  constexpr int kLd = FlashTile<D>::kLd;
  __syncwarp();  // every lane is done reading the stage's previous contents
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const mma::RowCol rc = mma::AccElement(lane, 2 * half);
      *reinterpret_cast<uint32_t*>(stage + rc.row * kLd + 8 * n + rc.col) =
          Pack2<T>(f(half, acc[n][2 * half]), f(half, acc[n][2 * half + 1]));
    }
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int i = lane; i < 16 * kChunks; i += 32) {
    const int r = i / kChunks;
    const int ch = i % kChunks;
    if (r < valid_rows) {
      *reinterpret_cast<uint4*>(dst + r * ld + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + r * kLd + ch * 8);
    }
  }
}

// The sum of a row's four partial sums held by the lanes of a quad
// (lane bits 0 and 1): (lane 0 + lane 1) + (lane 2 + lane 3), the same bits
// on all four lanes (fp32 addition commutes).
__device__ __forceinline__ float QuadSum(float x) {
  x = x + __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// ---- the forward's steps ----------------------------------------------------
// One query strip's steps per key block, shared by the register-tile
// forward (attention_flash_forward.cu) and its decode twin
// (attention_decode.cu), so that a decoded row has the forward's bits.

// The strip's Q as A fragments, one per k-step of 16 channels: rows
// 0 .. 15 of the (16, D) tile at q_strip (row stride FlashTile<D>::kLd).
template <typename T, int D>
__device__ __forceinline__ void FlashLoadQ(uint32_t (&qf)[D / 16][4], const T* q_strip, int lane) {
  constexpr int kLd = FlashTile<D>::kLd;
  const mma::RowCol ao = mma::LdsmA(lane);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) Ldsm4(qf[kk], q_strip + ao.row * kLd + kk * 16 + ao.col);
}

// S (16 x 64, fp32, zeroed here) = the strip's Q times the transpose of the
// (64, D) key tile ks: k-steps in increasing order, each over the 8 n8
// tiles of keys in order.
template <typename T, int D>
__device__ __forceinline__ void FlashScores(float (&s)[8][4], const uint32_t (&qf)[D / 16][4],
                                            const T* ks, int lane) {
  constexpr int kLd = FlashTile<D>::kLd;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
  }
  const mma::RowCol bo = mma::LdsmBFromNK(lane);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t bf[4];
      Ldsm4(bf, ks + (np * 16 + bo.row) * kLd + kk * 16 + bo.col);
      Mma<T>(s[2 * np], qf[kk], bf[0], bf[1]);
      Mma<T>(s[2 * np + 1], qf[kk], bf[2], bf[3]);
    }
  }
}

// The online softmax step of key block k0 for the lane's two rows (half 0:
// query position q_abs[0], half 1: q_abs[1]): S *= scale; in the diagonal
// block (the rows' own) keys after the query -> -inf; the rows' block max
// over the quad, m', alpha; P = exp(S - m') in place; l = l alpha + the
// block's P sum (each lane's 16 keys in key order, then
// (lanes 0 + 1) + (lanes 2 + 3) of the quad); m = m'; O *= alpha.
template <int D>
__device__ __forceinline__ void FlashSoftmaxBlock(float (&s)[8][4], float (&o)[D / 8][4],
                                                  float (&m)[2], float (&l)[2], float scale,
                                                  bool diagonal, int k0, const int (&q_abs)[2],
                                                  int lane) {
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int half = i >> 1;
      float x = s[n][i] * scale;
      if (diagonal && k0 + 8 * n + mma::AccElement(lane, i).col > q_abs[half]) x = -INFINITY;
      s[n][i] = x;
      block_max[half] = fmaxf(block_max[half], x);
    }
  }
  float m_new[2], alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    m_new[half] = fmaxf(m[half], QuadMax(block_max[half]));
    alpha[half] = expf(m[half] - m_new[half]);  // 0 on the first block
  }
  // P in place, each lane's keys in key order (8n + 2 (lane % 4), + 1).
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int half = i >> 1;
      const float p = expf(s[n][i] - m_new[half]);  // masked: exp(-inf) = 0
      s[n][i] = p;
      sum[half] += p;
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] = l[half] * alpha[half] + QuadSum(sum[half]);
    m[half] = m_new[half];
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] *= alpha[i >> 1];
  }
}

// ---- launch side ------------------------------------------------------------
// Whether the register-tile kernels take a call: fp16/bf16, D = 64 or 128,
// 16-byte aligned operands (checked by the caller), their shared memory
// within the device's.
bool AttentionFlashForwardApplies(int d, const AttentionKernelConfig& config);
bool AttentionFlashBackwardApplies(int d, const AttentionKernelConfig& config);
// Raise their dynamic shared memory limits (once, at backend creation).
absl::Status ConfigureAttentionFlashForward(const AttentionKernelConfig& config);
absl::Status ConfigureAttentionFlashBackward(const AttentionKernelConfig& config);
absl::Status LaunchAttentionForwardFlash(const void* qkv, DType dtype, const AttnShape& g,
                                         void* out, float* lse, cudaStream_t stream);
// Writes Delta (B, H, T) itself (in its dQ pass) before the dK/dV pass
// reads it.
absl::Status LaunchAttentionBackwardFlash(const void* qkv, const void* out, const void* dout,
                                          const float* lse, DType dtype, const AttnShape& g,
                                          void* dqkv, float* delta, cudaStream_t stream);

}  // namespace ampd::kernels::cuda
