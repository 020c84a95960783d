// LayerNorm over the last dimension, PyTorch's formulas: biased variance,
// rstd = 1 / sqrt(var + eps), y = (x - mean) * rstd * gamma + beta.
// Statistics are fp32 (two passes: the mean first, then the squared
// deviations, which avoids E[x^2] - E[x]^2 cancellation) and saved for the
// backward pass; every stored element is rounded once.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// gamma/beta when given: (C) of x's dtype.
absl::Status CheckAffine(absl::string_view op, absl::string_view name, const Tensor* p,
                         const Tensor& x) {
  if (p == nullptr) return absl::OkStatus();
  if (absl::Status s = CheckSameDType(op, name, *p, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckHasMemory(op, name, *p); !s.ok()) return s;
  if (p->rank() != 1 || p->dim(0) != x.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", p->DebugString(),
                                                   " but x is ", x.DebugString(), "; expected (",
                                                   x.dim(1), ")"));
  }
  return absl::OkStatus();
}

// mean/rstd: (N) F32.
absl::Status CheckStat(absl::string_view op, absl::string_view name, const Tensor& t,
                       const Tensor& x) {
  if (absl::Status s = CheckDType(op, name, t, DType::kF32); !s.ok()) return s;
  if (t.rank() != 1 || t.dim(0) != x.dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(),
                                                   " but x is ", x.DebugString(), "; expected (",
                                                   x.dim(0), ")"));
  }
  return absl::OkStatus();
}

// dgamma/dbeta when given: (C), any float dtype (they are accumulated into).
absl::Status CheckParamGrad(absl::string_view op, absl::string_view name, const Tensor* p,
                            const Tensor& x) {
  if (p == nullptr) return absl::OkStatus();
  if (absl::Status s = CheckFloat(op, name, *p); !s.ok()) return s;
  if (p->rank() != 1 || p->dim(0) != x.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", p->DebugString(),
                                                   " but x is ", x.DebugString(), "; expected (",
                                                   x.dim(1), ")"));
  }
  return absl::OkStatus();
}

// p (C) += acc (C) in fp32, rounded once to p's dtype.
void AccumulateInto(const std::vector<float>& acc, Tensor& p) {
  (void)VisitFloat(p.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(p);
    for (size_t c = 0; c < acc.size(); ++c) out[c] = Tag::Store(Tag::Load(out[c]) + acc[c]);
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                              Tensor& y, Tensor& mean, Tensor& rstd) {
  constexpr absl::string_view kOp = "LayerNormForward";
  if (absl::Status s = CheckFloat(kOp, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckRank(kOp, "x", x, 2); !s.ok()) return s;
  if (absl::Status s = CheckSameDType(kOp, "y", y, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckSameShape(kOp, "y", y, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckHasMemory(kOp, "y", y); !s.ok()) return s;
  if (absl::Status s = CheckAffine(kOp, "gamma", gamma, x); !s.ok()) return s;
  if (absl::Status s = CheckAffine(kOp, "beta", beta, x); !s.ok()) return s;
  if (absl::Status s = CheckStat(kOp, "mean", mean, x); !s.ok()) return s;
  if (absl::Status s = CheckStat(kOp, "rstd", rstd, x); !s.ok()) return s;
  if (x.dim(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x is ", x.DebugString(), "; cannot normalise zero columns"));
  }
  const int64_t rows = x.dim(0);  // N
  const int64_t cols = x.dim(1);  // C
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);                        // (N, C)
    const auto* g = gamma ? Ptr<Tag>(*gamma) : nullptr;  // (C)
    const auto* b = beta ? Ptr<Tag>(*beta) : nullptr;    // (C)
    auto* out = Ptr<Tag>(y);                             // (N, C)
    float* mean_out = mean.data_as<float>();             // (N)
    float* rstd_out = rstd.data_as<float>();             // (N)
    std::vector<float> row(static_cast<size_t>(cols));   // (C) widened x, so y may alias x
    for (int64_t n = 0; n < rows; ++n) {
      const auto* xr = in + n * cols;
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        row[static_cast<size_t>(c)] = Tag::Load(xr[c]);
        sum += row[static_cast<size_t>(c)];
      }
      const float mu = sum / static_cast<float>(cols);
      float sq = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float d = row[static_cast<size_t>(c)] - mu;
        sq += d * d;
      }
      const float var = sq / static_cast<float>(cols);  // biased, as PyTorch normalises
      const float rs = 1.0f / std::sqrt(var + eps);
      mean_out[n] = mu;
      rstd_out[n] = rs;
      auto* yr = out + n * cols;
      for (int64_t c = 0; c < cols; ++c) {
        float v = (row[static_cast<size_t>(c)] - mu) * rs;
        if (g != nullptr) v *= Tag::Load(g[c]);
        if (b != nullptr) v += Tag::Load(b[c]);
        yr[c] = Tag::Store(v);
      }
    }
    return absl::OkStatus();
  });
}

absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                               Tensor* dbeta) {
  constexpr absl::string_view kOp = "LayerNormBackward";
  if (absl::Status s = CheckFloat(kOp, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckRank(kOp, "x", x, 2); !s.ok()) return s;
  if (absl::Status s = CheckSameDType(kOp, "dy", dy, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckSameShape(kOp, "dy", dy, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckHasMemory(kOp, "dy", dy); !s.ok()) return s;
  if (absl::Status s = CheckSameDType(kOp, "dx", dx, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckSameShape(kOp, "dx", dx, "x", x); !s.ok()) return s;
  if (absl::Status s = CheckHasMemory(kOp, "dx", dx); !s.ok()) return s;
  if (absl::Status s = CheckAffine(kOp, "gamma", gamma, x); !s.ok()) return s;
  if (absl::Status s = CheckStat(kOp, "mean", mean, x); !s.ok()) return s;
  if (absl::Status s = CheckStat(kOp, "rstd", rstd, x); !s.ok()) return s;
  if (absl::Status s = CheckParamGrad(kOp, "dgamma", dgamma, x); !s.ok()) return s;
  if (absl::Status s = CheckParamGrad(kOp, "dbeta", dbeta, x); !s.ok()) return s;
  if (dgamma != nullptr && gamma == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": dgamma is ", dgamma->DebugString(), " but gamma is null"));
  }
  const int64_t rows = x.dim(0);                                   // N
  const int64_t cols = x.dim(1);                                   // C
  std::vector<float> dgamma_acc(static_cast<size_t>(cols), 0.0f);  // (C)
  std::vector<float> dbeta_acc(static_cast<size_t>(cols), 0.0f);   // (C)
  absl::Status s = VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);                         // (N, C)
    const auto* grad_out = Ptr<Tag>(dy);                  // (N, C)
    const auto* g = gamma ? Ptr<Tag>(*gamma) : nullptr;   // (C)
    auto* grad_in = Ptr<Tag>(dx);                         // (N, C)
    const float* mu = mean.data_as<float>();              // (N)
    const float* rs = rstd.data_as<float>();              // (N)
    std::vector<float> xhat(static_cast<size_t>(cols));   // (C)
    std::vector<float> dxhat(static_cast<size_t>(cols));  // (C)
    const float inv_cols = 1.0f / static_cast<float>(cols);
    for (int64_t n = 0; n < rows; ++n) {
      const auto* xr = in + n * cols;
      const auto* dyr = grad_out + n * cols;
      // dxhat = dy * gamma; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
      float sum_dxhat = 0.0f;
      float sum_dxhat_xhat = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const size_t ci = static_cast<size_t>(c);
        const float d = Tag::Load(dyr[c]);
        xhat[ci] = (Tag::Load(xr[c]) - mu[n]) * rs[n];
        dxhat[ci] = g != nullptr ? d * Tag::Load(g[c]) : d;
        sum_dxhat += dxhat[ci];
        sum_dxhat_xhat += dxhat[ci] * xhat[ci];
        dgamma_acc[ci] += d * xhat[ci];
        dbeta_acc[ci] += d;
      }
      const float mean_dxhat = sum_dxhat * inv_cols;
      const float mean_dxhat_xhat = sum_dxhat_xhat * inv_cols;
      auto* dxr = grad_in + n * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const size_t ci = static_cast<size_t>(c);
        dxr[c] = Tag::Store(rs[n] * (dxhat[ci] - mean_dxhat - xhat[ci] * mean_dxhat_xhat));
      }
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (dgamma != nullptr) AccumulateInto(dgamma_acc, *dgamma);
  if (dbeta != nullptr) AccumulateInto(dbeta_acc, *dbeta);
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
