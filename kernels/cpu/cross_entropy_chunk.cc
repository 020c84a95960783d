// CrossEntropyChunk: token cross-entropy over one chunk of an LM head's
// rows, with PyTorch's ignore_index, the oracle of the CUDA kernel. Per kept
// row (fp32, max subtracted before exp, as CrossEntropyLoss):
//   row loss = log(sum exp(z - max)) - (z[label] - max)
//   dlogits  = grad_scale * (softmax(z) - onehot(label)), one rounding
// and loss[0] += loss_scale * row loss, row after row in order (the CUDA
// kernel adds the same per-row terms atomically, in whatever order its
// blocks finish). Ignored rows get a zero gradient and add nothing. The
// row's sum of exponentials is a ChunkedSum in column order, as in
// CrossEntropyLoss (CUDA's order: kernels/cuda/cross_entropy_rows.cuh).
//
// With token-loss terms (kernels/token_loss.h), a kept row's logp is minus
// that row loss; TokenLossTerm turns it into the row's term (added in place
// of the row loss) and its coefficient, and the gradient is
// (grad_scale * coef) * (softmax - onehot), one rounding. terms.token_losses,
// when given, gets each row's loss_scale * term: the value added to loss.
//
// With terms.temperature T != 1 the row is z / T (each element divided in
// fp32) and the gradient's scale is (grad_scale * coef) / T. LabelLogprobs
// runs the same row code (RowLogprob) without the loss or the gradient, so
// its log-probs are CrossEntropyChunk's bits.
//
// Labels are all checked before anything is written, so a bad batch leaves
// loss and dlogits untouched. Rows are split over the thread pool; each
// row's loss lands in its own slot and the slots are added in row order, so
// the result does not depend on the thread count. dlogits may be logits
// itself: a row is widened into scratch before any of it is written.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

namespace {

// Row n of an optional (N) F32 input, or `absent`.
float RowOr(const Tensor* t, int64_t n, float absent) {
  return t == nullptr ? absent : t->data_as<float>()[n];
}

// One kept row's log-softmax at its label, of z / temperature: row (V)
// gets exp(z / temperature - max) and *sum their ChunkedSum (the gradient's
// softmax reads both); returns nll = log(sum) - (z[label] / temperature -
// max), minus the label's log-prob.
template <typename Storage, typename Load>
float RowLogprob(const Storage* zr, int64_t classes, int64_t label, float temperature, Load load,
                 float* row, float* sum) {
  float max = -INFINITY;
  for (int64_t v = 0; v < classes; ++v) row[v] = load(zr[v]);
  if (temperature != 1.0f) {
    for (int64_t v = 0; v < classes; ++v) row[v] = row[v] / temperature;
  }
  for (int64_t v = 0; v < classes; ++v) max = std::fmax(max, row[v]);
  const float label_logit = row[label];
  ChunkedSum sum_exp;
  for (int64_t v = 0; v < classes; ++v) {
    row[v] = std::exp(row[v] - max);
    sum_exp.Add(row[v]);
  }
  *sum = sum_exp.Total();
  // log(sum) - (z[label] - max), not (max + log(sum)) - z[label],
  // which cancels when the logits are large.
  return std::log(*sum) - (label_logit - max);
}

absl::Status CheckLabels(absl::string_view op, const Tensor& labels, int64_t classes,
                         int64_t ignore_index) {
  for (int64_t n = 0; n < labels.dim(0); ++n) {
    const int64_t label = LoadIndex(labels, n);
    if (label != ignore_index && (label < 0 || label >= classes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": labels[", n, "] = ", label, " is outside [0, ", classes,
                       ") and is not ignore_index (", ignore_index, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CrossEntropyChunk(ThreadPool& pool, const Tensor& logits, const Tensor& labels,
                               int64_t ignore_index, const TokenLossTerms& terms, float loss_scale,
                               float grad_scale, Tensor& loss, Tensor& dlogits) {
  constexpr absl::string_view kOp = "CrossEntropyChunk";
  AMPD_RETURN_IF_ERROR(ValidateCrossEntropyChunk(logits, labels, terms, loss, dlogits));
  const int64_t rows = logits.dim(0);     // N
  const int64_t classes = logits.dim(1);  // V
  AMPD_RETURN_IF_ERROR(CheckLabels(kOp, labels, classes, ignore_index));
  if (rows == 0) return absl::OkStatus();

  thread_local std::vector<float> row_loss;  // (N): each kept row's loss_scale * term, 0 ignored
  row_loss.assign(static_cast<size_t>(rows), 0.0f);
  float* row_losses = row_loss.data();
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / classes);
  AMPD_RETURN_IF_ERROR(VisitFloat(logits.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* z = Ptr<Tag>(logits);  // (N, V)
    auto* dz = Ptr<Tag>(dlogits);      // (N, V), possibly z itself
    pool.ParallelFor(rows, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scratch;  // (V): widened logits, then exp
      scratch.resize(static_cast<size_t>(classes));
      float* row = scratch.data();
      for (int64_t n = begin; n < end; ++n) {
        const int64_t label = LoadIndex(labels, n);
        auto* dzr = dz + n * classes;
        if (label == ignore_index) {
          for (int64_t v = 0; v < classes; ++v) dzr[v] = Tag::Store(0.0f);
          if (terms.logprobs != nullptr) terms.logprobs->data_as<float>()[n] = 0.0f;
          if (terms.token_losses != nullptr) terms.token_losses->data_as<float>()[n] = 0.0f;
          continue;
        }
        float sum = 0.0f;
        const float nll =
            RowLogprob(z + n * classes, classes, label, terms.temperature, Tag::Load, row, &sum);
        const TokenTerm t = TokenLossTerm(
            terms.kind, -nll, RowOr(terms.weights, n, 1.0f), RowOr(terms.advantages, n, 0.0f),
            RowOr(terms.sampling_logprobs, n, 0.0f), terms.clip_low, terms.clip_high, terms.beta);
        row_losses[n] = loss_scale * t.term;
        if (terms.logprobs != nullptr) terms.logprobs->data_as<float>()[n] = -nll;
        if (terms.token_losses != nullptr) terms.token_losses->data_as<float>()[n] = row_losses[n];
        float row_scale = grad_scale * t.coef;
        if (terms.temperature != 1.0f) row_scale = row_scale / terms.temperature;
        const float inv_sum = 1.0f / sum;
        for (int64_t v = 0; v < classes; ++v) {
          const float softmax = row[v] * inv_sum;
          dzr[v] = Tag::Store(row_scale * (v == label ? softmax - 1.0f : softmax));
        }
      }
    });
    return absl::OkStatus();
  }));
  float total = loss.data_as<float>()[0];
  for (int64_t n = 0; n < rows; ++n) {
    if (LoadIndex(labels, n) != ignore_index) total += row_losses[n];
  }
  loss.data_as<float>()[0] = total;
  return absl::OkStatus();
}

absl::Status LabelLogprobs(ThreadPool& pool, const Tensor& logits, const Tensor& labels,
                           int64_t ignore_index, float temperature, Tensor& logprobs) {
  AMPD_RETURN_IF_ERROR(ValidateLabelLogprobs(logits, labels, temperature, logprobs));
  const int64_t rows = logits.dim(0);     // N
  const int64_t classes = logits.dim(1);  // V
  AMPD_RETURN_IF_ERROR(CheckLabels("LabelLogprobs", labels, classes, ignore_index));
  auto* out = logprobs.data_as<float>();  // (N)
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / classes);
  return VisitFloat(logits.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* z = Ptr<Tag>(logits);  // (N, V)
    pool.ParallelFor(rows, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scratch;  // (V): widened logits, then exp
      scratch.resize(static_cast<size_t>(classes));
      for (int64_t n = begin; n < end; ++n) {
        const int64_t label = LoadIndex(labels, n);
        if (label == ignore_index) {
          out[n] = 0.0f;
          continue;
        }
        float sum = 0.0f;
        out[n] = -RowLogprob(z + n * classes, classes, label, temperature, Tag::Load,
                             scratch.data(), &sum);
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
