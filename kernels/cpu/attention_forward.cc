// Causal self-attention forward, the oracle of the CUDA version: per batch
// row b and head h, S = (q k^T) / sqrt(D) rounded to att's dtype, the
// causal softmax of S (row max subtracted, keys after the query set to 0)
// rounded into att, and out = P v from the rounded P, accumulated in fp32
// and rounded once. Those are the roundings a strided-batched GEMM in the
// working dtype makes, so CUDA can be compared op by op; only the order of
// the fp32 sums and expf's last bits differ.
//
// Each (b, h) pair is one chunk of the thread pool: its q, k and v are
// widened once into per-thread fp32 scratch (k transposed), and the inner
// loops run over contiguous keys or channels with independent accumulators,
// which the compiler vectorises without reassociating any sum (each
// element's sum keeps its sequential order, so the result does not depend
// on the thread count). Masked keys are skipped rather than multiplied by 0.
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/attention_scale.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Per-thread fp32 scratch, reused across calls (no allocation once a shape
// has been seen on a thread).
struct HeadScratch {
  std::vector<float> q;    // (T, D)
  std::vector<float> kt;   // (D, T): k transposed, keys contiguous
  std::vector<float> v;    // (T, D)
  std::vector<float> row;  // (T): scores, then probabilities of one query
  std::vector<float> acc;  // (D): one output row
};

HeadScratch& Scratch() {
  thread_local HeadScratch scratch;
  return scratch;
}

template <typename Tag>
void ForwardHead(const typename Tag::Storage* qkv, typename Tag::Storage* att,
                 typename Tag::Storage* out, int64_t b, int64_t h, int64_t heads, int64_t seq,
                 int64_t channels, int64_t head_dim, float scale) {
  using Storage = typename Tag::Storage;
  const int64_t t_len = seq;
  const int64_t d_len = head_dim;
  const int64_t stride = 3 * channels;  // one token's row of qkv
  HeadScratch& s = Scratch();
  s.q.resize(static_cast<size_t>(t_len * d_len));
  s.kt.resize(static_cast<size_t>(t_len * d_len));
  s.v.resize(static_cast<size_t>(t_len * d_len));
  s.row.resize(static_cast<size_t>(t_len));
  s.acc.resize(static_cast<size_t>(d_len));
  float* q = s.q.data();
  float* kt = s.kt.data();
  float* v = s.v.data();
  float* row = s.row.data();
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

  Storage* probs = att + (b * heads + h) * t_len * t_len;  // (T, T) of (b, h)
  for (int64_t t = 0; t < t_len; ++t) {
    const int64_t keys = t + 1;  // causal: keys 0 .. t
    for (int64_t j = 0; j < keys; ++j) row[j] = 0.0f;
    for (int64_t d = 0; d < d_len; ++d) {
      const float qd = q[t * d_len + d];
      const float* kd = kt + d * t_len;
      for (int64_t j = 0; j < keys; ++j) row[j] += qd * kd[j];
    }
    // The scaled score as the GEMM stores it (alpha * sum, rounded to att's
    // dtype), then the softmax over the stored values.
    float max = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
      row[j] = Tag::Load(Tag::Store(scale * row[j]));
      max = std::fmax(max, row[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      row[j] = std::exp(row[j] - max);
      sum += row[j];
    }
    const float inv_sum = 1.0f / sum;
    Storage* p = probs + t * t_len;
    for (int64_t j = 0; j < keys; ++j) {
      const Storage stored = Tag::Store(row[j] * inv_sum);
      p[j] = stored;
      row[j] = Tag::Load(stored);  // out uses P as stored
    }
    for (int64_t j = keys; j < t_len; ++j) p[j] = Tag::Store(0.0f);

    WeightedRowSum(row, v, keys, d_len, acc);
    Storage* o = out + (b * t_len + t) * channels + h * d_len;
    for (int64_t d = 0; d < d_len; ++d) o[d] = Tag::Store(acc[d]);
  }
}

}  // namespace

absl::Status AttentionForward(ThreadPool& pool, const Tensor& qkv, int64_t n_head, Tensor& att,
                              Tensor& out) {
  AMPD_RETURN_IF_ERROR(ValidateAttentionForward(qkv, n_head, att, out));
  const int64_t batch = qkv.dim(0);
  const int64_t seq = qkv.dim(1);
  const int64_t channels = qkv.dim(2) / 3;
  const int64_t head_dim = channels / n_head;
  const float scale = AttentionScale(head_dim);
  return VisitFloat(qkv.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(qkv);
    auto* probs = Ptr<Tag>(att);
    auto* o = Ptr<Tag>(out);
    pool.ForEachChunk(batch * n_head, [&](int64_t bh) {
      ForwardHead<Tag>(in, probs, o, bh / n_head, bh % n_head, n_head, seq, channels, head_dim,
                       scale);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
