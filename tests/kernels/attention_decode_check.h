// The check shared by the CPU and CUDA tests of AttentionDecode: on one
// backend, every row a decode writes is, bit for bit, the row the causal
// AttentionForward writes for the same query position (kernels/backend.h).
//
// A fused (S, T, (H + 2 Hkv) D) q|k|v is expanded with ExpandKvHeads, as
// the decoder does, and run through AttentionForward once. Then for every
// position t < T a decode call is made in which the S sequences sit at
// different positions (t, t + 37, t + 74, ... mod T) and read a KV cache
// of T + 13 positions filled from the same k and v up to their position
// and with NaN after it (a decode that reads a later position, or
// multiplies one by a zero weight, writes NaN); positions alternate
// between I32 and I64, and out starts as NaN bytes, so a row left
// unwritten fails too. With a sliding window (dims.options), the cache rows
// before each query's first visible key are NaN as well: a decode that
// weighs a key outside its window, even by zero, writes NaN.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels::testing {

struct DecodeDims {
  int64_t heads;                  // H
  int64_t kv_heads;               // Hkv
  int64_t head_dim;               // D
  int64_t seq;                    // T: positions 0 .. T - 1 are decoded
  int64_t seqs = 3;               // S: sequences per call
  AttentionOptions options = {};  // the scale and window of both calls
};

inline ::testing::AssertionResult DecodeRowsAreTheForwardsBits(Backend& be, DType dt,
                                                               const DecodeDims& g, uint64_t seed) {
  const int64_t s_len = g.seqs, t_len = g.seq, h = g.heads, hkv = g.kv_heads, d = g.head_dim;
  const int64_t t_max = t_len + 13;
  const int64_t fused = (h + 2 * hkv) * d;  // one token of the compact q|k|v
  const size_t elem = SizeOf(dt);
  std::mt19937_64 rng(seed);
  const std::vector<double> compact =
      RandomValues(rng, dt, static_cast<size_t>(s_len * t_len * fused), -2.0, 2.0);
  Tensor src = MakeTensor(be, dt, {s_len, t_len, fused}, compact);
  absl::StatusOr<Tensor> qkv = be.Allocate(dt, {s_len, t_len, 3 * h * d});
  absl::StatusOr<Tensor> fwd = be.Allocate(dt, {s_len, t_len, h * d});
  absl::StatusOr<Tensor> lse = be.Allocate(DType::kF32, {s_len, h, t_len});
  if (!qkv.ok() || !fwd.ok() || !lse.ok()) return ::testing::AssertionFailure() << "allocation";
  absl::Status st = be.ExpandKvHeads(src, h, hkv, *qkv);
  if (st.ok()) st = be.AttentionForward(*qkv, h, g.options, *fwd, *lse);
  if (!st.ok()) return ::testing::AssertionFailure() << "forward: " << st;
  const std::vector<unsigned char> fwd_bytes = RawBytes(be, *fwd);  // (S, T, H D)
  const std::vector<unsigned char> src_bytes = RawBytes(be, src);   // (S, T, fused)

  absl::StatusOr<Tensor> q = be.Allocate(dt, {s_len, h * d});
  absl::StatusOr<Tensor> k_cache = be.Allocate(dt, {s_len, t_max, hkv * d});
  absl::StatusOr<Tensor> v_cache = be.Allocate(dt, {s_len, t_max, hkv * d});
  absl::StatusOr<Tensor> out = be.Allocate(dt, {s_len, h * d});
  absl::StatusOr<Tensor> pos32 = be.Allocate(DType::kI32, {s_len});
  absl::StatusOr<Tensor> pos64 = be.Allocate(DType::kI64, {s_len});
  if (!q.ok() || !k_cache.ok() || !v_cache.ok() || !out.ok() || !pos32.ok() || !pos64.ok()) {
    return ::testing::AssertionFailure() << "allocation";
  }
  // NaN in every float dtype: all bits set.
  const std::vector<unsigned char> nan_out(out->nbytes(), 0xFF);
  std::vector<unsigned char> q_bytes(q->nbytes());
  std::vector<unsigned char> k_bytes(k_cache->nbytes(), 0xFF);
  std::vector<unsigned char> v_bytes(v_cache->nbytes(), 0xFF);
  const size_t row = static_cast<size_t>(fused) * elem;       // a compact token
  const size_t q_row = static_cast<size_t>(h * d) * elem;     // a query row
  const size_t kv_row = static_cast<size_t>(hkv * d) * elem;  // a cache row
  for (int64_t call = 0; call < t_len; ++call) {
    std::vector<int32_t> p32(static_cast<size_t>(s_len));
    std::vector<int64_t> p64(static_cast<size_t>(s_len));
    std::fill(k_bytes.begin(), k_bytes.end(), 0xFF);
    std::fill(v_bytes.begin(), v_bytes.end(), 0xFF);
    for (int64_t s = 0; s < s_len; ++s) {
      const int64_t t = (call + 37 * s) % t_len;
      p32[static_cast<size_t>(s)] = static_cast<int32_t>(t);
      p64[static_cast<size_t>(s)] = t;
      const unsigned char* seq = src_bytes.data() + static_cast<size_t>(s * t_len) * row;
      std::memcpy(q_bytes.data() + static_cast<size_t>(s) * q_row, seq + t * row, q_row);
      for (int64_t p = AttentionFirstKey(t, g.options.window); p <= t; ++p) {
        const size_t dst = static_cast<size_t>(s * t_max + p) * kv_row;
        std::memcpy(k_bytes.data() + dst, seq + p * row + q_row, kv_row);
        std::memcpy(v_bytes.data() + dst, seq + p * row + q_row + kv_row, kv_row);
      }
    }
    const bool wide = call % 2 == 1;
    Tensor& positions = wide ? *pos64 : *pos32;
    st = wide ? be.CopyFromHost(p64.data(), p64.size() * 8, positions)
              : be.CopyFromHost(p32.data(), p32.size() * 4, positions);
    if (st.ok()) st = be.CopyFromHost(q_bytes.data(), q_bytes.size(), *q);
    if (st.ok()) st = be.CopyFromHost(k_bytes.data(), k_bytes.size(), *k_cache);
    if (st.ok()) st = be.CopyFromHost(v_bytes.data(), v_bytes.size(), *v_cache);
    if (st.ok()) st = be.CopyFromHost(nan_out.data(), nan_out.size(), *out);
    if (st.ok())
      st = be.AttentionDecode(*q, *k_cache, *v_cache, positions, h, hkv, g.options, *out);
    if (!st.ok()) return ::testing::AssertionFailure() << "decode call " << call << ": " << st;
    const std::vector<unsigned char> got = RawBytes(be, *out);
    for (int64_t s = 0; s < s_len; ++s) {
      const int64_t t = p64[static_cast<size_t>(s)];
      const unsigned char* want = fwd_bytes.data() + static_cast<size_t>(s * t_len + t) * q_row;
      const unsigned char* mine = got.data() + static_cast<size_t>(s) * q_row;
      if (std::memcmp(want, mine, q_row) != 0) {
        size_t i = 0;
        while (std::memcmp(want + i * elem, mine + i * elem, elem) == 0) ++i;
        return ::testing::AssertionFailure()
               << DTypeName(dt) << " H=" << h << " Hkv=" << hkv << " D=" << d << ": sequence " << s
               << " at position " << t << " (positions " << (wide ? "I64" : "I32")
               << "): first differing element " << i << " (head " << i / static_cast<size_t>(d)
               << ") is not the forward's row";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ampd::kernels::testing
