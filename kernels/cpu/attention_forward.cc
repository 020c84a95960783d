// Causal self-attention forward, the oracle of the CUDA kernels: the
// blockwise online softmax of kernels/backend.h, step for step. Per batch
// row b, head h and query t, the row's arithmetic is AttentionRow
// (attention_row.h, shared with AttentionDecode): keys visited in blocks of
// kAttentionKeyBlock at absolute positions, up to the query's own block;
// per block the fp32 scores S = (q k) * scale (each dot product summed
// over the channels in order), the running max m, P = exp(S - m), the
// running sum l (the block's P summed in two sequential halves of 32 keys,
// then added: the order of the CUDA wmma kernel's row owners and of its
// generic kernel; the CUDA register-tile kernel sums four interleaved
// quarters instead, an order the contract leaves free), and
// acc = acc * alpha followed by the block's round(P) v products added in
// key order. out = acc / l rounded once; lse = m + log(l).
//
// A sliding window (options.window = W) starts each row at its first
// visible key's block and skips the keys before it, as it skips those after
// the query. A query's computation reads only its own q and keys first .. t,
// and the keys outside are skipped (not multiplied by 0), so row t's bits do not
// depend on T or on the other rows: the KV-cache prefix property holds
// exactly here.
//
// Each (b, h) pair is one chunk of the thread pool: its q, k and v are
// widened once into per-thread fp32 scratch (k transposed so the score loop
// runs over contiguous keys), and every sum keeps a sequential order, so the
// result does not depend on the thread count.
#include <vector>

#include "common/status_macros.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Per-thread fp32 scratch, reused across calls (no allocation once a shape
// has been seen on a thread).
struct HeadScratch {
  std::vector<float> q;    // (T, D)
  std::vector<float> kt;   // (D, T): k transposed, keys contiguous
  std::vector<float> v;    // (T, D)
  std::vector<float> p;    // (Bk): one block's scores, then probabilities
  std::vector<float> acc;  // (D): one output row
};

HeadScratch& Scratch() {
  thread_local HeadScratch scratch;
  return scratch;
}

template <typename Tag>
void ForwardHead(const typename Tag::Storage* qkv, typename Tag::Storage* out, float* lse,
                 int64_t b, int64_t h, int64_t heads, int64_t seq, int64_t channels,
                 int64_t head_dim, float scale, int64_t window) {
  using Storage = typename Tag::Storage;
  constexpr int64_t kBlock = kAttentionKeyBlock;
  const int64_t t_len = seq;
  const int64_t d_len = head_dim;
  const int64_t stride = 3 * channels;  // one token's row of qkv
  HeadScratch& s = Scratch();
  s.q.resize(static_cast<size_t>(t_len * d_len));
  s.kt.resize(static_cast<size_t>(t_len * d_len));
  s.v.resize(static_cast<size_t>(t_len * d_len));
  s.p.resize(static_cast<size_t>(kBlock));
  s.acc.resize(static_cast<size_t>(d_len));
  float* q = s.q.data();
  float* kt = s.kt.data();
  float* v = s.v.data();
  float* p = s.p.data();
  float* acc = s.acc.data();

  const Storage* base = qkv + b * t_len * stride;  // (T, 3C) of batch row b
  for (int64_t t = 0; t < t_len; ++t) {
    const Storage* tok = base + t * stride + h * d_len;
    for (int64_t d = 0; d < d_len; ++d) {
      q[t * d_len + d] = Tag::Load(tok[d]);
      kt[d * t_len + t] = Tag::Load(tok[channels + d]);
      v[t * d_len + d] = Tag::Load(tok[2 * channels + d]);
    }
  }

  float* lse_row = lse + (b * heads + h) * t_len;  // (T) of (b, h)
  for (int64_t t = 0; t < t_len; ++t) {
    Storage* o = out + (b * t_len + t) * channels + h * d_len;
    lse_row[t] = AttentionRow<Tag>(
        q + t * d_len, t, AttentionFirstKey(t, window), d_len, scale,
        [&](int64_t k0, int64_t /*n*/) {
          return AttentionKeyBlock{kt + k0, t_len, v + k0 * d_len};
        },
        p, acc, o);
  }
}

}  // namespace

absl::Status AttentionForward(ThreadPool& pool, const Tensor& qkv, int64_t n_head,
                              const AttentionOptions& options, Tensor& out, Tensor& lse) {
  AMPD_RETURN_IF_ERROR(ValidateAttentionForward(qkv, n_head, out, lse));
  AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionForward"));
  const int64_t batch = qkv.dim(0);
  const int64_t seq = qkv.dim(1);
  const int64_t channels = qkv.dim(2) / 3;
  const int64_t head_dim = channels / n_head;
  const float scale = AttentionScaleOf(options, head_dim);
  const int64_t window = options.window;
  return VisitFloat(qkv.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(qkv);
    auto* o = Ptr<Tag>(out);
    float* l = lse.data_as<float>();
    pool.ForEachChunk(batch * n_head, [&](int64_t bh) {
      ForwardHead<Tag>(in, o, l, bh / n_head, bh % n_head, n_head, seq, channels, head_dim, scale,
                       window);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
