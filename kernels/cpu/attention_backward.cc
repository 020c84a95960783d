// Causal self-attention backward, the oracle of the CUDA kernels: the
// contract of kernels/backend.h, recomputing P from the forward's lse
// instead of reading a stored (T, T) matrix. Per batch row b and head h:
//   Delta_t = sum_d dout_t,d out_t,d          (fp32, channels in order)
//   S_ts    = (q_t . k_s) * scale,  P_ts = exp(S_ts - lse_t)
//   dP_ts   = dout_t . v_s,  dS_ts = P_ts (dP_ts - Delta_t)
//   dv_s = sum_t round(P_ts) dout_t
//   dk_s = (sum_t round(dS_ts) q_t) * scale
//   dq_t = (sum_s round(dS_ts) k_s) * scale
// with P and dS rounded to the working dtype where the CUDA kernels feed
// them to tensor-core products, every gradient accumulated in fp32 and
// rounded once into dqkv. Each dot product is a sequential sum over the
// channels, as in the forward, so S here has the forward's bits.
//
// Each (b, h) pair is one chunk of the thread pool and writes only its own
// head's columns of dqkv. Query rows are visited in order: dq_t sums the
// keys 0 .. t in order (the key blocks in increasing order, and keys in
// order inside each), and dk and dv accumulate over the queries in order
// in fp32 scratch (the query blocks in increasing order), so every sum has
// a fixed sequential order; the inner loops run over contiguous keys or
// channels (vectorised, nothing reassociated). Under a sliding window
// (options.window) query t's pairs are its keys first(t) .. t alone: the
// others are skipped, as the forward skipped them.
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Per-thread fp32 scratch, reused across calls.
struct HeadScratch {
  std::vector<float> q;      // (T, D)
  std::vector<float> k;      // (T, D)
  std::vector<float> kt;     // (D, T): k transposed, keys contiguous
  std::vector<float> vt;     // (D, T): v transposed
  std::vector<float> dout;   // (T, D)
  std::vector<float> delta;  // (T): Delta_t
  std::vector<float> dk;     // (T, D) fp32 accumulators
  std::vector<float> dv;     // (T, D) fp32 accumulators
  std::vector<float> p;      // (T): one query's scores, then round(P)
  std::vector<float> ds;     // (T): its dP, then round(dS)
  std::vector<float> acc;    // (D): one row of dq
};

HeadScratch& Scratch() {
  thread_local HeadScratch scratch;
  return scratch;
}

template <typename Tag>
void BackwardHead(const typename Tag::Storage* qkv, const typename Tag::Storage* out,
                  const typename Tag::Storage* dout, const float* lse, typename Tag::Storage* dqkv,
                  int64_t b, int64_t h, int64_t heads, int64_t seq, int64_t channels,
                  int64_t head_dim, float scale, int64_t window) {
  using Storage = typename Tag::Storage;
  const int64_t t_len = seq;
  const int64_t d_len = head_dim;
  const int64_t stride = 3 * channels;
  const auto td = static_cast<size_t>(t_len * d_len);
  HeadScratch& s = Scratch();
  s.q.resize(td);
  s.k.resize(td);
  s.kt.resize(td);
  s.vt.resize(td);
  s.dout.resize(td);
  s.delta.resize(static_cast<size_t>(t_len));
  s.dk.assign(td, 0.0f);
  s.dv.assign(td, 0.0f);
  s.p.resize(static_cast<size_t>(t_len));
  s.ds.resize(static_cast<size_t>(t_len));
  s.acc.resize(static_cast<size_t>(d_len));
  float* q = s.q.data();
  float* k = s.k.data();
  float* kt = s.kt.data();
  float* vt = s.vt.data();
  float* go = s.dout.data();
  float* delta = s.delta.data();
  float* dk = s.dk.data();
  float* dv = s.dv.data();
  float* p = s.p.data();
  float* ds = s.ds.data();
  float* acc = s.acc.data();

  const Storage* base = qkv + b * t_len * stride;
  for (int64_t t = 0; t < t_len; ++t) {
    const Storage* tok = base + t * stride + h * d_len;
    const int64_t row = (b * t_len + t) * channels + h * d_len;  // in (B, T, C)
    float dot = 0.0f;
    for (int64_t d = 0; d < d_len; ++d) {
      q[t * d_len + d] = Tag::Load(tok[d]);
      k[t * d_len + d] = Tag::Load(tok[channels + d]);
      kt[d * t_len + t] = Tag::Load(tok[channels + d]);
      vt[d * t_len + t] = Tag::Load(tok[2 * channels + d]);
      go[t * d_len + d] = Tag::Load(dout[row + d]);
      dot += go[t * d_len + d] * Tag::Load(out[row + d]);
    }
    delta[t] = dot;
  }

  const float* lse_row = lse + (b * heads + h) * t_len;
  Storage* grad_base = dqkv + b * t_len * stride + h * d_len;
  for (int64_t t = 0; t < t_len; ++t) {
    const int64_t keys = t + 1;
    const int64_t first = AttentionFirstKey(t, window);  // keys first .. t
    for (int64_t j = first; j < keys; ++j) {
      p[j] = 0.0f;
      ds[j] = 0.0f;
    }
    // S and dP rows: dot products over the channels in order.
    for (int64_t d = 0; d < d_len; ++d) {
      const float qd = q[t * d_len + d];
      const float gd = go[t * d_len + d];
      const float* kd = kt + d * t_len;
      const float* vd = vt + d * t_len;
      for (int64_t j = first; j < keys; ++j) {
        p[j] += qd * kd[j];
        ds[j] += gd * vd[j];
      }
    }
    const float lse_t = lse_row[t];
    const float delta_t = delta[t];
    for (int64_t j = first; j < keys; ++j) {
      const float pj = std::exp(p[j] * scale - lse_t);
      // dS from the fp32 P, then both rounded as the products read them.
      ds[j] = Tag::Load(Tag::Store(pj * (ds[j] - delta_t)));
      p[j] = Tag::Load(Tag::Store(pj));
    }

    // dq[t] = scale * sum_j dS[t, j] k[j], keys in order.
    for (int64_t d = 0; d < d_len; ++d) acc[d] = 0.0f;
    AccumulateRows(ds + first, k + first * d_len, keys - first, d_len, acc);
    Storage* dq = grad_base + t * stride;
    for (int64_t d = 0; d < d_len; ++d) dq[d] = Tag::Store(acc[d] * scale);

    // dk[j] += dS[t, j] q[t]; dv[j] += P[t, j] dout[t]: queries in order.
    const float* qt = q + t * d_len;
    const float* gt = go + t * d_len;
    for (int64_t j = first; j < keys; ++j) {
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
      row[channels + d] = Tag::Store(dk[t * d_len + d] * scale);
      row[2 * channels + d] = Tag::Store(dv[t * d_len + d]);
    }
  }
}

}  // namespace

absl::Status AttentionBackward(ThreadPool& pool, const Tensor& qkv, const Tensor& out,
                               const Tensor& dout, const Tensor& lse, int64_t n_head,
                               const AttentionOptions& options, Tensor& dqkv) {
  AMPD_RETURN_IF_ERROR(ValidateAttentionBackward(qkv, out, dout, lse, n_head, dqkv));
  AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionBackward"));
  const int64_t batch = qkv.dim(0);
  const int64_t seq = qkv.dim(1);
  const int64_t channels = qkv.dim(2) / 3;
  const int64_t head_dim = channels / n_head;
  const float scale = AttentionScaleOf(options, head_dim);
  const int64_t window = options.window;
  return VisitFloat(qkv.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(qkv);
    const auto* o = Ptr<Tag>(out);
    const auto* g = Ptr<Tag>(dout);
    const float* l = lse.data_as<float>();
    auto* grad = Ptr<Tag>(dqkv);
    pool.ForEachChunk(batch * n_head, [&](int64_t bh) {
      BackwardHead<Tag>(in, o, g, l, grad, bh / n_head, bh % n_head, n_head, seq, channels,
                        head_dim, scale, window);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
