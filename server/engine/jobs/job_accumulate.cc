// Job::Run of ForwardBackward calls and OptimStep: the exactly-once rules of
// accumulated calls around the Trainer's two halves of a step. An update
// shares the job's sequence with Step (OptimStep is numbered as a Step
// would be, and its recorded report is the one a resend gets); its calls
// are numbered within it. The accumulated gradients live only in memory,
// so a call that counts on calls the job no longer holds is refused with
// how many to resend, never applied to a partial sum.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "server/engine/jobs/allocation_guard.h"
#include "server/engine/jobs/job.h"

namespace ampd::engine {

namespace {

absl::Status NotDistributed(absl::string_view what) {
  return absl::UnimplementedError(absl::StrCat(
      what, ": not available for distributed jobs; send Step, whose ranks sum the gradients"));
}

absl::Status Lost(absl::string_view message, int64_t lost, int64_t expected_index) {
  return WithReason(
      absl::FailedPreconditionError(message), reason::kAccumulationLost,
      {{"pending_lost", absl::StrCat(lost)}, {"expected_index", absl::StrCat(expected_index)}});
}

}  // namespace

int64_t Job::pending_forward_backward() const {
  return trainer_ != nullptr ? trainer_->pending_forward_backward() : 0;
}

void Job::ReportPending() const {
  if (context_->observer != nullptr) {
    context_->observer->OnAccumulated(id_, pending_forward_backward());
  }
}

absl::StatusOr<std::optional<ForwardBackwardReport>> Job::CheckAccumulation(int64_t sequence,
                                                                            int64_t index) const {
  const JobSnapshot current = Snapshot();
  if (current.state == JobState::kFailed) {
    return WithReason(absl::FailedPreconditionError(
                          absl::StrCat("job ", id_, " has failed (", current.failure,
                                       "); load a good state with LoadStateDict to resume it")),
                      reason::kJobFailed, {{"job_id", id_}});
  }
  const int64_t next = trainer_->steps_run() + 1;
  if (sequence != next) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "sequence: a ForwardBackward call names the update it accumulates for, "
                          "the job's next sequence ",
                          next, ", got ", sequence)),
                      reason::kSequenceMismatch, {{"expected_sequence", absl::StrCat(next)}});
  }
  const int64_t pending = trainer_->pending_forward_backward();
  if (index == pending && pending > 0 && last_call_.has_value() &&
      last_call_->sequence == sequence && last_call_->index == index) {
    return std::optional<ForwardBackwardReport>(*last_call_);
  }
  if (index == pending + 1) return std::nullopt;
  if (index > pending + 1 && accumulation_dropped_) {
    return Lost(
        absl::StrCat("index: this is call ", index, " of update ", sequence, ", but the job holds ",
                     pending, " accumulated call(s): the gradients of calls ", pending + 1, " to ",
                     index - 1,
                     " are lost (the server restarted, a state dict was loaded, or a "
                     "call failed); resend them from index ",
                     pending + 1, ", then this one"),
        index - 1 - pending, pending + 1);
  }
  // Calls accumulate in index order (the sums must be Step's): one that
  // arrived before the call ahead of it is resent once that one is in.
  return WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "index: expected ", pending + 1, " (", pending, " call(s) accumulated for update ",
          sequence, "), got ", index, "; calls accumulate in index order")),
      reason::kSequenceMismatch,
      {{"expected_sequence", absl::StrCat(next)}, {"expected_index", absl::StrCat(pending + 1)}});
}

absl::StatusOr<ForwardBackwardReport> Job::Run(Valid<ForwardBackwardRequest> request,
                                               const CallToken& call) {
  if (trainer_ == nullptr) return NotOpen();
  const int64_t sequence = request->sequence;
  const int64_t index = request->index;
  if (distributed()) return NotDistributed("ForwardBackward");
  AMPD_ASSIGN_OR_RETURN(std::optional<ForwardBackwardReport> recorded,
                        CheckAccumulation(sequence, index));
  if (recorded.has_value()) return *std::move(recorded);
  // An adaptive scaler's calibration may move the scale: not the seed's.
  initial_state_ = false;
  const int64_t pending_before = trainer_->pending_forward_backward();
  absl::StatusOr<ForwardBackwardReport> report =
      WithWorkspace("ForwardBackward", [&](const std::function<absl::Status(int64_t)>& admit) {
        return trainer_->ForwardBackward(request, admit, call);
      });
  if (!report.ok()) {
    // Dropped by the Trainer when the call failed after admission.
    if (trainer_->pending_forward_backward() == 0) {
      last_call_.reset();
      if (pending_before > 0) accumulation_dropped_ = true;
    }
    ReportPending();
    return report.status();
  }
  accumulation_dropped_ = false;
  report->sequence = sequence;
  report->index = index;
  last_call_ = *report;
  {
    absl::MutexLock lock(&mu_);
    RefreshSnapshot();  // an adaptive scaler's calibrated scale
  }
  ReportPending();
  return report;
}

absl::StatusOr<StepReport> Job::Run(Valid<OptimStepRequest> request, const CallToken& /*call*/) {
  if (trainer_ == nullptr) return NotOpen();
  if (distributed()) return NotDistributed("OptimStep");
  const int64_t sequence = request->sequence;
  const int64_t every = context_->grad_histogram_every;
  request.set_sample_grad_histogram(every > 0 && sequence % every == 0);
  AMPD_ASSIGN_OR_RETURN(std::optional<StepReport> recorded, CheckSequence(sequence));
  if (recorded.has_value()) return *std::move(recorded);
  const int64_t pending = trainer_->pending_forward_backward();
  const int64_t sent = request->input.forward_backward_calls;
  if (sent > pending && (accumulation_dropped_ || pending == 0)) {
    return Lost(absl::StrCat("forward_backward_calls: update ", sequence, " applies ", sent,
                             " call(s), but the job holds ", pending, ": the gradients of calls ",
                             pending + 1, " to ", sent,
                             " are lost (the server restarted, a state dict was loaded, or a "
                             "call failed); resend them, then OptimStep"),
                sent - pending, pending + 1);
  }
  if (sent != pending) {
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat("forward_backward_calls: the job holds ",
                                                   pending, " accumulated call(s) for update ",
                                                   sequence, ", the request applies ", sent)),
        reason::kSequenceMismatch,
        {{"expected_sequence", absl::StrCat(sequence)}, {"pending", absl::StrCat(pending)}});
  }
  absl::StatusOr<StepReport> report = RunUpdate(
      sequence, "OptimStep",
      [&](const std::function<absl::Status(int64_t)>&) { return trainer_->OptimStep(request); },
      nullptr);
  if (trainer_ != nullptr && trainer_->pending_forward_backward() == 0) last_call_.reset();
  if (report.ok()) accumulation_dropped_ = false;
  ReportPending();
  return report;
}

}  // namespace ampd::engine
