// The tensor-core passes of the fused attention backward (fp16/bf16,
// D = 64 or 128), launched by attention_backward.cu after its Delta pass.
// Deterministic without atomics: two passes, each output row written by
// exactly one CTA.
//
// dK/dV pass: a CTA per (key tile of 64, (b, h)); warp w owns keys
// 16w .. 16w + 15 and keeps their dK and dV in wmma accumulators (fp32)
// while the CTA walks the query tiles from the key tile's own to the last,
// in order. Per query tile (q and dout staged by 16-byte loads, with their
// lse and Delta): S^T = k q^T and dP^T = v dout^T with wmma, staged in
// shared memory; lanes 2r, 2r + 1 form P = exp(S * scale - lse) and
// dS = P (dP - Delta) for key r over 32 queries each, rounded to the dtype
// (0 for queries before the key or past T); then dV += P^T dout and
// dK += dS^T q with wmma.
//
// dQ pass: a CTA per (query tile, (b, h)); warp w owns queries 16w ..; the
// CTA walks the key blocks 0 .. its own in order, recomputing S, dP, P and
// dS the same way, and dQ += dS k accumulates in wmma accumulators.
// dK and dQ are multiplied by the scale once, at the end; every result is
// rounded once to the dtype.
#include <mma.h>

#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Both passes lay shared memory out alike: the CTA's own two (64, D) tiles,
// the two it walks over, 64 lse and 64 Delta values (the dK/dV pass's
// query rows), per warp an fp32 scratch (two (16, 64) strips) and two
// 16-bit (16, 64) strips (P and dS).
template <int D>
struct BackwardSmem {
  using L = AttnMmaLayout<D>;
  static constexpr int kOwn0 = 0;
  static constexpr int kOwn1 = kOwn0 + L::kTileBytes;
  static constexpr int kWalk0 = kOwn1 + L::kTileBytes;
  static constexpr int kWalk1 = kWalk0 + L::kTileBytes;
  static constexpr int kRowStats = kWalk1 + L::kTileBytes;  // lse (64), Delta (64)
  static constexpr int kScratch = kRowStats + 2 * kAttnTile * 4;
  static constexpr int kStrips = kScratch + kAttnMmaWarps * L::kWarpScratchBytes;
  static constexpr int kBytes = kStrips + kAttnMmaWarps * 2 * L::kStripBytes;
  static_assert(kScratch % 128 == 0 && kStrips % 128 == 0, "tiles start on 128 bytes");
};

// dst (16, 64) fp32 (ld kLdScore) = a strip (16, D) times the transpose of
// a (64, D) tile, column blocks of 16 in groups of kGroup: the A fragments
// are reloaded per group, which keeps D = 128's accumulators (and the dK/dV
// pass's live ones beside them) within the register file.
template <typename T, int D>
__device__ __forceinline__ void StripTimesTileT(const T* a_strip, const T* tile, float* dst) {
  using L = AttnMmaLayout<D>;
  constexpr int kGroup = D == 128 ? 2 : 4;
#pragma unroll
  for (int n0 = 0; n0 < 4; n0 += kGroup) {
    FragAcc acc[kGroup];
#pragma unroll
    for (int n = 0; n < kGroup; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA<T> a;
      wmma::load_matrix_sync(a, a_strip + kk * 16, L::kLdTile);
#pragma unroll
      for (int n = 0; n < kGroup; ++n) {
        FragBCol<T> b;
        wmma::load_matrix_sync(b, tile + (n0 + n) * 16 * L::kLdTile + kk * 16, L::kLdTile);
        wmma::mma_sync(acc[n], a, b, acc[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < kGroup; ++n) {
      wmma::store_matrix_sync(dst + (n0 + n) * 16, acc[n], L::kLdScore, wmma::mem_row_major);
    }
  }
}

// acc (16, D) += strip (16, 64) 16-bit (ld kLdProb) times a (64, D) tile.
template <typename T, int D>
__device__ __forceinline__ void AccumulateStripTimesTile(FragAcc (&acc)[D / 16], const T* strip,
                                                         const T* tile) {
  using L = AttnMmaLayout<D>;
  // Not unrolled across kk for D = 128: the dK/dV pass holds 16
  // accumulator fragments, and overlapping two steps' B loads spills.
#pragma unroll(D == 128 ? 1 : 4)
  for (int kk = 0; kk < 4; ++kk) {
    FragA<T> a;
    wmma::load_matrix_sync(a, strip + kk * 16, L::kLdProb);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragBRow<T> b;
      wmma::load_matrix_sync(b, tile + kk * 16 * L::kLdTile + n * 16, L::kLdTile);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// Stages a warp's (16, D) fp32 accumulators through its scratch and writes
// row `row` (the lane's), channels half * D/2 .., times `factor`, rounded
// once, to dst (that row's first channel of the head).
template <typename T, int D>
__device__ __forceinline__ void WriteStrip(const FragAcc (&acc)[D / 16], float* scratch,
                                           AttnLane me, bool valid, T* dst, float factor) {
  using L = AttnMmaLayout<D>;
  __syncwarp();  // the scratch's previous contents are no longer read
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(scratch + n * 16, acc[n], L::kLdAcc, wmma::mem_row_major);
  }
  __syncwarp();
  if (valid) {
    StoreAttnRow(dst + me.half * (D / 2), scratch + me.row * L::kLdAcc + me.half * (D / 2), D / 2,
                 [factor](float x) { return x * factor; });
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_dkdv_mma_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              T* __restrict__ dqkv, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using L = AttnMmaLayout<D>;
  using S = BackwardSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem + S::kOwn0);
  T* vs = reinterpret_cast<T*>(smem + S::kOwn1);
  T* qs = reinterpret_cast<T*>(smem + S::kWalk0);
  T* gs = reinterpret_cast<T*>(smem + S::kWalk1);  // dout
  float* lse_s = reinterpret_cast<float*>(smem + S::kRowStats);
  float* delta_s = lse_s + kAttnTile;
  const int warp = threadIdx.x >> 5;
  float* scratch = reinterpret_cast<float*>(smem + S::kScratch + warp * L::kWarpScratchBytes);
  float* st = scratch;                      // (16, 64) S^T of the warp's keys
  float* dpt = scratch + 16 * L::kLdScore;  // (16, 64) dP^T
  T* pt = reinterpret_cast<T*>(smem + S::kStrips + warp * 2 * L::kStripBytes);
  T* dst = pt + 16 * L::kLdProb;

  const AttnLane me = AttnLaneOf(threadIdx.x & 31);
  const int kb = static_cast<int>(blockIdx.x);  // key tile; the first ones see the most queries
  const int k0 = kb * kAttnTile;
  const int strip = warp * 16;
  const int k_abs = k0 + strip + me.row;
  const int64_t ld = 3 * g.c;
  const int tiles = g.Tiles();

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    const T* gbase = dout + g.Token(b, 0) * g.c + static_cast<int64_t>(h) * D;
    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    const int k_valid = min(kAttnTile, g.t - k0);
    LoadAttnTile<T, D>(ks, base + g.c + k0 * ld, ld, k_valid);
    LoadAttnTile<T, D>(vs, base + 2 * g.c + k0 * ld, ld, k_valid);
    FragAcc dk[D / 16], dv[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      wmma::fill_fragment(dk[n], 0.0f);
      wmma::fill_fragment(dv[n], 0.0f);
    }

    for (int qb = kb; qb < tiles; ++qb) {
      const int q0 = qb * kAttnTile;
      const int q_valid = min(kAttnTile, g.t - q0);
      __syncthreads();  // every warp is done with the previous query tile
      LoadAttnTile<T, D>(qs, base + q0 * ld, ld, q_valid);
      LoadAttnTile<T, D>(gs, gbase + q0 * g.c, g.c, q_valid);
      if (threadIdx.x < kAttnTile) {
        const int i = threadIdx.x;
        lse_s[i] = i < q_valid ? lse[bh * g.t + q0 + i] : 0.0f;
        delta_s[i] = i < q_valid ? delta[bh * g.t + q0 + i] : 0.0f;
      }
      __syncthreads();

      StripTimesTileT<T, D>(ks + strip * L::kLdTile, qs, st);   // S^T = k q^T
      StripTimesTileT<T, D>(vs + strip * L::kLdTile, gs, dpt);  // dP^T = v dout^T
      __syncwarp();
      for (int jj = 0; jj < 32; ++jj) {
        const int i = me.half * 32 + jj;  // query within the tile
        const int q_abs = q0 + i;
        float p = 0.0f, ds = 0.0f;
        if (q_abs >= k_abs && q_abs < g.t) {
          p = expf(st[me.row * L::kLdScore + i] * g.scale - lse_s[i]);
          ds = p * (dpt[me.row * L::kLdScore + i] - delta_s[i]);
        }
        pt[me.row * L::kLdProb + i] = FromFloat<T>(p);
        dst[me.row * L::kLdProb + i] = FromFloat<T>(ds);
      }
      __syncwarp();
      AccumulateStripTimesTile<T, D>(dv, pt, gs);   // dV += P^T dout
      AccumulateStripTimesTile<T, D>(dk, dst, qs);  // dK += dS^T q
    }

    T* row = dqkv + g.Token(b, k_abs < g.t ? k_abs : 0) * ld + static_cast<int64_t>(h) * D;
    WriteStrip<T, D>(dk, scratch, me, k_abs < g.t, row + g.c, g.scale);
    WriteStrip<T, D>(dv, scratch, me, k_abs < g.t, row + 2 * g.c, 1.0f);
  }
#endif
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_dq_mma_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            T* __restrict__ dqkv, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using L = AttnMmaLayout<D>;
  using S = BackwardSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + S::kOwn0);
  T* gs = reinterpret_cast<T*>(smem + S::kOwn1);  // dout
  T* ks = reinterpret_cast<T*>(smem + S::kWalk0);
  T* vs = reinterpret_cast<T*>(smem + S::kWalk1);
  const int warp = threadIdx.x >> 5;
  float* scratch = reinterpret_cast<float*>(smem + S::kScratch + warp * L::kWarpScratchBytes);
  float* ss = scratch;                      // (16, 64) S of the warp's queries
  float* dps = scratch + 16 * L::kLdScore;  // (16, 64) dP
  T* dss = reinterpret_cast<T*>(smem + S::kStrips + warp * 2 * L::kStripBytes);

  const AttnLane me = AttnLaneOf(threadIdx.x & 31);
  const int tile = g.Tiles() - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  const int q0 = tile * kAttnTile;
  const int strip = warp * 16;
  const int q_abs = q0 + strip + me.row;
  const int64_t ld = 3 * g.c;

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    const T* gbase = dout + g.Token(b, 0) * g.c + static_cast<int64_t>(h) * D;
    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    const int q_valid = min(kAttnTile, g.t - q0);
    LoadAttnTile<T, D>(qs, base + q0 * ld, ld, q_valid);
    LoadAttnTile<T, D>(gs, gbase + q0 * g.c, g.c, q_valid);
    const bool row_valid = q_abs < g.t;
    const float lse_i = row_valid ? lse[bh * g.t + q_abs] : 0.0f;
    const float delta_i = row_valid ? delta[bh * g.t + q_abs] : 0.0f;
    FragAcc dq[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);

    for (int kb = 0; kb <= tile; ++kb) {
      const int k0 = kb * kAttnTile;
      const int k_valid = min(kAttnTile, g.t - k0);
      __syncthreads();  // every warp is done with the previous K and V
      LoadAttnTile<T, D>(ks, base + g.c + k0 * ld, ld, k_valid);
      LoadAttnTile<T, D>(vs, base + 2 * g.c + k0 * ld, ld, k_valid);
      __syncthreads();

      StripTimesTileT<T, D>(qs + strip * L::kLdTile, ks, ss);   // S = q k^T
      StripTimesTileT<T, D>(gs + strip * L::kLdTile, vs, dps);  // dP = dout v^T
      __syncwarp();
      for (int jj = 0; jj < 32; ++jj) {
        const int j = me.half * 32 + jj;  // key within the block
        float ds = 0.0f;
        if (row_valid && k0 + j <= q_abs) {
          const float p = expf(ss[me.row * L::kLdScore + j] * g.scale - lse_i);
          ds = p * (dps[me.row * L::kLdScore + j] - delta_i);
        }
        dss[me.row * L::kLdProb + j] = FromFloat<T>(ds);
      }
      __syncwarp();
      AccumulateStripTimesTile<T, D>(dq, dss, ks);  // dQ += dS k
    }

    T* row = dqkv + g.Token(b, row_valid ? q_abs : 0) * ld + static_cast<int64_t>(h) * D;
    WriteStrip<T, D>(dq, scratch, me, row_valid, row, g.scale);
  }
#endif
}

template <typename T, int D>
cudaError_t Configure(int max_smem) {
  constexpr int kBytes = BackwardSmem<D>::kBytes;
  if (kBytes > max_smem) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(attention_dkdv_mma_kernel<T, D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(attention_dq_mma_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
}

template <typename T, int D>
absl::Status Launch(const void* qkv, const void* dout, const float* lse, const float* delta,
                    void* dqkv, const AttnShape& g, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.Tiles()), AttnGridY(g.bh));
  constexpr int kBytes = BackwardSmem<D>::kBytes;
  attention_dkdv_mma_kernel<T, D><<<grid, kAttnMmaThreads, kBytes, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  attention_dq_mma_kernel<T, D><<<grid, kAttnMmaThreads, kBytes, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchForHeadSize(const void* qkv, const void* dout, const float* lse,
                               const float* delta, void* dqkv, const AttnShape& g,
                               cudaStream_t stream) {
  return g.d == 64 ? Launch<T, 64>(qkv, dout, lse, delta, dqkv, g, stream)
                   : Launch<T, 128>(qkv, dout, lse, delta, dqkv, g, stream);
}

}  // namespace

bool AttentionBackwardMmaApplies(DType dtype, const AttnShape& g, const void* qkv, const void* dout,
                                 const void* dqkv, const AttentionKernelConfig& config) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) return false;
  if (!Aligned16(qkv) || !Aligned16(dout) || !Aligned16(dqkv)) return false;
  if (g.d == 64) return BackwardSmem<64>::kBytes <= config.max_dynamic_smem;
  if (g.d == 128) return BackwardSmem<128>::kBytes <= config.max_dynamic_smem;
  return false;
}

absl::Status LaunchAttentionBackwardMma(const void* qkv, const void* dout, const float* lse,
                                        const float* delta, DType dtype, const AttnShape& g,
                                        void* dqkv, cudaStream_t stream) {
  if (dtype == DType::kF16) {
    return LaunchForHeadSize<__half>(qkv, dout, lse, delta, dqkv, g, stream);
  }
  return LaunchForHeadSize<__nv_bfloat16>(qkv, dout, lse, delta, dqkv, g, stream);
}

absl::Status ConfigureAttentionBackwardMma(const AttentionKernelConfig& config) {
  const int max_smem = config.max_dynamic_smem;
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 128>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 128>(max_smem)));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
