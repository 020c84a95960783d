// Trainer::Sample: completions of prompts from the job's current weights.
//
// S = prompts x num_samples sequences, each its own row (a completion's
// prompt is run once per completion: its cache is its own).
//   prefill   the model's Forward over the (S, P) prompts, right-padded
//             with token 0 (causal: a row never reads the padding after
//             it); Network::Prefill keeps each sequence's keys and values
//             and its last prompt row's final-norm output.
//   per token the LM head's GEMM over the S rows (LmLogits, the loss's),
//             then each live sequence's token drawn on the device
//             (Backend::SampleTokens: Philox under each sequence's own
//             key and stream, SampleStreamOf, one block per token, with
//             the log of the mass top_k and top_p kept), which serve as
//             the labels of LabelLogprobs, the row code of the loss's
//             CrossEntropyChunk, for each token's log-prob at temperature
//             1 (the policy's) and at the call's temperature (what a loss
//             at that temperature computes); one read brings the tokens,
//             log-probs and kept masses back (the host needs them for stop
//             tokens and the reply) and the host forms each drawn
//             distribution's log-prob, the temperature's minus the log of
//             the kept mass (0 at temperature 0: the most likely token is
//             certain); then Network::DecodeStep feeds
//             the drawn tokens, each layer's new keys and values written
//             into the cache in one op.
// The caller's CallToken is checked before the prefill and before every
// decode step, so a call nobody waits for any more ends within one step.
// A sequence that has stopped keeps decoding its last token at its last
// position (its rows are never read again): the S rows stay one batch.
// With batch-invariant kernels every row's bits are those of the same
// sequence trained alone, so each reported log-prob is the training
// forward's, at temperature 1 or the call's (tests/engine/sample_test.cc
// checks both bit for bit).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

namespace {

// A sampler's memory is sized by its prompts, num_samples and max_tokens.
constexpr MemoryField kSampleMemory{"num_samples",
                                    "send fewer prompts or num_samples, or a smaller max_tokens"};

}  // namespace

SampleStream SampleStreamOf(const SampleInput& input, int64_t prompt, int64_t sample) {
  const auto p = static_cast<size_t>(prompt);
  if (p < input.prompt_seeds.size() && input.prompt_seeds[p].has_value()) {
    return {*input.prompt_seeds[p], static_cast<uint64_t>(sample)};
  }
  // The request's seed split by position (what every request did before
  // prompts had seeds of their own): stream i x num_samples + j.
  return {input.seed, static_cast<uint64_t>(prompt * input.num_samples + sample)};
}

absl::Status CheckSampleInput(const SampleInput& input) {
  const auto prompts = static_cast<int64_t>(input.prompts.size());
  if (prompts < 1 || prompts > kMaxSamplePrompts) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompts: 1 to ", kMaxSamplePrompts, " prompts, got ", prompts));
  }
  if (!input.prompt_seeds.empty() && input.prompt_seeds.size() != input.prompts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("prompts: ", input.prompt_seeds.size(),
                                                   " prompt seeds for ", prompts, " prompts"));
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

absl::StatusOr<SampleReport> Trainer::Sample(const SampleInput& input,
                                             const std::function<absl::Status(int64_t)>& admit,
                                             const CallToken& call) {
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
  const int64_t context = model::TokenShapeOf(spec).max_positions;
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
  // working dtype and what SampleTokens holds beside them, the per-token
  // tensors and their host copies (tokens, live flags, the two log-probs,
  // the kept masses and the rows' Philox keys: 112 bytes a sequence,
  // rounded up), and the prompts' host ids and targets.
  AMPD_ASSIGN_OR_RETURN(const int64_t state_bytes, net.DecodeStateBytes(n, max_len));
  const auto w = static_cast<int64_t>(kernels::SizeOf(net.working_dtype()));
  int64_t extra = state_bytes;
  int64_t logits_bytes = 0;
  int64_t prompt_bytes = 0;
  if (!CheckedMul(n, vocab, &logits_bytes) || !CheckedMul(logits_bytes, w, &logits_bytes) ||
      !CheckedAdd(extra, logits_bytes, &extra) ||
      !CheckedAdd(extra, b.SampleScratchBytes(n, vocab), &extra) ||
      !CheckedAdd(extra, n * 112, &extra) || !CheckedMul(n, prompt_len, &prompt_bytes) ||
      !CheckedMul(prompt_bytes, 16, &prompt_bytes) || !CheckedAdd(extra, prompt_bytes, &extra)) {
    return absl::InvalidArgumentError(
        "num_samples: the sampler's buffers need more than 2^63 bytes");
  }
  AMPD_RETURN_IF_ERROR(
      m.AdmitWorkspaces({prefill}, admit, "sampling", /*backward=*/false, extra, kSampleMemory));

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

  AMPD_RETURN_IF_ERROR(call.Check("sampling stopped before the prompts' forward"));
  AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, m.WorkspaceFor(prefill.inputs.shape));
  AMPD_RETURN_IF_ERROR(net.LoadBatch(prefill.inputs, prefill.targets, *ws));
  AMPD_RETURN_IF_ERROR(net.Forward(*ws));
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<model::DecodeState> state, net.NewDecodeState(n, max_len));
  AMPD_RETURN_IF_ERROR(net.Prefill(*ws, lengths, *state));

  const DType dtype = net.working_dtype();
  AMPD_ASSIGN_OR_RETURN(Tensor logits, b.Allocate(dtype, {n, vocab}));  // (S, V)
  // (S) each sequence's drawn token, kIgnoreIndex once it stopped: the
  // cross-entropy's labels as they are.
  AMPD_ASSIGN_OR_RETURN(Tensor labels, b.Allocate(DType::kI64, {n}));
  AMPD_ASSIGN_OR_RETURN(Tensor live, b.Allocate(DType::kI64, {n}));      // (S) 1 until stopped
  AMPD_ASSIGN_OR_RETURN(Tensor logprobs, b.Allocate(DType::kF32, {n}));  // (S) at temperature 1
  // (S) at the call's temperature, when it is neither 0 nor 1.
  const float temperature = input.temperature;
  const bool tempered = temperature != 0.0f && temperature != 1.0f;
  AMPD_ASSIGN_OR_RETURN(Tensor tempered_logprobs, b.Allocate(DType::kF32, {n}));
  AMPD_ASSIGN_OR_RETURN(Tensor log_kept, b.Allocate(DType::kF32, {n}));  // (S)
  // (S, 2) each sequence's Philox key and stream, fixed for the call.
  AMPD_ASSIGN_OR_RETURN(Tensor keys, b.Allocate(DType::kI64, {n, 2}));
  std::vector<int64_t> host_keys(static_cast<size_t>(2 * n));
  for (int64_t s = 0; s < n; ++s) {
    const SampleStream k = SampleStreamOf(input, s / samples, s % samples);
    host_keys[static_cast<size_t>(2 * s)] = static_cast<int64_t>(k.key);
    host_keys[static_cast<size_t>(2 * s + 1)] = static_cast<int64_t>(k.stream);
  }
  AMPD_RETURN_IF_ERROR(b.CopyFromHost(host_keys.data(), host_keys.size() * sizeof(int64_t), keys));
  kernels::SampleParams draw;
  draw.temperature = input.temperature;
  draw.top_k = input.top_k;
  draw.top_p = input.top_p;
  draw.keys = &keys;
  draw.ignore_index = model::kIgnoreIndex;
  draw.log_kept = &log_kept;

  SampleReport report;
  report.completions.resize(input.prompts.size());
  for (auto& per_prompt : report.completions) per_prompt.resize(static_cast<size_t>(samples));
  auto completion = [&](int64_t s) -> Completion& {
    return report.completions[static_cast<size_t>(s / samples)][static_cast<size_t>(s % samples)];
  };
  std::vector<bool> done(static_cast<size_t>(n), false);
  // live_flags is uploaded (asynchronously) whenever a sequence stops: it
  // stays unchanged until the next ReadBack has synchronised.
  std::vector<int64_t> live_flags(static_cast<size_t>(n), 1);
  std::vector<int64_t> tokens(static_cast<size_t>(n), 0);
  std::vector<int64_t> drawn(static_cast<size_t>(n), model::kIgnoreIndex);
  std::vector<int64_t> positions(static_cast<size_t>(n), 0);
  std::vector<float> host_logprobs(static_cast<size_t>(n), 0.0f);
  std::vector<float> host_tempered(static_cast<size_t>(n), 0.0f);
  std::vector<float> host_kept(static_cast<size_t>(n), 0.0f);
  // The step's one read: the drawn tokens, their log-probs and kept masses
  // together.
  const kernels::HostCopy copies[] = {
      {&labels, drawn.data(), drawn.size() * sizeof(int64_t)},
      {&logprobs, host_logprobs.data(), host_logprobs.size() * sizeof(float)},
      {&log_kept, host_kept.data(), host_kept.size() * sizeof(float)},
      {&tempered_logprobs, host_tempered.data(), host_tempered.size() * sizeof(float)}};
  const absl::Span<const kernels::HostCopy> step_copies(copies, tempered ? 4 : 3);
  AMPD_RETURN_IF_ERROR(
      b.CopyFromHost(live_flags.data(), live_flags.size() * sizeof(int64_t), live));
  // One read before the loop, of defined bytes, so that a backend sizes its
  // landing area for these copies here and never inside the loop.
  AMPD_RETURN_IF_ERROR(b.CopyFromHost(drawn.data(), drawn.size() * sizeof(int64_t), labels));
  for (Tensor* t : {&logprobs, &tempered_logprobs, &log_kept}) {
    AMPD_RETURN_IF_ERROR(b.Fill(*t, 0.0f));
  }
  AMPD_RETURN_IF_ERROR(b.ReadBack({}, {}, copies));
  for (int64_t step = 0; step < input.max_tokens; ++step) {
    // A caller gone (its deadline passed, it cancelled, the server drains)
    // stops the loop here: at most one decode step after it went.
    AMPD_RETURN_IF_ERROR(call.Check(
        absl::StrCat("sampling stopped after ", step, " of ", input.max_tokens, " decode steps")));
    AMPD_RETURN_IF_ERROR(model::LmLogits(b, state->hidden, *head, logits));
    draw.step = static_cast<uint64_t>(step);
    AMPD_RETURN_IF_ERROR(b.SampleTokens(logits, live, draw, labels));
    // Each drawn token's log-prob from the loss's own row code: the
    // policy's, and a tempered draw's at its temperature.
    AMPD_RETURN_IF_ERROR(b.LabelLogprobs(logits, labels, model::kIgnoreIndex, 1.0f, logprobs));
    if (tempered) {
      AMPD_RETURN_IF_ERROR(
          b.LabelLogprobs(logits, labels, model::kIgnoreIndex, temperature, tempered_logprobs));
    }
    AMPD_RETURN_IF_ERROR(b.ReadBack({}, {}, step_copies));
    bool all_done = true;
    bool stopped = false;
    for (int64_t s = 0; s < n; ++s) {
      const size_t i = static_cast<size_t>(s);
      if (!done[i]) {
        // Logits that are NaN (weights past the working dtype's range, a
        // diverged run) draw no token worth returning: say so instead.
        if (std::isnan(host_logprobs[i])) {
          return absl::FailedPreconditionError(absl::StrCat(
              "Sample: the logits of completion ", s, " are not finite at decode step ", step,
              ": the weights give NaN (have they diverged, or left the working dtype's "
              "range?); nothing was sampled"));
        }
        Completion& c = completion(s);
        c.tokens.push_back(drawn[i]);
        c.logprobs.push_back(host_logprobs[i]);
        // The drawn distribution's: certain at temperature 0; else the
        // token's at the temperature over the mass kept (log_kept is 0,
        // and the difference the temperature's bits, when nothing was cut).
        const float at_temperature = tempered ? host_tempered[i] : host_logprobs[i];
        c.sampling_logprobs.push_back(temperature == 0.0f ? 0.0f : at_temperature - host_kept[i]);
        ++report.tokens;
        tokens[i] = drawn[i];
        positions[i] = lengths[i] + step;
        const bool stop = std::find(input.stop_token_ids.begin(), input.stop_token_ids.end(),
                                    drawn[i]) != input.stop_token_ids.end();
        if (stop) c.stop = StopReason::kStopToken;
        done[i] = stop || step + 1 == input.max_tokens;
        if (stop) {
          live_flags[i] = 0;
          stopped = true;
        }
      }
      all_done = all_done && done[i];
    }
    if (all_done) break;
    if (stopped) {
      AMPD_RETURN_IF_ERROR(
          b.CopyFromHost(live_flags.data(), live_flags.size() * sizeof(int64_t), live));
    }
    AMPD_RETURN_IF_ERROR(net.DecodeStep(tokens, positions, *state));
  }
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace ampd::engine
