// The register-tile backward of the fused causal attention (fp16/bf16,
// D = 64 or 128; the contract of kernels/backend.h), recomputing P from
// the forward's lse. Two passes, each output row written by exactly one
// CTA, no atomics, so dqkv is the same bits run to run. Both keep their
// scores, probabilities and gradient accumulators in registers
// (attention_flash.cuh) and double-buffer the tiles they walk with cp.async.
//
// dQ pass (first): a CTA per (query tile of 64, (b, h)), 4 warps of 16
// queries. It first computes Delta_t = sum_d dout_t,d out_t,d of its rows
// (one lane per row, channels in order, as the CPU oracle sums) and writes
// it to the (B, H, T) scratch for the next pass. Then per key block 0 ..
// its own, in order: S = Q K^T and dP = dO V^T (mma.sync), P =
// exp(S scale - lse), dS = P (dP - Delta) (keys after the query: 0), and
// dQ += round(dS) K with dS packed straight from the registers.
//
// dK/dV pass: a CTA per (key tile of 64, (b, h)), warp w owning keys
// 16w .. 16w + 15; per query tile from the key tile's own to the last, in
// order, in column chunks of 32 (D = 64) or 16 (D = 128), which keeps the
// live registers within 255 without spills and the products' order over
// the queries unchanged: S^T =
// K Q^T, dP^T = V dO^T, P^T and dS^T as above with the queries' lse and
// Delta from shared memory (queries before the key or past T: 0), then
// dV += round(P^T) dO and dK += round(dS^T) Q.
// dK and dQ are multiplied by the scale once, at the end; every result is
// rounded once to the dtype and stored through shared memory, 16 bytes at
// a time.
#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/cuda_status.h"

namespace ampd::kernels::cuda {
namespace {

// Both passes: [own tile 0 | own tile 1 | walked tiles 0, 1 of buffer 0 |
// of buffer 1 | row statistics]. The row statistics (the dK/dV pass's
// walked queries' lse and Delta, 64 each per buffer) follow the tiles.
template <int D>
struct FlashBackwardSmem {
  static constexpr int kTile = FlashTile<D>::kBytes;
  static constexpr int kStats = 6 * kTile;
  static constexpr int kBytes = kStats + 2 * 2 * kAttnTile * 4;
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_dq_flash_kernel(const T* __restrict__ qkv, const T* __restrict__ out,
                              const T* __restrict__ dout, const float* __restrict__ lse,
                              float* __restrict__ delta, T* __restrict__ dqkv, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kLd = FlashTile<D>::kLd;
  constexpr int kTileElems = kAttnTile * kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* gs = qs + kTileElems;  // dout
  // Key block kb's K at walk + (kb & 1) * 2 kTileElems, its V one tile later.
  T* walk = gs + kTileElems;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int tile = g.Tiles() - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  const int q0 = tile * kAttnTile;
  const int strip = warp * 16;
  int q_abs[2];
  q_abs[0] = q0 + strip + mma::AccElement(lane, 0).row;
  q_abs[1] = q_abs[0] + 8;
  const int64_t ld = 3 * g.c;
  const int q_valid = min(kAttnTile, g.t - q0);

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    const int64_t head_col = static_cast<int64_t>(h) * D;  // in a (B, T, C) row
    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    AsyncLoadTile<T, D>(qs, base + q0 * ld, ld, q_valid);
    AsyncLoadTile<T, D>(gs, dout + g.Token(b, q0) * g.c + head_col, g.c, q_valid);
    AsyncLoadTile<T, D>(walk, base + g.c, ld, min(kAttnTile, g.t));
    AsyncLoadTile<T, D>(walk + kTileElems, base + 2 * g.c, ld, min(kAttnTile, g.t));
    CpAsyncCommit();

    // Delta of the lane's rows while the tiles load: lane 4r + half of a
    // quad sums row `half` (channels in order), then the quad shares it.
    float delta_r[2], lse_r[2];
    {
      float mine = 0.0f;
      const int my_q = (lane & 3) == 0 ? q_abs[0] : q_abs[1];
      if ((lane & 3) < 2 && my_q < g.t) {
        const int64_t row = g.Token(b, my_q) * g.c + head_col;
        for (int c = 0; c < D; c += 8) {
          const uint4 ov = *reinterpret_cast<const uint4*>(out + row + c);
          const uint4 gv = *reinterpret_cast<const uint4*>(dout + row + c);
          const T* oe = reinterpret_cast<const T*>(&ov);
          const T* ge = reinterpret_cast<const T*>(&gv);
#pragma unroll
          for (int e = 0; e < 8; ++e) mine += ToFloat(ge[e]) * ToFloat(oe[e]);
        }
        delta[bh * g.t + my_q] = mine;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        delta_r[r] = __shfl_sync(0xffffffffu, mine, (lane & ~3) | r);
        lse_r[r] = q_abs[r] < g.t ? lse[bh * g.t + q_abs[r]] : 0.0f;
      }
    }

    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dq[n][i] = 0.0f;
    }

    for (int kb = 0; kb <= tile; ++kb) {
      if (kb < tile) {
        const int k1 = (kb + 1) * kAttnTile;
        T* next = walk + ((kb + 1) & 1) * 2 * kTileElems;
        const int valid = min(kAttnTile, g.t - k1);
        AsyncLoadTile<T, D>(next, base + g.c + k1 * ld, ld, valid);
        AsyncLoadTile<T, D>(next + kTileElems, base + 2 * g.c + k1 * ld, ld, valid);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      const T* ks = walk + (kb & 1) * 2 * kTileElems;
      const T* vs = ks + kTileElems;

      float s[8][4], dp[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = dp[n][i] = 0.0f;
      }
      StripTimesRowsT<T, D, 8>(s, qs, strip, ks, 0, lane);   // S = Q K^T
      StripTimesRowsT<T, D, 8>(dp, gs, strip, vs, 0, lane);  // dP = dO V^T

      const int k0 = kb * kAttnTile;
      const bool diagonal = kb == tile;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int half = i >> 1;
          const float p = expf(s[n][i] * g.scale - lse_r[half]);
          float ds = p * (dp[n][i] - delta_r[half]);
          if (diagonal &&
              (k0 + 8 * n + mma::AccElement(lane, i).col > q_abs[half] || q_abs[half] >= g.t)) {
            ds = 0.0f;
          }
          s[n][i] = ds;
        }
      }
      AccTimesRows<T, D, 4>(dq, s, ks, 0, lane);  // dQ += round(dS) K
      __syncthreads();  // every warp is done with block kb's buffers before they refill
    }

    T* dst = dqkv + g.Token(b, q0 + strip) * ld + head_col;
    const float scale = g.scale;
    StoreStrip<T, D>(
        dq, [scale](int, float x) { return x * scale; }, qs + strip * kLd, dst, ld, q_valid - strip,
        lane);
  }
#endif
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_dkdv_flash_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                T* __restrict__ dqkv, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kLd = FlashTile<D>::kLd;
  constexpr int kTileElems = kAttnTile * kLd;
  constexpr int kChunk = D == 64 ? 32 : 16;  // query columns per S^T strip
  constexpr int kN8 = kChunk / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kTileElems;
  // Query tile qb's Q at walk + (qb & 1) * 2 kTileElems, its dout one tile
  // later; its lse at stats + (qb & 1) * 128, its Delta 64 further.
  T* walk = vs + kTileElems;
  float* stats = reinterpret_cast<float*>(smem + FlashBackwardSmem<D>::kStats);

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int kb = static_cast<int>(blockIdx.x);  // the first keys see the most queries
  const int k0 = kb * kAttnTile;
  const int strip = warp * 16;
  int k_abs[2];
  k_abs[0] = k0 + strip + mma::AccElement(lane, 0).row;
  k_abs[1] = k_abs[0] + 8;
  const int64_t ld = 3 * g.c;
  const int tiles = g.Tiles();
  const int k_valid = min(kAttnTile, g.t - k0);

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    const T* gbase = dout + g.Token(b, 0) * g.c + static_cast<int64_t>(h) * D;
    const float* lse_bh = lse + bh * g.t;
    const float* delta_bh = delta + bh * g.t;
    // Starts loading query tile qb (Q, dout by cp.async; lse and Delta by
    // plain loads) into buffer qb & 1.
    auto load_queries = [&](int qb) {
      const int q0 = qb * kAttnTile;
      const int valid = min(kAttnTile, g.t - q0);
      T* dst = walk + (qb & 1) * 2 * kTileElems;
      AsyncLoadTile<T, D>(dst, base + q0 * ld, ld, valid);
      AsyncLoadTile<T, D>(dst + kTileElems, gbase + q0 * g.c, g.c, valid);
      if (threadIdx.x < kAttnTile) {
        const int i = threadIdx.x;
        float* st = stats + (qb & 1) * 2 * kAttnTile;
        st[i] = i < valid ? lse_bh[q0 + i] : 0.0f;
        st[kAttnTile + i] = i < valid ? delta_bh[q0 + i] : 0.0f;
      }
    };

    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    AsyncLoadTile<T, D>(ks, base + g.c + k0 * ld, ld, k_valid);
    AsyncLoadTile<T, D>(vs, base + 2 * g.c + k0 * ld, ld, k_valid);
    load_queries(kb);
    CpAsyncCommit();

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;
    }

    for (int qb = kb; qb < tiles; ++qb) {
      if (qb + 1 < tiles) {
        load_queries(qb + 1);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      const T* qs = walk + (qb & 1) * 2 * kTileElems;
      const T* gs = qs + kTileElems;
      const float* lse_s = stats + (qb & 1) * 2 * kAttnTile;
      const float* delta_s = lse_s + kAttnTile;
      const int q0 = qb * kAttnTile;
      // Only the diagonal tile has queries before keys; only the last one
      // has queries past T.
      const bool check = qb == kb || qb == tiles - 1;

#pragma unroll
      for (int c = 0; c < kAttnTile; c += kChunk) {
        float st[kN8][4], dpt[kN8][4];
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) st[n][i] = dpt[n][i] = 0.0f;
        }
        StripTimesRowsT<T, D, kN8>(st, ks, strip, qs, c, lane);   // S^T = K Q^T
        StripTimesRowsT<T, D, kN8>(dpt, vs, strip, gs, c, lane);  // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          const int col = c + 8 * n + mma::AccElement(lane, 0).col;  // even: cols col, col + 1
          const float2 lse2 = *reinterpret_cast<const float2*>(lse_s + col);
          const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + col);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int half = i >> 1;
            const int j = i & 1;
            const int q_abs = q0 + col + j;
            const float p = expf(st[n][i] * g.scale - (j ? lse2.y : lse2.x));
            float ds = p * (dpt[n][i] - (j ? delta2.y : delta2.x));
            float pv = p;
            if (check && (q_abs < k_abs[half] || q_abs >= g.t)) pv = ds = 0.0f;
            st[n][i] = pv;
            dpt[n][i] = ds;
          }
        }
        AccTimesRows<T, D, kChunk / 16>(dv, st, gs, c, lane);   // dV += round(P^T) dO
        AccTimesRows<T, D, kChunk / 16>(dk, dpt, qs, c, lane);  // dK += round(dS^T) Q
      }
      __syncthreads();  // every warp is done with tile qb's buffers before they refill
    }

    T* row = dqkv + g.Token(b, k0 + strip) * ld + static_cast<int64_t>(h) * D;
    const float scale = g.scale;
    StoreStrip<T, D>(
        dk, [scale](int, float x) { return x * scale; }, ks + strip * kLd, row + g.c, ld,
        k_valid - strip, lane);
    StoreStrip<T, D>(
        dv, [](int, float x) { return x; }, vs + strip * kLd, row + 2 * g.c, ld, k_valid - strip,
        lane);
  }
#endif
}

template <typename T, int D>
cudaError_t Configure(int max_smem) {
  constexpr int kBytes = FlashBackwardSmem<D>::kBytes;
  if (kBytes > max_smem) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(attention_dq_flash_kernel<T, D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(attention_dkdv_flash_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
}

template <typename T, int D>
absl::Status Launch(const void* qkv, const void* out, const void* dout, const float* lse,
                    float* delta, void* dqkv, const AttnShape& g, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.Tiles()), AttnGridY(g.bh));
  constexpr int kBytes = FlashBackwardSmem<D>::kBytes;
  // dQ first: it writes the Delta the dK/dV pass reads.
  attention_dq_flash_kernel<T, D><<<grid, kAttnMmaThreads, kBytes, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(out), static_cast<const T*>(dout), lse,
      delta, static_cast<T*>(dqkv), g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  attention_dkdv_flash_kernel<T, D><<<grid, kAttnMmaThreads, kBytes, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchForHeadSize(const void* qkv, const void* out, const void* dout, const float* lse,
                               float* delta, void* dqkv, const AttnShape& g, cudaStream_t stream) {
  return g.d == 64 ? Launch<T, 64>(qkv, out, dout, lse, delta, dqkv, g, stream)
                   : Launch<T, 128>(qkv, out, dout, lse, delta, dqkv, g, stream);
}

}  // namespace

bool AttentionFlashBackwardApplies(int d, const AttentionKernelConfig& config) {
  if (d == 64) return FlashBackwardSmem<64>::kBytes <= config.max_dynamic_smem;
  if (d == 128) return FlashBackwardSmem<128>::kBytes <= config.max_dynamic_smem;
  return false;
}

absl::Status LaunchAttentionBackwardFlash(const void* qkv, const void* out, const void* dout,
                                          const float* lse, DType dtype, const AttnShape& g,
                                          void* dqkv, float* delta, cudaStream_t stream) {
  if (dtype == DType::kF16) {
    return LaunchForHeadSize<__half>(qkv, out, dout, lse, delta, dqkv, g, stream);
  }
  return LaunchForHeadSize<__nv_bfloat16>(qkv, out, dout, lse, delta, dqkv, g, stream);
}

absl::Status ConfigureAttentionFlashBackward(const AttentionKernelConfig& config) {
  const int max_smem = config.max_dynamic_smem;
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 128>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 128>(max_smem)));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
