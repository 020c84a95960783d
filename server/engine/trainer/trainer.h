// Trainer: one job's model, fp32 master weights, working copy, optimizer
// state and loss scaler on one Backend, and the mixed-precision step
// (step.cc; building it in trainer.cc, its state dict in state.cc). Not
// thread-safe: the job's ordered worker is its only caller.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/api.h"
#include "server/engine/call_token.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/config/job_config.h"
#include "server/engine/dist/gradient_all_reduce.h"
#include "server/engine/model/frozen_base.h"

namespace ampd::engine {

namespace amp {
class GradScaler;
}  // namespace amp

// The counts a Trainer writes into its state dict and reads back: the
// optimizer updates applied and the Step calls run (the job's sequence).
// The Trainer owns both; a Job reads them from it.
inline constexpr char kMetaOptimizerStep[] = "optimizer.step";
inline constexpr char kMetaStep[] = "ampd.step";
// A shared-base job's state names the base it was trained on: the
// base_model and the digest of its files (model::FrozenBase::Identity).
inline constexpr char kMetaBaseModel[] = "ampd.base_model";
inline constexpr char kMetaBaseDigest[] = "ampd.base_digest";

// What a rank of a distributed job adds to its step (docs/DISTRIBUTED.md):
// the micro-batch count of the step over every rank, which divides each
// micro-batch's loss gradient as K does in one process, and the sum across
// the ranks that runs after the backward pass (the gradients) and after
// the check pass (the loss sum and found_inf).
struct DataParallelStep {
  int64_t global_micro_batches = 0;
  dist::GradientAllReduce* all_reduce = nullptr;
  // How long this rank waited for the others to agree on the step
  // (reported as PhaseSeconds::wait).
  double wait_seconds = 0;
};

class Trainer;

// A Valid<StepRequest>'s input whose batches fit one Trainer's model too
// (shapes and dtypes, Trainer::CheckInput): what Trainer::Step runs,
// checked once per step. Only CheckInput makes one; Step refuses one made
// by another Trainer. It refers to the request's input, which outlives it.
class FittedStepInput {
 public:
  const StepInput& get() const { return *input_; }

 private:
  friend class Trainer;
  FittedStepInput(const StepInput* input, const Trainer* trainer)
      : input_(input), trainer_(trainer) {}
  const StepInput* input_;
  const Trainer* trainer_;  // whose model the batches fit
};

// A copy of the weights Trainer::Sample reads (sampler_weights.cc): each
// trainable parameter's value() (the working copy, or the fp32 master), in
// the model's trainable() order, on the Trainer's backend. A frozen base is
// not copied: it never changes, so the snapshot shares the job's. Made and
// read only by the Trainer that owns the backend; move-only; what it holds
// is freed with it.
class SamplerWeights {
 public:
  SamplerWeights();
  ~SamplerWeights();
  SamplerWeights(SamplerWeights&&) noexcept;
  SamplerWeights& operator=(SamplerWeights&&) noexcept;
  int64_t bytes() const { return bytes_; }

 private:
  friend class Trainer;
  std::vector<kernels::Tensor> tensors_;  // one per trainable parameter
  int64_t bytes_ = 0;
  const Trainer* owner_ = nullptr;
};

class Trainer {
 public:
  // Validates config, builds the model on backend, initialises weights from
  // config.seed (PyTorch's default distributions), casts the working copy.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const JobConfig& config,
                                                         std::unique_ptr<kernels::Backend> backend);
  // The same for a config validated before (no second check). `base`: the
  // shared base of a LoRA job on a base model (SharesBase), whose tensors
  // its frozen parameters view; such a job's state (ExportState, its
  // checkpoints) holds its adapters alone, with the base's name and digest
  // in the metadata (kMetaBaseModel, kMetaBaseDigest), and a state of a
  // base with another digest is refused (LoadState).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const ValidJobConfig& config, std::unique_ptr<kernels::Backend> backend,
      std::shared_ptr<const model::FrozenBase> base = nullptr);
  ~Trainer();

  // One optimizer step over the micro-batches, checked before (bad shapes
  // and dtypes are CheckInput's InvalidArgument, before any state changes).
  // Non-finite values in a batch are not an error: they overflow and the
  // step is skipped. FailedPrecondition when the scaler gives up
  // (deepspeed at min_scale); the job's state is then unchanged.
  //
  // Memory: before anything is allocated, the workspace the step needs (its
  // distinct micro-batch sizes, model::WorkspaceBytes each, and the
  // backend's scratch for them, kernels::Backend::ScratchBytes of
  // model::StepScratchExtents) is computed with overflow checks;
  // ResourceExhausted when it and what the backend already holds exceed
  // the backend's memory, and `admit` (when given) is asked for it next, so
  // a caller can hold it against a limit shared by several jobs; its error
  // is returned as is, with nothing changed. Workspaces of sizes
  // the step does not use are freed first, and the step's own stay cached
  // after it (workspace_bytes()), so that the next step of those sizes
  // allocates nothing. An allocation of the step's that fails for lack of
  // memory asks the memory-pressure handler (SetMemoryPressureHandler) to
  // free memory held elsewhere, then is retried once.
  //
  // With `data_parallel` the step is this rank's share of a distributed
  // step: the gradients are summed across the ranks before the histogram
  // and the check pass, so found_inf, the norm, max|g| and the update are
  // those of the whole batch and the same on every rank; the reported loss
  // is the mean over every rank's micro-batches. A sum that fails
  // (Unavailable) leaves the job's state as it was: nothing is applied
  // before the last sum.
  //
  // `call` (call_token.h) is checked before the step starts, before each
  // micro-batch (the adaptive scaler's calibration pass's too) and once
  // more before the update: a stopped call returns its status (Cancelled,
  // DeadlineExceeded...) with nothing applied, the scaler and both counts
  // as they were. A distributed step's share checks it only before it
  // starts: stopping one rank inside the collectives would fail the others.
  absl::StatusOr<StepReport> Step(const FittedStepInput& input,
                                  const std::function<absl::Status(int64_t)>& admit = nullptr,
                                  const DataParallelStep* data_parallel = nullptr,
                                  const CallToken& call = CallToken());
  // CheckStepInput and CheckInput's checks, then the Step above: for a
  // caller that holds a Trainer alone (tests, benchmarks).
  absl::StatusOr<StepReport> Step(const StepInput& input,
                                  const std::function<absl::Status(int64_t)>& admit = nullptr,
                                  const DataParallelStep* data_parallel = nullptr,
                                  const CallToken& call = CallToken());
  // Step's checks of its batches against the model (InvalidArgument naming
  // micro_batches[i].inputs or .targets), without running it: a job runs
  // them once per step, and a distributed job's ranks agree on a step only
  // when every rank's share passes them.
  absl::StatusOr<FittedStepInput> CheckInput(const Valid<StepRequest>& request) const;
  // The gradient tensors a distributed job's GradientAllReduce sums.
  std::vector<kernels::Tensor*> gradient_tensors();

  // A step in two halves (accumulate.cc; api.h ForwardBackwardInput and
  // OptimStepInput). ForwardBackward: the forward, loss and backward of
  // one call, its gradients added to those of the calls since the last
  // update (the first such call zeroes the buffers), with Step's checks and
  // admission. An error after admission drops every accumulated call (the
  // buffers then hold part of this one). Not for a distributed job's ranks.
  // `call` is checked before each micro-batch, as a Step's is: a stopped
  // call, like any error after admission, drops the accumulated calls.
  absl::StatusOr<ForwardBackwardReport> ForwardBackward(
      const Valid<ForwardBackwardRequest>& request,
      const std::function<absl::Status(int64_t)>& admit = nullptr,
      const CallToken& call = CallToken());
  // CheckForwardBackwardInput, then the call above (tests, benchmarks).
  absl::StatusOr<ForwardBackwardReport> ForwardBackward(
      const ForwardBackwardInput& input,
      const std::function<absl::Status(int64_t)>& admit = nullptr,
      const CallToken& call = CallToken());
  // The update from the accumulated gradients, as Step's (one check pass,
  // the fused update skipped on an overflow, the scaler's update) with the
  // input's hyperparameters; the accumulated calls are spent whatever the
  // outcome. InvalidArgument for betas or eps on an SGD job,
  // FailedPrecondition when no call is accumulated and, as Step's, when the
  // scaler gives up. The report's loss is the update's as Step would report
  // it (the first call's kind of loss and micro_batches_in_update).
  absl::StatusOr<StepReport> OptimStep(const Valid<OptimStepRequest>& request);
  // CheckOptimStepInput, then the update above (tests, benchmarks).
  absl::StatusOr<StepReport> OptimStep(const OptimStepInput& input);
  // ForwardBackward calls accumulated and not yet applied.
  int64_t pending_forward_backward() const;
  // Forgets them (a state load replaced the weights they were computed on).
  void DropAccumulated();

  // Forward and loss over the micro-batches (evaluate.cc): the loss Step
  // would report for them now, with weights, optimizer state, loss scaler
  // and both counts left as they are. The same input checks (InvalidArgument
  // naming the field) and the same workspace admission as Step, `admit`
  // included; the gradient buffers are not touched. `call` is checked
  // before each micro-batch.
  absl::StatusOr<EvaluateReport> Evaluate(
      const Valid<EvaluateRequest>& request,
      const std::function<absl::Status(int64_t)>& admit = nullptr,
      const CallToken& call = CallToken());
  // CheckEvaluateInput, then the Evaluate above (tests, benchmarks).
  absl::StatusOr<EvaluateReport> Evaluate(
      const EvaluateInput& input, const std::function<absl::Status(int64_t)>& admit = nullptr,
      const CallToken& call = CallToken());

  // Completions of the prompts from the current weights (sample.cc; api.h
  // SampleInput): the model's forward over the prompts, then one token per
  // completion at a time against a KV cache, every row through the training
  // forward's code (model/network.h). CheckSampleInput's errors, then the
  // model's (InvalidArgument naming "prompts[i]" for a token outside the
  // vocabulary or a prompt plus max_tokens beyond the context: the checks
  // against the model; CheckRequest's ran before), then the
  // admission of the prompts' workspace and the cache (`admit`, as Step's),
  // all before anything is allocated. Weights, optimizer, scaler and counts
  // are left as they are. `call` is checked before the prompts' forward
  // and before each decode step: a stopped call returns its status and no
  // completion.
  absl::StatusOr<SampleReport> Sample(const Valid<SampleRequest>& request,
                                      const std::function<absl::Status(int64_t)>& admit = nullptr,
                                      const CallToken& call = CallToken());
  // CheckSampleInput, then the Sample above (tests, benchmarks).
  absl::StatusOr<SampleReport> Sample(const SampleInput& input,
                                      const std::function<absl::Status(int64_t)>& admit = nullptr,
                                      const CallToken& call = CallToken());

  // ---- sampler snapshots (sampler_weights.cc) ----
  // The device bytes a SamplerWeights copy of this model holds, known
  // before anything is allocated (for admission).
  int64_t sampler_weights_bytes() const;
  // A device copy of the weights Sample reads now (Backend::Copy of each
  // trainable parameter's value()).
  absl::StatusOr<SamplerWeights> CopySamplerWeights();
  // Sample (above) from `weights` instead of the current weights: they are
  // swapped into the parameters for the call and swapped back before it
  // returns, whatever it returns (the job's strand runs nothing else
  // meanwhile). InvalidArgument for weights of another Trainer.
  absl::StatusOr<SampleReport> SampleFrom(SamplerWeights& weights,
                                          const Valid<SampleRequest>& request,
                                          const std::function<absl::Status(int64_t)>& admit,
                                          const CallToken& call = CallToken());
  // `weights` read into host tensors under the parameters' state-dict
  // names, in the working dtype (what a snapshot's file holds), and back:
  // LoadSamplerWeights checks every trainable parameter is there with its
  // dtype and shape and nothing else (DataLoss naming the tensor).
  absl::StatusOr<checkpoint::StateDict> ExportSamplerWeights(const SamplerWeights& weights);
  absl::StatusOr<SamplerWeights> LoadSamplerWeights(const checkpoint::StateDict& state);
  // Whether the weights Sample reads now are `weights`, bit for bit (a
  // restored snapshot's resend is told from a save of other weights by
  // it). Reads both back to the host: for the rare resend only.
  absl::StatusOr<bool> HoldsSamplerWeights(const SamplerWeights& weights);

  // Workspace bytes cached now (model::WorkspaceBytes of each, plus the
  // backend's scratch for them, kernels::Backend::ScratchBytes, and the
  // largest step's per-token log-prob buffer): the
  // buffers of the last step's (or evaluation's) batch sizes, kept until a
  // step of other sizes, ReleaseWorkspaces or the Trainer's end. A caller
  // sharing memory between jobs counts them as held.
  int64_t workspace_bytes() const;
  // Frees every cached workspace (workspace_bytes() becomes 0): what a job
  // gives up when another needs the memory. The next step allocates afresh.
  void ReleaseWorkspaces();
  // `relieve` is called, at most once per allocation, when allocating a
  // step's, an evaluation's or a calibration's workspace fails for lack of
  // memory: it frees memory held elsewhere (other jobs' cached
  // workspaces), and the allocation is retried once. Nullable.
  void SetMemoryPressureHandler(std::function<void()> relieve);

  // Master weights, optimizer state and scaler state, and the two counts
  // (checkpoint/state_dict.h).
  absl::StatusOr<checkpoint::StateDict> ExportState() const;
  // ExportState, or another view of the state (api.h StateView;
  // InvalidArgument naming "view" for the adapter view of a job without
  // adapters).
  absl::StatusOr<checkpoint::StateDict> ExportView(StateView view) const;
  // What LoadState does with the state's ampd.step, which it checks either
  // way: kFromState makes it the count (a job resuming its own checkpoint),
  // kKeep leaves the count as it is (a state dict from elsewhere replaces
  // the training state, and the job's sequence goes on).
  enum class StepCount { kFromState, kKeep };
  // How much of the model a state dict covers. kComplete: every tensor the
  // load needs (a missing one is refused). kPartial: some of the model's
  // weights only, as one file of a sharded checkpoint holds them: those
  // present replace theirs, every other weight, the optimizer's moments and
  // count, the scaler and the job's count stay as they are; an optimizer.*
  // tensor, optimizer.step or scaler.* metadata, a name the model does not
  // have or a wrong shape is still refused (each file of a checkpoint loads
  // in turn, the job stepping only between calls).
  enum class Coverage { kComplete, kPartial };
  // Replaces them all, or nothing: InvalidArgument naming the missing or
  // mismatched tensor or key. The working copy is recast from the masters.
  // With kKeep, a state of model weights alone (no optimizer.* tensor, no
  // optimizer.step) replaces the weights and starts the optimizer afresh
  // (zero moments, no update applied), the scaler unchanged; and every
  // floating value it loads must be finite (InvalidArgument naming the
  // tensor: a base or an adapter with inf or NaN makes a job that can
  // never train). The model may accept other spellings of its names (a
  // GPT takes Hugging Face's).
  absl::Status LoadState(const checkpoint::StateDict& state,
                         StepCount step_count = StepCount::kFromState,
                         Coverage coverage = Coverage::kComplete);
  // What ReplaceState replaced: the live tensors as they were (on the
  // device, not copied), the scaler and the counts. Dropping it frees them;
  // UndoReplace puts them back.
  class ReplacedState {
   public:
    ReplacedState();
    ~ReplacedState();
    ReplacedState(ReplacedState&&) noexcept;
    ReplacedState& operator=(ReplacedState&&) noexcept;

   private:
    friend class Trainer;
    struct Parts;
    std::unique_ptr<Parts> parts_;
  };
  // LoadState, keeping what it replaced until the result is dropped (the
  // device holds both states until then): a caller with more to do before
  // the load counts (a job's checkpoint of it) can go back exactly, without
  // a host copy of the state it replaced. On error nothing is replaced.
  absl::StatusOr<ReplacedState> ReplaceState(const checkpoint::StateDict& state,
                                             StepCount step_count = StepCount::kFromState,
                                             Coverage coverage = Coverage::kComplete);
  // Puts back what ReplaceState replaced (the working copy recast from the
  // masters put back). Nothing may have run on the Trainer in between.
  absl::Status UndoReplace(ReplacedState replaced);
  // `state` checked as LoadState checks it (same errors) and arranged as
  // ExportState will return it once loaded: ExportState's names and order,
  // its metadata (the scaler and counts the load gives), zeros for the
  // moments a weights-only load starts afresh; the buffers are moved out of
  // `state`, not copied. Loading the result (kKeep, or step_count) does
  // what loading `state` would, so a job can write its checkpoint of an
  // import while the import is uploaded, and nothing is read back. A
  // partial state is laid over ExportState's (the rest is read back).
  absl::StatusOr<checkpoint::StateDict> ArrangeForLoad(
      checkpoint::StateDict state, StepCount step_count = StepCount::kFromState,
      Coverage coverage = Coverage::kComplete) const;

  const JobConfig& config() const;
  // Step calls run so far (ampd.step); the next is number steps_run() + 1.
  int64_t steps_run() const;
  // Optimizer updates applied so far (the state dict's optimizer.step).
  int64_t applied_steps() const;
  // The loss scale the next step will use (1 when scaling is disabled) and
  // the scaler's counters now.
  ScalerSnapshot scaler() const;
  int64_t parameter_count() const;
  kernels::Backend& backend();
  // The shared base the job's frozen parameters view (nullptr: none).
  const model::FrozenBase* frozen_base() const;

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  // The calls on input their public callers checked (CheckRequest's
  // checks: a Valid<Request>'s, or a test's raw input checked there).
  absl::StatusOr<StepReport> StepChecked(const StepInput& input,
                                         const std::function<absl::Status(int64_t)>& admit,
                                         const DataParallelStep* data_parallel,
                                         const CallToken& call);
  absl::StatusOr<EvaluateReport> EvaluateChecked(const EvaluateInput& input,
                                                 const std::function<absl::Status(int64_t)>& admit,
                                                 const CallToken& call);
  absl::StatusOr<ForwardBackwardReport> ForwardBackwardChecked(
      const ForwardBackwardInput& input, const std::function<absl::Status(int64_t)>& admit,
      const CallToken& call);
  absl::StatusOr<StepReport> OptimStepChecked(const OptimStepInput& input);
  absl::StatusOr<SampleReport> SampleChecked(const SampleInput& input,
                                             const std::function<absl::Status(int64_t)>& admit,
                                             const CallToken& call);
  struct LoadPlan;
  absl::StatusOr<LoadPlan> PlanLoad(const checkpoint::StateDict& state, StepCount step_count,
                                    Coverage coverage) const;
  // ExportState's metadata: a scaler's state, the two counts, the model's.
  void AddStateMetadata(const amp::GradScaler& scaler, int64_t opt_step, int64_t steps_run,
                        checkpoint::StateDict& state) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ampd::engine
