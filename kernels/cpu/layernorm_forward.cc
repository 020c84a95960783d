// LayerNorm and RMSNorm forward over the last dimension. LayerNorm is
// PyTorch's: biased variance, rstd = 1 / sqrt(var + eps), y = (x - mean) *
// rstd * gamma + beta, with fp32 statistics in two passes (the mean first,
// then the squared deviations, which avoids E[x^2] - E[x]^2 cancellation).
// RMSNorm is the same code without the centring (mean 0, so the second pass
// sums x^2) and without beta, its scale offset + w in fp32 (offset 1:
// Gemma's (1 + w); 0 + w is w bit for bit). Statistics are saved for the
// backward pass; every stored element is rounded once.
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

namespace {

// mean == nullptr: RMSNorm (no centring, nothing saved but rstd).
absl::Status NormForward(const Tensor& x, const Tensor* gamma, float gamma_offset,
                         const Tensor* beta, float eps, Tensor& y, Tensor* mean, Tensor& rstd) {
  const int64_t rows = x.dim(0);  // N
  const int64_t cols = x.dim(1);  // C
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);                               // (N, C)
    const auto* g = gamma ? Ptr<Tag>(*gamma) : nullptr;         // (C)
    const auto* b = beta ? Ptr<Tag>(*beta) : nullptr;           // (C)
    auto* out = Ptr<Tag>(y);                                    // (N, C)
    float* mean_out = mean ? mean->data_as<float>() : nullptr;  // (N)
    float* rstd_out = rstd.data_as<float>();                    // (N)
    std::vector<float> row(static_cast<size_t>(cols));          // (C) widened x, so y may alias x
    for (int64_t n = 0; n < rows; ++n) {
      const auto* xr = in + n * cols;
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
      auto* yr = out + n * cols;
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
  return NormForward(x, gamma, 0.0f, beta, eps, y, &mean, rstd);
}

absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                            Tensor& y, Tensor& rstd) {
  AMPD_RETURN_IF_ERROR(ValidateRmsNormForward(x, weight, y, rstd));
  AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "RmsNormForward"));
  return NormForward(x, &weight, weight_offset, nullptr, eps, y, nullptr, rstd);
}

}  // namespace ampd::kernels::cpu
