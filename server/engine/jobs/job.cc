// Job: the strand that serialises one job's work on a WorkerPool, the
// exactly-once step sequence, and checkpoints.
#include "server/engine/jobs/job.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "kernels/backend_factory.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/config/job_config_codec.h"
#include "server/engine/jobs/allocation_guard.h"
#include "server/engine/jobs/base_models.h"

namespace ampd::engine {

// ---- helpers ----------------------------------------------------------------------

namespace {

std::string HexFloat(double v) { return absl::StrFormat("%a", v); }

bool ParseHexFloat(absl::string_view s, double* out) {
  std::string copy(s);
  char* end = nullptr;
  *out = std::strtod(copy.c_str(), &end);
  return end != nullptr && *end == '\0' && !copy.empty();
}

// "a,b,..." of hex floats, at most amp::kMaxLayerScaleGroups of them.
bool DecodeHexFloats(absl::string_view text, std::vector<float>* out) {
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    double d = 0;
    if (!ParseHexFloat(item, &d) || out->size() >= static_cast<size_t>(amp::kMaxLayerScaleGroups)) {
      return false;
    }
    out->push_back(static_cast<float>(d));
  }
  return true;
}

// The checks a seed-only checkpoint must pass before its job is rebuilt
// from its config: DataLoss naming the key that is wrong.
absl::Status CheckSeedOnly(const checkpoint::StateDict& state) {
  const std::string& init = state.metadata.at(kMetaInitialState);
  if (init != kSeededInitialisation) {
    return absl::DataLossError(
        absl::StrCat(kMetaInitialState, ": the checkpoint relies on the seeded initialisation \"",
                     init, "\", which this build does not have (it has \"", kSeededInitialisation,
                     "\"); the job was at step 0 and has no other state: create it again"));
  }
  if (!state.tensors.empty()) {
    return absl::DataLossError(absl::StrCat(kMetaInitialState,
                                            ": a seed-only checkpoint holds no tensors, this one "
                                            "holds ",
                                            state.tensors.size()));
  }
  auto step = state.metadata.find(kMetaStep);
  if (step == state.metadata.end() || step->second != "0") {
    return absl::DataLossError(
        absl::StrCat(kMetaStep, ": a seed-only checkpoint is at step 0, this one says \"",
                     step == state.metadata.end() ? "(missing)" : step->second, "\""));
  }
  auto config = state.metadata.find(kMetaConfig);
  auto digest = state.metadata.find(kMetaConfigDigest);
  if (config == state.metadata.end() || digest == state.metadata.end() ||
      digest->second != ConfigDigest(config->second)) {
    return absl::DataLossError(absl::StrCat(
        kMetaConfigDigest, ": ",
        digest == state.metadata.end()
            ? "missing from a seed-only checkpoint"
            : absl::StrCat("does not match the checkpoint's ", kMetaConfig),
        " (the file is corrupted: its state is its config's model and seed, which cannot be "
        "trusted)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeStepReport(const StepReport& r) {
  std::vector<std::string> parts = {
      absl::StrCat("step=", r.step),
      absl::StrCat("applied_steps=", r.applied_steps),
      absl::StrCat("loss=", HexFloat(r.loss)),
      absl::StrCat("scale_before=", HexFloat(r.scaler.scale_before)),
      absl::StrCat("scale_after=", HexFloat(r.scaler.scale_after)),
      absl::StrCat("found_inf=", r.scaler.found_inf ? 1 : 0),
      absl::StrCat("skipped=", r.scaler.skipped ? 1 : 0),
      absl::StrCat("grew=", r.scaler.grew ? 1 : 0),
      absl::StrCat("backed_off=", r.scaler.backed_off ? 1 : 0),
      absl::StrCat("forward=", HexFloat(r.seconds.forward)),
      absl::StrCat("backward=", HexFloat(r.seconds.backward)),
      absl::StrCat("unscale=", HexFloat(r.seconds.unscale)),
      absl::StrCat("optimizer=", HexFloat(r.seconds.optimizer)),
      absl::StrCat("total=", HexFloat(r.seconds.total)),
      absl::StrCat("samples=", r.samples),
  };
  if (r.grad_norm.has_value()) parts.push_back(absl::StrCat("grad_norm=", HexFloat(*r.grad_norm)));
  // A token loss with sampling_logprobs only. The per-token log-probs and
  // ratios are not recorded: a resend answered from a checkpoint's record
  // carries the scalars alone.
  if (r.logprob_mismatch.has_value()) {
    parts.push_back(absl::StrCat("logprob_mismatch=", HexFloat(*r.logprob_mismatch)));
  }
  // Only when set (an adaptive scaler's deferred growth), so that every
  // other report, and the checkpoints that carry one, keep their bytes.
  if (r.scaler.growth_deferred) parts.push_back("growth_deferred=1");
  // Per-layer scales only, likewise: "layer_scales_after=0x1p+24,0x1p+11".
  if (!r.scaler.layer_scales_after.empty()) {
    std::vector<std::string> scales;
    for (const float s : r.scaler.layer_scales_after) scales.push_back(HexFloat(s));
    parts.push_back(absl::StrCat("layer_scales_after=", absl::StrJoin(scales, ",")));
  }
  // Reports of checkpoints written before steps reported their lr decode
  // to 0, as a report of lr 0 does, so only a non-zero lr is written.
  if (r.learning_rate != 0.0f) {
    parts.push_back(absl::StrCat("learning_rate=", HexFloat(r.learning_rate)));
  }
  return absl::StrJoin(parts, ";");
}

absl::StatusOr<StepReport> DecodeStepReport(absl::string_view text) {
  StepReport r;
  for (absl::string_view part : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits('=', 1));
    double d = 0;
    int64_t i = 0;
    const bool is_int = absl::SimpleAtoi(kv.second, &i);
    const bool is_float = ParseHexFloat(kv.second, &d);
    const absl::string_view k = kv.first;
    if (k == "step" && is_int)
      r.step = i;
    else if (k == "applied_steps" && is_int)
      r.applied_steps = i;
    else if (k == "samples" && is_int)
      r.samples = i;
    else if (k == "found_inf" && is_int)
      r.scaler.found_inf = i != 0;
    else if (k == "skipped" && is_int)
      r.scaler.skipped = i != 0;
    else if (k == "grew" && is_int)
      r.scaler.grew = i != 0;
    else if (k == "backed_off" && is_int)
      r.scaler.backed_off = i != 0;
    else if (k == "growth_deferred" && is_int)
      r.scaler.growth_deferred = i != 0;
    else if (k == "loss" && is_float)
      r.loss = static_cast<float>(d);
    else if (k == "scale_before" && is_float)
      r.scaler.scale_before = static_cast<float>(d);
    else if (k == "scale_after" && is_float)
      r.scaler.scale_after = static_cast<float>(d);
    else if (k == "learning_rate" && is_float)
      r.learning_rate = static_cast<float>(d);
    else if (k == "grad_norm" && is_float)
      r.grad_norm = static_cast<float>(d);
    else if (k == "logprob_mismatch" && is_float)
      r.logprob_mismatch = static_cast<float>(d);
    else if (k == "forward" && is_float)
      r.seconds.forward = d;
    else if (k == "backward" && is_float)
      r.seconds.backward = d;
    else if (k == "unscale" && is_float)
      r.seconds.unscale = d;
    else if (k == "optimizer" && is_float)
      r.seconds.optimizer = d;
    else if (k == "total" && is_float)
      r.seconds.total = d;
    else if (k == "layer_scales_after" && r.scaler.layer_scales_after.empty() &&
             DecodeHexFloats(kv.second, &r.scaler.layer_scales_after))
      continue;  // decoded
    else
      return absl::InvalidArgumentError(absl::StrCat(kMetaLastReport, ": bad entry '", part, "'"));
  }
  return r;
}

// FNV-1a, 64 bits: a digest whose value is the same in every build and on
// every machine (absl::Hash is seeded per process), for kMetaConfigDigest.
std::string ConfigDigest(absl::string_view config_json) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : config_json) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return absl::StrFormat("%016x", h);
}

// ---- Job ----------------------------------------------------------------------------

Job::Job(std::string job_id, std::string owner, std::string request_id, ValidJobConfig config,
         const JobContext* context)
    : id_(std::move(job_id)),
      owner_(std::move(owner)),
      request_id_(std::move(request_id)),
      config_(std::move(config)),
      config_json_(EncodeJobConfig(config_.get(), request_id_)),
      context_(context),
      estimated_bytes_(EstimateJobBytes(config_.get())) {
  absl::MutexLock lock(&mu_);
  snapshot_.job_id = id_;
  snapshot_.request_id = request_id_;
  snapshot_.parameter_count = model::ParameterCount(config_.get().model);
  snapshot_.estimated_bytes = estimated_bytes_;
  snapshot_.scaler.scale = config_.get().scaler.InitialScale();
  snapshot_.config = config_.get();
}

Job::~Job() = default;

JobSnapshot Job::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return snapshot_;
}

bool Job::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

void Job::Post(std::function<void()> task, WorkerPool::Lane lane) {
  bool schedule = false;
  {
    absl::MutexLock lock(&queue_mu_);
    queue_.push_back(Task{std::move(task), lane});
    if (!scheduled_) scheduled_ = schedule = true;
  }
  // Unscheduled, the queue was empty: this task is its front.
  if (schedule) Pool().Post([self = shared_from_this()] { self->RunOne(); }, lane);
}

int64_t Job::ReleaseWorkspacesIfIdle() {
  // Never waits: a job inside a step holds workspace_mu_ and may itself be
  // asking the others (its admission) for memory.
  if (!workspace_mu_.TryLock()) return 0;
  int64_t freed = 0;
  if (trainer_ != nullptr) {
    freed = trainer_->workspace_bytes();
    trainer_->ReleaseWorkspaces();
    bytes_in_use_.store(trainer_->backend().BytesInUse(), std::memory_order_relaxed);
  }
  RecordWorkspace();
  workspace_mu_.Unlock();
  return freed;
}

// One task per pool turn, then the job queues itself again behind other jobs'
// work, so a job with a long backlog cannot starve the others; in the lane
// of its next task, so a long one waits for a thread long tasks may take.
void Job::RunOne() {
  std::function<void()> task;
  {
    absl::MutexLock lock(&queue_mu_);
    task = std::move(queue_.front().run);
    queue_.pop_front();
  }
  task();
  task = nullptr;  // what it captured (a finished call's buffers) goes now
  bytes_in_use_.store(trainer_ ? trainer_->backend().BytesInUse() : 0, std::memory_order_relaxed);
  std::optional<WorkerPool::Lane> next;
  {
    absl::MutexLock lock(&queue_mu_);
    if (queue_.empty()) {
      scheduled_ = false;
    } else {
      next = queue_.front().lane;
    }
  }
  if (next.has_value()) Pool().Post([self = shared_from_this()] { self->RunOne(); }, *next);
}

absl::Status Job::NotOpen() const {
  if (!unrestored_.empty() && !closed()) {
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "job ", id_, " has failed: its checkpoint could not be restored (", unrestored_,
            "); the file is kept as it was: load a good state with LoadStateDict "
            "to resume the job, or delete it")),
        reason::kJobFailed, {{"job_id", id_}});
  }
  return WithReason(absl::NotFoundError(absl::StrCat("job_id: no job ", id_)), reason::kJobNotFound,
                    {{"job_id", id_}});
}

void Job::RecordWorkspace() {
  workspace_bytes_.store(trainer_ != nullptr ? trainer_->workspace_bytes() : 0,
                         std::memory_order_relaxed);
}

void Job::SetFailure(std::string failure) {
  absl::MutexLock lock(&mu_);
  snapshot_.state = failure.empty() ? JobState::kActive : JobState::kFailed;
  snapshot_.failure = std::move(failure);
}

void Job::RefreshSnapshot() {
  if (trainer_ == nullptr) return;
  snapshot_.step = trainer_->steps_run();
  snapshot_.applied_steps = trainer_->applied_steps();
  snapshot_.config = trainer_->config();
  snapshot_.parameter_count = trainer_->parameter_count();
  snapshot_.scaler = trainer_->scaler();
}

absl::Status Job::Initialize(const std::string& device) {
  return AllocationGuard("CreateJob", [&] { return InitializeUnguarded(device); });
}

absl::StatusOr<std::unique_ptr<Trainer>> Job::CreateTrainer(const std::string& device,
                                                            int64_t* capacity) {
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend(device));
  *capacity = backend->MemoryCapacityBytes();
  std::shared_ptr<const model::FrozenBase> base;
  if (SharesBase(config_.get())) {
    if (context_->bases == nullptr) {
      return absl::FailedPreconditionError(
          "config.base_model: this ampd has no --models-dir, so no base model");
    }
    const JobConfig& c = config_.get();
    AMPD_ASSIGN_OR_RETURN(
        base, context_->bases->Acquire(c.base_model, c.model, c.precision, backend->name()));
  }
  return Trainer::Create(config_, std::move(backend), std::move(base));
}

absl::Status Job::LoadBaseWeights() {
  if (context_->bases == nullptr) {
    return absl::FailedPreconditionError(
        "config.base_model: this ampd has no --models-dir, so no base model");
  }
  // What ampd.from_pretrained sends: each weight file in turn, its weights
  // widened to F32, as a partial load (each weight replaced, the optimizer
  // fresh).
  absl::Status loaded =
      context_->bases
          ->ForEachWeightFile(config_.get().base_model,
                              [&](std::vector<codec::NamedTensor> tensors) -> absl::Status {
                                checkpoint::StateDict state;
                                state.metadata["format"] = "pt";
                                for (codec::NamedTensor& t : tensors) {
                                  AMPD_ASSIGN_OR_RETURN(HostTensor widened,
                                                        model::WidenedToF32(t.name, t.tensor));
                                  t.tensor = HostTensor();
                                  state.tensors.push_back({std::move(t.name), std::move(widened)});
                                }
                                return trainer_->LoadState(state, Trainer::StepCount::kKeep,
                                                           Trainer::Coverage::kPartial);
                              })
          .status();
  if (!loaded.ok() && !absl::StartsWith(loaded.message(), "config.base_model")) {
    return absl::Status(loaded.code(), absl::StrCat("config.base_model: ", config_.get().base_model,
                                                    ": ", loaded.message()));
  }
  return loaded;
}

absl::Status Job::InitializeUnguarded(const std::string& device) {
  int64_t capacity = 0;
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = CreateTrainer(device, &capacity);
  // Weights that fit the device yet could not be allocated: memory pressure
  // from other jobs' cached workspaces, which idle jobs give up, then one
  // more try. (Weights larger than the device are refused before any
  // allocation, and nothing is asked of the other jobs for them.)
  if (!trainer.ok() && trainer.status().code() == absl::StatusCode::kResourceExhausted &&
      (capacity == 0 || estimated_bytes_ <= capacity) && context_->release_idle_workspaces &&
      context_->release_idle_workspaces(this) > 0) {
    trainer = CreateTrainer(device, &capacity);
  }
  AMPD_RETURN_IF_ERROR(trainer.status());
  (*trainer)->SetMemoryPressureHandler([this] {
    if (context_->release_idle_workspaces) (void)context_->release_idle_workspaces(this);
  });
  {
    absl::MutexLock lock(&workspace_mu_);
    trainer_ = *std::move(trainer);
  }
  initial_state_ = true;
  if (!config_.get().base_model.empty() && !SharesBase(config_.get())) {
    // Its own copy of the base: its state is no longer its config and seed.
    AMPD_RETURN_IF_ERROR(LoadBaseWeights());
    initial_state_ = false;
  }
  bytes_in_use_.store(trainer_->backend().BytesInUse(), std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  RefreshSnapshot();
  return absl::OkStatus();
}

absl::Status Job::Restore(const std::string& device, const checkpoint::StateDict& state) {
  if (state.metadata.contains(kMetaInitialState)) {
    // Checked before anything is built: a file that fails is left as it is.
    AMPD_RETURN_IF_ERROR(CheckSeedOnly(state));
    AMPD_RETURN_IF_ERROR(Initialize(device));
    // A shared base's job at step 0 is its config, seed and base: the
    // base's files must be the ones it was made on.
    auto digest = state.metadata.find(kMetaBaseDigest);
    const model::FrozenBase* base = trainer_->frozen_base();
    if (base != nullptr &&
        (digest == state.metadata.end() || digest->second != base->identity().digest)) {
      return absl::DataLossError(absl::StrCat(
          kMetaBaseDigest, ": the job was made on base_model ", base->identity().name,
          digest == state.metadata.end() ? " (no digest recorded)"
                                         : absl::StrCat(" with files of digest ", digest->second),
          "; its files now have ", base->identity().digest, " (they changed since)"));
    }
    return absl::OkStatus();
  }
  AMPD_RETURN_IF_ERROR(Initialize(device));
  initial_state_ = false;
  // Whatever ForwardBackward calls the job held before the restart are gone.
  accumulation_dropped_ = true;
  AMPD_RETURN_IF_ERROR(AllocationGuard("restore", [&] { return trainer_->LoadState(state); }));
  // The Trainer took its counts from the checkpoint; the recorded response
  // is kept when it is the last step's.
  if (auto it = state.metadata.find(kMetaLastReport); it != state.metadata.end()) {
    absl::StatusOr<StepReport> report = DecodeStepReport(it->second);
    if (report.ok() && report->step == trainer_->steps_run()) last_report_ = *std::move(report);
  }
  // A job that failed before the restart stays failed: resuming it would
  // silently train on past the scaler's refusal.
  if (auto it = state.metadata.find(kMetaFailure); it != state.metadata.end()) {
    SetFailure(it->second.empty() ? "failed before a restart" : it->second);
  }
  absl::MutexLock lock(&mu_);
  RefreshSnapshot();
  return absl::OkStatus();
}

void Job::KeepUnrestored(std::string device, std::string why) {
  (void)DropSnapshots(/*remove_files=*/false);
  {
    absl::MutexLock lock(&workspace_mu_);
    trainer_.reset();
    RecordWorkspace();
  }
  last_report_.reset();
  initial_state_ = false;
  bytes_in_use_.store(0, std::memory_order_relaxed);
  device_ = std::move(device);
  unrestored_ = std::move(why);
  SetFailure(absl::StrCat("failed to restore: ", unrestored_));
}

WorkerPool& Job::Pool() const {
  return distributed() && context_->distributed_pool != nullptr ? *context_->distributed_pool
                                                                : *context_->pool;
}

absl::StatusOr<StepReport> Job::Run(Valid<StepRequest> request, const CallToken& call) {
  if (trainer_ == nullptr) return NotOpen();
  const int64_t sequence = request->sequence;
  const int64_t every = context_->grad_histogram_every;
  request.set_sample_grad_histogram(every > 0 && sequence % every == 0);
  if (distributed()) return DistributedStep(request);
  AMPD_ASSIGN_OR_RETURN(std::optional<StepReport> recorded, CheckSequence(sequence));
  if (recorded.has_value()) return *std::move(recorded);
  if (const int64_t pending = trainer_->pending_forward_backward(); pending > 0) {
    // A Step would drop them: the client meant them for an OptimStep.
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "sequence: ", pending, " ForwardBackward call(s) are accumulated for update ", sequence,
            "; apply them with OptimStep before a Step")),
        reason::kAccumulationPending, {{"pending", absl::StrCat(pending)}});
  }
  AMPD_ASSIGN_OR_RETURN(const FittedStepInput fitted, trainer_->CheckInput(request));
  return RunStep(sequence, fitted, nullptr, call);
}

absl::StatusOr<std::optional<StepReport>> Job::CheckSequence(int64_t sequence) const {
  const JobSnapshot current = Snapshot();
  const int64_t done = trainer_->steps_run();
  const std::string expected = absl::StrCat(done + 1);
  if (sequence == done && done > 0) {
    if (last_report_.has_value()) return std::optional<StepReport>(*last_report_);
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "sequence: step ", done,
            " was applied before a restart and its response is lost; expected ", expected)),
        reason::kSequenceMismatch, {{"expected_sequence", expected}});
  }
  if (current.state == JobState::kFailed) {
    return WithReason(absl::FailedPreconditionError(
                          absl::StrCat("job ", id_, " has failed (", current.failure,
                                       "); load a good state with LoadStateDict to resume it")),
                      reason::kJobFailed, {{"job_id", id_}});
  }
  if (sequence != done + 1) {
    return WithReason(absl::FailedPreconditionError(
                          absl::StrCat("sequence: expected ", expected, ", got ", sequence)),
                      reason::kSequenceMismatch, {{"expected_sequence", expected}});
  }
  return std::nullopt;
}

absl::StatusOr<StepReport> Job::RunStep(int64_t sequence, const FittedStepInput& input,
                                        const DataParallelStep* data_parallel,
                                        const CallToken& call) {
  return RunUpdate(
      sequence, "Step",
      [&](const std::function<absl::Status(int64_t)>& admit) {
        return trainer_->Step(input, admit, data_parallel, call);
      },
      data_parallel);
}

absl::StatusOr<StepReport> Job::RunUpdate(
    int64_t sequence, absl::string_view what,
    const std::function<absl::StatusOr<StepReport>(const std::function<absl::Status(int64_t)>&)>&
        run,
    const DataParallelStep* data_parallel) {
  // Whatever the step's outcome, the state may no longer be the seed's;
  // except a step of its own stopped by its caller, which changed nothing.
  const bool initial_before = initial_state_;
  initial_state_ = false;
  absl::StatusOr<StepReport> report = WithWorkspace(what, run);
  if (!report.ok()) {
    if (data_parallel == nullptr && StoppedByCaller(report.status())) {
      initial_state_ = initial_before;
      return report.status();
    }
    if (report.status().code() != absl::StatusCode::kFailedPrecondition) {
      // The other ranks may be left inside a collective this rank never
      // reached; they time out, and every rank forms the group afresh.
      if (data_parallel != nullptr) {
        DropGroup();
        if (report.status().code() == absl::StatusCode::kUnavailable) {
          return PeerUnavailable(report.status().message());
        }
      }
      return report.status();
    }
    // The Trainer's one FailedPrecondition: the scaler refused to go on at
    // its minimum scale. The job stops here, durably, until a good state is
    // loaded; the step's sequence number was not used.
    SetFailure(std::string(report.status().message()));
    if (absl::Status s = Checkpoint(); !s.ok()) {
      std::fprintf(stderr, "ampd: job %s checkpoint of its failure failed: %s\n", id_.c_str(),
                   s.ToString().c_str());
    }
    return WithReason(report.status(), reason::kScalerAtMinScale, {{"job_id", id_}});
  }
  // The Trainer's count is the sequence (a step runs only as number
  // steps_run() + 1, and an import keeps the count), so report->step is
  // `sequence` already.
  last_report_ = *report;
  ++weights_version_;
  {
    absl::MutexLock lock(&mu_);
    RefreshSnapshot();
    if (!report->scaler.skipped) snapshot_.grad_norm = report->grad_norm;
  }
  if (context_->observer != nullptr) context_->observer->OnStep(id_, *report);
  if (context_->checkpoint_every > 0 && sequence % context_->checkpoint_every == 0) {
    if (absl::Status s = CheckpointInBackground(); !s.ok()) {
      std::fprintf(stderr, "ampd: job %s checkpoint failed at step %lld: %s\n", id_.c_str(),
                   static_cast<long long>(sequence), s.ToString().c_str());
    }
  }
  return report;
}

absl::StatusOr<EvaluateReport> Job::Run(Valid<EvaluateRequest> request, const CallToken& call) {
  if (trainer_ == nullptr) return NotOpen();
  absl::StatusOr<EvaluateReport> report =
      WithWorkspace("Evaluate", [&](const std::function<absl::Status(int64_t)>& admit) {
        return trainer_->Evaluate(request, admit, call);
      });
  if (report.ok() && context_->observer != nullptr) context_->observer->OnEvaluate(id_, *report);
  return report;
}

absl::StatusOr<SampleReport> Job::Run(Valid<SampleRequest> request, const CallToken& call) {
  if (trainer_ == nullptr) return NotOpen();
  SamplerWeights* snapshot = nullptr;
  if (!request->input.snapshot.empty()) {
    AMPD_ASSIGN_OR_RETURN(snapshot, FindSnapshot("snapshot", request->input.snapshot));
  }
  absl::StatusOr<SampleReport> report =
      WithWorkspace("Sample", [&](const std::function<absl::Status(int64_t)>& admit) {
        return snapshot != nullptr ? trainer_->SampleFrom(*snapshot, request, admit, call)
                                   : trainer_->Sample(request, admit, call);
      });
  if (report.ok() && context_->observer != nullptr) context_->observer->OnSample(id_, *report);
  return report;
}

absl::StatusOr<checkpoint::EncodedSafetensors> Job::Run(Valid<ExportStateRequest> request,
                                                        const CallToken& /*call*/) {
  // The read of the state is one unit; its chunks are streamed by the
  // caller, which stops when its client does.
  return ExportSafetensors(request->view);
}

absl::StatusOr<int64_t> Job::Run(Valid<ImportStateRequest> request, const CallToken& /*call*/) {
  const bool partial = request->partial;
  // The file's buffers move into the job, not copied.
  absl::StatusOr<int64_t> tensors = ImportSafetensors(std::move(request).Take().state, partial);
  if (tensors.ok()) std::fprintf(stderr, "ampd: job %s state loaded\n", id_.c_str());
  return tensors;
}

absl::StatusOr<checkpoint::EncodedSafetensors> Job::ExportSafetensors(StateView view) const {
  return AllocationGuard("GetStateDict", [&] { return ExportSafetensorsUnguarded(view); });
}

absl::StatusOr<checkpoint::EncodedSafetensors> Job::ExportSafetensorsUnguarded(
    StateView view) const {
  if (trainer_ == nullptr) return NotOpen();
  checkpoint::EncodedSafetensors encoded;
  AMPD_ASSIGN_OR_RETURN(encoded.state, trainer_->ExportView(view));
  AMPD_RETURN_IF_ERROR(checkpoint::ValidateStateDict(encoded.state));
  encoded.header = checkpoint::EncodeSafetensorsHeader(encoded.state);
  return encoded;
}

absl::StatusOr<int64_t> Job::ImportSafetensors(checkpoint::StateDict state, bool partial) {
  return AllocationGuard("LoadStateDict",
                         [&] { return ImportSafetensorsUnguarded(std::move(state), partial); });
}

absl::StatusOr<int64_t> Job::ImportSafetensorsUnguarded(checkpoint::StateDict state, bool partial) {
  const Trainer::Coverage coverage =
      partial ? Trainer::Coverage::kPartial : Trainer::Coverage::kComplete;
  if (trainer_ == nullptr && !unrestored_.empty() && !closed()) {
    // A job whose checkpoint could not be restored comes back through a
    // good state: built from its config, then loaded as any import. Until
    // the import is on disk it stays as it was (no Trainer, its file kept).
    AMPD_RETURN_IF_ERROR(InitializeUnguarded(device_));
    const std::string why = unrestored_;
    unrestored_.clear();
    absl::StatusOr<int64_t> loaded = ImportSafetensorsUnguarded(std::move(state), partial);
    if (!loaded.ok()) KeepUnrestored(device_, why);
    return loaded;
  }
  if (trainer_ == nullptr) return NotOpen();
  const auto tensors = static_cast<int64_t>(state.tensors.size());
  auto refused = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kInvalidArgument ? WithReason(s, reason::kInvalidStateDict)
                                                          : s;
  };
  // The step sequence is the job's protocol with its client: an imported
  // state replaces weights, optimizer and scaler, not the count of Step
  // calls this job has answered.
  if (context_->state_dir == nullptr) {
    absl::StatusOr<Trainer::ReplacedState> replaced =
        trainer_->ReplaceState(state, Trainer::StepCount::kKeep, coverage);
    if (!replaced.ok()) return refused(replaced.status());
    AfterImport();
    return tensors;
  }
  // With a state directory the import is acknowledged only once it is on
  // disk. The checkpoint is the imported file's own host buffers, arranged
  // as ExportState will read them back (nothing is read back), and it is
  // written while the same buffers are uploaded. What the upload replaces
  // stays on the device until the write is done, to go back to if it fails.
  absl::StatusOr<checkpoint::StateDict> arranged =
      trainer_->ArrangeForLoad(std::move(state), Trainer::StepCount::kKeep, coverage);
  if (!arranged.ok()) return refused(arranged.status());
  const JobSnapshot before = Snapshot();
  const bool initial_before = initial_state_;
  std::optional<StepReport> previous_report = last_report_;
  // The checkpoint's job metadata is the job's after the import: active,
  // no failure, no recorded response (set below, once the upload is in).
  AddJobMetadata(*arranged);
  arranged->metadata.erase(kMetaLastReport);
  arranged->metadata.erase(kMetaFailure);
  // A background write of an older state must not land after this one.
  if (context_->writer != nullptr) context_->writer->Cancel(id_);
  absl::StatusOr<std::string> temp = absl::InternalError("checkpoint: not written");
  absl::StatusOr<Trainer::ReplacedState> replaced = UploadBesideCheckpoint(*arranged, &temp);
  if (!replaced.ok()) {
    if (temp.ok()) context_->state_dir->Discard(*temp);
    return refused(replaced.status());
  }
  AfterImport();
  absl::Status saved = temp.status();
  if (saved.ok()) saved = context_->state_dir->Publish(id_, *temp);
  if (!saved.ok()) {
    // Not durable, so not done: put the job back as it was (memory and disk
    // agree again) and say so.
    absl::Status restored = trainer_->UndoReplace(*std::move(replaced));
    initial_state_ = initial_before;
    last_report_ = std::move(previous_report);
    {
      absl::MutexLock lock(&mu_);
      snapshot_.state = before.state;
      snapshot_.failure = before.failure;
      RefreshSnapshot();
    }
    return absl::Status(
        saved.code(),
        absl::StrCat(
            "the state dict could not be checkpointed, so it was not loaded: ", saved.message(),
            restored.ok()
                ? ""
                : absl::StrCat("; restoring the previous state failed too: ", restored.message())));
  }
  std::fprintf(stderr, "ampd: job %s checkpointed at step %s\n", id_.c_str(),
               arranged->metadata.at(kMetaStep).c_str());
  return tensors;
}

absl::StatusOr<Trainer::ReplacedState> Job::UploadBesideCheckpoint(
    const checkpoint::StateDict& arranged, absl::StatusOr<std::string>* temp) {
  absl::StatusOr<Trainer::ReplacedState> replaced = absl::InternalError("not loaded");
  double write_seconds = 0.0;
  double upload_seconds = 0.0;
  {
    // Both only read `arranged`; the thread is joined before it is touched.
    std::jthread write([&] {
      const auto start = std::chrono::steady_clock::now();
      *temp = AllocationGuard("checkpoint",
                              [&] { return context_->state_dir->WriteTemp(id_, arranged); });
      write_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
    // Guarded here: out of memory is an error to clean up after, not an
    // exception past the temp file.
    const auto start = std::chrono::steady_clock::now();
    replaced = AllocationGuard("LoadStateDict", [&]() -> absl::StatusOr<Trainer::ReplacedState> {
      return trainer_->ReplaceState(arranged, Trainer::StepCount::kKeep);
    });
    upload_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // Which of the two bounds an import: the device's upload or the disk.
  std::fprintf(stderr,
               "ampd: job %s import: upload %.3f s, checkpoint written in %.3f s beside it\n",
               id_.c_str(), upload_seconds, write_seconds);
  return replaced;
}

void Job::AfterImport() {
  initial_state_ = false;
  ++weights_version_;
  // The recorded response belongs to the old weights; a retry of the last
  // sequence after an import must not pretend it was computed on the new ones.
  last_report_.reset();
  // So do accumulated gradients: the client's next call learns they are
  // gone (ACCUMULATION_LOST) rather than applying them to other weights.
  last_call_.reset();
  if (trainer_ != nullptr && trainer_->pending_forward_backward() > 0) {
    trainer_->DropAccumulated();
    accumulation_dropped_ = true;
    ReportPending();
  }
  // A distributed job's ranks meet again at the next step and compare their
  // states: the same import must reach every rank before it trains on.
  DropGroup();
  absl::MutexLock lock(&mu_);
  snapshot_.state = JobState::kActive;
  snapshot_.failure.clear();
  RefreshSnapshot();
}

absl::Status Job::Checkpoint() {
  return AllocationGuard("checkpoint", [&] { return CheckpointUnguarded(); });
}

absl::StatusOr<checkpoint::StateDict> Job::CheckpointState() const {
  if (trainer_ == nullptr) return NotOpen();
  checkpoint::StateDict state;
  if (initial_state_) {
    // The config and seed are the state (kMetaInitialState): no weights
    // are read back or written, whatever the model's size.
    state.metadata[kMetaInitialState] = kSeededInitialisation;
    state.metadata[kMetaConfigDigest] = ConfigDigest(config_json_);
    state.metadata.emplace(kMetaStep, "0");  // not = "0": GCC 12 -Wrestrict misfires on it
    if (const model::FrozenBase* base = trainer_->frozen_base(); base != nullptr) {
      state.metadata[kMetaBaseModel] = base->identity().name;
      state.metadata[kMetaBaseDigest] = base->identity().digest;
    }
  } else {
    AMPD_ASSIGN_OR_RETURN(state, trainer_->ExportState());
  }
  AddJobMetadata(state);
  return state;
}

void Job::AddJobMetadata(checkpoint::StateDict& state) const {
  const JobSnapshot snapshot = Snapshot();
  state.metadata[kMetaConfig] = config_json_;
  state.metadata[kMetaRequestId] = request_id_;
  state.metadata[kMetaOwner] = owner_;
  if (last_report_.has_value()) {
    state.metadata[kMetaLastReport] = EncodeStepReport(*last_report_);
  } else {
    state.metadata.erase(kMetaLastReport);
  }
  if (snapshot.state == JobState::kFailed) {
    state.metadata[kMetaFailure] = snapshot.failure;
  } else {
    state.metadata.erase(kMetaFailure);
  }
}

absl::Status Job::CheckpointUnguarded() {
  if (context_->state_dir == nullptr) return absl::OkStatus();
  // The checkpoint that could not be restored stays on disk untouched.
  if (trainer_ == nullptr && !unrestored_.empty()) return absl::OkStatus();
  AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDict state, CheckpointState());
  if (context_->writer != nullptr) context_->writer->Cancel(id_);
  AMPD_RETURN_IF_ERROR(context_->state_dir->Write(id_, state));
  std::fprintf(stderr, "ampd: job %s checkpointed at step %s\n", id_.c_str(),
               state.metadata.at(kMetaStep).c_str());
  return absl::OkStatus();
}

absl::Status Job::CheckpointInBackground() {
  if (context_->state_dir == nullptr) return absl::OkStatus();
  if (context_->writer == nullptr) return Checkpoint();
  // The previous snapshot must be on disk first: with one unwritten
  // snapshot at most, no acknowledged step runs more than 2N - 1 steps past
  // the last durable checkpoint (N = checkpoint_every; the bound docs/OPERATIONS.md states).
  // A step waits here only when the writer is slower than N steps.
  context_->writer->WaitForJob(id_);
  return AllocationGuard("checkpoint", [&]() -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(checkpoint::StateDict state, CheckpointState());
    // The writer encodes and validates (StateDirectory::Write) off the strand.
    context_->writer->Enqueue(id_, Snapshot().step, std::move(state));
    return absl::OkStatus();
  });
}

absl::Status Job::Close(bool remove_checkpoint) {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // The group's buffers and communicator go before the Trainer whose
  // gradients they sum; the other ranks' collectives fail and they wait.
  DropGroup();
  rendezvous_.reset();
  // Before the Trainer, whose backend holds them; a deleted job's files go.
  const absl::Status snapshots_dropped = DropSnapshots(remove_checkpoint);
  {
    // Its workspaces go with it.
    absl::MutexLock lock(&workspace_mu_);
    trainer_.reset();
    RecordWorkspace();
  }
  last_report_.reset();
  bytes_in_use_.store(0, std::memory_order_relaxed);
  // The strand enqueues no more snapshots (no Trainer), so after this no
  // background write of the job can land.
  if (context_->writer != nullptr) context_->writer->Cancel(id_);
  if (remove_checkpoint && context_->state_dir != nullptr) {
    AMPD_RETURN_IF_ERROR(context_->state_dir->Remove(id_));
  }
  return snapshots_dropped;
}

}  // namespace ampd::engine
