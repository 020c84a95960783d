// Trainer::Step: one mixed-precision training step on a Backend, as phases
// (trainer_impl.h lists them in order: Admit, ForwardBackward, then Apply's
// CheckGradients, Update and Finish), which accumulate.cc also runs as two
// calls: a Step is the update whose only forward and backward is its own,
// which is why the two forms train the same bits. Why the phases are what
// they are:
// - One device->host round trip per step. The loss sum, found_inf, norm^2
//   and each group's max|g| stay on the device, each in its own (1, 1) F32
//   tensor (a non-finite loss never reaches found_inf: the scaler skips on
//   bad gradients, not a bad loss), and Finish's one ReadBack brings them
//   with the sampled histograms and the kept per-token log-probs and losses.
// - The check pass (UnscaleAndCheck) reads every gradient, not in place:
//   16-bit gradients must not be unscaled in 16 bits, and for fp32 ones the
//   fused update's own unscale saves a write pass. Since it reads them all,
//   it also gives the norm every step reports, and max|g|. The fused update
//   reads found_inf on the device and writes nothing on a skipped step.
// - Micro-batch k's loss gradient carries S / K (S for a token loss, a
//   sum), so K micro-batches give one big batch's gradient times S; Linear
//   gradients are written (beta = 0) by the first and added to by the rest
//   (beta = 1: an inf survives accumulation), the others zeroed once.
// - A distributed rank sums the gradients as backward finishes them (the
//   sums overlap the rest of the backward) and the loss with found_inf
//   after the check pass: both before the update, so a rank that dies
//   mid-step leaves the others with nothing applied. On CUDA the sums are
//   NCCL kernels on the job's stream: still no host wait before the read.
// - Per-layer scales (amp/grad_scaler.h): the backward moves the upstream
//   gradient to each group's S_g as it crosses into it (no extra pass); each
//   group is checked and updated with its own 1 / S_g, found_inf and the
//   norm shared, and its entry gradient checked as it completes
//   (GroupEntryCheck), so its max|g| bounds what flows through it.
// - The CallToken is checked before the step, before each micro-batch (a
//   calibration pass's too) and before the update, the last point where a
//   stopped step returns with nothing applied; a distributed share only
//   before it starts (leaving the collectives part-way would fail the
//   others). An adaptive scaler's first step calibrates first
//   (calibrate.cc), so the step starts at the calibrated scale.
// Bytes per parameter (AdamW, fp16 or bf16 grads; m, v, master F32): the
// check reads the grad (2 B); the update reads grad, master, m, v (14 B)
// and writes master, m, v and the working copy (14 B): 30 B against the
// 28 B minimum, +7%, the price of knowing found_inf before anything is
// written (a skipped step moves 2 B). fp32: 32 B against 28 B; SGD with
// momentum in fp16: 22 B against 20 B.
// Timing: PhaseSeconds are steady_clock intervals around the host calls:
// real on the CPU backend; on CUDA, launch times, but `total`, which ends
// after the read that waits for the device, is wall time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/amp/adaptive_policy.h"
#include "server/engine/model/batch_check.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::Tensor;
using Clock = std::chrono::steady_clock;

namespace {

// Positions in the step's one ReadBack; group g's max_abs is at
// kReadMaxAbs + g.
constexpr int kReadLossSum = 0;
constexpr int kReadFoundInf = 1;
constexpr int kReadNormSq = 2;
constexpr int kReadMaxAbs = 3;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Whether the step's caller still waits for it, between two units of work
// (call_token.h). A distributed step's share runs to its end: a rank that
// left the collectives part-way would fail its group's other ranks.
absl::Status CheckCall(const CallToken& call, const DataParallelStep* data_parallel,
                       absl::string_view where) {
  if (data_parallel != nullptr) return absl::OkStatus();
  return call.Check(absl::StrCat("the step stopped ", where, "; nothing was applied"));
}

}  // namespace

absl::Status CheckMicroBatchesFitModel(const model::ModelSpec& spec, const LossFn& loss_fn,
                                       const std::vector<MicroBatch>& micro_batches) {
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const MicroBatch& mb = micro_batches[i];
    const std::string prefix = absl::StrCat("micro_batches[", i, "]");
    AMPD_RETURN_IF_ERROR(model::CheckBatchFitsModel(spec, mb.inputs, mb.targets,
                                                    absl::StrCat(prefix, ".inputs"),
                                                    absl::StrCat(prefix, ".targets")));
    AMPD_RETURN_IF_ERROR(model::CheckTokenLossInputs(spec, loss_fn, mb, prefix));
  }
  return absl::OkStatus();
}

namespace {

// A refusal of the registry's admission (which words it for a step) named
// for the call that asked: its field and advice in place of a step's,
// every payload (the ErrorInfo's reason and facts) kept.
absl::Status NamedFor(const absl::Status& refused, MemoryField names) {
  const MemoryField step = kStepMemory;
  if (refused.ok() || names.field == step.field) return refused;
  std::string message(refused.message());
  const std::string prefix = absl::StrCat(step.field, ": ");
  if (absl::StartsWith(message, prefix)) {
    message = absl::StrCat(names.field, ": ", message.substr(prefix.size()));
  }
  message = absl::StrReplaceAll(message, {{step.advice, names.advice}});
  absl::Status named(refused.code(), message);
  refused.ForEachPayload([&named](absl::string_view url, const absl::Cord& payload) {
    named.SetPayload(url, payload);
  });
  return named;
}

}  // namespace

absl::Status Trainer::Impl::AdmitWorkspaces(const std::vector<MicroBatch>& micro_batches,
                                            const std::function<absl::Status(int64_t)>& admit,
                                            absl::string_view what, bool backward,
                                            int64_t extra_bytes, MemoryField names,
                                            const kernels::ScratchExtents& also) {
  kernels::Backend& b = *backend;
  model::Network& net = *model;
  // The workspace of every distinct batch shape, whether cached already or
  // not (a limit shared with other jobs must see what this job holds
  // while it runs).
  std::vector<kernels::Shape> shapes;
  for (const MicroBatch& mb : micro_batches) {
    const kernels::Shape& shape = mb.inputs.shape;
    if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
  }
  net.KeepWorkspaces(shapes);
  int64_t need = 0;
  // The backend's scratch is reused by every size: the largest extents,
  // and those of what the call runs beside the micro-batches.
  kernels::ScratchExtents extents = also;
  extents.dtype = model::WorkingDType(config.precision);
  for (const kernels::Shape& shape : shapes) {
    AMPD_ASSIGN_OR_RETURN(const int64_t bytes,
                          model::WorkspaceBytes(config.model, config.precision, shape));
    need = SaturatingAdd(need, bytes);
    model::WidenExtents(model::StepScratchExtents(config.model, config.precision, shape, backward),
                        extents);
  }
  // What the ops hold beside the workspace tensors (fp32 staging, per-thread
  // rows, the allocator's rounding): counted, or a step admitted at its
  // estimate would still grow the process past the limit.
  const int64_t scratch = b.ScratchBytes(extents, need);
  need = SaturatingAdd(need, scratch);
  need = SaturatingAdd(need, extra_bytes);
  const int64_t capacity = b.MemoryCapacityBytes();
  const int64_t to_allocate = need - net.cached_workspace_bytes();
  if (capacity > 0 && SaturatingAdd(b.BytesInUse(), to_allocate) > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat(names.field, ": the ", what, " needs an estimated ", need,
                     " bytes of activation and workspace memory for its sizes, and with the ",
                     b.BytesInUse(), " bytes the job holds that exceeds the ", capacity,
                     " bytes of ", b.name(), "; ", names.advice));
  }
  if (admit) AMPD_RETURN_IF_ERROR(NamedFor(admit(need), names));
  // The scratch only grows (to the largest sizes run) until released.
  scratch_bytes = std::max(scratch_bytes, scratch);
  return absl::OkStatus();
}

absl::StatusOr<model::Workspace*> Trainer::Impl::WorkspaceFor(const kernels::Shape& shape) {
  absl::StatusOr<model::Workspace*> ws = model->GetWorkspace(shape);
  if (ws.ok() || ws.status().code() != absl::StatusCode::kResourceExhausted || !relieve_memory) {
    return ws;
  }
  // Admitted, yet the device (or host) is short: memory other jobs keep
  // cached is the likely holder. A failed allocation left nothing behind.
  relieve_memory();
  return model->GetWorkspace(shape);
}

model::Network::GroupEntry Trainer::Impl::GroupEntryCheck() {
  return [this](int group, Tensor& entry) -> absl::Status {
    const auto g = static_cast<size_t>(group);
    if (g >= groups.size()) {
      return absl::InternalError(absl::StrCat("per_layer_scales: the model reported group ", group,
                                              " of ", groups.size()));
    }
    Tensor* const entries[1] = {&entry};
    const float inv_scale = static_cast<float>(1.0 / static_cast<double>(group_scales[g]));
    return backend->UnscaleAndCheck(entries, inv_scale, /*in_place=*/false, found_inf,
                                    /*norm_sq=*/nullptr, &groups[g].max_abs);
  };
}

std::vector<Tensor*> Trainer::gradient_tensors() { return impl_->grads; }

absl::StatusOr<FittedStepInput> Trainer::CheckInput(const Valid<StepRequest>& request) const {
  const StepInput& input = request->input;
  AMPD_RETURN_IF_ERROR(
      CheckMicroBatchesFitModel(impl_->config.model, input.loss_fn, input.micro_batches));
  AMPD_RETURN_IF_ERROR(CheckLogprobsWanted(impl_->config.model, input.return_logprobs));
  return FittedStepInput(&input, this);
}

absl::StatusOr<Trainer::Impl::StepPlan> Trainer::Impl::Admit(
    const StepInput& input, const std::function<absl::Status(int64_t)>& admit,
    const DataParallelStep* data_parallel, const CallToken& call,
    const ForwardBackwardInput* accumulating) {
  StepPlan plan;
  plan.accumulate = accumulating != nullptr;
  plan.first = accumulating == nullptr || accumulation.calls == 0;
  plan.token_loss = input.loss_fn.kind != LossFnKind::kModel;
  // Each token's log-prob is kept for the report, or for the mismatch a
  // loss with sampling_logprobs reports; a token loss's per-token losses
  // for the report.
  plan.keep_logprobs = input.return_logprobs || ReadsSamplingLogprobs(input.loss_fn.kind);
  plan.keep_losses = input.return_logprobs && plan.token_loss;
  int64_t logprob_bytes = 0;
  const int64_t held = step_logprobs_held();
  if (plan.keep_logprobs) {
    // Validated batches: each B*T is a language model's, well inside int64.
    for (const MicroBatch& mb : input.micro_batches) {
      plan.tokens = SaturatingAdd(plan.tokens, kernels::NumElements(mb.targets.shape));
    }
    // The device buffer when it must grow, its host twin, and the report's
    // log-probs and ratios (and losses).
    const int64_t rows = plan.read_rows();
    const int64_t grow = std::max<int64_t>(0, rows - held);
    const int64_t host = SaturatingAdd(rows, SaturatingMul(plan.keep_losses ? 3 : 2, plan.tokens));
    logprob_bytes = SaturatingMul(SaturatingAdd(grow, host), 4);
  }
  // Admission before allocation. The step's buffers stay cached after it,
  // counted (workspace_bytes) until the job gives them up.
  AMPD_RETURN_IF_ERROR(
      AdmitWorkspaces(input.micro_batches, admit, "step", /*backward=*/true, logprob_bytes));
  if (plan.keep_logprobs && held < plan.read_rows()) {
    step_logprobs = kernels::Tensor();  // the smaller one goes before the larger comes
    AMPD_ASSIGN_OR_RETURN(step_logprobs,
                          backend->Allocate(kernels::DType::kF32, {plan.read_rows()}));
  }
  plan.per_layer = config.scaler.per_layer_scales;
  if (plan.per_layer && data_parallel != nullptr) {
    // Validation refuses the config; a Trainer handed one anyway must not
    // train ranks whose group scales were never reduced.
    return absl::InvalidArgumentError(
        "scaler.per_layer_scales: not available for distributed jobs");
  }
  // Calibration runs a backward of its own over the gradient buffers: only
  // before the update's first forward and backward.
  if (plan.first && scaler.NeedsCalibration()) {
    AMPD_RETURN_IF_ERROR(CalibrateLossScale(input, data_parallel, call));
  }
  if (plan.per_layer) {
    for (size_t g = 0; g < groups.size(); ++g) {
      group_scales[g] = scaler.layer_scale(static_cast<int64_t>(g));
    }
    AMPD_RETURN_IF_ERROR(model->SetGroupScales(group_scales));
  }
  // The loss gradient's scale: the job's, or the last layer group's.
  plan.scale = scaler.scale();
  plan.local_k = static_cast<int64_t>(input.micro_batches.size());
  // A distributed step's K counts every rank's micro-batches: the sum of
  // the ranks' gradients is then the whole batch's.
  plan.k = data_parallel != nullptr ? data_parallel->global_micro_batches : plan.local_k;
  // A ForwardBackward call's mean is over the update's micro-batches.
  if (accumulating != nullptr && accumulating->micro_batches_in_update > 0) {
    plan.k = accumulating->micro_batches_in_update;
  }
  // d(S * mean_k L_k)/dw: each micro-batch's loss gradient carries S / K;
  // a token loss sums over every micro-batch's tokens, so S alone, on every
  // rank too: the ranks' summed gradients are then the whole batch's sum,
  // and their summed loss_sum (CheckGradients) the loss over every token.
  // The job's ranks agree on loss_fn before the step (job_distributed.cc).
  plan.grad_scale = plan.token_loss ? plan.scale : plan.scale / static_cast<float>(plan.k);
  plan.max_grad_norm = config.optimizer.max_grad_norm;
  plan.clip = plan.max_grad_norm > 0.0f;
  return plan;
}

float Trainer::Impl::InvScale(const StepPlan& plan, size_t group) const {
  const float s = plan.per_layer ? group_scales[group] : plan.scale;
  return static_cast<float>(1.0 / static_cast<double>(s));
}

absl::Status Trainer::Impl::ForwardBackward(const StepInput& input, const StepPlan& plan,
                                            const DataParallelStep* data_parallel,
                                            const CallToken& call, StepReport& report) {
  kernels::Backend& b = *backend;
  model::Network& net = *model;
  AMPD_RETURN_IF_ERROR(ZeroScalars(plan));

  // A distributed step starts summing each parameter's gradient as the last
  // micro-batch's backward finishes it, so the sums overlap the rest of the
  // backward pass; whatever is still running, or a model did not report, is
  // started and finished right after it. A step that ends early still
  // finishes what it started (SumsInFlight), so no collective outlives it.
  dist::GradientAllReduce* const all_reduce =
      data_parallel != nullptr ? data_parallel->all_reduce : nullptr;
  SumsInFlight in_flight{all_reduce};
  // Every micro-batch's backward checks the groups' entry gradients; the
  // last one's also starts the sums.
  model::Network::BackwardHooks hooks;
  if (plan.per_layer) hooks.group_entry = GroupEntryCheck();
  model::Network::BackwardHooks last_hooks = hooks;
  if (all_reduce != nullptr) last_hooks.grads_ready = SumWhenReady(*all_reduce);

  int64_t logprobs_at = 0;  // where the next micro-batch's log-probs go in step_logprobs
  for (int64_t i = 0; i < plan.local_k; ++i) {
    // Gradients accumulated so far are zeroed by the next step: only the
    // update changes the job.
    AMPD_RETURN_IF_ERROR(CheckCall(call, data_parallel,
                                   absl::StrCat("before micro-batch ", i, " of ", plan.local_k)));
    const MicroBatch& mb = input.micro_batches[static_cast<size_t>(i)];
    report.samples += mb.inputs.shape[0];
    AMPD_ASSIGN_OR_RETURN(auto* ws, WorkspaceFor(mb.inputs.shape));
    const Clock::time_point t0 = Clock::now();
    model::TokenLossInputs tokens = model::TokenLossInputs::Of(input.loss_fn, mb);
    tokens.logprobs = plan.keep_logprobs;
    tokens.token_losses = plan.keep_losses;
    AMPD_RETURN_IF_ERROR(net.LoadBatch(mb.inputs, mb.targets, tokens, *ws));
    AMPD_RETURN_IF_ERROR(net.Forward(*ws));
    // The head's gradient, like Backward's Linear ones, is written by the
    // update's first micro-batch and added to by the rest.
    AMPD_RETURN_IF_ERROR(
        net.Loss(*ws, plan.grad_scale, /*first_micro_batch=*/plan.first && i == 0, loss));
    AMPD_RETURN_IF_ERROR(b.Add(loss, loss_sum));
    if (plan.accumulate) AMPD_RETURN_IF_ERROR(b.Add(loss, accum_loss));
    if (plan.keep_logprobs) AMPD_RETURN_IF_ERROR(KeepTokenValues(*ws, plan, &logprobs_at));
    const Clock::time_point t1 = Clock::now();
    const bool last = i == plan.local_k - 1;
    // Linear grads are written (beta = 0) by the update's first micro-batch
    // and added to by every later one, in this call or a later one.
    AMPD_RETURN_IF_ERROR(
        net.Backward(*ws, /*first_micro_batch=*/plan.first && i == 0, last ? last_hooks : hooks));
    const Clock::time_point t2 = Clock::now();
    report.seconds.forward += Seconds(t0, t1);
    report.seconds.backward += Seconds(t1, t2);
  }

  if (all_reduce != nullptr) {
    // The communication backward did not hide: what a rank waits here.
    const Clock::time_point t0 = Clock::now();
    ready_grads.clear();
    for (size_t p = 0; p < grads.size(); ++p) {
      if (grad_started[p] == 0) ready_grads.push_back(grads[p]);
    }
    AMPD_RETURN_IF_ERROR(all_reduce->Start(ready_grads));
    AMPD_RETURN_IF_ERROR(in_flight.Finish());
    report.seconds.allreduce += Seconds(t0, Clock::now());
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::ZeroScalars(const StepPlan& plan) {
  kernels::Backend& b = *backend;
  if (plan.first) {
    // The update starts: what earlier calls accumulated is applied or
    // dropped by now.
    AMPD_RETURN_IF_ERROR(model->ZeroGrads());
    AMPD_RETURN_IF_ERROR(b.Fill(found_inf, 0.0f));
    AMPD_RETURN_IF_ERROR(b.Fill(norm_sq, 0.0f));
    for (ScaleGroup& g : groups) AMPD_RETURN_IF_ERROR(b.Fill(g.max_abs, 0.0f));
    if (plan.accumulate) AMPD_RETURN_IF_ERROR(b.Fill(accum_loss, 0.0f));
  }
  return b.Fill(loss_sum, 0.0f);
}

model::Network::GradsReady Trainer::Impl::SumWhenReady(dist::GradientAllReduce& all_reduce) {
  std::fill(grad_started.begin(), grad_started.end(), 0);
  return [this, &all_reduce](absl::Span<const int> params) -> absl::Status {
    ready_grads.clear();
    for (const int p : params) {
      const int slot = slot_of[static_cast<size_t>(p)];  // -1: frozen, nothing to sum
      if (slot < 0 || grad_started[static_cast<size_t>(slot)] != 0) continue;
      grad_started[static_cast<size_t>(slot)] = 1;
      ready_grads.push_back(grads[static_cast<size_t>(slot)]);
    }
    return all_reduce.Start(ready_grads);
  };
}

absl::Status Trainer::Impl::KeepTokenValues(model::Workspace& ws, const StepPlan& plan,
                                            int64_t* at) {
  // A later micro-batch of this shape reuses the workspace: its log-probs
  // (and losses, plan.tokens further on) move to the step's buffer now, on
  // the device.
  AMPD_ASSIGN_OR_RETURN(const Tensor* logprobs, model->TokenLogprobs(ws));
  AMPD_ASSIGN_OR_RETURN(Tensor slot, step_logprobs.View(*at, {logprobs->numel()}));
  AMPD_RETURN_IF_ERROR(backend->Copy(*logprobs, slot));
  if (plan.keep_losses) {
    AMPD_ASSIGN_OR_RETURN(const Tensor* losses, model->TokenLosses(ws));
    AMPD_ASSIGN_OR_RETURN(Tensor loss_slot,
                          step_logprobs.View(plan.tokens + *at, {losses->numel()}));
    AMPD_RETURN_IF_ERROR(backend->Copy(*losses, loss_slot));
  }
  *at += logprobs->numel();
  return absl::OkStatus();
}

absl::Status Trainer::Impl::Apply(const optim::UpdateOverrides& overrides,
                                  bool sample_grad_histogram, const StepPlan& plan,
                                  const DataParallelStep* data_parallel,
                                  const StepInput* logprobs_of, StepReport& report) {
  AMPD_RETURN_IF_ERROR(CheckGradients(sample_grad_histogram, plan, data_parallel, report));
  AMPD_RETURN_IF_ERROR(Update(overrides, plan, report));
  return Finish(sample_grad_histogram, plan, logprobs_of, report);
}

absl::Status Trainer::Impl::CheckGradients(bool sample_grad_histogram, const StepPlan& plan,
                                           const DataParallelStep* data_parallel,
                                           StepReport& report) {
  kernels::Backend& b = *backend;
  if (sample_grad_histogram) {
    // On the scaled grads: what the operator needs to see is where the
    // values sit relative to fp16's range, i.e. what was actually stored.
    // One histogram per scale group, so each group's underflow is its own.
    for (ScaleGroup& g : groups) {
      AMPD_RETURN_IF_ERROR(
          b.CopyFromHost(zero_bins.data(), zero_bins.size() * sizeof(int64_t), g.histogram));
      AMPD_RETURN_IF_ERROR(b.GradLog2Histogram(g.const_grads, g.histogram));
    }
  }
  const Clock::time_point t0 = Clock::now();
  // found_inf is only ever set and norm_sq only added to, so the groups'
  // calls share them: the norm is the global one clipping needs.
  for (size_t g = 0; g < groups.size(); ++g) {
    AMPD_RETURN_IF_ERROR(b.UnscaleAndCheck(groups[g].grads, InvScale(plan, g), /*in_place=*/false,
                                           found_inf, &norm_sq, &groups[g].max_abs));
  }
  report.seconds.unscale = Seconds(t0, Clock::now());
  if (data_parallel != nullptr) {
    // The whole batch's loss, and found_inf as a sum of the ranks' flags
    // (non-zero when any is: MAX and SUM agree on 0/1 flags, and one
    // collective carries both). The ranks checked the same summed gradients,
    // so the flags agree already; summing them makes the skip a decision of
    // the group even so. The last collective before anything is applied.
    const Clock::time_point t1 = Clock::now();
    Tensor* const scalars[2] = {&loss_sum, &found_inf};
    AMPD_RETURN_IF_ERROR(data_parallel->all_reduce->Sum(scalars));
    report.seconds.allreduce += Seconds(t1, Clock::now());
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::Update(const optim::UpdateOverrides& overrides, const StepPlan& plan,
                                   StepReport& report) {
  const Clock::time_point t0 = Clock::now();
  // A disabled scaler (PyTorch's enabled=False) never skips, so the update
  // reads a found_inf that is always 0.
  kernels::GradTransform transform;
  transform.found_inf = config.scaler.enabled ? &found_inf : &no_inf;
  transform.norm_sq = plan.clip ? &norm_sq : nullptr;
  transform.max_grad_norm = plan.max_grad_norm;
  // The schedule's lr for the updates applied so far (a skipped step does
  // not advance it), unless the request overrides it.
  report.learning_rate =
      overrides.lr.has_value()
          ? *overrides.lr
          : optim::ScheduledLearningRate(config.optimizer, optimizer.applied_steps());
  optim::UpdateOverrides applied = overrides;
  applied.lr = report.learning_rate;
  // Each group's update with its own 1 / S_g; the optimizer's step count
  // is advanced once, after the read (Finish).
  for (size_t g = 0; g < groups.size(); ++g) {
    transform.inv_scale = InvScale(plan, g);
    AMPD_RETURN_IF_ERROR(optimizer.Apply(*backend, groups[g].refs, applied, transform));
  }
  report.seconds.optimizer = Seconds(t0, Clock::now());
  return absl::OkStatus();
}

absl::Status Trainer::Impl::Finish(bool sample_grad_histogram, const StepPlan& plan,
                                   const StepInput* logprobs_of, StepReport& report) {
  // One read brings the scalars, the histograms when sampled, and the
  // step's per-token log-probs (and losses) when kept.
  const bool keep_logprobs = plan.keep_logprobs && logprobs_of != nullptr;
  std::vector<kernels::HostCopy> copies;
  if (sample_grad_histogram) {
    copies.reserve(groups.size());
    for (ScaleGroup& g : groups) {
      copies.push_back({&g.histogram, g.bins.data(), g.bins.size() * sizeof(int64_t)});
    }
  }
  Tensor logprobs_read;
  const auto read_rows = static_cast<size_t>(plan.read_rows());
  if (keep_logprobs) {
    AMPD_ASSIGN_OR_RETURN(logprobs_read, step_logprobs.View(0, {plan.read_rows()}));
    step_logprobs_host.resize(read_rows);
    copies.push_back({&logprobs_read, step_logprobs_host.data(), read_rows * sizeof(float)});
  }
  const std::vector<float>& host = read_values;
  AMPD_RETURN_IF_ERROR(backend->ReadBack(read_scalars, absl::MakeSpan(read_values), copies));
  if (keep_logprobs) ReportKeptLogprobs(*logprobs_of, plan, report);
  const bool overflowed = host[kReadFoundInf] != 0.0f;
  amp::StepGradStats stats;
  stats.found_inf = overflowed;
  float max_abs = 0.0f;
  for (size_t g = 0; g < groups.size(); ++g) {
    // Exact, whatever the grouping: a max never rounds (fmax keeps inf).
    max_abs = std::fmax(max_abs, host[kReadMaxAbs + g]);
    if (plan.per_layer) stats.layer_max_abs.push_back(host[kReadMaxAbs + g]);
  }
  stats.max_abs = max_abs;
  if (sample_grad_histogram) {
    report.grad_histogram.assign(kGradHistogramBins, 0);
    for (const ScaleGroup& g : groups) {
      for (size_t i = 0; i < g.bins.size(); ++i) report.grad_histogram[i] += g.bins[i];
      if (plan.per_layer) stats.layer_underflow_fraction.push_back(amp::UnderflowFraction(g.bins));
    }
    stats.underflow_fraction = amp::UnderflowFraction(report.grad_histogram);
    report.grad_underflow_fraction = stats.underflow_fraction;
  }
  absl::StatusOr<amp::ScalerUpdate> update = scaler.Update(stats);
  if (!update.ok()) {
    // deepspeed at min_scale: the device already skipped the update
    // (found_inf was set), so the job's state is as it was.
    return absl::FailedPreconditionError(update.status().message());
  }
  const bool applied = !(config.scaler.enabled && overflowed);
  if (applied) optimizer.set_applied_steps(optimizer.applied_steps() + 1);
  ++steps_run;

  report.step = steps_run;
  report.applied_steps = optimizer.applied_steps();
  report.loss =
      plan.token_loss ? host[kReadLossSum] : host[kReadLossSum] / static_cast<float>(plan.k);
  report.scaler = *update;
  report.grad_max_abs = max_abs;
  // Every applied step reports its norm; a skipped one only when clipping
  // (the norm of gradients that overflowed is inf or NaN, kept as clipping
  // always reported it).
  if (applied || plan.clip) report.grad_norm = std::sqrt(host[kReadNormSq]);
  return absl::OkStatus();
}

absl::StatusOr<StepReport> Trainer::Step(const StepInput& input,
                                         const std::function<absl::Status(int64_t)>& admit,
                                         const DataParallelStep* data_parallel,
                                         const CallToken& call) {
  // The checks CheckInput's FittedStepInput proves, on the caller's input
  // itself (no copy of its batches).
  AMPD_RETURN_IF_ERROR(CheckStepInput(input));
  AMPD_RETURN_IF_ERROR(
      CheckMicroBatchesFitModel(impl_->config.model, input.loss_fn, input.micro_batches));
  AMPD_RETURN_IF_ERROR(CheckLogprobsWanted(impl_->config.model, input.return_logprobs));
  return StepChecked(input, admit, data_parallel, call);
}

absl::StatusOr<StepReport> Trainer::Step(const FittedStepInput& input,
                                         const std::function<absl::Status(int64_t)>& admit,
                                         const DataParallelStep* data_parallel,
                                         const CallToken& call) {
  if (input.trainer_ != this) {
    return absl::InternalError("Trainer::Step: the input was checked by another Trainer");
  }
  return StepChecked(input.get(), admit, data_parallel, call);
}

absl::StatusOr<StepReport> Trainer::StepChecked(const StepInput& input,
                                                const std::function<absl::Status(int64_t)>& admit,
                                                const DataParallelStep* data_parallel,
                                                const CallToken& call) {
  const Clock::time_point start = Clock::now();
  Impl& m = *impl_;
  AMPD_RETURN_IF_ERROR(CheckCall(call, data_parallel, "before it started"));
  // Nothing before the update changes the job, except an adaptive scaler's
  // calibration (Admit): a step of its own that fails or is stopped before
  // the update puts the scaler back, so the next step calibrates again. (A
  // distributed share keeps it: its ranks calibrated together.)
  std::optional<amp::GradScaler> scaler_before;
  if (data_parallel == nullptr && m.scaler.NeedsCalibration()) scaler_before = m.scaler;
  StepReport report;
  absl::StatusOr<Impl::StepPlan> plan = [&]() -> absl::StatusOr<Impl::StepPlan> {
    AMPD_ASSIGN_OR_RETURN(Impl::StepPlan p, m.Admit(input, admit, data_parallel, call));
    // A Step is the update's only forward and backward: whatever calls
    // accumulated before it (a Job refuses the Step then) is dropped.
    m.accumulation = Impl::Accumulation();
    AMPD_RETURN_IF_ERROR(m.ForwardBackward(input, p, data_parallel, call, report));
    // The last point to stop at: the update and the read run to the end.
    AMPD_RETURN_IF_ERROR(CheckCall(call, data_parallel, "before its update"));
    return p;
  }();
  if (!plan.ok()) {
    if (scaler_before.has_value()) m.scaler = *std::move(scaler_before);
    return plan.status();
  }
  optim::UpdateOverrides overrides;
  overrides.lr = input.learning_rate;
  AMPD_RETURN_IF_ERROR(
      m.Apply(overrides, input.sample_grad_histogram, *plan, data_parallel, &input, report));
  report.seconds.total = Seconds(start, Clock::now());
  if (data_parallel != nullptr) report.seconds.wait = data_parallel->wait_seconds;
  return report;
}

}  // namespace ampd::engine
