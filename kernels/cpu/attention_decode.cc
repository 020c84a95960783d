// The decode step of causal attention against a KV cache (the contract in
// kernels/backend.h): sequence s's one new query row at position
// t = positions[s], per head h, over the cached keys and values 0 .. t of
// kv head h / (H / Hkv) (first(t) .. t under a sliding window; blocks wholly
// before first(t)'s are not read). The row's arithmetic is AttentionRow
// (attention_row.h), the same code AttentionForward runs for its row t, so
// the two agree bit for bit: key blocks at absolute positions, each score
// a sequential sum over the channels in order, the same softmax and
// accumulation steps.
//
// Where the forward widens a whole head once (k transposed), the decode
// widens one key block at a time straight from the cache rows into the
// same transposed layout, so the shared score loop sees the same fp32
// values in the same order. Each (s, h) pair is one chunk of the thread
// pool, with per-thread scratch; cache positions after t are never read.
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Per-thread fp32 scratch, reused across calls.
struct DecodeScratch {
  std::vector<float> q;    // (D)
  std::vector<float> kt;   // (D, Bk): one key block transposed
  std::vector<float> v;    // (Bk, D): its value rows
  std::vector<float> p;    // (Bk)
  std::vector<float> acc;  // (D)
};

DecodeScratch& Scratch() {
  thread_local DecodeScratch scratch;
  return scratch;
}

struct DecodeShape {
  int64_t heads = 0;     // H
  int64_t group = 0;     // H / Hkv
  int64_t head_dim = 0;  // D
  int64_t t_max = 0;     // T_max
  int64_t kv_width = 0;  // Hkv D: one cache row
  float scale = 0.0f;
  int64_t window = 0;  // options.window
};

template <typename Tag>
void DecodeHead(const typename Tag::Storage* q_in, const typename Tag::Storage* k_cache,
                const typename Tag::Storage* v_cache, typename Tag::Storage* out, int64_t s,
                int64_t h, int64_t t, const DecodeShape& g) {
  using Storage = typename Tag::Storage;
  constexpr int64_t kBlock = kAttentionKeyBlock;
  const int64_t d_len = g.head_dim;
  DecodeScratch& sc = Scratch();
  sc.q.resize(static_cast<size_t>(d_len));
  sc.kt.resize(static_cast<size_t>(d_len * kBlock));
  sc.v.resize(static_cast<size_t>(kBlock * d_len));
  sc.p.resize(static_cast<size_t>(kBlock));
  sc.acc.resize(static_cast<size_t>(d_len));
  float* q = sc.q.data();
  float* kt = sc.kt.data();
  float* v = sc.v.data();

  const Storage* q_row = q_in + (s * g.heads + h) * d_len;  // (D) of (s, h)
  for (int64_t d = 0; d < d_len; ++d) q[d] = Tag::Load(q_row[d]);
  // Key j of this (s, h): row j of sequence s's cache, kv head h / G.
  const int64_t kv_col = (h / g.group) * d_len;
  const Storage* k_seq = k_cache + s * g.t_max * g.kv_width + kv_col;
  const Storage* v_seq = v_cache + s * g.t_max * g.kv_width + kv_col;
  auto key_block = [&](int64_t k0, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const Storage* kr = k_seq + (k0 + j) * g.kv_width;
      const Storage* vr = v_seq + (k0 + j) * g.kv_width;
      for (int64_t d = 0; d < d_len; ++d) {
        kt[d * kBlock + j] = Tag::Load(kr[d]);
        v[j * d_len + d] = Tag::Load(vr[d]);
      }
    }
    return AttentionKeyBlock{kt, kBlock, v};
  };
  Storage* o = out + (s * g.heads + h) * d_len;
  AttentionRow<Tag>(q, t, AttentionFirstKey(t, g.window), d_len, g.scale, key_block, sc.p.data(),
                    sc.acc.data(), o);
}

}  // namespace

absl::Status AttentionDecode(ThreadPool& pool, const Tensor& q, const Tensor& k_cache,
                             const Tensor& v_cache, const Tensor& positions, int64_t heads,
                             int64_t kv_heads, const AttentionOptions& options, Tensor& out) {
  AMPD_RETURN_IF_ERROR(
      ValidateAttentionDecode(q, k_cache, v_cache, positions, heads, kv_heads, out));
  AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionDecode"));
  const int64_t seqs = q.dim(0);
  DecodeShape g;
  g.heads = heads;
  g.group = heads / kv_heads;
  g.head_dim = q.dim(1) / heads;
  g.t_max = k_cache.dim(1);
  g.kv_width = k_cache.dim(2);
  g.scale = AttentionScaleOf(options, g.head_dim);
  g.window = options.window;
  // The positions, checked before anything is written.
  std::vector<int64_t> pos(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < seqs; ++s) {
    pos[static_cast<size_t>(s)] = LoadIndex(positions, s);
    if (pos[static_cast<size_t>(s)] < 0 || pos[static_cast<size_t>(s)] >= g.t_max) {
      return absl::InvalidArgumentError(
          absl::StrCat("AttentionDecode: positions[", s, "] is ", pos[static_cast<size_t>(s)],
                       "; expected 0 <= position < T_max = ", g.t_max));
    }
  }
  return VisitFloat(q.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* qp = Ptr<Tag>(q);
    const auto* kp = Ptr<Tag>(k_cache);
    const auto* vp = Ptr<Tag>(v_cache);
    auto* op = Ptr<Tag>(out);
    pool.ForEachChunk(seqs * heads, [&](int64_t sh) {
      const int64_t s = sh / heads;
      DecodeHead<Tag>(qp, kp, vp, op, s, sh % heads, pos[static_cast<size_t>(s)], g);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
