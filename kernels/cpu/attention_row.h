// One query row of the causal attention forward (the contract in
// kernels/backend.h), the arithmetic shared by the two CPU ops that produce
// such a row: AttentionForward (attention_forward.cc, every row of a
// sequence) and AttentionDecode (attention_decode.cc, one row per sequence
// against a KV cache). There is one code path, so a decoded row equals the
// forward's row bit for bit by construction; the callers differ only in
// where the widened keys and values of a block come from.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention_params.h"
#include "kernels/cpu/attention_rows.h"

namespace ampd::kernels::cpu {

// Keys k0 .. k0 + n - 1 of one key block, widened to fp32: channel d of key
// k0 + j is kt[d * kt_ld + j] (keys contiguous per channel, so the score
// loop runs over contiguous keys), its value row is v[j * D .. j * D + D).
struct AttentionKeyBlock {
  const float* kt;
  int64_t kt_ld;
  const float* v;
};

// Query row t (q: D fp32 values, the stored q widened) against keys
// first .. t (first = AttentionFirstKey(t, window), 0 without one): key
// blocks of kAttentionKeyBlock at absolute positions, from first's block
// up to the row's own; the keys before first in first's block are skipped
// (not multiplied by 0), so they add nothing; per block the fp32 scores
// (q k) * scale, each dot product a
// sequential sum over the channels in order; the running max m; P =
// exp(S - m); the running sum l (the block's P summed in two sequential
// halves of 32 keys, then added); acc = acc * alpha, then the block's
// round(P) v products added in key order (AccumulateRows). Writes
// out[d] = round(acc[d] / l) for d < D and returns lse = m + log(l).
//
// key_block(k0, n) -> AttentionKeyBlock gives keys k0 .. k0 + n - 1 (k0 a
// block boundary, also in first's block); it is called once per block, in
// increasing k0. p (kAttentionKeyBlock) and acc
// (D) are the caller's scratch.
template <typename Tag, typename KeyBlockFn>
inline float AttentionRow(const float* q, int64_t t, int64_t first, int64_t d_len, float scale,
                          KeyBlockFn&& key_block, float* p, float* acc,
                          typename Tag::Storage* out) {
  constexpr int64_t kBlock = kAttentionKeyBlock;
  float m = -INFINITY;
  float l = 0.0f;
  for (int64_t d = 0; d < d_len; ++d) acc[d] = 0.0f;
  for (int64_t k0 = first / kBlock * kBlock; k0 <= t; k0 += kBlock) {
    const int64_t n = std::min(kBlock, t + 1 - k0);       // keys k0 .. k0 + n - 1, none after t
    const int64_t j0 = std::max<int64_t>(first - k0, 0);  // keys before k0 + j0: outside the window
    const AttentionKeyBlock keys = key_block(k0, n);
    // Scores: each a sequential sum over the channels, then scaled.
    for (int64_t j = j0; j < n; ++j) p[j] = 0.0f;
    for (int64_t d = 0; d < d_len; ++d) {
      const float qd = q[d];
      const float* kd = keys.kt + d * keys.kt_ld;
      for (int64_t j = j0; j < n; ++j) p[j] += qd * kd[j];
    }
    float block_max = -INFINITY;
    for (int64_t j = j0; j < n; ++j) {
      p[j] *= scale;
      block_max = std::fmax(block_max, p[j]);
    }
    const float m_new = std::fmax(m, block_max);
    const float alpha = std::exp(m - m_new);
    // The halves stay those of the block's absolute keys.
    float half_sum[2] = {0.0f, 0.0f};
    for (int64_t j = j0; j < n; ++j) {
      p[j] = std::exp(p[j] - m_new);
      half_sum[j / (kBlock / 2)] += p[j];
    }
    l = l * alpha + (half_sum[0] + half_sum[1]);
    for (int64_t j = j0; j < n; ++j) p[j] = Tag::Load(Tag::Store(p[j]));  // the MMA operand
    for (int64_t d = 0; d < d_len; ++d) acc[d] *= alpha;
    AccumulateRows(p + j0, keys.v + j0 * d_len, n - j0, d_len, acc);
    m = m_new;
  }
  for (int64_t d = 0; d < d_len; ++d) out[d] = Tag::Store(acc[d] / l);
  return m + std::log(l);
}

}  // namespace ampd::kernels::cpu
