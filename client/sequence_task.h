// A built-in sequence task for a GPT in `ampctl train` and the service
// tests: token sequences drawn from a fixed random Markov chain over the
// vocabulary, seeded, in which every token has a few likely successors
// (probabilities 0.6, 0.25, 0.1, 0.05). Its entropy rate, about 1.03 nats
// per token, is the loss a model that has learned the chain reaches, far
// below the ln(vocab) of an untrained one, so a falling loss is visible in a
// few hundred steps. Each batch is (batch, seq_len) I32 inputs and the same
// sequences shifted by one as the (batch, seq_len) I32 next-token targets.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "ampd/v1/trainer.pb.h"

namespace ampd {

struct SequenceTaskOptions {
  int64_t vocab_size = 0;
  int64_t batch_size = 8;
  int64_t seq_len = 0;
  uint64_t seed = 0;
};

class SequenceTask {
 public:
  // Likely successors per token, and their probabilities.
  static constexpr int kSuccessors = 4;
  static constexpr double kSuccessorProbabilities[kSuccessors] = {0.6, 0.25, 0.1, 0.05};
  // Bounds that keep the task's tables and batches small (the chain holds
  // kSuccessors entries a token, a batch batch_size * (seq_len + 1) tokens).
  static constexpr int64_t kMaxVocab = int64_t{1} << 24;
  static constexpr int64_t kMaxBatchTokens = int64_t{1} << 24;

  // InvalidArgument naming the option when a size is below 1 or over the
  // bounds above.
  static absl::StatusOr<SequenceTask> Create(const SequenceTaskOptions& options);

  // The next batch; deterministic for a given seed and call count.
  v1::MicroBatch NextBatch();

  // The chain's entropy per token in nats (the loss floor of the task).
  static double EntropyRate();

 private:
  explicit SequenceTask(const SequenceTaskOptions& options);
  int32_t Next(int32_t token);
  double Uniform();  // in [0, 1), the same on every platform

  SequenceTaskOptions options_;
  std::mt19937_64 rng_;
  std::vector<int32_t> successors_;  // (vocab, kSuccessors)
};

}  // namespace ampd
