// The loss scaler's fused pass over every gradient: detect inf/NaN, add the
// squared norm of the unscaled gradients (for clipping), track their
// largest magnitude (for the adaptive scaler), and optionally unscale in
// place. One read of each gradient does all of it, which is what makes it
// worth fusing on a GPU; the CPU version keeps the same contract. The max
// is exact (a max never rounds), so it does not depend on the order the
// elements are visited in.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// Returns whether any g * inv_scale is non-finite; adds (g * inv_scale)^2 to
// sum and raises max to the largest |g * inv_scale| (std::fmax skips NaN).
template <typename Tag, bool kInPlace, bool kNorm>
bool UnscaleLoop(typename Tag::Storage* g, int64_t n, float inv_scale, ChunkedSum& sum,
                 float& max) {
  bool nonfinite = false;
  float m = max;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Tag::Load(g[i]);
    // Checked on the unscaled value, the one the optimizer will consume: a
    // stored inf or NaN stays non-finite whatever inv_scale is (inf * 0 is
    // NaN), and a finite gradient times an inv_scale that is inf (a loss
    // scale of 0) or large enough to overflow (a subnormal scale) is caught
    // too, so no inv_scale can let a non-finite value reach a master weight.
    const float u = v * inv_scale;
    nonfinite |= !std::isfinite(u);
    m = std::fmax(m, std::fabs(u));
    if constexpr (kNorm) sum.Add(u * u);
    if constexpr (kInPlace) g[i] = Tag::Store(u);
  }
  max = m;
  return nonfinite;
}

}  // namespace

absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                             Tensor& found_inf, Tensor* norm_sq, Tensor* max_abs) {
  AMPD_RETURN_IF_ERROR(ValidateUnscaleAndCheck(grads, found_inf, norm_sq, max_abs));
  bool nonfinite = false;
  float max = 0.0f;
  ChunkedSum sum;  // fp32, in tensor order then element order
  for (Tensor* grad : grads) {
    absl::Status s = VisitFloat(grad->dtype(), [&](auto tag) {
      using Tag = decltype(tag);
      auto* g = Ptr<Tag>(*grad);
      const int64_t n = grad->numel();
      if (in_place && norm_sq != nullptr) {
        nonfinite |= UnscaleLoop<Tag, true, true>(g, n, inv_scale, sum, max);
      } else if (in_place) {
        nonfinite |= UnscaleLoop<Tag, true, false>(g, n, inv_scale, sum, max);
      } else if (norm_sq != nullptr) {
        nonfinite |= UnscaleLoop<Tag, false, true>(g, n, inv_scale, sum, max);
      } else {
        nonfinite |= UnscaleLoop<Tag, false, false>(g, n, inv_scale, sum, max);
      }
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
  }
  // Set, never cleared: the caller zeroes found_inf once per step so several
  // calls (e.g. one per parameter group) can share it.
  if (nonfinite) found_inf.data_as<float>()[0] = 1.0f;
  if (norm_sq != nullptr) norm_sq->data_as<float>()[0] += sum.Total();
  if (max_abs != nullptr) {
    float& out = max_abs->data_as<float>()[0];
    out = std::fmax(out, max);
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
