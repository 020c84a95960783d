// Job: one training job — its Trainer, its step sequence (exactly-once
// Steps), its checkpoints — and the ordered worker that is the Trainer's only
// caller. A job's work runs as tasks on a strand over a small shared
// WorkerPool (server/common/worker_pool.h): one task of a job at a time, in
// post order, different jobs in parallel. No gRPC or protobuf here; the rpc
// layer posts tasks and finishes its calls from them.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/worker_pool.h"
#include "server/engine/call_token.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/checkpoint/state_directory.h"
#include "server/engine/config/job_config.h"
#include "server/engine/dist/gradient_all_reduce.h"
#include "server/engine/dist/process_group.h"
#include "server/engine/dist/rendezvous.h"
#include "server/engine/jobs/allocation_guard.h"
#include "server/engine/jobs/checkpoint_writer.h"
#include "server/engine/jobs/job_observer.h"
#include "server/engine/trainer/trainer.h"

namespace ampd::engine {

class Job;

// A step's (or an evaluation's) workspace admitted against a memory limit
// (JobContext::admit_step). Whoever admitted it counts it for the job, in
// place of the job's workspace_bytes(), until it is dropped: the job drops
// it once it has recorded what its Trainer keeps cached after the call, so
// the bytes are counted throughout and two jobs cannot both be admitted
// into the same free bytes. Move-only; an empty one holds nothing.
class WorkspaceReservation {
 public:
  WorkspaceReservation() = default;
  // `release` runs once, when the reservation is dropped.
  explicit WorkspaceReservation(std::function<void()> release) : release_(std::move(release)) {}
  WorkspaceReservation(WorkspaceReservation&& other) noexcept
      : release_(std::exchange(other.release_, nullptr)) {}
  WorkspaceReservation& operator=(WorkspaceReservation&& other) noexcept {
    Reset();
    release_ = std::exchange(other.release_, nullptr);
    return *this;
  }
  ~WorkspaceReservation() { Reset(); }
  void Reset() {
    if (release_) std::exchange(release_, nullptr)();
  }

 private:
  std::function<void()> release_;
};

class BaseModels;

// Shared by every job of a registry; outlives them.
struct JobContext {
  WorkerPool* pool = nullptr;
  const checkpoint::StateDirectory* state_dir = nullptr;  // nullptr: no checkpoints
  JobObserver* observer = nullptr;                        // nullable
  int64_t checkpoint_every = 0;                           // 0: only on shutdown
  // Writes periodic checkpoints off the strand; nullptr: they are written on
  // it, before the step that took them is answered (--checkpoint-sync).
  CheckpointWriter* writer = nullptr;
  int64_t grad_histogram_every = 0;         // 0: never sample
  std::function<void()> on_memory_changed;  // nullable
  // Asked, on the job's strand, for the workspace bytes a Step (or an
  // Evaluate) is about to allocate (Trainer::Step's admit); an error
  // refuses the step unchanged. The job holds the reservation until the
  // step is over. Nullable: no limit.
  std::function<absl::StatusOr<WorkspaceReservation>(Job& job, int64_t workspace_bytes)> admit_step;
  // Memory pressure: frees the cached workspaces of every idle job but
  // `except` (JobRegistry::ReleaseIdleWorkspaces) and returns the bytes
  // freed. A job calls it when an allocation of its own fails for lack of
  // memory, then retries that allocation once. Nullable.
  std::function<int64_t(const Job* except)> release_idle_workspaces;
  // Asked, on the job's strand, before a sampler snapshot of `bytes` is
  // made or restored: OK once the bytes are counted for the job
  // (Job::HoldSnapshotBytes, under the limits' own lock, so two jobs cannot
  // both take the same free bytes); an error refuses the snapshot.
  // Nullable: no limit (the job counts them itself).
  std::function<absl::Status(Job& job, int64_t bytes)> admit_snapshot;
  // Distributed jobs (docs/DISTRIBUTED.md). Their strands run on a pool of
  // their own, one thread per distributed job the registry admits, because
  // a distributed job's task blocks while it waits for its peers: on the
  // shared pool, jobs waiting for other processes could hold every thread
  // those processes' progress depends on. nullptr: this ampd takes no
  // distributed jobs.
  WorkerPool* distributed_pool = nullptr;
  // The --models-dir a job made from a base_model reads (and, for a LoRA
  // job, shares) its base from; nullptr: none.
  BaseModels* bases = nullptr;
  // The host this ampd's --peer-address names: the Gloo transport binds
  // there. And how to reach a group's meeting point.
  std::string peer_host;
  dist::RendezvousConnector rendezvous;
};

// A sampler snapshot's file (job_snapshots.cc), in the sub-directory
// snapshots/<job id>/ of the state directory, named <snapshot>.safetensors:
// the snapshot's weights under the parameters' names in the working dtype,
// and these keys. kMetaSnapshotFormat is the file's format version (a file
// of another version is not restored, and left on disk);
// kMetaConfigDigest ties it to its job's config.
inline constexpr char kMetaSnapshotFormat[] = "ampd.sampler_snapshot";
inline constexpr char kSnapshotFormatVersion[] = "1";
inline constexpr char kMetaSnapshotStep[] = "ampd.snapshot_step";
inline constexpr char kMetaSnapshotAppliedSteps[] = "ampd.snapshot_applied_steps";

// Metadata keys a job writes into its checkpoints (state_dict.h's ampd.*),
// beside the Trainer's own (kMetaStep, kMetaOptimizerStep).
inline constexpr char kMetaConfig[] = "ampd.config";  // job_config_codec.h's JSON
// Written by earlier versions instead of ampd.config: base64 of a serialized
// CreateJobRequest, which only the rpc layer can read (RestoreAll's
// CreateRequestDecoder).
inline constexpr char kMetaCreateRequest[] = "ampd.create_request";
inline constexpr char kMetaLastReport[] = "ampd.last_report";  // the last step's response
inline constexpr char kMetaRequestId[] = "ampd.request_id";
// The tenant that created the job; absent (as in checkpoints written before
// jobs had owners) means the anonymous tenant "".
inline constexpr char kMetaOwner[] = "ampd.owner";
inline constexpr char kMetaFailure[] = "ampd.failure";  // present while the job is failed
// Present in a seed-only checkpoint: the one a job writes while it is still
// exactly what its config and seed made (no step run, nothing imported), at
// creation and at shutdown. Such a file holds no tensors: a restore rebuilds
// the weights from ampd.config's model and seed, bit for bit (the seeded
// initialisation is deterministic on every backend), so creating a job
// never writes its weights to disk; its first full checkpoint replaces the
// file. The value names the initialisation the file relies on.
inline constexpr char kMetaInitialState[] = "ampd.initial_state";
// The FNV-1a 64 digest of ampd.config's bytes, in hex, in a seed-only
// checkpoint: there the config is the whole state, and a corrupted seed
// still reads as valid JSON, so it must not silently rebuild other weights.
inline constexpr char kMetaConfigDigest[] = "ampd.config_digest";
// The seeded initialisation seed-only checkpoints rely on: model/init.cc's
// PyTorch-default distributions drawn with Philox4x32-10, parameter k of
// the model's parameter order from stream k of the seed.
// tests/engine/seed_checkpoint_test.cc pins what it produces; a change that
// moves that pin must rename this, so that files written before it are
// refused with a clear error instead of restored with other weights.
inline constexpr char kSeededInitialisation[] = "seed:philox4x32-10:v1";

// The FNV-1a 64 digest of a job's config JSON, in hex (kMetaConfigDigest).
std::string ConfigDigest(absl::string_view config_json);

class Job : public std::enable_shared_from_this<Job> {
 public:
  // Every checkpoint stores config with request_id (EncodeJobConfig): what a
  // restart recreates the job from, beside its owner (kMetaOwner): the
  // tenant that created it ("" for the anonymous tenant of an open server).
  Job(std::string job_id, std::string owner, std::string request_id, ValidJobConfig config,
      const JobContext* context);
  ~Job();

  const std::string& id() const { return id_; }
  const std::string& owner() const { return owner_; }
  const std::string& request_id() const { return request_id_; }
  const dist::DistributedSpec& distributed_spec() const { return config_.get().distributed; }
  const JobConfig& config() const { return config_.get(); }
  JobSnapshot Snapshot() const;
  int64_t estimated_bytes() const { return estimated_bytes_; }
  // Backend bytes in use, refreshed by the worker after each task.
  int64_t bytes_in_use() const { return bytes_in_use_.load(std::memory_order_relaxed); }
  // Workspace bytes (activations, buffers) the job's Trainer keeps cached:
  // the workspaces of its last step's sizes stay allocated between steps
  // until ReleaseWorkspacesIfIdle or Close frees them. The job alone sets
  // it (RecordWorkspace); a registry counts it with estimated_bytes()
  // against its memory limit, except while a step's WorkspaceReservation
  // stands in for it.
  int64_t workspace_bytes() const { return workspace_bytes_.load(std::memory_order_relaxed); }

  // Runs `task` on this job's strand, after every task posted before it.
  // A long task (WorkerPool::Lane::kLong: a Sample) waits, once its turn
  // on the strand has come, for one of the pool's threads that long tasks
  // may take, so that it never holds the threads other jobs' calls need.
  void Post(std::function<void()> task, WorkerPool::Lane lane = WorkerPool::Lane::kShort);

  // Memory pressure, from any thread: unless the job is inside a step or
  // an evaluation (whose workspaces are in use), frees its Trainer's
  // cached workspaces right here and returns the bytes freed; 0 for a busy
  // job, which is left alone. Never waits for the job: a step holds
  // workspace_mu_, and this only tries it. Other strand work (exports,
  // checkpoints, state loads) never touches the workspaces and may run
  // meanwhile.
  int64_t ReleaseWorkspacesIfIdle();

  // ---- strand-only (call from a posted task) ----------------------------------
  // Builds the Trainer on a new backend for `device` from the job's config:
  // a LoRA job on a base_model over the shared base (BaseModels::Acquire),
  // a full job on one with the base's weights loaded into its own.
  absl::Status Initialize(const std::string& device);
  // Initialize, then load a checkpoint and continue its step sequence. A
  // seed-only checkpoint (kMetaInitialState) loads nothing: Initialize
  // rebuilds its state. One that names another initialisation, holds
  // tensors, is past step 0 or whose config does not match its digest is
  // refused (DataLoss naming the key).
  absl::Status Restore(const std::string& device, const checkpoint::StateDict& state);
  // After a Restore (or reading the checkpoint) failed with `why`: the job
  // stays listed, failed ("failed to restore: why"), without a Trainer.
  // Steps, evaluations and exports answer JOB_FAILED; its checkpoint is
  // never overwritten, except by an ImportSafetensors of a good state,
  // which builds the job from its config on `device` and makes it active;
  // DeleteJob removes it.
  void KeepUnrestored(std::string device, std::string why);
  // ---- the job's calls: one Run per request type (api.h), each given its
  // request as JobRegistry::Submit checked it (Valid<>) and the caller's
  // CallToken; each call that runs the model hands it to the Trainer
  // through WithWorkspace.
  //
  // Step. Exactly-once: sequence == step()+1 trains; sequence == step() returns the
  // recorded report; anything else is FailedPrecondition SEQUENCE_MISMATCH
  // naming the expected one. A scaler that gives up fails the job
  // (SCALER_AT_MIN_SCALE, checkpointed as failed); a failed job answers
  // JOB_FAILED until ImportSafetensors.
  //
  // A distributed job's Step first forms its group when it has none (meets
  // the other ranks; a rank behind the most advanced one copies its state),
  // then agrees with the ranks on the step (every rank must be sent the
  // same sequence) and runs its share. Unavailable, with the reason, while
  // a rank is missing or when one fails mid-step: nothing is applied and
  // the group forms again on the next Step; FailedPrecondition when the
  // ranks' configs or states disagree, InvalidArgument on every rank when
  // one rank's share is invalid.
  //
  // `request` was checked where the step was accepted (Valid<>); its
  // batches are checked against the model here, once (Trainer::CheckInput):
  // after the sequence rules for a job of its own, before the ranks agree
  // for a distributed one.
  //
  // `call` stops a step of a job of its own between its micro-batches
  // (Trainer::Step): nothing is applied, the sequence does not advance and
  // the same sequence may be sent again. A distributed step is not stopped
  // once it has started.
  absl::StatusOr<StepReport> Run(Valid<StepRequest> request, const CallToken& call = CallToken());
  // Accumulate, then apply (job_accumulate.cc). A ForwardBackward call
  // names the update its gradients go into (`sequence`, the job's next
  // sequence number, the one its OptimStep carries) and its 1-based
  // `index` among that update's calls. index == pending + 1 runs; the last
  // call resent (index == pending, same sequence) returns its recorded
  // report; index > pending + 1 after accumulated calls were dropped (a
  // restart, a state load or a call that failed after admission) is
  // FailedPrecondition ACCUMULATION_LOST with pending_lost, the calls to
  // resend, and expected_index; any other index (a call that arrived
  // before the one before it) or sequence is SEQUENCE_MISMATCH. Not for
  // distributed jobs (Unimplemented).
  // `call` stops it between micro-batches (Trainer::ForwardBackward): the
  // accumulated calls are then dropped, as after any failed call.
  absl::StatusOr<ForwardBackwardReport> Run(Valid<ForwardBackwardRequest> request,
                                            const CallToken& call = CallToken());
  // The update (Trainer::OptimStep) of sequence number `sequence`, under
  // Step's exactly-once rules (it shares the job's sequence and recorded
  // report with Step). forward_backward_calls must be the calls pending:
  // more, after calls were dropped, is ACCUMULATION_LOST (pending_lost =
  // the difference); any other difference is SEQUENCE_MISMATCH.
  absl::StatusOr<StepReport> Run(Valid<OptimStepRequest> request,
                                 const CallToken& call = CallToken());
  // ForwardBackward calls accumulated and not applied (0 without a Trainer).
  int64_t pending_forward_backward() const;

  // Trainer::Evaluate on the job's weights: NotFound when closed; a failed
  // job still evaluates (its weights are what it holds). Admitted as a
  // step's workspaces are (JobContext::admit_step), and reported to the
  // observer. Neither the step sequence nor the recorded report changes.
  // `call` stops it between micro-batches.
  absl::StatusOr<EvaluateReport> Run(Valid<EvaluateRequest> request,
                                     const CallToken& call = CallToken());
  // Trainer::Sample on the job's weights (or on its sampler snapshot
  // input.snapshot: NotFound SNAPSHOT_NOT_FOUND when it holds none of that
  // name), admitted and reported as Evaluate is; `call` stops it between
  // decode steps.
  absl::StatusOr<SampleReport> Run(Valid<SampleRequest> request,
                                   const CallToken& call = CallToken());

  // ---- sampler snapshots (job_snapshots.cc) ----
  // A named copy of the weights Sample reads now (Trainer::
  // CopySamplerWeights), admitted first (JobContext::admit_snapshot) and,
  // with a state directory, written to its own file before this returns.
  // An empty name is "step-N" (N the job's step count; "step-N-2", ... when
  // that name holds other weights). A name the job holds for exactly its
  // weights now (no update or load since; or restored at start, at the
  // job's step and with its bits) returns that snapshot: a resend, after a
  // restart too, makes nothing. Otherwise a name held is AlreadyExists SNAPSHOT_EXISTS,
  // and the job's kMaxSamplerSnapshots-th is ResourceExhausted
  // SNAPSHOT_LIMIT.
  absl::StatusOr<SamplerSnapshotInfo> Run(Valid<SaveSamplerSnapshotRequest> request,
                                          const CallToken& call = CallToken());
  // Frees the snapshot and removes its file; NotFound SNAPSHOT_NOT_FOUND.
  absl::StatusOr<NoReport> Run(Valid<DeleteSamplerSnapshotRequest> request,
                               const CallToken& call = CallToken());
  // After Restore: the snapshots of the job's sub-directory, each admitted
  // and loaded; one that cannot be (a bad file, no memory) is logged and
  // its file left on disk.
  void RestoreSamplerSnapshots();
  // Any thread: the job's snapshots sorted by name, and their bytes.
  std::vector<SamplerSnapshotInfo> SamplerSnapshots() const;
  int64_t snapshot_bytes() const { return snapshot_bytes_.load(std::memory_order_relaxed); }
  // Counts (or, negative, uncounts) snapshot bytes: JobContext::
  // admit_snapshot's, under its lock.
  void HoldSnapshotBytes(int64_t delta) {
    snapshot_bytes_.fetch_add(delta, std::memory_order_relaxed);
  }
  // The Trainer's state, or a view of it (api.h StateView), as a
  // safetensors file (header and host tensors, not yet concatenated).
  absl::StatusOr<checkpoint::EncodedSafetensors> ExportSafetensors(
      StateView view = StateView::kFull) const;
  // Replaces weights, optimizer and scaler state from a decoded safetensors
  // file and clears a failure (an unrestored job's too: KeepUnrestored);
  // the step sequence is the job's own and does not change. With a state
  // directory the new state is checkpointed before this returns, so an
  // acknowledged import survives a crash; when that write fails the
  // previous state is put back and the error returned. partial: the file
  // holds some of the model's weights (one file of a sharded checkpoint),
  // which replace theirs and nothing else (Trainer::Coverage::kPartial).
  absl::StatusOr<int64_t> ImportSafetensors(checkpoint::StateDict state, bool partial = false);
  // ExportSafetensors and ImportSafetensors as the registry's calls
  // (ExportStateRequest, ImportStateRequest: job_registry.h).
  absl::StatusOr<checkpoint::EncodedSafetensors> Run(Valid<ExportStateRequest> request,
                                                     const CallToken& call = CallToken());
  absl::StatusOr<int64_t> Run(Valid<ImportStateRequest> request,
                              const CallToken& call = CallToken());
  // Writes the checkpoint when there is a state directory (no-op otherwise)
  // and returns once it is on disk. A background write of this job still
  // queued is dropped (this one is newer) and one in flight is waited for,
  // so it cannot land after this one.
  absl::Status Checkpoint();
  // The periodic checkpoint: with JobContext::writer, waits until the
  // job's previous snapshot is written (CheckpointWriter::WaitForJob), then
  // snapshots the state into host memory and queues it for the writer;
  // without, Checkpoint().
  absl::Status CheckpointInBackground();
  // Releases the Trainer; later tasks see NotFound. Cancels a background
  // write of this job (CheckpointWriter::Cancel), then removes the
  // checkpoint when remove_checkpoint, so a deleted job's file never comes
  // back.
  absl::Status Close(bool remove_checkpoint);
  bool closed() const;

 private:
  void RunOne();
  // The pool its strand runs on (JobContext::distributed_pool for a
  // distributed job).
  WorkerPool& Pool() const;
  // The bodies of the public calls of the same names, which run them under
  // an allocation guard (job.cc).
  absl::Status InitializeUnguarded(const std::string& device);
  // The Trainer on a new backend for `device` (its memory into *capacity),
  // over the shared base when the job has one.
  absl::StatusOr<std::unique_ptr<Trainer>> CreateTrainer(const std::string& device,
                                                         int64_t* capacity);
  // A full job made from a base_model: the base's weights into its own.
  absl::Status LoadBaseWeights();
  absl::StatusOr<checkpoint::EncodedSafetensors> ExportSafetensorsUnguarded(StateView view) const;
  absl::StatusOr<int64_t> ImportSafetensorsUnguarded(checkpoint::StateDict state, bool partial);
  absl::Status CheckpointUnguarded();
  // An import's upload of `arranged` into the Trainer, with its checkpoint
  // written to a temporary file (*temp) beside it on another thread.
  absl::StatusOr<Trainer::ReplacedState> UploadBesideCheckpoint(
      const checkpoint::StateDict& arranged, absl::StatusOr<std::string>* temp);
  // What a successful import does to the job beside its Trainer: no longer
  // seed-only, no recorded response, no group, active.
  void AfterImport();
  // The Trainer's state plus the job's ampd.* metadata, as checkpointed:
  // seed-only while initial_state_ (kMetaInitialState), full otherwise.
  absl::StatusOr<checkpoint::StateDict> CheckpointState() const;
  // The job's ampd.* metadata into a state the Trainer exported.
  void AddJobMetadata(checkpoint::StateDict& state) const;
  void RefreshSnapshot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // workspace_bytes() := what the Trainer keeps cached now (0 without one):
  // its one writer. Called holding workspace_mu_.
  void RecordWorkspace();
  // The one hand-off to the Trainer of every call that runs the model
  // (Step, ForwardBackward, OptimStep, Evaluate, Sample): `work(admit)`
  // with the Trainer's workspaces held (memory pressure leaves them be:
  // ReleaseWorkspacesIfIdle), its admission (JobContext::admit_step) kept
  // until the workspace it leaves cached is recorded, and an allocation
  // failure its ResourceExhausted (AllocationGuard, naming `what`).
  template <typename Work>
  auto WithWorkspace(absl::string_view what, Work&& work)
      -> decltype(work(std::function<absl::Status(int64_t)>()));
  absl::Status NotOpen() const;
  void SetFailure(std::string failure);
  // The exactly-once rules for `sequence` (job.cc): the recorded report of
  // a retried step, nullopt for the next one (to be run), or the error.
  absl::StatusOr<std::optional<StepReport>> CheckSequence(int64_t sequence) const;
  // The Trainer's step of a sequence CheckSequence let through (job.cc),
  // with the group's part of a distributed job's step.
  absl::StatusOr<StepReport> RunStep(int64_t sequence, const FittedStepInput& input,
                                     const DataParallelStep* data_parallel,
                                     const CallToken& call = CallToken());
  // What RunStep does around the Trainer's update `run` (a Step's or an
  // OptimStep's): admission, the failure of a scaler that gives up, the
  // recorded report, the observer, the periodic checkpoint.
  absl::StatusOr<StepReport> RunUpdate(
      int64_t sequence, absl::string_view what,
      const std::function<absl::StatusOr<StepReport>(const std::function<absl::Status(int64_t)>&)>&
          run,
      const DataParallelStep* data_parallel);
  // The exactly-once rules of a ForwardBackward call (job_accumulate.cc):
  // its recorded report when resent, nullopt to run it, or the error.
  absl::StatusOr<std::optional<ForwardBackwardReport>> CheckAccumulation(int64_t sequence,
                                                                         int64_t index) const;
  // Tells the observer how many calls are pending now.
  void ReportPending() const;
  // Sampler snapshots (job_snapshots.cc): the one of `name`, or NotFound
  // SNAPSHOT_NOT_FOUND naming field `field`; the directory their files go
  // to (nullptr without a state directory); the admission of `bytes`; the
  // listing and the observer after a change; all of them dropped (Close,
  // KeepUnrestored: before the Trainer whose backend holds them), and
  // their files too when `remove_files`.
  absl::StatusOr<SamplerWeights*> FindSnapshot(absl::string_view field, const std::string& name);
  // Whether `stored` holds the weights Sample reads now: taken since the
  // last change of them, or restored at start and equal to them (the
  // resend of a save whose answer a restart lost).
  struct StoredSnapshot;
  bool HoldsWeightsNow(StoredSnapshot& stored);
  absl::StatusOr<const checkpoint::StateDirectory*> SnapshotDirectory();
  absl::Status AdmitSnapshot(int64_t bytes);
  void SnapshotsChanged();
  absl::Status DropSnapshots(bool remove_files);

  // ---- distributed jobs (job_distributed.cc) ----
  bool distributed() const { return config_.get().distributed.enabled(); }
  absl::StatusOr<StepReport> DistributedStep(const Valid<StepRequest>& request);
  // Forms the group when there is none: meet, connect, bring every rank to
  // the most advanced rank's state, make the gradient all-reduce.
  absl::Status EnsureGroup();
  // Every rank at the step count of the most advanced one, holding its
  // state (a checkpoint of it, decoded and loaded by the ranks behind).
  absl::Status SyncState(dist::ProcessGroup& group, bool* copied, int32_t* source);
  // Unavailable with reason PEER_UNAVAILABLE (group, rank): another rank
  // is missing or a collective failed, nothing was applied.
  absl::Status PeerUnavailable(absl::string_view what) const;
  // Drops the group after a failure; the next Step forms it again.
  void DropGroup();

  const std::string id_;
  const std::string owner_;
  const std::string request_id_;
  const ValidJobConfig config_;    // as created; Initialize builds the Trainer from it
  const std::string config_json_;  // EncodeJobConfig(config_, request_id_)
  const JobContext* const context_;
  const int64_t estimated_bytes_;

  // Strand queue.
  struct Task {
    std::function<void()> run;
    WorkerPool::Lane lane;
  };
  absl::Mutex queue_mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool scheduled_ ABSL_GUARDED_BY(queue_mu_) = false;

  // Owned by the strand (only tasks touch them), except that
  // ReleaseWorkspacesIfIdle frees trainer_'s workspaces from another
  // thread while it holds workspace_mu_, which the strand holds while a
  // step or an evaluation uses them and while trainer_ is set or reset.
  absl::Mutex workspace_mu_;
  std::unique_ptr<Trainer> trainer_;
  // Sampler snapshots by name (strand-owned; declared after trainer_, so
  // that they go before the backend that holds them).
  struct StoredSnapshot {
    SamplerWeights weights;
    SamplerSnapshotInfo info;
    // weights_version_ when taken (-1: restored, never "the weights now").
    int64_t version = -1;
  };
  std::map<std::string, StoredSnapshot> snapshots_;
  // Counts every change of the Trainer's weights in this process (an
  // update run, a load): a snapshot of the same version holds them.
  int64_t weights_version_ = 0;
  std::unique_ptr<checkpoint::StateDirectory> snapshot_dir_;  // opened on first use
  std::atomic<int64_t> snapshot_bytes_{0};
  std::optional<StepReport> last_report_;
  // The last ForwardBackward call's report, while its update is pending:
  // what a resend of it gets back (not checkpointed: a restart loses the
  // accumulated gradients anyway).
  std::optional<ForwardBackwardReport> last_call_;
  // Whether calls the client sent may have been dropped since its last
  // successful call or update: after a restore (a restart loses them), an
  // import, or a call that failed part-way. A call past the next index is
  // then ACCUMULATION_LOST; otherwise it arrived out of order
  // (SEQUENCE_MISMATCH).
  bool accumulation_dropped_ = false;
  // True while the Trainer holds exactly what Initialize built from the
  // config and seed: its checkpoints are then seed-only. Cleared before
  // anything that may change the Trainer's state (a step, an import, a
  // distributed job's copy of another rank's state).
  bool initial_state_ = false;
  // KeepUnrestored's reason (empty while the job has its state) and the
  // device an import builds the job on.
  std::string unrestored_;
  std::string device_;
  std::atomic<int64_t> bytes_in_use_{0};
  std::atomic<int64_t> workspace_bytes_{0};
  // A distributed job's meeting point and formed group (strand-owned).
  std::unique_ptr<dist::Rendezvous> rendezvous_;
  std::unique_ptr<dist::ProcessGroup> group_;
  std::unique_ptr<dist::GradientAllReduce> all_reduce_;

  // Snapshot for readers on other threads.
  mutable absl::Mutex mu_;
  JobSnapshot snapshot_ ABSL_GUARDED_BY(mu_);
  std::vector<SamplerSnapshotInfo> snapshot_infos_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Work>
auto Job::WithWorkspace(absl::string_view what, Work&& work)
    -> decltype(work(std::function<absl::Status(int64_t)>())) {
  WorkspaceReservation reservation;
  const std::function<absl::Status(int64_t)> admit = [this, &reservation](int64_t bytes) {
    if (!context_->admit_step) return absl::OkStatus();
    absl::StatusOr<WorkspaceReservation> admitted = context_->admit_step(*this, bytes);
    if (admitted.ok()) reservation = *std::move(admitted);
    return admitted.status();
  };
  absl::MutexLock lock(&workspace_mu_);
  auto result = AllocationGuard(what, [&] { return work(admit); });
  // What stays cached is what the job holds until its next call, counted
  // for admission in place of the reservation, dropped once recorded.
  RecordWorkspace();
  reservation.Reset();
  if (trainer_ != nullptr) {
    bytes_in_use_.store(trainer_->backend().BytesInUse(), std::memory_order_relaxed);
  }
  return result;
}

// Text form of a StepReport for checkpoint metadata (exact: floats as hex).
std::string EncodeStepReport(const StepReport& report);
absl::StatusOr<StepReport> DecodeStepReport(absl::string_view text);

}  // namespace ampd::engine
