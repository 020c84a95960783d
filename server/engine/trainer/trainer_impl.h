// Trainer::Impl: one job's state on its Backend, shared by the Trainer's
// files (trainer.cc builds it, step.cc trains it, state.cc exports and
// loads it). Private to server/engine/trainer/.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/model/network.h"
#include "server/engine/optim/optimizer_state.h"
#include "server/engine/trainer/trainer.h"

namespace ampd::engine {

// How a memory refusal names the request's field that sized the call, and
// what to send instead (Trainer::Impl::AdmitWorkspaces).
struct MemoryField {
  absl::string_view field;
  absl::string_view advice;
};
inline constexpr MemoryField kStepMemory{"micro_batches", "send smaller micro-batches"};

// sample.cc: what Trainer::Sample's checks against the model fix for the
// call (Impl::PlanSample).
struct SamplePlan {
  const model::Parameter* head = nullptr;  // the LM head
  int64_t vocab = 0;
  int64_t n = 0;           // S = prompts x num_samples sequences, one row each
  int64_t prompt_len = 0;  // P: the longest prompt (the others right-padded)
  int64_t max_len = 0;     // the cache's positions: a prompt + max_tokens - 1, at most
};

struct Trainer::Impl {
  Impl(const JobConfig& c, std::unique_ptr<kernels::Backend> b, amp::GradScaler s)
      : config(c), backend(std::move(b)), scaler(std::move(s)) {}

  JobConfig config;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Network> model;
  optim::OptimizerState optimizer;
  amp::GradScaler scaler;
  int64_t steps_run = 0;

  // Views the Backend calls take, built once (the tensors never move:
  // LoadState move-assigns into the same Tensor objects).
  // One entry per trainable parameter (model->trainable()'s order: its
  // "slot"); slot_of maps an index into model->params() to its slot, -1 for
  // a frozen one.
  std::vector<int> slot_of;
  std::vector<kernels::ParamRef> refs;
  std::vector<kernels::Tensor*> grads;
  std::vector<const kernels::Tensor*> const_grads;
  // A distributed step's scratch (sized once, at creation): the gradients
  // backward just finished, and which have been started summing.
  std::vector<kernels::Tensor*> ready_grads;
  std::vector<char> grad_started;

  kernels::Tensor loss;      // (1, 1) F32, one micro-batch's loss
  kernels::Tensor loss_sum;  // (1, 1) F32, sum of the step's (or the call's) micro-batch losses
  // (1, 1) F32, sum of the micro-batch losses of every ForwardBackward call
  // of the pending update, added in the order a Step adds them into loss_sum.
  kernels::Tensor accum_loss;
  kernels::Tensor found_inf;  // (1, 1) F32
  kernels::Tensor norm_sq;    // (1, 1) F32
  kernels::Tensor no_inf;     // (1, 1) F32 zero: the update's found_inf when the scaler is disabled
  std::vector<int64_t> zero_bins = std::vector<int64_t>(kGradHistogramBins, 0);

  // The parameters one loss scale covers: all of them (one group) for a
  // job-wide scale, one layer group's each with per-layer scales. Each is
  // unscaled with its own 1 / S_g and updated with it; found_inf and
  // norm_sq are shared (both accumulate across UnscaleAndCheck calls).
  struct ScaleGroup {
    // One entry per trainable parameter (model->trainable()'s order: its
    // "slot"); slot_of maps an index into model->params() to its slot, -1 for
    // a frozen one.
    std::vector<int> slot_of;
    std::vector<kernels::ParamRef> refs;
    std::vector<kernels::Tensor*> grads;
    std::vector<const kernels::Tensor*> const_grads;
    kernels::Tensor max_abs;    // (1, 1) F32, max |g| of the group's unscaled grads
    kernels::Tensor histogram;  // (kGradHistogramBins) I64 of its scaled grads
    std::vector<int64_t> bins = std::vector<int64_t>(kGradHistogramBins, 0);
  };
  std::vector<ScaleGroup> groups;
  // Host buffers of the step's one ReadBack, sized once: [loss sum,
  // found_inf, norm_sq, max_abs of group 0, 1, ...], the groups' scales.
  std::vector<const kernels::Tensor*> read_scalars;
  std::vector<float> read_values;
  std::vector<float> group_scales;
  // A step's per-token log-probs (StepPlan::keep_logprobs): each
  // micro-batch's (B*T) copied after its loss, in order, into one (tokens)
  // F32 device buffer, followed by as many per-token losses when
  // StepPlan::keep_losses, that the step's one ReadBack brings into the host
  // twin. Kept between steps, grown only when a step has more tokens than
  // any before it, counted in workspace_bytes and released with the
  // workspaces.
  kernels::Tensor step_logprobs;
  std::vector<float> step_logprobs_host;
  // The tokens step_logprobs holds: 0 before a step first kept them (an
  // empty Tensor's shape {} counts one element).
  int64_t step_logprobs_held() const { return step_logprobs.empty() ? 0 : step_logprobs.numel(); }

  // The update ForwardBackward calls accumulate (step.cc): the calls run
  // since the last update (0: none pending, the gradient buffers hold
  // nothing to apply) and what the update's report needs of them.
  struct Accumulation {
    int64_t calls = 0;
    bool token_loss = false;  // the first call's: how the update's loss is reported
    int64_t k = 1;            // its mean's divisor (micro_batches_in_update)
  };
  Accumulation accumulation;

  // ---- step.cc: Trainer::Step's phases, in order ---------------------------------
  // What Admit fixes for the rest of the step.
  struct StepPlan {
    // The update's first forward and backward: the gradients and the
    // update's scalars are zeroed before it (every Step; a ForwardBackward
    // call when none is pending).
    bool first = true;
    // A ForwardBackward call: its micro-batches' losses are also added
    // into accum_loss, and loss_sum holds the call's own.
    bool accumulate = false;
    float max_grad_norm = 0.0f;  // the update's (the job's, or an OptimStep's)
    bool per_layer = false;      // per-layer scales
    float scale = 1.0f;          // the loss gradient's scale: the job's, or the last group's
    int64_t local_k = 0;         // this rank's micro-batches
    int64_t k = 0;               // every rank's: the mean's divisor
    float grad_scale = 1.0f;     // scale / k (scale for a token loss), each micro-batch's
                                 // loss gradient
    bool clip = false;           // max_grad_norm > 0
    bool token_loss = false;     // loss_fn is a token loss: a sum over every micro-batch's tokens
    // Each token's log-prob read back: return_logprobs, or a loss whose
    // sampling_logprobs the mismatch compares with.
    bool keep_logprobs = false;
    // Each token's loss read back too (return_logprobs with a token loss);
    // only with keep_logprobs.
    bool keep_losses = false;
    int64_t tokens = 0;  // B*T summed over the micro-batches when keep_logprobs
    // The F32 values the step reads back: the log-probs, then the losses.
    int64_t read_rows() const { return keep_losses ? 2 * tokens : tokens; }
  };
  // The (checked) input's workspaces admitted, an adaptive scaler
  // calibrated and the groups' scales set: the plan of the step.
  // `call` is checked before each micro-batch of a calibration pass.
  // `accumulating`: a ForwardBackward call's input (its mean's divisor; an
  // adaptive scaler calibrates on the update's first call only).
  absl::StatusOr<StepPlan> Admit(const StepInput& input,
                                 const std::function<absl::Status(int64_t)>& admit,
                                 const DataParallelStep* data_parallel, const CallToken& call,
                                 const ForwardBackwardInput* accumulating = nullptr);
  // Group g's 1 / S_g (S for a job-wide scale).
  float InvScale(const StepPlan& plan, size_t group) const;
  // The step's scalars zeroed; every micro-batch's forward, loss and
  // backward; a distributed step's gradient sums finished. `call` is
  // checked before each micro-batch (not in a distributed step).
  absl::Status ForwardBackward(const StepInput& input, const StepPlan& plan,
                               const DataParallelStep* data_parallel, const CallToken& call,
                               StepReport& report);
  // ForwardBackward's parts: the update's gradients and scalars zeroed on
  // its first call, and the call's loss sum always; the backward hook that
  // starts summing each gradient across the ranks as the last
  // micro-batch's backward finishes it; a micro-batch's per-token
  // log-probs (and losses) copied into step_logprobs at *at.
  absl::Status ZeroScalars(const StepPlan& plan);
  model::Network::GradsReady SumWhenReady(dist::GradientAllReduce& all_reduce);
  absl::Status KeepTokenValues(model::Workspace& ws, const StepPlan& plan, int64_t* at);
  // The update from the gradients the forward and backward passes left:
  // CheckGradients, Update and Finish, as a Step and an OptimStep run them.
  // `logprobs_of`: the Step whose kept log-probs the one read brings back
  // (nullptr for an OptimStep).
  absl::Status Apply(const optim::UpdateOverrides& overrides, bool sample_grad_histogram,
                     const StepPlan& plan, const DataParallelStep* data_parallel,
                     const StepInput* logprobs_of, StepReport& report);
  // The sampled histograms, the unscale-and-check pass of every group and a
  // distributed step's sum of the loss and found_inf.
  absl::Status CheckGradients(bool sample_grad_histogram, const StepPlan& plan,
                              const DataParallelStep* data_parallel, StepReport& report);
  // The fused update of every group at the step's learning rate (skipped
  // on the device when found_inf is set).
  absl::Status Update(const optim::UpdateOverrides& overrides, const StepPlan& plan,
                      StepReport& report);
  // The step's one read, the scaler's update and the report's figures.
  absl::Status Finish(bool sample_grad_histogram, const StepPlan& plan,
                      const StepInput* logprobs_of, StepReport& report);
  // A ForwardBackward call's one read: its loss sum and kept log-probs.
  absl::Status ReadCall(const StepInput& input, const StepPlan& plan, StepReport& report);
  // step_logprobs.cc: ReportStepLogprobs from what a step's or a call's one
  // read brought into step_logprobs_host: plan.read_rows() values, the
  // log-probs and then (plan.keep_losses) the losses.
  void ReportKeptLogprobs(const StepInput& input, const StepPlan& plan, StepReport& report) const;

  // ---- sample.cc: Trainer::Sample's phases before its decode loop --------------
  // The checks against the model and the admission of everything the call
  // allocates (the prompts' workspace, the KV cache, the decode buffers).
  absl::StatusOr<SamplePlan> PlanSample(const SampleInput& input,
                                        const std::function<absl::Status(int64_t)>& admit);
  // The prompts' forward into a new cache; each sequence's prompt length
  // into `lengths`. `call` is checked before it.
  absl::StatusOr<std::unique_ptr<model::DecodeState>> Prefill(const SampleInput& input,
                                                              const SamplePlan& plan,
                                                              const CallToken& call,
                                                              std::vector<int64_t>& lengths);

  // calibrate.cc: the adaptive scaler's calibrated start, run by Step
  // before the step proper when the scaler NeedsCalibration().
  absl::Status CalibrateLossScale(const StepInput& input, const DataParallelStep* data_parallel,
                                  const CallToken& call);

  // step.cc, per-layer scales: the Backward hook that joins each group's
  // entry gradient (Network::BackwardHooks::group_entry) to its found_inf
  // and max|g| check, unscaled by that group's 1 / group_scales[g].
  model::Network::GroupEntry GroupEntryCheck();

  // Trainer::SetMemoryPressureHandler's; may be empty.
  std::function<void()> relieve_memory;
  // step.cc: the model's cached workspace for inputs of `shape`, allocated
  // when there is none; an allocation that fails for lack of memory calls
  // relieve_memory and is retried once.
  absl::StatusOr<model::Workspace*> WorkspaceFor(const kernels::Shape& shape);

  // step.cc: admission of the workspaces a step or an evaluation (`what`)
  // needs for its micro-batches' sizes, before anything is allocated (see
  // Trainer::Step). Frees the cached workspaces of other sizes first.
  // backward: whether the call runs a backward (a step) or the forward
  // alone (an evaluation, a sampler's prefill), whose ops need less
  // scratch. extra_bytes: what the call allocates beside the workspaces (a
  // sampler's KV cache), admitted with them, and `also` the extents of the
  // ops it runs beside the micro-batches' (a sampler's decode steps). A
  // refusal (the device's, or admit's) names `names.field`, the request's
  // own.
  absl::Status AdmitWorkspaces(const std::vector<MicroBatch>& micro_batches,
                               const std::function<absl::Status(int64_t)>& admit,
                               absl::string_view what, bool backward, int64_t extra_bytes = 0,
                               MemoryField names = kStepMemory,
                               const kernels::ScratchExtents& also = {});
  // The backend's scratch (kernels::Backend::ScratchBytes) for the last
  // admitted sizes: held with the cached workspaces, counted with them
  // (Trainer::workspace_bytes) and released with them.
  int64_t scratch_bytes = 0;
};

// step_logprobs.cc: StepReport's logprobs, ratios, token_losses and
// logprob_mismatch from the (tokens) F32 log-probs and the (tokens, or
// empty) per-token losses the step read back, micro-batch after
// micro-batch in input order.
void ReportStepLogprobs(const StepInput& input, absl::Span<const float> logprobs,
                        absl::Span<const float> losses, StepReport& report);

// Per-token log-probs (return_logprobs) need a language model's head:
// InvalidArgument naming return_logprobs otherwise.
absl::Status CheckLogprobsWanted(const model::ModelSpec& spec, bool return_logprobs);

// step.cc: each micro-batch checked against the model and the step's
// loss_fn, InvalidArgument naming micro_batches[i].inputs / .targets /
// .weights / .advantages / .sampling_logprobs.
absl::Status CheckMicroBatchesFitModel(const model::ModelSpec& spec, const LossFn& loss_fn,
                                       const std::vector<MicroBatch>& micro_batches);

// state.cc: the device tensors of `sources` read into host tensors of
// their names, dtypes and shapes, in a few batched ReadBacks.
absl::StatusOr<std::vector<codec::NamedTensor>> ReadHostTensors(
    kernels::Backend& backend,
    const std::vector<std::pair<std::string, kernels::Tensor*>>& sources);

// The gradient sums a distributed step started: Finish waits for them;
// a step that returns early (an error) finishes them on the way out, so no
// collective of this step is still running when the next one starts.
struct SumsInFlight {
  dist::GradientAllReduce* all_reduce;  // nullptr: not a distributed step
  absl::Status Finish() {
    dist::GradientAllReduce* const finishing = std::exchange(all_reduce, nullptr);
    return finishing != nullptr ? finishing->Finish() : absl::OkStatus();
  }
  ~SumsInFlight() { (void)Finish(); }
};

}  // namespace ampd::engine
