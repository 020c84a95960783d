// LayerNorm and RMSNorm forward over the last dimension. LayerNorm is
// PyTorch's: biased variance, rstd = 1 / sqrt(var + eps), y = (x - mean) *
// rstd * gamma + beta, with fp32 statistics in two passes (the mean first,
// then the squared deviations, which avoids E[x^2] - E[x]^2 cancellation).
// RMSNorm is the same code without the centring (mean 0, so the second pass
// sums x^2) and without beta, its scale offset + w in fp32 (offset 1:
// Gemma's (1 + w); 0 + w is w bit for bit), and the per-head RMSNorm the
// same again over each head's columns of a fused row (NormRows,
// cpu_internal.h). Statistics are saved for the backward pass; every
// stored element is rounded once.
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

namespace {

// mean == nullptr: RMSNorm (no centring, nothing saved but rstd). The
// rows `at` of x and y, of C = at.width each.
absl::Status NormForward(const Tensor& x, const Tensor* gamma, float gamma_offset,
                         const Tensor* beta, float eps, Tensor& y, Tensor* mean, Tensor& rstd,
                         const NormRows& at) {
  const int64_t rows = at.count;  // N
  const int64_t cols = at.width;  // C
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);                               // N rows of C at `at`
    const auto* g = gamma ? Ptr<Tag>(*gamma) : nullptr;         // (C)
    const auto* b = beta ? Ptr<Tag>(*beta) : nullptr;           // (C)
    auto* out = Ptr<Tag>(y);                                    // N rows of C at `at`
    float* mean_out = mean ? mean->data_as<float>() : nullptr;  // (N)
    float* rstd_out = rstd.data_as<float>();                    // (N)
    std::vector<float> row(static_cast<size_t>(cols));          // (C) widened x, so y may alias x
    for (int64_t n = 0; n < rows; ++n) {
      const auto* xr = in + at.Start(n);
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        row[static_cast<size_t>(c)] = Tag::Load(xr[c]);
        sum += row[static_cast<size_t>(c)];
      }
      const float mu = mean != nullptr ? sum / static_cast<float>(cols) : 0.0f;
      float sq = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float d = row[static_cast<size_t>(c)] - mu;
        sq += d * d;
      }
      const float var = sq / static_cast<float>(cols);  // biased, as PyTorch normalises
      const float rs = 1.0f / std::sqrt(var + eps);
      if (mean_out != nullptr) mean_out[n] = mu;
      rstd_out[n] = rs;
      auto* yr = out + at.Start(n);
      for (int64_t c = 0; c < cols; ++c) {
        float v = (row[static_cast<size_t>(c)] - mu) * rs;
        if (g != nullptr) v *= OffsetWeight(gamma_offset, Tag::Load(g[c]));
        if (b != nullptr) v += Tag::Load(b[c]);
        yr[c] = Tag::Store(v);
      }
    }
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                              Tensor& y, Tensor& mean, Tensor& rstd) {
  AMPD_RETURN_IF_ERROR(ValidateLayerNormForward(x, gamma, beta, y, mean, rstd));
  return NormForward(x, gamma, 0.0f, beta, eps, y, &mean, rstd, NormRows::Plain(x));
}

absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                            Tensor& y, Tensor& rstd) {
  AMPD_RETURN_IF_ERROR(ValidateRmsNormForward(x, weight, y, rstd));
  AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "RmsNormForward"));
  return NormForward(x, &weight, weight_offset, nullptr, eps, y, nullptr, rstd, NormRows::Plain(x));
}

absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                float eps, float weight_offset, Tensor& y, Tensor& rstd) {
  AMPD_RETURN_IF_ERROR(ValidateHeadRmsNormForward(x, col, heads, weight, y, rstd));
  AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "HeadRmsNormForward"));
  return NormForward(x, &weight, weight_offset, nullptr, eps, y, nullptr, rstd,
                     NormRows::Heads(x, col, heads, weight.dim(0)));
}

}  // namespace ampd::kernels::cpu
