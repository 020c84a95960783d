// CrossEntropyLoss: the mean over rows of -log softmax(logits)[label],
// computed in fp32 whatever the logits dtype (log-softmax with the row max
// subtracted, so large fp16 logits cannot overflow exp), with its gradient
// in the same pass.
// The loss written is multiplier * loss; the gradient additionally carries
// grad_scale (the loss scale), so the backward pass starts scaled without
// the loss value itself being scaled. The scale is applied last, per
// element: (coef * (softmax - onehot)) * grad_scale with coef = multiplier / N.
// Folding it into coef first (grad_scale * multiplier / N) overflows to inf
// for scales near float32's top (2^127 times a multiplier of 2 or more) before
// the division can bring it back, and inf * a zero difference is NaN: a
// finite step would be reported as an overflow. In this order an element is
// inf only when its true scaled gradient exceeds float32, and a zero
// difference gives 0. With a power-of-two grad_scale (one micro-batch, a
// power-of-two factor) the product by it is exact away from fp32's
// subnormals, so there the order changes no finite result.
// dlogits may alias logits: each row is read before it is written.
// A row's sum of exponentials is a ChunkedSum in column order: the contract
// (kernels/backend.h) leaves that order to each backend, as long as it
// depends on the row alone; the CUDA kernels' order is described in
// kernels/cuda/cross_entropy_rows.cuh, and the two agree to rounding.
#include <cmath>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                              float grad_scale, Tensor& loss, Tensor& dlogits) {
  constexpr absl::string_view kOp = "CrossEntropyLoss";
  AMPD_RETURN_IF_ERROR(ValidateCrossEntropyLoss(logits, labels, loss, dlogits));
  const int64_t rows = logits.dim(0);     // N
  const int64_t classes = logits.dim(1);  // V
  AMPD_RETURN_IF_ERROR(CheckIdsInRange(kOp, "labels", labels, classes));
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
