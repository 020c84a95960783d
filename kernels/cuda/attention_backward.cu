// Fused causal self-attention backward (kernels/backend.h), recomputing P
// from the forward's lse; nothing of size T x T in memory and no atomics,
// so dqkv is the same bits run to run.
//
// First Delta_t = sum_d dout_t,d out_t,d per (b, h, t) into (B, H, T) F32
// scratch (a thread per row, channels in order, as the CPU oracle sums).
// Then either the tensor-core passes (attention_backward_mma.cu: fp16/bf16,
// D = 64 or 128) or the generic ones here (fp32, other head sizes,
// unaligned views). By default, fp16/bf16 calls with D = 64 or 128 and
// aligned operands take neither: the register-tile passes
// (attention_flash_backward.cu) run instead, and compute Delta themselves
// in their dQ pass. The generic passes:
// - dK/dV: a warp per key s (4 per CTA); per block of 64 queries from the
//   key's own block on, lanes compute P and dS for two queries each (dot
//   products over the channels in order), rounded to the dtype, and each
//   lane adds round(dS) q and round(P) dout onto its channels, queries in
//   order;
// - dQ: a warp per query t; per key block up to its own, lanes compute dS
//   for two keys each, and add round(dS) k onto their channels, keys in
//   order.
// A sliding window (g.window) takes the generic passes whatever the dtype:
// dK/dV's queries stop at the key's last viewer (QueryEnd), dQ's keys start
// at the query's first (FirstKey), and the pairs outside are masked.
// Both generic passes take channels in slices of 128 per grid z index (4
// per lane), recomputing the scores per slice, so any D works; each sum
// has the CPU oracle's order, so they differ from it only in expf's bits.
#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// Delta[(b, h), t] for every (b, t, h): consecutive threads take
// consecutive heads of one token, so a warp reads contiguous memory.
template <typename T>
__global__ void attention_delta_kernel(const T* __restrict__ out, const T* __restrict__ dout,
                                       float* __restrict__ delta, AttnShape g, int64_t rows) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t token = i / g.heads;  // b * T + t
    const int64_t h = i % g.heads;
    const int64_t off = token * g.c + h * g.d;
    float dot = 0.0f;
    for (int d = 0; d < g.d; ++d) dot += ToFloat(dout[off + d]) * ToFloat(out[off + d]);
    const int64_t b = token / g.t;
    delta[(b * g.heads + h) * g.t + token % g.t] = dot;
  }
}

// dS of query t and key s, rounded to T (the product's operand), and
// round(P) in *p: S * scale and dP are dot products over the channels in
// order.
template <typename T>
__device__ __forceinline__ float GenericDs(const T* q, const T* k, const T* go, const T* v,
                                           float lse_t, float delta_t, const AttnShape& g,
                                           float* p) {
  float dot = 0.0f, dp = 0.0f;
  for (int d = 0; d < g.d; ++d) {
    dot += ToFloat(q[d]) * ToFloat(k[d]);
    dp += ToFloat(go[d]) * ToFloat(v[d]);
  }
  const float pf = expf(dot * g.scale - lse_t);
  *p = ToFloat(FromFloat<T>(pf));
  return ToFloat(FromFloat<T>(pf * (dp - delta_t)));
}

template <typename T>
__global__ void __launch_bounds__(32 * kAttnGenericWarps)
    attention_dkdv_generic_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                                  const float* __restrict__ lse, const float* __restrict__ delta,
                                  T* __restrict__ dqkv, AttnShape g) {
  __shared__ float p_sh[kAttnGenericWarps][kAttnTile];
  __shared__ float ds_sh[kAttnGenericWarps][kAttnTile];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // The first keys see the most queries: they go first.
  const int s = static_cast<int>(blockIdx.x) * kAttnGenericWarps + warp;
  if (s >= g.t) return;  // whole warps only: no CTA-wide barrier below
  const int64_t ld = 3 * g.c;
  float* p = p_sh[warp];
  float* dsw = ds_sh[warp];

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int64_t h = bh % g.heads;
    const T* base = qkv + g.Token(b, 0) * ld + h * g.d;
    const T* gbase = dout + g.Token(b, 0) * g.c + h * g.d;
    const float* lse_bh = lse + bh * g.t;
    const float* delta_bh = delta + bh * g.t;
    const T* k = base + g.c + s * ld;
    const T* v = base + 2 * g.c + s * ld;
    for (int d0 = static_cast<int>(blockIdx.z) * kAttnGenericSlice; d0 < g.d;
         d0 += static_cast<int>(gridDim.z) * kAttnGenericSlice) {
      float dk[kAttnGenericChannels], dv[kAttnGenericChannels];
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) dk[c] = dv[c] = 0.0f;
      const int i_end = g.QueryEnd(s);  // queries s .. i_end - 1 see key s
      for (int i0 = s / kAttnTile * kAttnTile; i0 < i_end; i0 += kAttnTile) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = i0 + lane + 32 * e;
          float pi = 0.0f, dsi = 0.0f;
          if (i >= s && i < i_end) {
            dsi = GenericDs(base + i * ld, k, gbase + i * g.c, v, lse_bh[i], delta_bh[i], g, &pi);
          }
          p[lane + 32 * e] = pi;
          dsw[lane + 32 * e] = dsi;
        }
        __syncwarp();
        const int first = max(s, i0);
        const int last = min(i_end, i0 + kAttnTile);
        for (int i = first; i < last; ++i) {
          const float w = dsw[i - i0];
          const float pi = p[i - i0];
          const T* q = base + i * ld;
          const T* go = gbase + i * g.c;
#pragma unroll
          for (int c = 0; c < kAttnGenericChannels; ++c) {
            const int d = d0 + lane + 32 * c;
            if (d < g.d) {
              dk[c] += w * ToFloat(q[d]);
              dv[c] += pi * ToFloat(go[d]);
            }
          }
        }
        __syncwarp();  // p and dsw are rewritten by the next block
      }
      T* row = dqkv + g.Token(b, s) * ld + h * g.d;
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) {
        const int d = d0 + lane + 32 * c;
        if (d < g.d) {
          row[g.c + d] = FromFloat<T>(dk[c] * g.scale);
          row[2 * g.c + d] = FromFloat<T>(dv[c]);
        }
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kAttnGenericWarps)
    attention_dq_generic_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                T* __restrict__ dqkv, AttnShape g) {
  __shared__ float ds_sh[kAttnGenericWarps][kAttnTile];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int groups = (g.t + kAttnGenericWarps - 1) / kAttnGenericWarps;
  const int t = (groups - 1 - static_cast<int>(blockIdx.x)) * kAttnGenericWarps + warp;
  if (t >= g.t) return;  // whole warps only: no CTA-wide barrier below
  const int64_t ld = 3 * g.c;
  float* dsw = ds_sh[warp];

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int64_t h = bh % g.heads;
    const T* base = qkv + g.Token(b, 0) * ld + h * g.d;
    const T* q = base + t * ld;
    const T* go = dout + g.Token(b, t) * g.c + h * g.d;
    const float lse_t = lse[bh * g.t + t];
    const float delta_t = delta[bh * g.t + t];
    for (int d0 = static_cast<int>(blockIdx.z) * kAttnGenericSlice; d0 < g.d;
         d0 += static_cast<int>(gridDim.z) * kAttnGenericSlice) {
      float dq[kAttnGenericChannels];
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) dq[c] = 0.0f;
      const int first = g.FirstKey(t);
      for (int k0 = first / kAttnTile * kAttnTile; k0 <= t; k0 += kAttnTile) {
        const int n = min(kAttnTile, t + 1 - k0);  // keys up to t
        const int j0 = max(first - k0, 0);         // keys before k0 + j0: outside the window
        for (int j = lane; j < kAttnTile; j += 32) {
          float dsj = 0.0f, unused_p;
          if (j >= j0 && j < n) {
            dsj = GenericDs(q, base + g.c + (k0 + j) * ld, go, base + 2 * g.c + (k0 + j) * ld,
                            lse_t, delta_t, g, &unused_p);
          }
          dsw[j] = dsj;
        }
        __syncwarp();
        for (int j = j0; j < n; ++j) {
          const float w = dsw[j];
          const T* k = base + g.c + (k0 + j) * ld;
#pragma unroll
          for (int c = 0; c < kAttnGenericChannels; ++c) {
            const int d = d0 + lane + 32 * c;
            if (d < g.d) dq[c] += w * ToFloat(k[d]);
          }
        }
        __syncwarp();  // dsw is rewritten by the next block
      }
      T* row = dqkv + g.Token(b, t) * ld + h * g.d;
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) {
        const int d = d0 + lane + 32 * c;
        if (d < g.d) row[d] = FromFloat<T>(dq[c] * g.scale);
      }
    }
  }
}

template <typename T>
absl::Status LaunchDelta(const void* out, const void* dout, float* delta, const AttnShape& g,
                         int64_t batch, cudaStream_t stream) {
  const int64_t rows = batch * g.t * g.heads;
  attention_delta_kernel<T><<<GridFor(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(out), static_cast<const T*>(dout), delta, g, rows);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchGeneric(const void* qkv, const void* dout, const float* lse, const float* delta,
                           void* dqkv, const AttnShape& g, cudaStream_t stream) {
  const int groups = (g.t + kAttnGenericWarps - 1) / kAttnGenericWarps;
  const int slices = (g.d + kAttnGenericSlice - 1) / kAttnGenericSlice;
  const dim3 grid(static_cast<unsigned>(groups), AttnGridY(g.bh),
                  static_cast<unsigned>(std::min(slices, 65535)));
  attention_dkdv_generic_kernel<T><<<grid, 32 * kAttnGenericWarps, 0, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  attention_dq_generic_kernel<T><<<grid, 32 * kAttnGenericWarps, 0, stream>>>(
      static_cast<const T*>(qkv), static_cast<const T*>(dout), lse, delta, static_cast<T*>(dqkv),
      g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const void* qkv, const void* out, const void* dout, const float* lse,
                      DType dtype, int64_t batch, const AttnShape& g, void* dqkv, float* delta,
                      const AttentionKernelConfig& config, cudaStream_t stream) {
  // The register-tile passes compute Delta themselves (in their dQ pass).
  const bool sixteen = dtype == DType::kF16 || dtype == DType::kBF16;
  const bool windowed = g.window > 0;  // the tensor-core passes know only the diagonal
  if (sixteen && !windowed && !config.wmma_kernels && Aligned16(qkv) && Aligned16(out) &&
      Aligned16(dout) && Aligned16(dqkv) && AttentionFlashBackwardApplies(g.d, config)) {
    return LaunchAttentionBackwardFlash(qkv, out, dout, lse, dtype, g, dqkv, delta, stream);
  }
  AMPD_RETURN_IF_ERROR(LaunchDelta<T>(out, dout, delta, g, batch, stream));
  if (!windowed && AttentionBackwardMmaApplies(dtype, g, qkv, dout, dqkv, config)) {
    return LaunchAttentionBackwardMma(qkv, dout, lse, delta, dtype, g, dqkv, stream);
  }
  return LaunchGeneric<T>(qkv, dout, lse, delta, dqkv, g, stream);
}

}  // namespace

absl::Status ConfigureAttentionBackward(const AttentionKernelConfig& config) {
  AMPD_RETURN_IF_ERROR(ConfigureAttentionFlashBackward(config));
  return ConfigureAttentionBackwardMma(config);
}

absl::Status LaunchAttentionBackward(const void* qkv, const void* out, const void* dout,
                                     const float* lse, DType dtype, int64_t batch, int64_t seq,
                                     int64_t channels, int64_t heads,
                                     const AttentionOptions& options, void* dqkv, float* delta,
                                     const AttentionKernelConfig& config, cudaStream_t stream) {
  if (batch == 0 || seq == 0) return absl::OkStatus();
  const AttnShape g = MakeAttnShape(batch, seq, channels, heads, options);
  switch (dtype) {
    case DType::kF16:
      return Backward<__half>(qkv, out, dout, lse, dtype, batch, g, dqkv, delta, config, stream);
    case DType::kBF16:
      return Backward<__nv_bfloat16>(qkv, out, dout, lse, dtype, batch, g, dqkv, delta, config,
                                     stream);
    default:
      return Backward<float>(qkv, out, dout, lse, dtype, batch, g, dqkv, delta, config, stream);
  }
}

}  // namespace ampd::kernels::cuda
