// JobRegistry: every job of the server by id — creation (with request_id
// deduplication and the --max-jobs / --max-memory-bytes limits, and the
// tenants' quotas), lookup, paging, deletion, restore from the state
// directory at start, and the final checkpoint at shutdown. Every job belongs
// to the tenant (owner) that created it, and every call names its caller's
// tenant: another tenant's job answers exactly as a job that does not exist. Every job call
// (Submit) takes a completion that runs on the job's strand, so the caller (a gRPC reaction)
// never blocks on training, and the caller's CallToken: one in progress stops at its next unit
// of work (a micro-batch, a decode step), leaving the job as it was.
#pragma once

#include <cstdint>
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
#include "codec/safetensors.h"
#include "codec/state_dict.h"
#include "server/engine/api.h"
#include "server/engine/call_token.h"
#include "server/engine/config/job_config_codec.h"
#include "server/engine/dist/rendezvous.h"
#include "server/engine/jobs/job_observer.h"

namespace ampd {
class WorkerPool;
}  // namespace ampd

namespace ampd::engine {

namespace checkpoint {
class StateDirectory;
}  // namespace checkpoint
class BaseModels;
class CheckpointWriter;
class Job;
struct JobContext;
class WorkspaceReservation;

// A tenant's own limits, on top of the server-wide ones (0: none).
struct TenantQuota {
  int64_t max_jobs = 0;
  // Bounds the tenant's jobs' bytes, counted as for max_memory_bytes.
  int64_t max_memory_bytes = 0;
};

// A device as the backends name it, and its memory.
struct DeviceInfo {
  std::string name;                   // "cpu", "cuda:0"
  int64_t memory_capacity_bytes = 0;  // 0: unbounded
};

// Resolves a --device flag ("auto", "cpu", "cuda", "cuda:N") by creating a
// backend for it once: "auto" becomes "cuda:0" or "cpu", and a device that
// does not exist is an error here rather than at the first job.
absl::StatusOr<DeviceInfo> ResolveDevice(const std::string& device);

struct RegistryOptions {
  std::string device = "cpu";  // a DeviceInfo::name
  int64_t max_jobs = 0;        // 0: unlimited
  // 0: unlimited. Else it bounds, at CreateJob and at every Step, the sum of
  // every job's EstimateJobBytes (weights) and workspace_bytes (activations
  // and buffers, model::WorkspaceBytes of the batch sizes in use).
  int64_t max_memory_bytes = 0;
  int64_t checkpoint_every = 0;  // 0: only at shutdown
  // false: a periodic checkpoint is a host snapshot taken on the job's
  // strand and written by a background writer (CheckpointWriter), so a crash
  // can lose the steps whose write had not finished. true: written before
  // the step is answered, as every other checkpoint (create, import,
  // failure, shutdown) always is.
  bool checkpoint_sync = false;
  int64_t grad_histogram_every = 0;  // 0: never
  std::string state_dir;             // empty: no checkpoints
  int worker_threads = 2;
  JobObserver* observer = nullptr;  // nullable; must outlive the registry
  // Called with the sum of the jobs' backend bytes after each change; nullable.
  std::function<void(int64_t in_use_bytes)> on_device_memory;
  // By tenant name; a tenant not listed has only the server-wide limits.
  std::map<std::string, TenantQuota> tenant_quotas;
  // Distributed jobs (docs/DISTRIBUTED.md): the host of this ampd's
  // --peer-address, where the jobs' Gloo transport binds, and how a job
  // reaches its group's meeting point. No connector: this ampd takes no
  // distributed job (FAILED_PRECONDITION at CreateJob).
  std::string peer_host;
  dist::RendezvousConnector rendezvous;
  // The most distributed jobs held at once: each gets a thread of its own
  // (JobContext::distributed_pool), since it blocks while it waits for its
  // peers.
  int max_distributed_jobs = 4;
  // --models-dir: the Hugging Face folders jobs name as their base_model
  // (BaseModels); empty: none.
  std::string models_dir;
};

// Reads the ampd.create_request (a serialized CreateJobRequest, the bytes
// base64-decoded) of a checkpoint written by an earlier version: the one
// thing restoring needs from the rpc layer, and only for those checkpoints.
// The config it returns is translated, not yet validated.
using CreateRequestDecoder =
    std::function<absl::StatusOr<JobConfigRecord>(absl::string_view create_request)>;

struct JobPage {
  std::vector<JobSnapshot> jobs;
  std::string next_page_token;
};

class JobRegistry {
 public:
  static absl::StatusOr<std::unique_ptr<JobRegistry>> Create(RegistryOptions options);
  ~JobRegistry();  // Shutdown()

  // Restores the jobs in the state directory (blocking; call at start), the
  // most recently written first, as long as --max-jobs and
  // --max-memory-bytes admit them: the others are logged ("not restored")
  // and their checkpoints left on disk untouched, to be restored by a later
  // start with room for them. A job whose checkpoint names its config but
  // cannot be restored from it is never dropped: it is listed as failed
  // with the reason (Job::KeepUnrestored), its file left on disk untouched
  // until a LoadStateDict of a good state or a DeleteJob. A file whose
  // header or config cannot be read names no job (nor its owner): it is
  // logged and left on disk. Admission reads only the files' headers, in that
  // order; the admitted jobs are then read and rebuilt in parallel on the
  // worker threads. A job's config is read from its ampd.config; one
  // written before that key existed has an ampd.create_request instead,
  // read with `legacy_decode` (when null, such a checkpoint is logged as
  // not restorable and left on disk).
  absl::Status RestoreAll(const CreateRequestDecoder& legacy_decode = nullptr);

  // `owner` is the calling tenant ("" for the anonymous one) in every call.
  // A job of another owner is NOT_FOUND with reason JOB_NOT_FOUND, word for
  // word as a job id that does not exist, so its existence is not revealed.

  // config must already carry its defaults; it is validated here (errors
  // name the field as "config.<field>"). A non-empty request_id the same
  // owner sent before returns the job it created (or that creation's error).
  void CreateJob(const std::string& owner, JobConfig config, std::string request_id,
                 std::function<void(absl::StatusOr<JobSnapshot>)> done);
  absl::StatusOr<JobSnapshot> GetJob(const std::string& owner, const std::string& job_id) const;
  // The owner's jobs, sorted by job id; page_token is the last id of the
  // previous page.
  absl::StatusOr<JobPage> ListJobs(const std::string& owner, int page_size,
                                   const std::string& page_token) const;
  // Runs after the job's queued work; removes its checkpoint.
  void DeleteJob(const std::string& owner, const std::string& job_id,
                 std::function<void(absl::Status)> done);
  // Every job call, by one path (api.h's request types): the request
  // checked first (Valid<Request>::Check, CheckRequest's error before the
  // job is looked up, whatever its state or sequence), then Unavailable
  // while the server drains (a state's export and import excepted) and
  // NOT_FOUND for a job this owner does not have, all before it is queued;
  // then Job::Run on the job's strand, after every call sent before it (a
  // step's, an evaluation's, a sample's weights are those of every step
  // sent before it), `done` with its report there. `call` stops it: a
  // call whose token has stopped by its turn is answered with the token's
  // status without being started. A Sample is a long call
  // (WorkerPool::Lane::kLong): its length is set by max_tokens, not by the
  // request's size, so Samples take at most worker_threads - 1 of the
  // worker threads at once and the other calls of every job are served
  // meanwhile; StartDraining stops those queued or in progress
  // (Unavailable, SERVER_DRAINING). A sampler snapshot's bytes are admitted
  // against --max-memory-bytes and the owner's quota (AdmitSnapshot) and
  // held until it is deleted. Defined for the request types of api.h (job_registry.cc).
  template <typename Request>
  using Done = std::function<void(absl::StatusOr<typename Request::Report>)>;
  template <typename Request>
  void Submit(const std::string& owner, const std::string& job_id, Request request,
              Done<Request> done, CallToken call = CallToken());
  // The job's sampler snapshots now, sorted by name (no wait for its strand).
  absl::StatusOr<std::vector<SamplerSnapshotInfo>> ListSamplerSnapshots(
      const std::string& owner, const std::string& job_id) const;

  // The secrets and owners of the distributed jobs held here that are rank
  // 0 of `group`: the meeting point this ampd hosts (dist::RendezvousTable)
  // authenticates the group's calls with them, and keeps each owner's
  // group apart. Empty when none is.
  struct PeerSecret {
    std::string secret;
    std::string owner;
  };
  std::vector<PeerSecret> PeerSecrets(const std::string& group) const;

  // New creates and steps answer Unavailable from now on, and the Samples
  // queued or in progress stop (Unavailable, SERVER_DRAINING: a client
  // retries them elsewhere) rather than hold the shutdown for as long as
  // their max_tokens asks. Other calls in progress run to their end.
  void StartDraining();
  // Checkpoints every job after its queued work and waits for it (jobs in
  // parallel on the worker threads; each final write supersedes a
  // background one). Blocking.
  absl::Status CheckpointAll();
  // Runs the queued work and the queued background checkpoint writes, then
  // joins the threads. Blocking; idempotent.
  void Shutdown();

  int64_t job_count() const;

  // The base models of --models-dir (BaseModels::List): folder names.
  std::vector<std::string> ListModels() const;

 private:
  // A create's config with base_model: its model replaced by the one the
  // base's config.json describes, keeping the request's LoRA adapters and
  // loss_multiplier (the only model fields a base_model create may set).
  // InvalidArgument naming config.base_model or config.model.*.
  absl::Status ApplyBaseModel(JobConfig& config) const;
  // The bytes a new job of `config` adds to what the jobs (of `owner`
  // only, when given) hold: its own estimate, and its shared base's when no
  // job of theirs holds that base yet.
  int64_t NewJobBytes(const JobConfig& config, const std::string* owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  explicit JobRegistry(RegistryOptions options);
  // nullptr when there is no such job or it is not `owner`'s.
  std::shared_ptr<Job> Find(const std::string& owner, const std::string& job_id) const;
  // The job a queued call runs on, refusing before it is queued:
  // input_check when it failed (a malformed request, whatever the job's
  // state), Unavailable while the server drains (when `drain_refuses`),
  // NotFound for a job this owner does not have.
  absl::StatusOr<std::shared_ptr<Job>> AcceptWork(const absl::Status& input_check,
                                                  const std::string& owner,
                                                  const std::string& job_id,
                                                  bool drain_refuses = true) const;
  // After any job call (`what`, e.g. "step 3", "sample") on the job's
  // strand: the memory report when it ran, else a log line for a call
  // stopped (by its caller, or by a drain when `long_call`), a job failed
  // at its minimum scale (at step `sequence`), or an error that is not a
  // refusal of the request.
  void AfterCall(const Job& job, absl::string_view what, int64_t sequence, bool long_call,
                 const absl::Status& status);
  // The server-wide limits, then `owner`'s quota.
  absl::Status CheckAdmission(const std::string& owner, const JobConfig& config) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Weights of every job (of `owner` only, when given) plus the workspaces
  // of those jobs but `except`.
  int64_t MemoryHeld(const Job* except, const std::string* owner = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t JobsOf(const std::string& owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const TenantQuota* QuotaOf(const std::string& owner) const;
  // Whether the memory limits alone (--max-memory-bytes, `owner`'s quota)
  // would refuse a new job of `need` bytes now.
  bool MemoryRefuses(const std::string& owner, int64_t need) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // JobContext::admit_step: the workspace of a step or an evaluation
  // against --max-memory-bytes and the owner's quota (TryAdmitStep). When
  // they refuse it, the idle jobs give up their cached workspaces
  // (ReleaseIdleWorkspaces) and, if that freed anything, the step is
  // admitted or refused on what is left. Admitted, the bytes are reserved
  // for the job (reserved_) until it drops the reservation.
  absl::StatusOr<WorkspaceReservation> AdmitStep(Job& job, int64_t workspace_bytes);
  absl::StatusOr<WorkspaceReservation> TryAdmitStep(Job& job, int64_t workspace_bytes);
  // JobContext::admit_snapshot: a sampler snapshot's bytes against the same
  // limits, counted for the job (Job::HoldSnapshotBytes) under mu_ when
  // admitted; idle jobs' cached workspaces (the saving job's own too) are
  // given up once when refused.
  absl::Status AdmitSnapshot(Job& job, int64_t bytes);
  absl::Status TryAdmitSnapshot(Job& job, int64_t bytes);
  // Memory pressure (JobContext::release_idle_workspaces): every job but
  // `except` that is idle frees its cached workspaces
  // (Job::ReleaseWorkspacesIfIdle), so that a step, a job or an
  // allocation another job needs can have their memory; busy jobs keep
  // theirs. Returns the bytes freed. Takes mu_ itself.
  int64_t ReleaseIdleWorkspaces(const Job* except);
  void Remove(const std::string& job_id);
  // The Samples StartDraining stops: each one's token from before it is
  // queued until it has answered. Refused (false) once draining.
  bool AddLongCall(uint64_t* id, const CallToken& call);
  void RemoveLongCall(uint64_t id);
  // RestoreAll's passes. AdmitForRestore puts the jobs of `ids` that the
  // limits admit into the table (in order) and returns them; the ones the
  // limits turn away go to *turned_away, with the line that says why to
  // *refusals. RestoreInParallel rebuilds `jobs` from their files on the
  // worker pool; those that fail stay, failed (Job::KeepUnrestored).
  std::vector<std::shared_ptr<Job>> AdmitForRestore(const std::vector<std::string>& ids,
                                                    const CreateRequestDecoder& legacy_decode,
                                                    std::vector<std::string>* turned_away,
                                                    std::vector<std::string>* refusals);
  void RestoreInParallel(const std::vector<std::shared_ptr<Job>>& jobs);
  void ReportMemory() const;
  // One line per job event (never per step), on stderr.
  static void LogEvent(const std::string& line);

  const RegistryOptions options_;
  // Before the pool: a job's last task may still release a shared base.
  std::unique_ptr<BaseModels> bases_;
  std::unique_ptr<checkpoint::StateDirectory> state_dir_;  // nullptr: no state dir
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<WorkerPool> distributed_pool_;  // nullptr: no distributed jobs
  std::unique_ptr<CheckpointWriter> writer_;      // nullptr: no state dir, or checkpoint_sync
  const std::unique_ptr<JobContext> context_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // (owner, request_id) -> job id: deduplication is per tenant.
  std::map<std::pair<std::string, std::string>, std::string> by_request_id_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // The workspace admitted for each job's step or evaluation in progress
  // (TryAdmitStep), counted in place of the job's workspace_bytes() until
  // the job drops its WorkspaceReservation.
  std::map<const Job*, int64_t> reserved_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, CallToken> long_calls_ ABSL_GUARDED_BY(mu_);
  uint64_t next_long_call_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ampd::engine
