// SampleTokens (the contract in kernels/backend.h): one token per live row
// of logits, drawn in float64 with the row's Philox uniform, the oracle of
// the CUDA kernel. This is the draw the sampler always made on the host
// (its tokens for a seed are unchanged): the inverse CDF in id order when
// nothing is truncated (no sort; top_k >= V truncates nothing either),
// else a partial sort of the top_k most likely (all when top_k is 0), the
// nucleus cut from them, and the inverse CDF over the nucleus in that
// order. With params.log_kept, a truncated draw also sums the whole row's
// weights (in id order) for the kept mass. Row r's uniform comes from its own (key, stream) when
// the caller gives them (params.keys), else from (seed, r). Each sum runs sequentially in the order
// it names. Rows are split over the thread pool; each row's draw depends on that row alone, so the
// tokens do not depend on the thread count. Scratch per thread: the row widened to float, its order
// and its weights (Backend::SampleScratchBytes counts them).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/philox.h"

namespace ampd::kernels::cpu {

namespace {

// The token drawn from one row of logits with u in [0, 1) (the contract's
// formulas; temperature 0: the most likely, the lowest id among ties), and
// in *log_kept the log of the mass the draw kept (0 when it kept the whole
// row).
int64_t Draw(const float* logits, int64_t vocab, const SampleParams& in, double u,
             std::vector<int64_t>& order, std::vector<double>& weights, double* log_kept) {
  *log_kept = 0.0;
  if (in.temperature == 0.0f) {
    return std::max_element(logits, logits + vocab) - logits;
  }
  const double inv_t = 1.0 / static_cast<double>(in.temperature);
  // top_k >= V keeps every token: the same distribution as top_k 0, so the
  // same draw (the untruncated one when nothing else truncates).
  const int64_t keep = in.top_k > 0 && in.top_k < vocab ? in.top_k : vocab;
  if (keep == vocab && in.top_p >= 1.0f) {
    // No truncation: the inverse CDF in id order, no sort of the vocabulary.
    const double top = static_cast<double>(*std::max_element(logits, logits + vocab)) * inv_t;
    weights.resize(static_cast<size_t>(vocab));
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      weights[static_cast<size_t>(i)] = std::exp(static_cast<double>(logits[i]) * inv_t - top);
      total += weights[static_cast<size_t>(i)];
    }
    const double target = u * total;
    double cumulative = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      cumulative += weights[static_cast<size_t>(i)];
      if (target < cumulative) return i;
    }
    return vocab - 1;
  }
  order.resize(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), int64_t{0});
  // Most likely first, ties by id: a total order, so the draw repeats.
  auto likelier = [logits](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), likelier);
  const double top = static_cast<double>(logits[order[0]]) * inv_t;
  weights.resize(static_cast<size_t>(keep));
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    weights[static_cast<size_t>(i)] =
        std::exp(static_cast<double>(logits[order[static_cast<size_t>(i)]]) * inv_t - top);
    total += weights[static_cast<size_t>(i)];
  }
  // The nucleus: the most likely tokens until their mass reaches top_p.
  int64_t nucleus = keep;
  if (in.top_p < 1.0f) {
    double mass = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      mass += weights[static_cast<size_t>(i)] / total;
      if (mass >= static_cast<double>(in.top_p)) {
        nucleus = i + 1;
        break;
      }
    }
  }
  double in_nucleus = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) in_nucleus += weights[static_cast<size_t>(i)];
  if (nucleus < vocab && in.log_kept != nullptr) {
    // The whole row's mass, of which the nucleus is a part.
    double all = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      all += std::exp(static_cast<double>(logits[i]) * inv_t - top);
    }
    *log_kept = std::log(in_nucleus / all);
  }
  const double target = u * in_nucleus;
  double cumulative = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) {
    cumulative += weights[static_cast<size_t>(i)];
    if (target < cumulative) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(nucleus - 1)];
}

}  // namespace

absl::Status SampleTokens(ThreadPool& pool, const Tensor& logits, const Tensor& live,
                          const SampleParams& params, Tensor& tokens) {
  AMPD_RETURN_IF_ERROR(ValidateSampleTokens(logits, live, params, tokens));
  const int64_t rows = logits.dim(0);           // S
  const int64_t vocab = logits.dim(1);          // V
  const auto* alive = live.data_as<int64_t>();  // (S)
  auto* out = tokens.data_as<int64_t>();        // (S)
  // (S, 2) each row's Philox key and stream, or none: (seed, r).
  const int64_t* keys = params.keys != nullptr ? params.keys->data_as<int64_t>() : nullptr;
  // (S) each row's log of the kept mass, or none.
  float* log_kept = params.log_kept != nullptr ? params.log_kept->data_as<float>() : nullptr;
  return VisitFloat(logits.dtype(), [&](auto tag) -> absl::Status {
    using Tag = decltype(tag);
    const auto* z = Ptr<Tag>(logits);  // (S, V)
    pool.ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> row;  // (V) the row widened (exactly) to float
      thread_local std::vector<int64_t> order;
      thread_local std::vector<double> weights;
      row.resize(static_cast<size_t>(vocab));
      for (int64_t r = begin; r < end; ++r) {
        if (alive[r] == 0) {
          out[r] = params.ignore_index;
          if (log_kept != nullptr) log_kept[r] = 0.0f;
          continue;
        }
        const auto* zr = z + r * vocab;
        for (int64_t i = 0; i < vocab; ++i) row[static_cast<size_t>(i)] = Tag::Load(zr[i]);
        const uint64_t key = keys != nullptr ? static_cast<uint64_t>(keys[2 * r]) : params.seed;
        const uint64_t stream =
            keys != nullptr ? static_cast<uint64_t>(keys[2 * r + 1]) : static_cast<uint64_t>(r);
        const philox::Block b = philox::StreamBlock(key, stream, params.step);
        const double u = philox::Unit53(b.v[0], b.v[1]);
        double kept = 0.0;
        out[r] = Draw(row.data(), vocab, params, u, order, weights, &kept);
        if (log_kept != nullptr) log_kept[r] = static_cast<float>(kept);
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
