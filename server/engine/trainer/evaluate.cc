// Trainer::Evaluate: a validation loss on the job's current weights.
//
// Per micro-batch: upload, forward on the working copy, loss, Add into
// loss_sum on the device; then one ReadScalars of loss_sum. It runs the
// same model calls as Step's forward half (LoadBatch, Forward, then
// EvalLoss, the loss Step's Loss computes without any parameter gradient)
// in the same order, so it reports exactly the loss a Step on the same
// batches would report now (Step reports the loss before its update).
// With return_logprobs, each micro-batch's per-token log-probs (the LM
// head's own, as the training forward computes them) are copied back after
// its loss. Backward is never called, so no parameter gradient, no master or working
// weight, no optimizer buffer and no scaler state changes, and neither does
// the step count or the applied count.
#include <chrono>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

absl::StatusOr<EvaluateReport> Trainer::Evaluate(const Valid<EvaluateRequest>& request,
                                                 const std::function<absl::Status(int64_t)>& admit,
                                                 const CallToken& call) {
  return EvaluateChecked(request->input, admit, call);
}

absl::StatusOr<EvaluateReport> Trainer::Evaluate(const EvaluateInput& input,
                                                 const std::function<absl::Status(int64_t)>& admit,
                                                 const CallToken& call) {
  AMPD_RETURN_IF_ERROR(CheckEvaluateInput(input));
  return EvaluateChecked(input, admit, call);
}

absl::StatusOr<EvaluateReport> Trainer::EvaluateChecked(
    const EvaluateInput& input, const std::function<absl::Status(int64_t)>& admit,
    const CallToken& call) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Impl& m = *impl_;
  // The one check that needs the model; CheckEvaluateInput ran before.
  // The model's own loss, at the input's temperature.
  LossFn loss_fn;
  loss_fn.temperature = input.temperature;
  AMPD_RETURN_IF_ERROR(CheckMicroBatchesFitModel(m.config.model, loss_fn, input.micro_batches));
  AMPD_RETURN_IF_ERROR(CheckLogprobsWanted(m.config.model, input.return_logprobs));
  kernels::Backend& b = *m.backend;
  model::Network& net = *m.model;
  AMPD_RETURN_IF_ERROR(
      m.AdmitWorkspaces(input.micro_batches, admit, "evaluation", /*backward=*/false));

  EvaluateReport report;
  const auto k = static_cast<int64_t>(input.micro_batches.size());
  AMPD_RETURN_IF_ERROR(b.Fill(m.loss_sum, 0.0f));
  model::TokenLossInputs tokens;
  tokens.fn = loss_fn;
  tokens.logprobs = input.return_logprobs;
  for (int64_t i = 0; i < k; ++i) {
    AMPD_RETURN_IF_ERROR(
        call.Check(absl::StrCat("the evaluation stopped before micro-batch ", i, " of ", k)));
    const MicroBatch& mb = input.micro_batches[static_cast<size_t>(i)];
    report.samples += mb.inputs.shape[0];
    AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, m.WorkspaceFor(mb.inputs.shape));
    AMPD_RETURN_IF_ERROR(net.LoadBatch(mb.inputs, mb.targets, tokens, *ws));
    AMPD_RETURN_IF_ERROR(net.Forward(*ws));
    AMPD_RETURN_IF_ERROR(net.EvalLoss(*ws, m.loss));
    AMPD_RETURN_IF_ERROR(b.Add(m.loss, m.loss_sum));
    if (input.return_logprobs) {
      // The next micro-batch of this shape reuses the workspace: its
      // log-probs are read back now (one copy per micro-batch).
      AMPD_ASSIGN_OR_RETURN(const kernels::Tensor* logprobs, net.TokenLogprobs(*ws));
      HostTensor out;
      out.dtype = codec::DType::kF32;
      out.shape = mb.targets.shape;
      out.data.resize(logprobs->nbytes());
      AMPD_RETURN_IF_ERROR(b.CopyToHost(*logprobs, out.data.data(), out.data.size()));
      report.logprobs.push_back(std::move(out));
    }
  }
  const kernels::Tensor* const scalars[1] = {&m.loss_sum};
  float host[1] = {0};  // [loss sum]
  AMPD_RETURN_IF_ERROR(b.ReadScalars(scalars, host));
  report.loss = host[0] / static_cast<float>(k);
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace ampd::engine
