// The face's checks (api.h): each request's fields that need no model,
// checked once where the registry accepts the request (Valid<Request>).
// The checks against a job's model are the Trainer's, on the job's strand.
#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/api.h"

namespace ampd::engine {

namespace {

absl::Status CheckHyperparameter(absl::string_view field, const std::optional<float>& value,
                                 bool ok, absl::string_view rule) {
  if (!value.has_value() || ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": must be ", rule, ", got ", *value));
}

// A loss parameter given to a kind that does not read it: refused, as a
// per-token input the loss does not read is (batch_check.cc).
absl::Status RefuseUnread(const std::optional<float>& value, absl::string_view name,
                          LossFnKind reader, LossFnKind kind) {
  if (!value.has_value() || kind == reader) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, ": loss_fn ", LossFnName(kind),
                                                 " does not read it (only ", LossFnName(reader),
                                                 " does); send none"));
}

}  // namespace

absl::Status CheckLossFn(const LossFn& fn) {
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.ppo_clip_low, "ppo_clip_low", LossFnKind::kPpo, fn.kind));
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.ppo_clip_high, "ppo_clip_high", LossFnKind::kPpo, fn.kind));
  AMPD_RETURN_IF_ERROR(
      RefuseUnread(fn.cispo_clip_low, "cispo_clip_low", LossFnKind::kCispo, fn.kind));
  AMPD_RETURN_IF_ERROR(
      RefuseUnread(fn.cispo_clip_high, "cispo_clip_high", LossFnKind::kCispo, fn.kind));
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.dro_beta, "dro_beta", LossFnKind::kDro, fn.kind));
  if (fn.temperature.has_value() && !(std::isfinite(*fn.temperature) && *fn.temperature > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: must be finite and > 0, got ", *fn.temperature));
  }
  const float low = fn.clip_low();
  const float high = fn.clip_high();
  const bool finite = std::isfinite(low) && std::isfinite(high);
  if (fn.kind == LossFnKind::kPpo && !(finite && low >= 0.0f && low <= 1.0f && high >= 1.0f)) {
    // Named after the bound that breaks the order (the low one when both do).
    const bool low_bad = !(std::isfinite(low) && low >= 0.0f && low <= 1.0f);
    return absl::InvalidArgumentError(
        absl::StrCat(low_bad ? "ppo_clip_low" : "ppo_clip_high",
                     ": the ppo clip range must satisfy 0 <= ppo_clip_low <= 1 <= "
                     "ppo_clip_high, got ppo_clip_low ",
                     low, " and ppo_clip_high ", high));
  }
  if (fn.kind == LossFnKind::kCispo && !(finite && low >= 0.0f && low <= high)) {
    const bool low_bad = !(std::isfinite(low) && low >= 0.0f);
    return absl::InvalidArgumentError(
        absl::StrCat(low_bad ? "cispo_clip_low" : "cispo_clip_high",
                     ": the cispo clip range must be finite with 0 <= cispo_clip_low <= "
                     "cispo_clip_high, got cispo_clip_low ",
                     low, " and cispo_clip_high ", high));
  }
  if (fn.kind == LossFnKind::kDro && !(std::isfinite(fn.beta()) && fn.beta() >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dro_beta: must be finite and >= 0, got ", fn.beta()));
  }
  return absl::OkStatus();
}

absl::Status CheckStepInput(const StepInput& input) {
  if (input.micro_batches.empty()) {
    return absl::InvalidArgumentError("micro_batches: at least one micro-batch is required");
  }
  if (input.learning_rate.has_value() &&
      !(std::isfinite(*input.learning_rate) && *input.learning_rate >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("learning_rate: must be finite and >= 0, got ", *input.learning_rate));
  }
  return CheckLossFn(input.loss_fn);
}

absl::Status CheckForwardBackwardInput(const ForwardBackwardInput& input) {
  AMPD_RETURN_IF_ERROR(CheckStepInput(input.batch));
  if (input.batch.learning_rate.has_value()) {
    return absl::InvalidArgumentError(
        "learning_rate: a ForwardBackward call applies nothing; OptimStep carries the learning "
        "rate");
  }
  if (input.micro_batches_in_update < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batches_in_update: must be >= 0, got ", input.micro_batches_in_update));
  }
  return absl::OkStatus();
}

absl::Status CheckOptimStepInput(const OptimStepInput& input) {
  if (input.forward_backward_calls < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward_backward_calls: the ForwardBackward calls this update applies, "
                     "must be >= 1, got ",
                     input.forward_backward_calls));
  }
  auto finite = [](const std::optional<float>& v) { return v.has_value() && std::isfinite(*v); };
  const auto& in = input;
  AMPD_RETURN_IF_ERROR(CheckHyperparameter("learning_rate", in.learning_rate,
                                           finite(in.learning_rate) && *in.learning_rate >= 0.0f,
                                           "finite and >= 0"));
  AMPD_RETURN_IF_ERROR(CheckHyperparameter(
      "beta1", in.beta1, finite(in.beta1) && *in.beta1 >= 0.0f && *in.beta1 < 1.0f, "in [0, 1)"));
  AMPD_RETURN_IF_ERROR(CheckHyperparameter(
      "beta2", in.beta2, finite(in.beta2) && *in.beta2 >= 0.0f && *in.beta2 < 1.0f, "in [0, 1)"));
  AMPD_RETURN_IF_ERROR(
      CheckHyperparameter("eps", in.eps, finite(in.eps) && *in.eps > 0.0f, "finite and > 0"));
  AMPD_RETURN_IF_ERROR(CheckHyperparameter("weight_decay", in.weight_decay,
                                           finite(in.weight_decay) && *in.weight_decay >= 0.0f,
                                           "finite and >= 0"));
  AMPD_RETURN_IF_ERROR(CheckHyperparameter("max_grad_norm", in.max_grad_norm,
                                           finite(in.max_grad_norm), "finite (<= 0: no clipping)"));
  return absl::OkStatus();
}

absl::Status CheckEvaluateInput(const EvaluateInput& input) {
  if (input.micro_batches.empty()) {
    return absl::InvalidArgumentError("micro_batches: at least one micro-batch is required");
  }
  LossFn fn;
  fn.temperature = input.temperature;
  return CheckLossFn(fn);
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

SampleStream SampleStreamOf(const SampleInput& input, int64_t prompt, int64_t sample) {
  const auto p = static_cast<size_t>(prompt);
  if (p < input.prompt_seeds.size() && input.prompt_seeds[p].has_value()) {
    return {*input.prompt_seeds[p], static_cast<uint64_t>(sample)};
  }
  // The request's seed split by position (what every request did before
  // prompts had seeds of their own): stream i x num_samples + j.
  return {input.seed, static_cast<uint64_t>(prompt * input.num_samples + sample)};
}

absl::Status CheckSnapshotName(absl::string_view field, absl::string_view name) {
  const bool safe = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
  if (name.empty() || name.size() > kMaxSnapshotNameBytes || !safe) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": a snapshot name is 1 to ", kMaxSnapshotNameBytes,
        " bytes of [A-Za-z0-9_-], got \"", name.substr(0, kMaxSnapshotNameBytes), "\""));
  }
  return absl::OkStatus();
}

absl::Status CheckRequest(const StepRequest& request) { return CheckStepInput(request.input); }

absl::Status CheckRequest(const ForwardBackwardRequest& request) {
  AMPD_RETURN_IF_ERROR(CheckForwardBackwardInput(request.input));
  if (request.index < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "index: a ForwardBackward call's 1-based position in its update, got ", request.index));
  }
  return absl::OkStatus();
}

absl::Status CheckRequest(const OptimStepRequest& request) {
  return CheckOptimStepInput(request.input);
}

absl::Status CheckRequest(const EvaluateRequest& request) {
  return CheckEvaluateInput(request.input);
}

absl::Status CheckRequest(const SampleRequest& request) {
  AMPD_RETURN_IF_ERROR(CheckSampleInput(request.input));
  if (request.input.snapshot.empty()) return absl::OkStatus();
  return CheckSnapshotName("snapshot", request.input.snapshot);
}

absl::Status CheckRequest(const SaveSamplerSnapshotRequest& request) {
  return request.name.empty() ? absl::OkStatus() : CheckSnapshotName("snapshot", request.name);
}

absl::Status CheckRequest(const DeleteSamplerSnapshotRequest& request) {
  return CheckSnapshotName("snapshot", request.name);
}

}  // namespace ampd::engine
