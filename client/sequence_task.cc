// SequenceTask: the Markov chain and its batches.
#include "client/sequence_task.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ampd {

absl::StatusOr<SequenceTask> SequenceTask::Create(const SequenceTaskOptions& options) {
  if (options.vocab_size < 1 || options.vocab_size > kMaxVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size: must be in [1, ", kMaxVocab, "], got ", options.vocab_size));
  }
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch_size: must be >= 1, got ", options.batch_size));
  }
  if (options.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seq_len: must be >= 1, got ", options.seq_len));
  }
  // Both are >= 1, so the division is exact about the product's bound.
  if (options.batch_size > kMaxBatchTokens / (options.seq_len + 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch_size * (--seq_len + 1): must be at most ", kMaxBatchTokens,
        " tokens, got batch_size ", options.batch_size, ", seq_len ", options.seq_len));
  }
  return SequenceTask(options);
}

SequenceTask::SequenceTask(const SequenceTaskOptions& options)
    : options_(options), rng_(options.seed ^ 0x5e9e'4ce7'a5c0ULL) {
  const uint64_t vocab = static_cast<uint64_t>(options_.vocab_size);
  successors_.resize(static_cast<size_t>(options_.vocab_size) * kSuccessors);
  for (int64_t v = 0; v < options_.vocab_size; ++v) {
    int32_t* row = &successors_[static_cast<size_t>(v) * kSuccessors];
    for (int k = 0; k < kSuccessors; ++k) {
      // Distinct successors where the vocabulary has room for them.
      int32_t next = 0;
      bool fresh = false;
      for (int attempt = 0; attempt < 64 && !fresh; ++attempt) {
        next = static_cast<int32_t>(rng_() % vocab);
        fresh = true;
        for (int j = 0; j < k; ++j) fresh = fresh && row[j] != next;
      }
      row[k] = next;
    }
  }
}

double SequenceTask::EntropyRate() {
  double h = 0;
  for (double p : kSuccessorProbabilities) h -= p * std::log(p);
  return h;
}

double SequenceTask::Uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // 53 random bits
}

int32_t SequenceTask::Next(int32_t token) {
  const double u = Uniform();
  double cumulative = 0;
  for (int k = 0; k + 1 < kSuccessors; ++k) {
    cumulative += kSuccessorProbabilities[k];
    if (u < cumulative) return successors_[static_cast<size_t>(token) * kSuccessors + k];
  }
  return successors_[static_cast<size_t>(token) * kSuccessors + kSuccessors - 1];
}

v1::MicroBatch SequenceTask::NextBatch() {
  const int64_t b = options_.batch_size;
  const int64_t t = options_.seq_len;
  std::vector<int32_t> inputs(static_cast<size_t>(b * t));
  std::vector<int32_t> targets(static_cast<size_t>(b * t));
  for (int64_t r = 0; r < b; ++r) {
    int32_t token = static_cast<int32_t>(rng_() % static_cast<uint64_t>(options_.vocab_size));
    for (int64_t i = 0; i < t; ++i) {
      inputs[static_cast<size_t>(r * t + i)] = token;
      token = Next(token);
      targets[static_cast<size_t>(r * t + i)] = token;
    }
  }
  v1::MicroBatch batch;
  for (auto [tensor, values] :
       {std::pair{batch.mutable_inputs(), &inputs}, std::pair{batch.mutable_targets(), &targets}}) {
    tensor->set_dtype(v1::DTYPE_I32);
    tensor->add_shape(b);
    tensor->add_shape(t);
    tensor->set_data(reinterpret_cast<const char*>(values->data()),
                     values->size() * sizeof(int32_t));
  }
  return batch;
}

}  // namespace ampd
