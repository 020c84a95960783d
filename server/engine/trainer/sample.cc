// Trainer::Sample: completions of prompts from the job's current weights,
// as phases: PlanSample (the checks against the model, the admission of
// everything the call allocates), Prefill (the prompts' forward into the
// KV cache), then one Decoder::Step per token. Why it is built this way:
// - Every row is its own sequence (S = prompts x num_samples; a prompt is
//   run once per completion, its cache its own) and goes through the
//   training forward's code and the loss's row code (LmLogits,
//   LabelLogprobs: CrossEntropyChunk's): with batch-invariant kernels each
//   reported log-prob is the training forward's, bit for bit, at
//   temperature 1 and at the call's (tests/engine/sample_test.cc).
// - The draw is on the device (SampleTokens: Philox under each sequence's
//   key and stream, SampleStreamOf), and one read a step brings the
//   tokens, both log-probs and the log of the mass top_k and top_p kept
//   back: the host needs them for stop tokens and the reply, and forms the
//   drawn distribution's log-prob from them.
// - A sequence that has stopped keeps decoding its last token at its last
//   position (its rows are never read again): the S rows stay one batch.
// - The CallToken is checked before the prefill and before every decode
//   step: a call nobody waits for ends within one step.
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

// The checks against the model (CheckSampleInput's ran before): every
// prompt's tokens and the stop tokens in the vocabulary, and every
// completion, recomputed by a trainer as inputs = sequence[:-1], within
// the context: prompt + max_tokens - 1 positions. The plan's sizes.
absl::Status FitSampleToModel(const SampleInput& input, int64_t context, SamplePlan& plan) {
  for (size_t p = 0; p < input.prompts.size(); ++p) {
    const std::vector<int64_t>& prompt = input.prompts[p];
    const auto len = static_cast<int64_t>(prompt.size());
    if (len > context || input.max_tokens > context - len + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompts[", p, "]: ", len, " tokens + max_tokens ", input.max_tokens,
                       " - 1 exceed the model's context of ", context));
    }
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (prompt[i] < 0 || prompt[i] >= plan.vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prompts[", p, "][", i, "]: token ", prompt[i], " outside [0, ", plan.vocab, ")"));
      }
    }
    plan.prompt_len = std::max(plan.prompt_len, len);
    plan.max_len = std::max(plan.max_len, len + input.max_tokens - 1);
  }
  for (size_t i = 0; i < input.stop_token_ids.size(); ++i) {
    if (input.stop_token_ids[i] < 0 || input.stop_token_ids[i] >= plan.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: token ",
                                                     input.stop_token_ids[i], " outside [0, ",
                                                     plan.vocab, ")"));
    }
  }
  plan.n = static_cast<int64_t>(input.prompts.size()) * input.num_samples;  // S, checked
  return absl::OkStatus();
}

// The decode loop's device tensors, their host twins and the per-token
// bookkeeping of every sequence: allocated once (after admission), then
// one Step per token.
class Decoder {
 public:
  Decoder(kernels::Backend& b, model::Network& net, const SampleInput& input,
          const SamplePlan& plan, std::vector<int64_t> lengths)
      : b_(b), net_(net), input_(input), plan_(plan), lengths_(std::move(lengths)) {}

  absl::Status Allocate();
  // Decode step `step`: logits, the draw, the log-probs, the one read,
  // then the host's record of each live sequence. *all_done when every
  // sequence has ended.
  absl::Status Step(int64_t step, model::DecodeState& state, bool* all_done);
  SampleReport& report() { return report_; }

 private:
  // The host's part of a step: each live sequence's token, log-probs and
  // end, from what the read brought.
  absl::Status Record(int64_t step, bool* all_done, bool* stopped);
  Completion& CompletionOf(int64_t s) {
    const int64_t samples = input_.num_samples;
    return report_.completions[static_cast<size_t>(s / samples)][static_cast<size_t>(s % samples)];
  }

  kernels::Backend& b_;
  model::Network& net_;
  const SampleInput& input_;
  const SamplePlan& plan_;
  const std::vector<int64_t> lengths_;
  // At the call's temperature too, when it is neither 0 nor 1.
  const bool tempered_ = input_.temperature != 0.0f && input_.temperature != 1.0f;
  Tensor logits_;  // (S, V) working dtype
  // (S) each sequence's drawn token, kIgnoreIndex once it stopped: the
  // cross-entropy's labels as they are.
  Tensor labels_;
  Tensor live_;               // (S) I64, 1 until stopped
  Tensor logprobs_;           // (S) F32 at temperature 1
  Tensor tempered_logprobs_;  // (S) F32 at the call's temperature
  Tensor log_kept_;           // (S) F32 log of the mass top_k and top_p kept
  Tensor keys_;               // (S, 2) I64 each sequence's Philox key and stream
  kernels::SampleParams draw_;
  std::vector<bool> done_;
  // Uploaded (asynchronously) whenever a sequence stops: unchanged until
  // the next ReadBack has synchronised.
  std::vector<int64_t> live_flags_, tokens_, drawn_, positions_;
  std::vector<float> host_logprobs_, host_tempered_, host_kept_;
  std::vector<kernels::HostCopy> copies_;  // the step's one read
  SampleReport report_;
};

absl::Status Decoder::Allocate() {
  const int64_t n = plan_.n;
  const auto un = static_cast<size_t>(n);
  AMPD_ASSIGN_OR_RETURN(logits_, b_.Allocate(net_.working_dtype(), {n, plan_.vocab}));
  AMPD_ASSIGN_OR_RETURN(labels_, b_.Allocate(DType::kI64, {n}));
  AMPD_ASSIGN_OR_RETURN(live_, b_.Allocate(DType::kI64, {n}));
  AMPD_ASSIGN_OR_RETURN(logprobs_, b_.Allocate(DType::kF32, {n}));
  AMPD_ASSIGN_OR_RETURN(tempered_logprobs_, b_.Allocate(DType::kF32, {n}));
  AMPD_ASSIGN_OR_RETURN(log_kept_, b_.Allocate(DType::kF32, {n}));
  AMPD_ASSIGN_OR_RETURN(keys_, b_.Allocate(DType::kI64, {n, 2}));
  std::vector<int64_t> host_keys(2 * un);
  for (int64_t s = 0; s < n; ++s) {
    const SampleStream k = SampleStreamOf(input_, s / input_.num_samples, s % input_.num_samples);
    host_keys[static_cast<size_t>(2 * s)] = static_cast<int64_t>(k.key);
    host_keys[static_cast<size_t>(2 * s + 1)] = static_cast<int64_t>(k.stream);
  }
  AMPD_RETURN_IF_ERROR(
      b_.CopyFromHost(host_keys.data(), host_keys.size() * sizeof(int64_t), keys_));
  draw_.temperature = input_.temperature;
  draw_.top_k = input_.top_k;
  draw_.top_p = input_.top_p;
  draw_.keys = &keys_;
  draw_.ignore_index = model::kIgnoreIndex;
  draw_.log_kept = &log_kept_;
  report_.completions.resize(input_.prompts.size());
  for (auto& per_prompt : report_.completions) {
    per_prompt.resize(static_cast<size_t>(input_.num_samples));
  }
  done_.assign(un, false);
  live_flags_.assign(un, 1);
  tokens_.assign(un, 0);
  drawn_.assign(un, model::kIgnoreIndex);
  positions_.assign(un, 0);
  host_logprobs_.assign(un, 0.0f);
  host_tempered_.assign(un, 0.0f);
  host_kept_.assign(un, 0.0f);
  // The drawn tokens, their log-probs and kept masses together.
  copies_ = {{&labels_, drawn_.data(), un * sizeof(int64_t)},
             {&logprobs_, host_logprobs_.data(), un * sizeof(float)},
             {&log_kept_, host_kept_.data(), un * sizeof(float)}};
  if (tempered_)
    copies_.push_back({&tempered_logprobs_, host_tempered_.data(), un * sizeof(float)});
  AMPD_RETURN_IF_ERROR(b_.CopyFromHost(live_flags_.data(), un * sizeof(int64_t), live_));
  // One read before the loop, of defined bytes, so that a backend sizes its
  // landing area for these copies here and never inside the loop.
  AMPD_RETURN_IF_ERROR(b_.CopyFromHost(drawn_.data(), un * sizeof(int64_t), labels_));
  for (Tensor* t : {&logprobs_, &tempered_logprobs_, &log_kept_}) {
    AMPD_RETURN_IF_ERROR(b_.Fill(*t, 0.0f));
  }
  return b_.ReadBack({}, {}, copies_);
}

absl::Status Decoder::Step(int64_t step, model::DecodeState& state, bool* all_done) {
  AMPD_RETURN_IF_ERROR(model::LmLogits(b_, state.hidden, *plan_.head, logits_));
  draw_.step = static_cast<uint64_t>(step);
  AMPD_RETURN_IF_ERROR(b_.SampleTokens(logits_, live_, draw_, labels_));
  // Each drawn token's log-prob from the loss's own row code: the
  // policy's, and a tempered draw's at its temperature.
  AMPD_RETURN_IF_ERROR(b_.LabelLogprobs(logits_, labels_, model::kIgnoreIndex, 1.0f, logprobs_));
  if (tempered_) {
    AMPD_RETURN_IF_ERROR(b_.LabelLogprobs(logits_, labels_, model::kIgnoreIndex, input_.temperature,
                                          tempered_logprobs_));
  }
  AMPD_RETURN_IF_ERROR(b_.ReadBack({}, {}, copies_));
  bool stopped = false;
  AMPD_RETURN_IF_ERROR(Record(step, all_done, &stopped));
  if (*all_done) return absl::OkStatus();
  if (stopped) {
    AMPD_RETURN_IF_ERROR(
        b_.CopyFromHost(live_flags_.data(), live_flags_.size() * sizeof(int64_t), live_));
  }
  return net_.DecodeStep(tokens_, positions_, state);
}

absl::Status Decoder::Record(int64_t step, bool* all_done, bool* stopped) {
  *all_done = true;
  for (int64_t s = 0; s < plan_.n; ++s) {
    const auto i = static_cast<size_t>(s);
    if (!done_[i]) {
      // Logits that are NaN (weights past the working dtype's range, a
      // diverged run) draw no token worth returning: say so instead.
      if (std::isnan(host_logprobs_[i])) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Sample: the logits of completion ", s, " are not finite at decode step ", step,
            ": the weights give NaN (have they diverged, or left the working dtype's "
            "range?); nothing was sampled"));
      }
      Completion& c = CompletionOf(s);
      c.tokens.push_back(drawn_[i]);
      c.logprobs.push_back(host_logprobs_[i]);
      // The drawn distribution's: certain at temperature 0; else the
      // token's at the temperature over the mass kept (log_kept is 0,
      // and the difference the temperature's bits, when nothing was cut).
      const float at_temperature = tempered_ ? host_tempered_[i] : host_logprobs_[i];
      c.sampling_logprobs.push_back(input_.temperature == 0.0f ? 0.0f
                                                               : at_temperature - host_kept_[i]);
      ++report_.tokens;
      tokens_[i] = drawn_[i];
      positions_[i] = lengths_[i] + step;
      const bool stop = std::find(input_.stop_token_ids.begin(), input_.stop_token_ids.end(),
                                  drawn_[i]) != input_.stop_token_ids.end();
      if (stop) c.stop = StopReason::kStopToken;
      done_[i] = stop || step + 1 == input_.max_tokens;
      if (stop) {
        live_flags_[i] = 0;
        *stopped = true;
      }
    }
    *all_done = *all_done && done_[i];
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SampleReport> Trainer::Sample(const Valid<SampleRequest>& request,
                                             const std::function<absl::Status(int64_t)>& admit,
                                             const CallToken& call) {
  return SampleChecked(request->input, admit, call);
}

absl::StatusOr<SampleReport> Trainer::Sample(const SampleInput& input,
                                             const std::function<absl::Status(int64_t)>& admit,
                                             const CallToken& call) {
  AMPD_RETURN_IF_ERROR(CheckSampleInput(input));
  return SampleChecked(input, admit, call);
}

absl::StatusOr<SampleReport> Trainer::SampleChecked(
    const SampleInput& input, const std::function<absl::Status(int64_t)>& admit,
    const CallToken& call) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Impl& m = *impl_;
  AMPD_ASSIGN_OR_RETURN(const SamplePlan plan, m.PlanSample(input, admit));
  std::vector<int64_t> lengths;
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<model::DecodeState> state,
                        m.Prefill(input, plan, call, lengths));
  Decoder decoder(*m.backend, *m.model, input, plan, std::move(lengths));
  AMPD_RETURN_IF_ERROR(decoder.Allocate());
  for (int64_t step = 0; step < input.max_tokens; ++step) {
    // A caller gone (its deadline passed, it cancelled, the server drains)
    // stops the loop here: at most one decode step after it went.
    AMPD_RETURN_IF_ERROR(call.Check(
        absl::StrCat("sampling stopped after ", step, " of ", input.max_tokens, " decode steps")));
    bool all_done = false;
    AMPD_RETURN_IF_ERROR(decoder.Step(step, *state, &all_done));
    if (all_done) break;
  }
  SampleReport report = std::move(decoder.report());
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

absl::StatusOr<SamplePlan> Trainer::Impl::PlanSample(
    const SampleInput& input, const std::function<absl::Status(int64_t)>& admit) {
  SamplePlan plan;
  plan.head = model->LmHead();
  if (plan.head == nullptr) {
    return absl::InvalidArgumentError("prompts: sampling needs a language model (gpt or decoder)");
  }
  const model::ModelSpec& spec = config.model;
  plan.vocab = plan.head->value().dim(0);
  const int64_t context = model::TokenShapeOf(spec).max_positions;
  AMPD_RETURN_IF_ERROR(FitSampleToModel(input, context, plan));
  const int64_t n = plan.n;
  // Admission before any allocation: the prompts' workspace and scratch,
  // the KV cache and decode buffers, the head's logits (S, V) in the
  // working dtype and what SampleTokens holds beside them, the per-token
  // tensors and their host copies (tokens, live flags, the two log-probs,
  // the kept masses and the rows' Philox keys: 112 bytes a sequence,
  // rounded up), and the prompts' host ids and targets.
  AMPD_ASSIGN_OR_RETURN(const int64_t state_bytes, model->DecodeStateBytes(n, plan.max_len));
  const auto w = static_cast<int64_t>(kernels::SizeOf(model->working_dtype()));
  int64_t extra = state_bytes;
  int64_t logits_bytes = 0;
  int64_t prompt_bytes = 0;
  if (!CheckedMul(n, plan.vocab, &logits_bytes) || !CheckedMul(logits_bytes, w, &logits_bytes) ||
      !CheckedAdd(extra, logits_bytes, &extra) ||
      !CheckedAdd(extra, backend->SampleScratchBytes(n, plan.vocab), &extra) ||
      !CheckedAdd(extra, n * 112, &extra) || !CheckedMul(n, plan.prompt_len, &prompt_bytes) ||
      !CheckedMul(prompt_bytes, 16, &prompt_bytes) || !CheckedAdd(extra, prompt_bytes, &extra)) {
    return absl::InvalidArgumentError(
        "num_samples: the sampler's buffers need more than 2^63 bytes");
  }
  // Admission reads only the prompts' micro-batch's shape.
  MicroBatch prefill;
  for (HostTensor* t : {&prefill.inputs, &prefill.targets}) {
    t->dtype = DType::kI64;
    t->shape = {n, plan.prompt_len};
  }
  AMPD_RETURN_IF_ERROR(AdmitWorkspaces({prefill}, admit, "sampling", /*backward=*/false, extra,
                                       kSampleMemory,
                                       model::DecodeScratchExtents(spec, config.precision, n)));
  return plan;
}

absl::StatusOr<std::unique_ptr<model::DecodeState>> Trainer::Impl::Prefill(
    const SampleInput& input, const SamplePlan& plan, const CallToken& call,
    std::vector<int64_t>& lengths) {
  // The prompts as one (S, P) micro-batch of I64 ids, right-padded with
  // token 0, no target kept.
  const int64_t n = plan.n;
  const int64_t prompt_len = plan.prompt_len;
  MicroBatch prefill;
  for (HostTensor* t : {&prefill.inputs, &prefill.targets}) {
    t->dtype = DType::kI64;
    t->shape = {n, prompt_len};
    t->data.assign(static_cast<size_t>(n * prompt_len) * sizeof(int64_t), '\0');
  }
  lengths.assign(static_cast<size_t>(n), 0);
  std::vector<int64_t> ignored(static_cast<size_t>(prompt_len), model::kIgnoreIndex);
  for (int64_t s = 0; s < n; ++s) {
    const std::vector<int64_t>& prompt = input.prompts[static_cast<size_t>(s / input.num_samples)];
    lengths[static_cast<size_t>(s)] = static_cast<int64_t>(prompt.size());
    std::memcpy(prefill.inputs.data.data() + s * prompt_len * 8, prompt.data(),
                prompt.size() * sizeof(int64_t));
    std::memcpy(prefill.targets.data.data() + s * prompt_len * 8, ignored.data(),
                ignored.size() * sizeof(int64_t));
  }
  AMPD_RETURN_IF_ERROR(call.Check("sampling stopped before the prompts' forward"));
  AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, WorkspaceFor(prefill.inputs.shape));
  AMPD_RETURN_IF_ERROR(model->LoadBatch(prefill.inputs, prefill.targets, *ws));
  AMPD_RETURN_IF_ERROR(model->Forward(*ws));
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<model::DecodeState> state,
                        model->NewDecodeState(n, plan.max_len));
  AMPD_RETURN_IF_ERROR(model->Prefill(*ws, lengths, *state));
  return state;
}

}  // namespace ampd::engine
