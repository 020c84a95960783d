// Causal self-attention backward, the oracle of the CUDA version. Per batch
// row b and head h, with P the probabilities AttentionForward stored:
//   dv = P^T dout
//   dP = dout v^T, rounded to datt's dtype
//   dS = P * (dP - sum_s P dP)   (row sum in fp32 over the rounded dP),
//        rounded and stored in datt (0 after the query)
//   dq = (dS k) / sqrt(D),  dk = (dS^T q) / sqrt(D)
// each gradient accumulated in fp32 and rounded once into dqkv. These are
// the roundings of strided-batched GEMMs in the working dtype (dP and dS
// pass through datt) and a softmax-backward kernel between them.
//
// Each (b, h) pair is one chunk of the thread pool and writes only its own
// head's columns of dqkv and its own (T, T) block of datt. Query rows are
// visited in order, and dk and dv are accumulated over them in that order in
// fp32 scratch, so every sum has a fixed sequential order; the inner loops
// are over contiguous keys or channels (vectorised, nothing reassociated).
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/attention_scale.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Per-thread fp32 scratch, reused across calls.
struct HeadScratch {
  std::vector<float> q;     // (T, D)
  std::vector<float> k;     // (T, D)
  std::vector<float> vt;    // (D, T): v transposed, keys contiguous
  std::vector<float> dout;  // (T, D)
  std::vector<float> dk;    // (T, D) fp32 accumulators
  std::vector<float> dv;    // (T, D) fp32 accumulators
  std::vector<float> p;     // (T): one query's stored probabilities
  std::vector<float> ds;    // (T): its dP, then dS as stored
  std::vector<float> acc;   // (D): one row of dq
};

HeadScratch& Scratch() {
  thread_local HeadScratch scratch;
  return scratch;
}

template <typename Tag>
void BackwardHead(const typename Tag::Storage* qkv, const typename Tag::Storage* att,
                  const typename Tag::Storage* dout, typename Tag::Storage* datt,
                  typename Tag::Storage* dqkv, int64_t b, int64_t h, int64_t heads, int64_t seq,
                  int64_t channels, int64_t head_dim, float scale) {
  using Storage = typename Tag::Storage;
  const int64_t t_len = seq;
  const int64_t d_len = head_dim;
  const int64_t stride = 3 * channels;
  const auto td = static_cast<size_t>(t_len * d_len);
  HeadScratch& s = Scratch();
  s.q.resize(td);
  s.k.resize(td);
  s.vt.resize(td);
  s.dout.resize(td);
  s.dk.assign(td, 0.0f);
  s.dv.assign(td, 0.0f);
  s.p.resize(static_cast<size_t>(t_len));
  s.ds.resize(static_cast<size_t>(t_len));
  s.acc.resize(static_cast<size_t>(d_len));
  float* q = s.q.data();
  float* k = s.k.data();
  float* vt = s.vt.data();
  float* go = s.dout.data();
  float* dk = s.dk.data();
  float* dv = s.dv.data();
  float* p = s.p.data();
  float* ds = s.ds.data();
  float* acc = s.acc.data();

  const Storage* base = qkv + b * t_len * stride;
  for (int64_t t = 0; t < t_len; ++t) {
    const Storage* tok = base + t * stride + h * d_len;
    const Storage* g = dout + (b * t_len + t) * channels + h * d_len;
    for (int64_t d = 0; d < d_len; ++d) {
      q[t * d_len + d] = Tag::Load(tok[d]);
      k[t * d_len + d] = Tag::Load(tok[channels + d]);
      vt[d * t_len + t] = Tag::Load(tok[2 * channels + d]);
      go[t * d_len + d] = Tag::Load(g[d]);
    }
  }

  const Storage* probs = att + (b * heads + h) * t_len * t_len;
  Storage* dscores = datt + (b * heads + h) * t_len * t_len;
  Storage* grad_base = dqkv + b * t_len * stride + h * d_len;
  for (int64_t t = 0; t < t_len; ++t) {
    const int64_t keys = t + 1;
    const Storage* pr = probs + t * t_len;
    for (int64_t j = 0; j < keys; ++j) {
      p[j] = Tag::Load(pr[j]);
      ds[j] = 0.0f;
    }
    // dP row: dout[t] . v[j], rounded as the GEMM stores it.
    for (int64_t d = 0; d < d_len; ++d) {
      const float gd = go[t * d_len + d];
      const float* vd = vt + d * t_len;
      for (int64_t j = 0; j < keys; ++j) ds[j] += gd * vd[j];
    }
    float dot = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      ds[j] = Tag::Load(Tag::Store(ds[j]));
      dot += p[j] * ds[j];
    }
    Storage* dsr = dscores + t * t_len;
    for (int64_t j = 0; j < keys; ++j) {
      const Storage stored = Tag::Store(p[j] * (ds[j] - dot));
      dsr[j] = stored;
      ds[j] = Tag::Load(stored);  // the products below read dS as stored
    }
    for (int64_t j = keys; j < t_len; ++j) dsr[j] = Tag::Store(0.0f);

    // dq[t] = scale * sum_j dS[t, j] k[j].
    WeightedRowSum(ds, k, keys, d_len, acc);
    Storage* dq = grad_base + t * stride;
    for (int64_t d = 0; d < d_len; ++d) dq[d] = Tag::Store(scale * acc[d]);

    // dk[j] += dS[t, j] q[t]; dv[j] += P[t, j] dout[t].
    const float* qt = q + t * d_len;
    const float* gt = go + t * d_len;
    for (int64_t j = 0; j < keys; ++j) {
      const float w = ds[j];
      const float pj = p[j];
      float* dkj = dk + j * d_len;
      float* dvj = dv + j * d_len;
      for (int64_t d = 0; d < d_len; ++d) dkj[d] += w * qt[d];
      for (int64_t d = 0; d < d_len; ++d) dvj[d] += pj * gt[d];
    }
  }
  for (int64_t t = 0; t < t_len; ++t) {
    Storage* row = grad_base + t * stride;
    for (int64_t d = 0; d < d_len; ++d) {
      row[channels + d] = Tag::Store(scale * dk[t * d_len + d]);
      row[2 * channels + d] = Tag::Store(dv[t * d_len + d]);
    }
  }
}

}  // namespace

absl::Status AttentionBackward(ThreadPool& pool, const Tensor& qkv, const Tensor& att,
                               const Tensor& dout, int64_t n_head, Tensor& datt, Tensor& dqkv) {
  AMPD_RETURN_IF_ERROR(ValidateAttentionBackward(qkv, att, dout, n_head, datt, dqkv));
  const int64_t batch = qkv.dim(0);
  const int64_t seq = qkv.dim(1);
  const int64_t channels = qkv.dim(2) / 3;
  const int64_t head_dim = channels / n_head;
  const float scale = AttentionScale(head_dim);
  return VisitFloat(qkv.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(qkv);
    const auto* probs = Ptr<Tag>(att);
    const auto* g = Ptr<Tag>(dout);
    auto* dscores = Ptr<Tag>(datt);
    auto* grad = Ptr<Tag>(dqkv);
    pool.ForEachChunk(batch * n_head, [&](int64_t bh) {
      BackwardHead<Tag>(in, probs, g, dscores, grad, bh / n_head, bh % n_head, n_head, seq,
                        channels, head_dim, scale);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
