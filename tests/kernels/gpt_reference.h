// Float64 references of the GPT ops that two test suites check against:
// GELU's tanh approximation and its derivative, and causal self-attention
// forward and backward following the op contract (kernels/backend.h): the
// blockwise online softmax with P rounded to the working dtype before the
// P.V product, and the backward's P and dS rounded before theirs; each
// element with a bound derived from the error an fp32 implementation makes
// (dot products, exp and log, sums in another order). cpu_gpt_ops_test
// checks the CPU oracle element by element against them; backend_ops_test
// takes the largest bound as a case's tolerance for every backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/dtype.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels::testing {

// GELU's tanh approximation and its derivative, from the formula.
inline double RefGeluTanhInner(double x) {
  return std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x);
}
inline double RefGeluTanh(double x) { return 0.5 * x * (1.0 + std::tanh(RefGeluTanhInner(x))); }
inline double RefGeluTanhGrad(double x) {
  const double t = std::tanh(RefGeluTanhInner(x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * std::sqrt(2.0 / std::numbers::pi) *
                               (1.0 + 3.0 * 0.044715 * x * x);
}

// Causal self-attention over qkv (B, T, 3C) with n_head heads; window > 0:
// query t sees keys t - window < j <= t; scale > 0: the score scale
// (else 1/sqrt(D)).
struct AttnDims {
  int64_t b, t, c, heads;
  int64_t window = 0;
  float scale = 0.0f;
};

// The score scale as the ops compute it (a float): 1/sqrt(D) unless set.
inline double AttnScale(const AttnDims& s) {
  if (s.scale > 0.0f) return s.scale;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.c / s.heads)));
}

// The first key query t sees.
inline int64_t AttnFirstKey(const AttnDims& s, int64_t t) {
  return s.window > 0 && t >= s.window ? t - s.window + 1 : 0;
}

// A reference output with a bound per element: how far a correct
// implementation may stray from want.
struct Bounded {
  std::vector<double> want, bound;
};

// fp32 error of one score S = fl(fl(q . k) * scale) summed in any order:
// (D + 1) roundings of the partial sums and products, bounded by the sum of
// |q_d k_d|, then the scaling's.
inline double AttnScoreError(int64_t d, double abs_dot, double scale, double score) {
  return (d + 2) * kU32 * abs_dot * scale + kU32 * std::fabs(score);
}

// The forward in double, block by block as the contract orders it (keys in
// blocks of kAttentionKeyBlock, running max and sum, P rounded to the dtype
// before the P.V product), and bounds for an fp32 implementation:
// - each fp32 score is off by at most dS_max (AttnScoreError), the max
//   with it, so exp(S - m) moves relatively by 2 dS_max, plus u |S - m| for
//   the rounded argument and 3 u for exp itself; every rescale by alpha
//   adds as much again, so a row of nb blocks carries
//   eps_row = (nb + 1) (2 dS_max + 4 u) + 2 u R   (R: the scores' range);
// - P's rounding to the dtype may flip one ulp (eps_dt P);
// - acc and l are sums of Bk + 2 nb + 4 terms at most per rounding chain,
//   each rounding 2 u (tensor cores truncate);
// - out's own rounding, one ulp of the dtype.
struct AttnForwardRef {
  Bounded out, lse;
};
inline AttnForwardRef RefAttnForward(DType dt, const AttnDims& s, const std::vector<double>& qkv) {
  const int64_t dd = s.c / s.heads;
  const int64_t bk = kAttentionKeyBlock;
  const double scale = AttnScale(s), eps = Eps(dt);
  AttnForwardRef r;
  r.out.want.assign(static_cast<size_t>(s.b * s.t * s.c), 0.0);
  r.out.bound.assign(r.out.want.size(), 0.0);
  r.lse.want.assign(static_cast<size_t>(s.b * s.heads * s.t), 0.0);
  r.lse.bound.assign(r.lse.want.size(), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t col) {
    return qkv[static_cast<size_t>((b * s.t + t) * 3 * s.c + col)];
  };
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t t = 0; t < s.t; ++t) {
        // Keys first .. t; score and weight stay indexed by absolute key
        // (the entries before first unused).
        const int64_t first = AttnFirstKey(s, t);
        const size_t n = static_cast<size_t>(t + 1);
        std::vector<double> score(n), weight(n, 0.0);
        double score_err = 0, lo = INFINITY, hi = -INFINITY;
        for (int64_t j = first; j <= t; ++j) {
          double dot = 0, abs_dot = 0;
          for (int64_t d = 0; d < dd; ++d) {
            const double p = at(b, t, h * dd + d) * at(b, j, s.c + h * dd + d);
            dot += p;
            abs_dot += std::fabs(p);
          }
          score[j] = scale * dot;
          score_err = std::max(score_err, AttnScoreError(dd, abs_dot, scale, score[j]));
          lo = std::min(lo, score[j]);
          hi = std::max(hi, score[j]);
        }
        // The online softmax; weight[j] is key j's final coefficient in acc
        // (its rounded P times the later blocks' alphas).
        double m = -INFINITY, l = 0;
        std::vector<double> acc(static_cast<size_t>(dd), 0.0);
        const int64_t blocks = t / bk - first / bk + 1;
        for (int64_t k0 = first / bk * bk; k0 <= t; k0 += bk) {
          const int64_t k1 = std::min(k0 + bk, t + 1);
          const int64_t j0 = std::max(k0, first);
          double m_new = m;
          for (int64_t j = j0; j < k1; ++j) m_new = std::max(m_new, score[j]);
          const double alpha = std::exp(m - m_new);
          l *= alpha;
          for (double& a : acc) a *= alpha;
          for (int64_t j = first; j < j0; ++j) weight[j] *= alpha;
          for (int64_t j = j0; j < k1; ++j) {
            const double p = std::exp(score[j] - m_new);
            l += p;
            weight[j] = RefStore(dt, p);
            for (int64_t d = 0; d < dd; ++d) {
              acc[static_cast<size_t>(d)] += weight[j] * at(b, j, 2 * s.c + h * dd + d);
            }
          }
          m = m_new;
        }
        const double eps_row =
            static_cast<double>(blocks + 1) * (2 * score_err + 4 * kU32) + 2 * kU32 * (hi - lo);
        const double sum_err = static_cast<double>(bk + 2 * blocks + 4) * 2 * kU32;
        const size_t lrow = static_cast<size_t>((b * s.heads + h) * s.t + t);
        r.lse.want[lrow] = m + std::log(l);
        r.lse.bound[lrow] =
            score_err + eps_row + sum_err + 2 * kU32 * (std::fabs(m) + std::log(l) + 2.0);
        for (int64_t d = 0; d < dd; ++d) {
          double abs_sum = 0;
          for (int64_t j = first; j <= t; ++j) {
            abs_sum += (weight[j] + DenormMin(dt)) * std::fabs(at(b, j, 2 * s.c + h * dd + d));
          }
          const size_t o = static_cast<size_t>((b * s.t + t) * s.c + h * dd + d);
          const double exact = acc[static_cast<size_t>(d)] / l;
          r.out.want[o] = RefStore(dt, exact);
          r.out.bound[o] = (eps_row + eps + sum_err) * abs_sum / l +
                           (eps_row + sum_err) * std::fabs(exact) + eps * std::fabs(exact) +
                           DenormMin(dt);
        }
      }
    }
  }
  return r;
}

// The backward in double from given out and lse (the forward's, as
// stored), recomputing P = exp(S - lse) as the contract does, with P and
// dS rounded to the dtype before the products that read them; bounded as
// the forward is: fp32 scores, dP and Delta off by their dot products'
// error, exp's argument and result, one-ulp flips where P and dS are
// rounded, and the fp32 sums of the gradients.
struct AttnBackwardRef {
  Bounded dqkv;
};
inline AttnBackwardRef RefAttnBackward(DType dt, const AttnDims& s, const std::vector<double>& qkv,
                                       const std::vector<double>& out,
                                       const std::vector<double>& lse,
                                       const std::vector<double>& dout) {
  const int64_t dd = s.c / s.heads;
  const double scale = AttnScale(s), eps = Eps(dt);
  AttnBackwardRef r;
  // Per element of dqkv: the exact sum, the sum of |terms|, the terms' bounds.
  struct Sums {
    double acc = 0, abs = 0, err = 0;
  };
  std::vector<Sums> sums(qkv.size());
  auto idx = [&](int64_t b, int64_t t, int64_t col) {
    return static_cast<size_t>((b * s.t + t) * 3 * s.c + col);
  };
  auto row = [&](int64_t b, int64_t t, int64_t col) {
    return static_cast<size_t>((b * s.t + t) * s.c + col);
  };
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t t = 0; t < s.t; ++t) {
        double delta = 0, delta_abs = 0;
        for (int64_t d = 0; d < dd; ++d) {
          const double p = dout[row(b, t, h * dd + d)] * out[row(b, t, h * dd + d)];
          delta += p;
          delta_abs += std::fabs(p);
        }
        const double delta_err = (dd + 2) * kU32 * delta_abs;
        const double lse_t = lse[static_cast<size_t>((b * s.heads + h) * s.t + t)];
        for (int64_t j = AttnFirstKey(s, t); j <= t; ++j) {
          double dot = 0, abs_dot = 0, dp = 0, dp_abs = 0;
          for (int64_t d = 0; d < dd; ++d) {
            const double sq = qkv[idx(b, t, h * dd + d)] * qkv[idx(b, j, s.c + h * dd + d)];
            dot += sq;
            abs_dot += std::fabs(sq);
            const double sv = dout[row(b, t, h * dd + d)] * qkv[idx(b, j, 2 * s.c + h * dd + d)];
            dp += sv;
            dp_abs += std::fabs(sv);
          }
          const double score = scale * dot;
          const double p = std::exp(score - lse_t);
          const double p_rel = AttnScoreError(dd, abs_dot, scale, score) +
                               kU32 * (std::fabs(score) + std::fabs(lse_t)) + 3 * kU32;
          const double dp_err = (dd + 2) * kU32 * dp_abs;
          const double ds_exact = p * (dp - delta);
          const double pr = RefStore(dt, p);
          const double dsr = RefStore(dt, ds_exact);
          const double pr_err = (p_rel + eps) * p + DenormMin(dt);
          const double dsr_err = p_rel * std::fabs(ds_exact) + p * (dp_err + delta_err) +
                                 2 * kU32 * p * (std::fabs(dp) + std::fabs(delta)) +
                                 eps * std::fabs(ds_exact) + DenormMin(dt);
          for (int64_t d = 0; d < dd; ++d) {
            const int64_t qc = h * dd + d;
            const double kj = qkv[idx(b, j, s.c + qc)], qt = qkv[idx(b, t, qc)];
            const double gt = dout[row(b, t, qc)];
            const size_t dq = idx(b, t, qc), dk = idx(b, j, s.c + qc), dv = idx(b, j, 2 * s.c + qc);
            sums[dq].acc += dsr * kj;
            sums[dq].abs += std::fabs(dsr * kj);
            sums[dq].err += dsr_err * std::fabs(kj);
            sums[dk].acc += dsr * qt;
            sums[dk].abs += std::fabs(dsr * qt);
            sums[dk].err += dsr_err * std::fabs(qt);
            sums[dv].acc += pr * gt;
            sums[dv].abs += std::fabs(pr * gt);
            sums[dv].err += pr_err * std::fabs(gt);
          }
        }
      }
    }
  }
  r.dqkv.want.resize(qkv.size());
  r.dqkv.bound.resize(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) {
    const bool is_v = static_cast<int64_t>(i % static_cast<size_t>(3 * s.c)) >= 2 * s.c;
    const double sc = is_v ? 1.0 : scale;
    r.dqkv.want[i] = RefStore(dt, sc * sums[i].acc);
    r.dqkv.bound[i] = sc * (sums[i].err + (s.t + 3) * 2 * kU32 * sums[i].abs) +
                      eps * std::fabs(r.dqkv.want[i]) + DenormMin(dt);
  }
  return r;
}

}  // namespace ampd::kernels::testing
