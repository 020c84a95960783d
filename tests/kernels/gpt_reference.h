// Float64 references of the GPT ops that two test suites check against:
// GELU's tanh approximation and its derivative, and causal self-attention
// forward and backward with the op contract's intermediate roundings (S, P,
// dP and dS stored in the working dtype), each element with a bound derived
// from how an fp32 implementation may order its sums. cpu_gpt_ops_test
// checks the CPU oracle element by element against them; backend_ops_test
// takes the largest bound as a case's tolerance for every backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

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

// Causal self-attention over qkv (B, T, 3C) with n_head heads.
struct AttnDims {
  int64_t b, t, c, heads;
};

// 1/sqrt(D) as the ops compute it (a float).
inline double AttnScale(int64_t c, int64_t heads) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(c / heads)));
}

// A reference output with a bound per element: how far a correct
// implementation may stray from want.
struct Bounded {
  std::vector<double> want, bound;
};

// The forward in double with the contract's roundings (S and P stored in
// the dtype), and bounds for an fp32 implementation that sums in another
// order: a score may round one ulp apart, moving each P relatively by twice
// that, P's own rounding may flip, and out sums T products.
struct AttnForwardRef {
  Bounded att, out;
};
inline AttnForwardRef RefAttnForward(DType dt, const AttnDims& s, const std::vector<double>& qkv) {
  const int64_t dd = s.c / s.heads;
  const double scale = AttnScale(s.c, s.heads), eps = Eps(dt);
  AttnForwardRef r;
  r.att.want.assign(static_cast<size_t>(s.b * s.heads * s.t * s.t), 0.0);
  r.att.bound.assign(r.att.want.size(), 0.0);
  r.out.want.assign(static_cast<size_t>(s.b * s.t * s.c), 0.0);
  r.out.bound.assign(r.out.want.size(), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t col) {
    return qkv[static_cast<size_t>((b * s.t + t) * 3 * s.c + col)];
  };
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t t = 0; t < s.t; ++t) {
        std::vector<double> score(static_cast<size_t>(t + 1));
        double mx = -INFINITY, max_abs = 0, dot_err = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0, abs_sum = 0;
          for (int64_t d = 0; d < dd; ++d) {
            const double p = at(b, t, h * dd + d) * at(b, j, s.c + h * dd + d);
            dot += p;
            abs_sum += std::fabs(p);
          }
          score[j] = RefStore(dt, scale * dot);
          mx = std::max(mx, score[j]);
          max_abs = std::max(max_abs, std::fabs(score[j]));
          dot_err = std::max(dot_err, (dd + 2) * kU32 * abs_sum * scale);
        }
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j) sum += std::exp(score[j] - mx);
        const double p_rel = 2 * (eps * max_abs + dot_err) + (t + 8) * kU32 + eps;
        const size_t row = static_cast<size_t>(((b * s.heads + h) * s.t + t) * s.t);
        for (int64_t j = 0; j <= t; ++j) {
          r.att.want[row + j] = RefStore(dt, std::exp(score[j] - mx) / sum);
          r.att.bound[row + j] = p_rel * r.att.want[row + j] + DenormMin(dt);
        }
        for (int64_t d = 0; d < dd; ++d) {
          double acc = 0, abs_sum = 0, p_err = 0;
          for (int64_t j = 0; j <= t; ++j) {
            const double v = at(b, j, 2 * s.c + h * dd + d);
            acc += r.att.want[row + j] * v;
            abs_sum += std::fabs(r.att.want[row + j] * v);
            p_err += r.att.bound[row + j] * std::fabs(v);
          }
          const size_t o = static_cast<size_t>((b * s.t + t) * s.c + h * dd + d);
          r.out.want[o] = RefStore(dt, acc);
          r.out.bound[o] =
              p_err + (t + 3) * kU32 * abs_sum + eps * std::fabs(r.out.want[o]) + DenormMin(dt);
        }
      }
    }
  }
  return r;
}

// The backward in double from a given P (att), with the contract's
// roundings (dP and dS stored in the dtype), bounded as the forward is.
struct AttnBackwardRef {
  Bounded datt, dqkv;
};
inline AttnBackwardRef RefAttnBackward(DType dt, const AttnDims& s, const std::vector<double>& qkv,
                                       const std::vector<double>& att,
                                       const std::vector<double>& dout) {
  const int64_t dd = s.c / s.heads;
  const double scale = AttnScale(s.c, s.heads), eps = Eps(dt);
  AttnBackwardRef r;
  r.datt.want.assign(att.size(), 0.0);
  r.datt.bound.assign(att.size(), DenormMin(dt));
  std::vector<double> acc(qkv.size(), 0.0), abs_acc(qkv.size(), 0.0), err_acc(qkv.size(), 0.0);
  auto idx = [&](int64_t b, int64_t t, int64_t col) {
    return static_cast<size_t>((b * s.t + t) * 3 * s.c + col);
  };
  auto g = [&](int64_t b, int64_t t, int64_t col) {
    return dout[static_cast<size_t>((b * s.t + t) * s.c + col)];
  };
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t t = 0; t < s.t; ++t) {
        const size_t row = static_cast<size_t>(((b * s.heads + h) * s.t + t) * s.t);
        const size_t n = static_cast<size_t>(t + 1);
        std::vector<double> dp(n), dp_err(n), ds(n), ds_err(n);
        double rowsum = 0, rowsum_abs = 0, rowsum_err = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0, abs_sum = 0;
          for (int64_t d = 0; d < dd; ++d) {
            const double p = g(b, t, h * dd + d) * qkv[idx(b, j, 2 * s.c + h * dd + d)];
            dot += p;
            abs_sum += std::fabs(p);
          }
          dp[j] = RefStore(dt, dot);
          dp_err[j] = (dd + 2) * kU32 * abs_sum + eps * std::fabs(dp[j]);
          rowsum += att[row + j] * dp[j];
          rowsum_abs += std::fabs(att[row + j] * dp[j]);
          rowsum_err += att[row + j] * dp_err[j];
        }
        rowsum_err += (t + 3) * kU32 * rowsum_abs;
        for (int64_t j = 0; j <= t; ++j) {
          const double p = att[row + j];
          ds[j] = RefStore(dt, p * (dp[j] - rowsum));
          ds_err[j] = p * (dp_err[j] + rowsum_err) +
                      2 * kU32 * p * (std::fabs(dp[j]) + std::fabs(rowsum)) +
                      eps * std::fabs(ds[j]) + DenormMin(dt);
          r.datt.want[row + j] = ds[j];
          r.datt.bound[row + j] = ds_err[j];
        }
        for (int64_t j = 0; j <= t; ++j) {
          for (int64_t d = 0; d < dd; ++d) {
            const int64_t qc = h * dd + d;
            const double kj = qkv[idx(b, j, s.c + qc)], qt = qkv[idx(b, t, qc)];
            const size_t dq = idx(b, t, qc), dk = idx(b, j, s.c + qc), dv = idx(b, j, 2 * s.c + qc);
            acc[dq] += ds[j] * kj;
            abs_acc[dq] += std::fabs(ds[j] * kj);
            err_acc[dq] += ds_err[j] * std::fabs(kj);
            acc[dk] += ds[j] * qt;
            abs_acc[dk] += std::fabs(ds[j] * qt);
            err_acc[dk] += ds_err[j] * std::fabs(qt);
            acc[dv] += att[row + j] * g(b, t, qc);
            abs_acc[dv] += std::fabs(att[row + j] * g(b, t, qc));
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
    r.dqkv.want[i] = RefStore(dt, sc * acc[i]);
    r.dqkv.bound[i] = sc * (err_acc[i] + (s.t + 3) * kU32 * abs_acc[i]) +
                      eps * std::fabs(r.dqkv.want[i]) + DenormMin(dt);
  }
  return r;
}

}  // namespace ampd::kernels::testing
