// Trainer::Sample: completions of prompts from the job's current weights.
//
// S = prompts x num_samples sequences, each its own row (a completion's
// prompt is run once per completion: its cache is its own).
//   prefill   the model's Forward over the (S, P) prompts, right-padded
//             with token 0 (causal: a row never reads the padding after
//             it); Network::Prefill keeps each sequence's keys and values
//             and its last prompt row's final-norm output.
//   per token the LM head's GEMM over the S rows (LmLogits, the loss's),
//             one read of the logits to draw each live sequence's token on
//             the host (Philox under the request's seed, stream = the
//             sequence's index, one block per token), then the head's
//             CrossEntropyChunk with the drawn tokens as labels gives each
//             token's log-prob (the kernel Step and Evaluate take theirs
//             from, at temperature 1), read back; then Network::DecodeStep
//             feeds the drawn tokens.
// A sequence that has stopped keeps decoding its last token at its last
// position (its rows are never read again): the S rows stay one batch.
// With batch-invariant kernels every row's bits are those of the same
// sequence trained alone, so each reported log-prob is the training
// forward's (tests/engine/sample_test.cc checks it bit for bit).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "kernels/float16.h"
#include "kernels/philox.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

absl::Status CheckSampleInput(const SampleInput& input) {
  const auto prompts = static_cast<int64_t>(input.prompts.size());
  if (prompts < 1 || prompts > kMaxSamplePrompts) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompts: 1 to ", kMaxSamplePrompts, " prompts, got ", prompts));
  }
  for (size_t i = 0; i < input.prompts.size(); ++i) {
    if (input.prompts[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("prompts[", i, "]: empty"));
    }
  }
  if (input.num_samples < 1 || input.num_samples > kMaxSamplesPerPrompt) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_samples: 1 to ", kMaxSamplesPerPrompt, ", got ", input.num_samples));
  }
  int64_t sequences = 0;
  if (!CheckedMul(prompts, input.num_samples, &sequences) || sequences > kMaxSampleSequences) {
    return absl::InvalidArgumentError(absl::StrCat("num_samples: ", prompts, " prompts x ",
                                                   input.num_samples, " samples exceed the ",
                                                   kMaxSampleSequences, " sequences of one call"));
  }
  if (input.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: must be >= 1, got ", input.max_tokens));
  }
  if (!std::isfinite(input.temperature) || input.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: must be finite and >= 0, got ", input.temperature));
  }
  if (input.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: must be >= 0, got ", input.top_k));
  }
  if (!(input.top_p > 0.0f && input.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p: must be in (0, 1], got ", input.top_p));
  }
  if (static_cast<int64_t>(input.stop_token_ids.size()) > kMaxStopTokens) {
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: at most ", kMaxStopTokens,
                                                   ", got ", input.stop_token_ids.size()));
  }
  return absl::OkStatus();
}

namespace {

// The token drawn from one row of logits: softmax(logits / temperature)
// over the top_k most likely tokens (0: all), then the smallest set of the
// most likely whose probability reaches top_p, sampled by inverse CDF with
// u in [0, 1) (in id order when nothing is truncated, which needs no
// sort); temperature 0: the most likely (the lowest id among ties).
// In float64 on the host: the draw is the sampler's own choice, and the
// log-prob reported for the drawn token is the kernel's, not this.
int64_t Draw(const float* logits, int64_t vocab, const SampleInput& in, double u,
             std::vector<int64_t>& order, std::vector<double>& weights) {
  if (in.temperature == 0.0f) {
    return std::max_element(logits, logits + vocab) - logits;
  }
  const double inv_t = 1.0 / static_cast<double>(in.temperature);
  if (in.top_k == 0 && in.top_p >= 1.0f) {
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
  const int64_t keep = in.top_k > 0 ? std::min(in.top_k, vocab) : vocab;
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
  const double target = u * in_nucleus;
  double cumulative = 0.0;
  for (int64_t i = 0; i < nucleus; ++i) {
    cumulative += weights[static_cast<size_t>(i)];
    if (target < cumulative) return order[static_cast<size_t>(i)];
  }
  return order[static_cast<size_t>(nucleus - 1)];
}

// Row-major (rows, vocab) logits of `dtype` read back as floats (exact).
void Widen(const std::string& raw, DType dtype, std::vector<float>& out) {
  const size_t n = raw.size() / kernels::SizeOf(dtype);
  out.resize(n);
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), raw.data(), raw.size());
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    uint16_t bits = 0;
    std::memcpy(&bits, raw.data() + 2 * i, 2);
    out[i] = dtype == DType::kF16 ? kernels::HalfBitsToFloat(bits) : kernels::Bf16BitsToFloat(bits);
  }
}

}  // namespace

absl::StatusOr<SampleReport> Trainer::Sample(const SampleInput& input,
                                             const std::function<absl::Status(int64_t)>& admit) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  AMPD_RETURN_IF_ERROR(CheckSampleInput(input));
  Impl& m = *impl_;
  model::Network& net = *m.model;
  kernels::Backend& b = *m.backend;
  const model::Parameter* head = net.LmHead();
  if (head == nullptr) {
    return absl::InvalidArgumentError("prompts: sampling needs a language model (gpt or decoder)");
  }
  const model::ModelSpec& spec = m.config.model;
  const int64_t vocab = head->value().dim(0);
  const int64_t context =
      spec.gpt.has_value() ? spec.gpt->context_length : spec.decoder->max_position_embeddings;
  // Every completion, recomputed by a trainer as inputs = sequence[:-1],
  // must fit the context: prompt + max_tokens - 1 positions.
  int64_t prompt_len = 0;
  int64_t max_len = 0;
  for (size_t p = 0; p < input.prompts.size(); ++p) {
    const std::vector<int64_t>& prompt = input.prompts[p];
    const auto len = static_cast<int64_t>(prompt.size());
    if (len > context || input.max_tokens > context - len + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompts[", p, "]: ", len, " tokens + max_tokens ", input.max_tokens,
                       " - 1 exceed the model's context of ", context));
    }
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (prompt[i] < 0 || prompt[i] >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("prompts[", p, "][", i, "]: token ",
                                                       prompt[i], " outside [0, ", vocab, ")"));
      }
    }
    prompt_len = std::max(prompt_len, len);
    max_len = std::max(max_len, len + input.max_tokens - 1);
  }
  for (size_t i = 0; i < input.stop_token_ids.size(); ++i) {
    if (input.stop_token_ids[i] < 0 || input.stop_token_ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids[", i, "]: token ", input.stop_token_ids[i], " outside [0, ", vocab, ")"));
    }
  }
  const auto samples = input.num_samples;
  const int64_t n = static_cast<int64_t>(input.prompts.size()) * samples;  // S, checked

  // The prompts as one (S, P) micro-batch of I64 ids, no target kept: its
  // shape first (admission reads only that), its bytes once admitted.
  MicroBatch prefill;
  for (HostTensor* t : {&prefill.inputs, &prefill.targets}) {
    t->dtype = DType::kI64;
    t->shape = {n, prompt_len};
  }

  // Admission before any allocation: the prompts' workspace and scratch,
  // the KV cache and decode buffers, the head's logits (S, V) in the
  // working dtype, their host copies (the read-back bytes and their
  // floats), and the prompts' host ids and targets.
  AMPD_ASSIGN_OR_RETURN(const int64_t state_bytes, net.DecodeStateBytes(n, max_len));
  const auto w = static_cast<int64_t>(kernels::SizeOf(net.working_dtype()));
  int64_t extra = state_bytes;
  int64_t logits_bytes = 0;
  int64_t prompt_bytes = 0;
  if (!CheckedMul(n, vocab, &logits_bytes) || !CheckedMul(logits_bytes, 2 * w + 4, &logits_bytes) ||
      !CheckedAdd(extra, logits_bytes, &extra) || !CheckedAdd(extra, n * 16, &extra) ||
      !CheckedMul(n, prompt_len, &prompt_bytes) || !CheckedMul(prompt_bytes, 16, &prompt_bytes) ||
      !CheckedAdd(extra, prompt_bytes, &extra)) {
    return absl::InvalidArgumentError(
        "num_samples: the sampler's buffers need more than 2^63 bytes");
  }
  AMPD_RETURN_IF_ERROR(m.AdmitWorkspaces({prefill}, admit, "sampling", extra));

  for (HostTensor* t : {&prefill.inputs, &prefill.targets}) {
    t->data.assign(static_cast<size_t>(n * prompt_len) * sizeof(int64_t), '\0');
  }
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  {
    std::vector<int64_t> ignored(static_cast<size_t>(prompt_len), model::kIgnoreIndex);
    for (int64_t s = 0; s < n; ++s) {
      const std::vector<int64_t>& prompt = input.prompts[static_cast<size_t>(s / samples)];
      lengths[static_cast<size_t>(s)] = static_cast<int64_t>(prompt.size());
      std::memcpy(prefill.inputs.data.data() + s * prompt_len * 8, prompt.data(),
                  prompt.size() * sizeof(int64_t));
      std::memcpy(prefill.targets.data.data() + s * prompt_len * 8, ignored.data(),
                  ignored.size() * sizeof(int64_t));
    }
  }

  AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, m.WorkspaceFor(prefill.inputs.shape));
  AMPD_RETURN_IF_ERROR(net.LoadBatch(prefill.inputs, prefill.targets, *ws));
  AMPD_RETURN_IF_ERROR(net.Forward(*ws));
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<model::DecodeState> state, net.NewDecodeState(n, max_len));
  AMPD_RETURN_IF_ERROR(net.Prefill(*ws, lengths, *state));

  const DType dtype = net.working_dtype();
  AMPD_ASSIGN_OR_RETURN(Tensor logits, b.Allocate(dtype, {n, vocab}));
  AMPD_ASSIGN_OR_RETURN(Tensor labels, b.Allocate(DType::kI64, {n}));
  AMPD_ASSIGN_OR_RETURN(Tensor logprobs, b.Allocate(DType::kF32, {n}));
  kernels::TokenLossTerms terms;
  terms.logprobs = &logprobs;

  SampleReport report;
  report.completions.resize(input.prompts.size());
  for (auto& per_prompt : report.completions) per_prompt.resize(static_cast<size_t>(samples));
  auto completion = [&](int64_t s) -> Completion& {
    return report.completions[static_cast<size_t>(s / samples)][static_cast<size_t>(s % samples)];
  };
  std::vector<bool> done(static_cast<size_t>(n), false);
  std::vector<int64_t> tokens(static_cast<size_t>(n), 0);
  std::vector<int64_t> drawn(static_cast<size_t>(n), model::kIgnoreIndex);
  std::vector<int64_t> positions(static_cast<size_t>(n), 0);
  std::vector<float> host_logits, host_logprobs(static_cast<size_t>(n));
  std::string raw;
  std::vector<int64_t> order;
  std::vector<double> weights;
  for (int64_t step = 0; step < input.max_tokens; ++step) {
    AMPD_RETURN_IF_ERROR(model::LmLogits(b, state->hidden, *head, logits));
    raw.resize(static_cast<size_t>(logits.nbytes()));
    AMPD_RETURN_IF_ERROR(b.CopyToHost(logits, raw.data(), raw.size()));
    Widen(raw, dtype, host_logits);
    for (int64_t s = 0; s < n; ++s) {
      if (done[static_cast<size_t>(s)]) {
        drawn[static_cast<size_t>(s)] = model::kIgnoreIndex;
        continue;
      }
      const kernels::philox::Block r = kernels::philox::StreamBlock(
          input.seed, static_cast<uint64_t>(s), static_cast<uint64_t>(step));
      const double u = kernels::philox::Unit53(r.v[0], r.v[1]);
      drawn[static_cast<size_t>(s)] =
          Draw(host_logits.data() + s * vocab, vocab, input, u, order, weights);
    }
    // Each drawn token's log-prob from the loss's own kernel. The logits
    // were read already: its (unused) gradient overwrites them in place.
    AMPD_RETURN_IF_ERROR(b.CopyFromHost(drawn.data(), drawn.size() * sizeof(int64_t), labels));
    AMPD_RETURN_IF_ERROR(b.Fill(m.loss, 0.0f));
    AMPD_RETURN_IF_ERROR(b.CrossEntropyChunk(logits, labels, model::kIgnoreIndex, terms, 0.0f, 0.0f,
                                             m.loss, logits));
    AMPD_RETURN_IF_ERROR(
        b.CopyToHost(logprobs, host_logprobs.data(), host_logprobs.size() * sizeof(float)));
    bool all_done = true;
    for (int64_t s = 0; s < n; ++s) {
      const size_t i = static_cast<size_t>(s);
      if (!done[i]) {
        Completion& c = completion(s);
        c.tokens.push_back(drawn[i]);
        c.logprobs.push_back(host_logprobs[i]);
        ++report.tokens;
        tokens[i] = drawn[i];
        positions[i] = lengths[i] + step;
        const bool stop = std::find(input.stop_token_ids.begin(), input.stop_token_ids.end(),
                                    drawn[i]) != input.stop_token_ids.end();
        if (stop) c.stop = StopReason::kStopToken;
        done[i] = stop || step + 1 == input.max_tokens;
      }
      all_done = all_done && done[i];
    }
    if (all_done) break;
    AMPD_RETURN_IF_ERROR(net.DecodeStep(tokens, positions, *state));
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace ampd::engine
