// Trainer::ForwardBackward and Trainer::OptimStep: a step's two halves as
// separate calls, so that a client can accumulate gradients over several
// calls and then apply them with the hyperparameters of its choice. Both
// run Step's own phases (step.cc): a call is Admit and ForwardBackward with
// the update's first call zeroing what Step zeroes, and the update is
// Apply (the check pass over everything accumulated, the fused update, the
// one read and the scaler's update). Nothing here is a second copy of the
// step, which is why the two halves train exactly as one Step does.
#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

int64_t Trainer::pending_forward_backward() const { return impl_->accumulation.calls; }

void Trainer::DropAccumulated() { impl_->accumulation = Impl::Accumulation(); }

absl::Status Trainer::Impl::ReadCall(const StepInput& input, const StepPlan& plan,
                                     StepReport& report) {
  std::vector<kernels::HostCopy> copies;
  kernels::Tensor logprobs_read;
  if (plan.keep_logprobs) {
    const auto read_rows = static_cast<size_t>(plan.read_rows());
    AMPD_ASSIGN_OR_RETURN(logprobs_read, step_logprobs.View(0, {plan.read_rows()}));
    step_logprobs_host.resize(read_rows);
    copies.push_back({&logprobs_read, step_logprobs_host.data(), read_rows * sizeof(float)});
  }
  const kernels::Tensor* const scalars[1] = {&loss_sum};
  float call_loss = 0.0f;
  AMPD_RETURN_IF_ERROR(backend->ReadBack(scalars, absl::MakeSpan(&call_loss, 1), copies));
  if (plan.keep_logprobs) ReportKeptLogprobs(input, plan, report);
  // The call's own loss: its mean over its micro-batches, or its tokens' sum.
  report.loss = plan.token_loss ? call_loss : call_loss / static_cast<float>(plan.local_k);
  return absl::OkStatus();
}

absl::StatusOr<ForwardBackwardReport> Trainer::ForwardBackward(
    const Valid<ForwardBackwardRequest>& request, const std::function<absl::Status(int64_t)>& admit,
    const CallToken& call) {
  return ForwardBackwardChecked(request->input, admit, call);
}

absl::StatusOr<ForwardBackwardReport> Trainer::ForwardBackward(
    const ForwardBackwardInput& input, const std::function<absl::Status(int64_t)>& admit,
    const CallToken& call) {
  AMPD_RETURN_IF_ERROR(CheckForwardBackwardInput(input));
  return ForwardBackwardChecked(input, admit, call);
}

absl::StatusOr<ForwardBackwardReport> Trainer::ForwardBackwardChecked(
    const ForwardBackwardInput& input, const std::function<absl::Status(int64_t)>& admit,
    const CallToken& call) {
  // The checks against the model; CheckForwardBackwardInput's ran before.
  AMPD_RETURN_IF_ERROR(CheckMicroBatchesFitModel(impl_->config.model, input.batch.loss_fn,
                                                 input.batch.micro_batches));
  AMPD_RETURN_IF_ERROR(CheckLogprobsWanted(impl_->config.model, input.batch.return_logprobs));
  const Clock::time_point start = Clock::now();
  Impl& m = *impl_;
  // Admission's errors leave the accumulated gradients as they were.
  AMPD_ASSIGN_OR_RETURN(const Impl::StepPlan plan,
                        m.Admit(input.batch, admit, nullptr, call, &input));
  StepReport step;
  absl::Status ran = m.ForwardBackward(input.batch, plan, nullptr, call, step);
  if (ran.ok()) ran = m.ReadCall(input.batch, plan, step);
  if (!ran.ok()) {
    // Some of the call's gradients may be in the buffers: what was
    // accumulated is no longer what the calls sent, so none of it counts.
    DropAccumulated();
    return ran;
  }
  if (plan.first) {
    m.accumulation.token_loss = plan.token_loss;
    m.accumulation.k = plan.k;
  }
  ++m.accumulation.calls;
  ForwardBackwardReport report;
  report.loss = step.loss;
  report.loss_scale = plan.scale;
  report.samples = step.samples;
  report.pending = m.accumulation.calls;
  report.seconds = step.seconds;
  report.seconds.total = Seconds(start, Clock::now());
  report.logprobs = std::move(step.logprobs);
  report.ratios = std::move(step.ratios);
  report.token_losses = std::move(step.token_losses);
  report.logprob_mismatch = step.logprob_mismatch;
  return report;
}

absl::StatusOr<StepReport> Trainer::OptimStep(const Valid<OptimStepRequest>& request) {
  return OptimStepChecked(request->input);
}

absl::StatusOr<StepReport> Trainer::OptimStep(const OptimStepInput& input) {
  AMPD_RETURN_IF_ERROR(CheckOptimStepInput(input));
  return OptimStepChecked(input);
}

absl::StatusOr<StepReport> Trainer::OptimStepChecked(const OptimStepInput& input) {
  Impl& m = *impl_;
  const optim::OptimizerSpec& spec = m.config.optimizer;
  if (spec.kind == optim::OptimizerKind::kSgd &&
      (input.beta1.has_value() || input.beta2.has_value() || input.eps.has_value())) {
    return absl::InvalidArgumentError(
        "beta1: betas and eps are Adam's and AdamW's; this job's optimizer is sgd");
  }
  if (m.accumulation.calls == 0) {
    return absl::FailedPreconditionError(
        "forward_backward_calls: no ForwardBackward call is accumulated; there is nothing to "
        "apply");
  }
  const Clock::time_point start = Clock::now();
  // The plan the update's calls ran under: the scaler has not moved since
  // the first of them (only an update moves it), so its scales are theirs.
  Impl::StepPlan plan;
  plan.per_layer = m.config.scaler.per_layer_scales;
  plan.scale = m.scaler.scale();
  plan.token_loss = m.accumulation.token_loss;
  plan.k = m.accumulation.k;
  plan.local_k = plan.k;
  plan.max_grad_norm = input.max_grad_norm.has_value() ? *input.max_grad_norm : spec.max_grad_norm;
  plan.clip = plan.max_grad_norm > 0.0f;
  optim::UpdateOverrides overrides;
  overrides.lr = input.learning_rate;
  overrides.beta1 = input.beta1;
  overrides.beta2 = input.beta2;
  overrides.eps = input.eps;
  overrides.weight_decay = input.weight_decay;
  // Whatever the update's outcome (applied, skipped on an overflow as
  // GradScaler skips it, or an error), the accumulated gradients are spent.
  DropAccumulated();
  StepReport report;
  // The update's loss, summed over its calls in Step's order, goes where
  // the one read looks for a step's.
  AMPD_RETURN_IF_ERROR(m.backend->Copy(m.accum_loss, m.loss_sum));
  AMPD_RETURN_IF_ERROR(m.Apply(overrides, input.sample_grad_histogram, plan, nullptr,
                               /*logprobs_of=*/nullptr, report));
  report.seconds.total = Seconds(start, Clock::now());
  return report;
}

}  // namespace ampd::engine
