// Losses, computed in fp32 whatever the prediction dtype: mean squared
// error and cross-entropy (log-softmax with the row max subtracted, so large
// fp16 logits cannot overflow exp). The loss written is multiplier * loss;
// the gradient additionally carries grad_scale (the loss scale), so the
// backward pass starts scaled without the loss value itself being scaled.
// The scale is applied last, per element: (coef * diff) * grad_scale with
// coef = multiplier * 2 / count (MSE) or multiplier / N (cross-entropy).
// Folding it into coef first (grad_scale * multiplier * 2 / count) overflows
// to inf for scales near float32's top (2^127 * 2) before the division can
// bring it back, and inf * a zero difference is NaN: a finite step would be
// reported as an overflow. In this order an element is inf only when its
// true scaled gradient exceeds float32, and a zero difference gives 0. With
// a power-of-two grad_scale (one micro-batch, a power-of-two factor) the
// product by it is exact away from fp32's subnormals, so there the order
// changes no finite result.
// dpred/dlogits may alias pred/logits: each element (row, for CE) is read
// before it is written.
#include <cmath>
#include <vector>

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

absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                              float grad_scale, Tensor& loss, Tensor& dlogits) {
  constexpr absl::string_view kOp = "CrossEntropyLoss";
  if (absl::Status s = ValidateCrossEntropyLoss(logits, labels, loss, dlogits); !s.ok()) {
    return s;
  }
  const int64_t rows = logits.dim(0);     // N
  const int64_t classes = logits.dim(1);  // V
  if (absl::Status s = CheckIdsInRange(kOp, "labels", labels, classes); !s.ok()) return s;
  const float inv_rows = 1.0f / static_cast<float>(rows);
  // d/dz [m * mean_n(lse(z_n) - z_n[y_n])] = m (softmax - onehot) / N, times
  // the loss scale (applied last, see the file comment).
  const float grad_coef = multiplier * inv_rows;
  float total = 0.0f;  // rows summed in order
  absl::Status s = VisitFloat(logits.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* z = Ptr<Tag>(logits);                      // (N, V)
    auto* dz = Ptr<Tag>(dlogits);                          // (N, V)
    std::vector<float> row(static_cast<size_t>(classes));  // (V) widened logits, then exp
    for (int64_t n = 0; n < rows; ++n) {
      const auto* zr = z + n * classes;
      float max = -INFINITY;
      for (int64_t v = 0; v < classes; ++v) {
        row[static_cast<size_t>(v)] = Tag::Load(zr[v]);
        max = std::fmax(max, row[static_cast<size_t>(v)]);
      }
      const int64_t label = LoadIndex(labels, n);
      const float label_logit = row[static_cast<size_t>(label)];
      ChunkedSum sum_exp;
      for (int64_t v = 0; v < classes; ++v) {
        row[static_cast<size_t>(v)] = std::exp(row[static_cast<size_t>(v)] - max);
        sum_exp.Add(row[static_cast<size_t>(v)]);
      }
      const float sum = sum_exp.Total();
      // -log softmax[label] = log(sum exp(z - max)) - (z[label] - max).
      total += std::log(sum) - (label_logit - max);
      const float inv_sum = 1.0f / sum;
      auto* dzr = dz + n * classes;
      for (int64_t v = 0; v < classes; ++v) {
        const float softmax = row[static_cast<size_t>(v)] * inv_sum;
        const float onehot = v == label ? 1.0f : 0.0f;
        dzr[v] = Tag::Store((grad_coef * (softmax - onehot)) * grad_scale);
      }
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  loss.data_as<float>()[0] = multiplier * (total * inv_rows);
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
