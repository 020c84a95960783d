// A step's per-token log-probs on the host: what Step reports of the
// (tokens) F32 log-probs its forward wrote and its one ReadBack brought
// back (step.cc copies each micro-batch's into one device buffer, in input
// order). From them, per micro-batch of targets (B, T):
//   logprobs  (B, T) F32, as the head wrote them (0 where ignored);
//   ratios    (B, T) F32 exp(logp - q) for a loss with sampling_logprobs q;
//   mismatch  max |logp - q| over every kept target token of the step;
//   token_losses (B, T) F32, what each token added to the loss, as the head
//             wrote them (0 where ignored), when the step read them back.
// The mismatch is what an RL loop watches: on samples drawn from the same
// weights it is the sampler-trainer disagreement, which a batch-invariant
// job holds at exactly 0.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "server/engine/model/lm_head.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

namespace {

// A (B, T) F32 host tensor of `shape` holding values [0, n).
HostTensor F32Tensor(const kernels::Shape& shape, const float* values, int64_t n) {
  HostTensor t;
  t.dtype = kernels::DType::kF32;
  t.shape = shape;
  t.data.resize(static_cast<size_t>(n) * sizeof(float));
  std::memcpy(t.data.data(), values, t.data.size());
  return t;
}

}  // namespace

absl::Status CheckLogprobsWanted(const model::ModelSpec& spec, bool return_logprobs) {
  if (return_logprobs && !model::IsSequenceModel(spec)) {
    return absl::InvalidArgumentError(
        "return_logprobs: per-token log-probs need a language model (gpt or decoder)");
  }
  return absl::OkStatus();
}

void ReportStepLogprobs(const StepInput& input, absl::Span<const float> logprobs,
                        absl::Span<const float> losses, StepReport& report) {
  const bool with_q = ReadsSamplingLogprobs(input.loss_fn.kind);
  float mismatch = 0.0f;
  bool saw_nan = false;  // a NaN log-prob reports NaN, which fmax would drop
  std::vector<float> ratios;
  size_t offset = 0;
  for (const MicroBatch& mb : input.micro_batches) {
    const int64_t n = kernels::NumElements(mb.targets.shape);  // B*T
    const float* lp = logprobs.data() + offset;
    if (!losses.empty()) {
      report.token_losses.push_back(F32Tensor(mb.targets.shape, losses.data() + offset, n));
    }
    offset += static_cast<size_t>(n);
    if (input.return_logprobs) report.logprobs.push_back(F32Tensor(mb.targets.shape, lp, n));
    if (!with_q || !mb.sampling_logprobs.has_value()) continue;
    const char* q = mb.sampling_logprobs->data.data();  // the client's bytes: no alignment
    ratios.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      if (model::TokenIdAt(mb.targets, i) == model::kIgnoreIndex) continue;
      float qi = 0.0f;
      std::memcpy(&qi, q + i * 4, sizeof(float));
      const float delta = lp[i] - qi;
      // The same fp32 expression kernels/token_loss.h evaluates.
      ratios[static_cast<size_t>(i)] = std::exp(delta);
      if (std::isnan(delta)) {
        saw_nan = true;
      } else {
        mismatch = std::fmax(mismatch, std::fabs(delta));
      }
    }
    if (input.return_logprobs) {
      report.ratios.push_back(F32Tensor(mb.targets.shape, ratios.data(), n));
    }
  }
  if (with_q) report.logprob_mismatch = saw_nan ? std::nanf("") : mismatch;
}

void Trainer::Impl::ReportKeptLogprobs(const StepInput& input, const StepPlan& plan,
                                       StepReport& report) const {
  const auto tokens = static_cast<size_t>(plan.tokens);
  const absl::Span<const float> read(step_logprobs_host.data(),
                                     static_cast<size_t>(plan.read_rows()));
  ReportStepLogprobs(input, read.subspan(0, tokens),
                     plan.keep_losses ? read.subspan(tokens) : absl::Span<const float>(), report);
}

}  // namespace ampd::engine
