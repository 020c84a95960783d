// One query row of the generic (CUDA-core) causal attention forward, shared
// by the kernels that produce such a row: the generic forward
// (attention_forward.cu, every row of a sequence) and the generic decode
// (attention_decode.cu, one row per sequence against a KV cache), so the
// two agree bit for bit by construction. CUDA C++17, device only.
//
// A warp per row: lanes over the block's 64 keys (two each) for the scores
// and over channels (kAttnGenericChannels each, a slice of
// kAttnGenericSlice) for the output; each dot product and sum in the CPU
// oracle's order (channels in order, the block's P in two sequential
// halves, the products in key order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/device_common.cuh"

namespace ampd::kernels::cuda {

// S = (q . k) * scale over d_len channels in order; -inf for a masked key.
template <typename T>
__device__ __forceinline__ float GenericScore(const T* q, const T* k, bool visible, int d_len,
                                              float scale) {
  if (!visible) return -INFINITY;
  float dot = 0.0f;
  for (int d = 0; d < d_len; ++d) dot += ToFloat(q[d]) * ToFloat(k[d]);
  return dot * scale;
}

// Query row t (q: its D = d_len values) against keys first .. t (first =
// AttentionFirstKey(t, window): key blocks from first's, the keys before it
// masked as the keys after t are), key j's row at
// k + j * ld and its value row at v + j * ld, for the lane's channels
// d0 + lane + 32 c (c < kAttnGenericChannels, those < d_len): acc (the
// unnormalised output), the running max m and sum l, all set here. p: the
// warp's kAttnTile floats of shared memory. Every lane of the warp calls it.
template <typename T>
__device__ __forceinline__ void GenericAttentionRowSlice(const T* q, const T* k, const T* v,
                                                         int64_t ld, int t, int first, int d0,
                                                         int d_len, float scale, float* p, int lane,
                                                         float (&acc)[kAttnGenericChannels],
                                                         float& m, float& l) {
#pragma unroll
  for (int c = 0; c < kAttnGenericChannels; ++c) acc[c] = 0.0f;
  m = -INFINITY;
  l = 0.0f;
  for (int k0 = first / kAttnTile * kAttnTile; k0 <= t; k0 += kAttnTile) {
    const int n = min(kAttnTile, t + 1 - k0);  // keys up to t
    const int j0 = max(first - k0, 0);         // keys before k0 + j0: outside the window
    const float s0 = GenericScore(q, k + (k0 + lane) * ld, lane >= j0 && lane < n, d_len, scale);
    const float s1 =
        GenericScore(q, k + (k0 + lane + 32) * ld, lane + 32 >= j0 && lane + 32 < n, d_len, scale);
    const float m_new = fmaxf(m, WarpMax(fmaxf(s0, s1)));
    const float alpha = expf(m - m_new);
    p[lane] = expf(s0 - m_new);
    p[lane + 32] = expf(s1 - m_new);
    __syncwarp();
    // l's block sum as the oracle orders it: two sequential halves.
    float half0 = 0.0f, half1 = 0.0f;
    for (int j = 0; j < 32; ++j) half0 += p[j];
    for (int j = 32; j < 64; ++j) half1 += p[j];
    l = l * alpha + (half0 + half1);
    m = m_new;
#pragma unroll
    for (int c = 0; c < kAttnGenericChannels; ++c) acc[c] *= alpha;
    for (int j = j0; j < n; ++j) {
      const float pj = ToFloat(FromFloat<T>(p[j]));  // the MMA operand's rounding
      const T* vj = v + (k0 + j) * ld;
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) {
        const int d = d0 + lane + 32 * c;
        if (d < d_len) acc[c] += pj * ToFloat(vj[d]);
      }
    }
    __syncwarp();  // p is rewritten by the next block
  }
}

}  // namespace ampd::kernels::cuda
