// Trainer: one job's model, fp32 master weights, working copy, optimizer
// state and loss scaler on one Backend, and the mixed-precision step
// (SCALER.md's "one training step"). Not thread-safe: the job's ordered
// worker is its only caller.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/host_tensor.h"
#include "server/engine/jobs/job_config.h"

namespace ampd::engine {

// One micro-batch. inputs: (N, in_features) float (any float dtype, cast to
// the working dtype) or (N) I32/I64 ids when the first layer is Embedding;
// targets: (N, out) F32 for MSE, (N) I32/I64 labels for cross-entropy.
struct MicroBatch {
  HostTensor inputs;
  HostTensor targets;
};

struct StepInput {
  std::vector<MicroBatch> micro_batches;  // >= 1; gradients accumulate over them
  std::optional<float> learning_rate;     // overrides the optimizer's lr for this step
  bool sample_grad_histogram = false;     // fill StepReport::grad_histogram (costs a pass)
};

struct PhaseSeconds {
  double forward = 0;
  double backward = 0;
  double unscale = 0;  // non-finite check (+ norm)
  double optimizer = 0;
  double total = 0;
};

struct StepReport {
  int64_t step = 0;                // 1-based number of this Step call in the job
  int64_t applied_steps = 0;       // optimizer updates applied so far, this one included
  float loss = 0;                  // mean over micro-batches, unscaled fp32 (multiplier included)
  amp::ScalerUpdate scaler;        // scale before/after, found_inf, skipped, grew, backed_off
  std::optional<float> grad_norm;  // L2 of unscaled grads (before clipping): every applied
                                   // step, and skipped ones when clipping
  float grad_max_abs = 0;          // max |g| of the unscaled grads (inf when they overflowed)
  PhaseSeconds seconds;
  int64_t samples = 0;                  // rows over all micro-batches
  std::vector<int64_t> grad_histogram;  // kernels::kGradHistogramBins counts, when sampled
  // Fraction of the sampled (scaled) gradient elements at zero or below
  // fp16's smallest normal 2^-14, when sampled (amp::UnderflowFraction).
  std::optional<double> grad_underflow_fraction;
};

class Trainer {
 public:
  // Validates config, builds the model on backend, initialises weights from
  // config.seed (PyTorch's default distributions), casts the working copy.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const JobConfig& config,
                                                         std::unique_ptr<kernels::Backend> backend);
  // The same for a config validated before (no second check).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const ValidJobConfig& config,
                                                         std::unique_ptr<kernels::Backend> backend);
  ~Trainer();

  // One optimizer step over the micro-batches. InvalidArgument (naming
  // micro_batches[i].inputs etc.) for bad shapes/dtypes, before any state
  // changes. Non-finite values in a batch are not an error: they overflow and
  // the step is skipped. FailedPrecondition when the scaler gives up
  // (deepspeed at min_scale); the job's state is then unchanged.
  //
  // Memory: before anything is allocated, the workspace the step needs (its
  // distinct micro-batch sizes, model::WorkspaceBytes each) is computed with
  // overflow checks; ResourceExhausted when it and what the backend already
  // holds exceed the backend's memory, and `admit` (when given) is asked for
  // it next, so a caller can hold it against a limit shared by several jobs;
  // its error is returned as is, with nothing changed. Workspaces of sizes
  // the step does not use are freed first, and the step's own are freed
  // after it when they exceed kMaxCachedWorkspaceBytes.
  absl::StatusOr<StepReport> Step(const StepInput& input,
                                  const std::function<absl::Status(int64_t)>& admit = nullptr);

  // The most workspace memory a job keeps cached between steps; a step whose
  // buffers are larger frees them when it ends (CUDA's pool keeps the blocks
  // for reuse without a cudaMalloc, while the CPU backend returns them).
  static constexpr int64_t kMaxCachedWorkspaceBytes = int64_t{64} << 20;
  // Workspace bytes cached now (model::WorkspaceBytes of each).
  int64_t workspace_bytes() const;

  // Master weights, optimizer state and scaler state (checkpoint/state_dict.h).
  absl::StatusOr<checkpoint::StateDict> ExportState() const;
  // Replaces them all, or nothing: InvalidArgument naming the missing or
  // mismatched tensor or key. The working copy is recast from the masters.
  absl::Status LoadState(const checkpoint::StateDict& state);

  const JobConfig& config() const;
  int64_t steps_run() const;
  // The loss scale the next step will use (1 when scaling is disabled).
  float loss_scale() const;
  // The scaler's counters now (amp::ScalerCounters).
  amp::ScalerCounters scaler_counters() const;
  int64_t parameter_count() const;
  kernels::Backend& backend();

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ampd::engine
