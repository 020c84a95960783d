// LayerNorm and RMSNorm backward over the last dimension, PyTorch's
// LayerNorm formula, from the fp32 statistics the forward pass saved: dx is
// overwritten, dgamma and dbeta (when given: LayerNorm is affine, an
// RMSNorm weight is not frozen) get the column sums of the batch added in
// fp32 and rounded once to their dtype; dx does not depend on whether they
// are formed. RMSNorm is the same code with mean 0 and without the
// mean(dxhat) term (subtracting an exact 0 changes no bit), and its scale
// offset + w (dxhat = dy * (offset + w); the weight's gradient is the same
// sum, the offset being a constant); the per-head RMSNorm the same again
// over each head's columns (NormRows, cpu_internal.h): its weight gradient
// sums over every row's heads.
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// p (C) += acc (C) in fp32, rounded once to p's dtype.
void AccumulateInto(const std::vector<float>& acc, Tensor& p) {
  (void)VisitFloat(p.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(p);
    for (size_t c = 0; c < acc.size(); ++c) out[c] = Tag::Store(Tag::Load(out[c]) + acc[c]);
    return absl::OkStatus();
  });
}

// mean == nullptr: RMSNorm. The rows `at` of x, dy and dx, of C =
// at.width each.
absl::Status NormBackward(const Tensor& x, const Tensor* gamma, float gamma_offset,
                          const Tensor* mean, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                          Tensor* dgamma, Tensor* dbeta, const NormRows& at) {
  const int64_t rows = at.count;  // N
  const int64_t cols = at.width;  // C
  // (C) each, empty when that gradient is not asked for.
  std::vector<float> dgamma_acc(dgamma != nullptr ? static_cast<size_t>(cols) : 0, 0.0f);
  std::vector<float> dbeta_acc(dbeta != nullptr ? static_cast<size_t>(cols) : 0, 0.0f);
  const bool sum_dgamma = dgamma != nullptr;
  const bool sum_dbeta = dbeta != nullptr;
  absl::Status s = VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);                               // N rows of C at `at`
    const auto* grad_out = Ptr<Tag>(dy);                        // N rows of C at `at`
    const auto* g = gamma ? Ptr<Tag>(*gamma) : nullptr;         // (C)
    auto* grad_in = Ptr<Tag>(dx);                               // N rows of C at `at`
    const float* mu = mean ? mean->data_as<float>() : nullptr;  // (N)
    const float* rs = rstd.data_as<float>();                    // (N)
    std::vector<float> xhat(static_cast<size_t>(cols));         // (C)
    std::vector<float> dxhat(static_cast<size_t>(cols));        // (C)
    const float inv_cols = 1.0f / static_cast<float>(cols);
    for (int64_t n = 0; n < rows; ++n) {
      const auto* xr = in + at.Start(n);
      const auto* dyr = grad_out + at.Start(n);
      // dxhat = dy * gamma; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
      float sum_dxhat = 0.0f;
      float sum_dxhat_xhat = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const size_t ci = static_cast<size_t>(c);
        const float d = Tag::Load(dyr[c]);
        xhat[ci] = (Tag::Load(xr[c]) - (mu != nullptr ? mu[n] : 0.0f)) * rs[n];
        dxhat[ci] = g != nullptr ? d * OffsetWeight(gamma_offset, Tag::Load(g[c])) : d;
        sum_dxhat += dxhat[ci];
        sum_dxhat_xhat += dxhat[ci] * xhat[ci];
        if (sum_dgamma) dgamma_acc[ci] += d * xhat[ci];
        if (sum_dbeta) dbeta_acc[ci] += d;
      }
      const float mean_dxhat = mu != nullptr ? sum_dxhat * inv_cols : 0.0f;
      const float mean_dxhat_xhat = sum_dxhat_xhat * inv_cols;
      // dy's row was read whole above, so dx may be dy.
      auto* dxr = grad_in + at.Start(n);
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

}  // namespace

absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                               Tensor* dbeta) {
  AMPD_RETURN_IF_ERROR(ValidateLayerNormBackward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta));
  return NormBackward(x, gamma, 0.0f, &mean, rstd, dy, dx, dgamma, dbeta, NormRows::Plain(x));
}

absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                             const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dweight) {
  AMPD_RETURN_IF_ERROR(ValidateRmsNormBackward(x, weight, rstd, dy, dx, dweight));
  AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "RmsNormBackward"));
  return NormBackward(x, &weight, weight_offset, nullptr, rstd, dy, dx, dweight, nullptr,
                      NormRows::Plain(x));
}

absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                 float weight_offset, const Tensor& rstd, const Tensor& dy,
                                 Tensor& dx, Tensor* dweight) {
  AMPD_RETURN_IF_ERROR(ValidateHeadRmsNormBackward(x, col, heads, weight, rstd, dy, dx, dweight));
  AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "HeadRmsNormBackward"));
  return NormBackward(x, &weight, weight_offset, nullptr, rstd, dy, dx, dweight, nullptr,
                      NormRows::Heads(x, col, heads, weight.dim(0)));
}

}  // namespace ampd::kernels::cpu
