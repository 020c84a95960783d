// MseLoss: mean squared error over every element, computed in fp32 whatever
// the prediction dtype, with its gradient in the same pass.
// The loss written is multiplier * loss; the gradient additionally carries
// grad_scale (the loss scale), so the backward pass starts scaled without
// the loss value itself being scaled. The scale is applied last, per
// element: (coef * diff) * grad_scale with coef = multiplier * 2 / count.
// Folding it into coef first (grad_scale * multiplier * 2 / count) overflows
// to inf for scales near float32's top (2^127 * 2) before the division can
// bring it back, and inf * a zero difference is NaN: a finite step would be
// reported as an overflow. In this order an element is inf only when its
// true scaled gradient exceeds float32, and a zero difference gives 0. With
// a power-of-two grad_scale (one micro-batch, a power-of-two factor) the
// product by it is exact away from fp32's subnormals, so there the order
// changes no finite result.
// dpred may alias pred: each element is read before it is written.
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                     Tensor& loss, Tensor& dpred) {
  if (absl::Status s = ValidateMseLoss(pred, target, loss, dpred); !s.ok()) return s;
  const int64_t count = pred.numel();
  const float inv_count = 1.0f / static_cast<float>(count);
  // d/dp [m * mean((p - t)^2)] = 2 m (p - t) / count, times the loss scale
  // (applied last, see the file comment).
  const float grad_coef = multiplier * 2.0f * inv_count;
  ChunkedSum sum;
  absl::Status s = VisitFloat(pred.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* p = Ptr<Tag>(pred);            // (N, C)
    const float* t = target.data_as<float>();  // (N, C)
    auto* d = Ptr<Tag>(dpred);                 // (N, C)
    for (int64_t i = 0; i < count; ++i) {
      const float diff = Tag::Load(p[i]) - t[i];
      sum.Add(diff * diff);
      d[i] = Tag::Store((grad_coef * diff) * grad_scale);
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  loss.data_as<float>()[0] = multiplier * (sum.Total() * inv_count);
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
