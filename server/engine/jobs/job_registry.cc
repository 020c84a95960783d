// JobRegistry: the job table and the orchestration of jobs' strand tasks.
#include "server/engine/jobs/job_registry.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/checked_math.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "kernels/backend_factory.h"
#include "server/engine/checkpoint/state_directory.h"
#include "server/engine/jobs/checkpoint_writer.h"
#include "server/engine/jobs/job.h"

namespace ampd::engine {
namespace {

// One line per job event (never per step), on stderr.
void LogEvent(const std::string& line) { std::fprintf(stderr, "ampd: %s\n", line.c_str()); }

std::string NewJobId() {
  static absl::Mutex mu(absl::kConstInit);
  static absl::BitGen* gen = new absl::BitGen();
  absl::MutexLock lock(&mu);
  return absl::StrFormat("job-%012x", absl::Uniform<uint64_t>(*gen, 0, uint64_t{1} << 48));
}

absl::Status JobNotFound(const std::string& job_id) {
  return WithReason(absl::NotFoundError(absl::StrCat("job_id: no job '", Echo(job_id), "'")),
                    reason::kJobNotFound, {{"job_id", Echo(job_id)}});
}

absl::Status Draining() {
  return WithReason(absl::UnavailableError("the server is shutting down"), reason::kServerDraining);
}

struct RestoredConfig {
  ValidJobConfig config;
  std::string request_id;
  std::string owner;
};

// The checkpoint's owner; one written before jobs had owners belongs to the
// anonymous tenant.
std::string OwnerOfCheckpoint(const std::map<std::string, std::string>& metadata) {
  auto it = metadata.find(kMetaOwner);
  return it == metadata.end() ? std::string() : it->second;
}

// The config and request_id a checkpoint recreates its job from: its
// ampd.config, or, for a checkpoint written before that key existed, its
// ampd.create_request through `legacy_decode`.
absl::StatusOr<RestoredConfig> ConfigOfCheckpoint(
    const std::map<std::string, std::string>& metadata, const CreateRequestDecoder& legacy_decode) {
  if (auto it = metadata.find(kMetaConfig); it != metadata.end()) {
    AMPD_ASSIGN_OR_RETURN(DecodedJobConfig decoded, DecodeJobConfig(it->second));
    return RestoredConfig{std::move(decoded.config), std::move(decoded.request_id),
                          OwnerOfCheckpoint(metadata)};
  }
  auto it = metadata.find(kMetaCreateRequest);
  if (it == metadata.end()) {
    return absl::DataLossError(
        absl::StrCat("neither ", kMetaConfig, " nor ", kMetaCreateRequest, " in the metadata"));
  }
  std::string blob;
  if (!absl::Base64Unescape(it->second, &blob)) {
    return absl::DataLossError(absl::StrCat(kMetaCreateRequest, ": not base64"));
  }
  if (!legacy_decode) {
    return absl::FailedPreconditionError(absl::StrCat(
        kMetaCreateRequest, ": written by an earlier ampd, and no reader of it was given"));
  }
  AMPD_ASSIGN_OR_RETURN(JobConfigRecord record, legacy_decode(blob));
  absl::StatusOr<ValidJobConfig> valid = ValidJobConfig::Check(std::move(record.config));
  if (!valid.ok()) {
    return absl::Status(valid.status().code(),
                        absl::StrCat(kMetaCreateRequest, ": ", valid.status().message()));
  }
  return RestoredConfig{*std::move(valid), std::move(record.request_id),
                        OwnerOfCheckpoint(metadata)};
}

}  // namespace

absl::StatusOr<DeviceInfo> ResolveDevice(const std::string& device) {
  AMPD_ASSIGN_OR_RETURN(const std::unique_ptr<kernels::Backend> backend,
                        kernels::CreateBackend(device));
  return DeviceInfo{backend->name(), backend->MemoryCapacityBytes()};
}

JobRegistry::JobRegistry(RegistryOptions options)
    : options_(std::move(options)), context_(std::make_unique<JobContext>()) {}

absl::StatusOr<std::unique_ptr<JobRegistry>> JobRegistry::Create(RegistryOptions options) {
  auto registry = std::unique_ptr<JobRegistry>(new JobRegistry(std::move(options)));
  if (!registry->options_.state_dir.empty()) {
    AMPD_ASSIGN_OR_RETURN(checkpoint::StateDirectory dir,
                          checkpoint::StateDirectory::Open(registry->options_.state_dir));
    registry->state_dir_ = std::make_unique<checkpoint::StateDirectory>(std::move(dir));
  }
  registry->pool_ = std::make_unique<WorkerPool>(registry->options_.worker_threads);
  registry->context_->pool = registry->pool_.get();
  if (registry->options_.rendezvous && registry->options_.max_distributed_jobs > 0) {
    registry->distributed_pool_ =
        std::make_unique<WorkerPool>(registry->options_.max_distributed_jobs);
    registry->context_->distributed_pool = registry->distributed_pool_.get();
    registry->context_->peer_host = registry->options_.peer_host;
    registry->context_->rendezvous = registry->options_.rendezvous;
  }
  if (registry->state_dir_ && !registry->options_.checkpoint_sync) {
    // One writer: writes are disk-bound, and jobs' snapshots queue behind
    // each other at most one per job.
    registry->writer_ = std::make_unique<CheckpointWriter>(registry->state_dir_.get(), 1);
    registry->context_->writer = registry->writer_.get();
  }
  registry->context_->state_dir = registry->state_dir_ ? registry->state_dir_.get() : nullptr;
  registry->context_->observer = registry->options_.observer;
  registry->context_->checkpoint_every = registry->options_.checkpoint_every;
  registry->context_->grad_histogram_every = registry->options_.grad_histogram_every;
  JobRegistry* self = registry.get();
  registry->context_->admit_step = [self](Job& job, int64_t bytes) {
    return self->AdmitStep(job, bytes);
  };
  registry->context_->release_idle_workspaces = [self](const Job* except) {
    return self->ReleaseIdleWorkspaces(except);
  };
  return registry;
}

JobRegistry::~JobRegistry() { Shutdown(); }

void JobRegistry::Shutdown() {
  if (distributed_pool_) distributed_pool_->Shutdown();
  if (pool_) pool_->Shutdown();
  // After the pool: its last tasks may still queue snapshots.
  if (writer_) writer_->Shutdown();
}

int64_t JobRegistry::job_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(jobs_.size());
}

std::shared_ptr<Job> JobRegistry::Find(const std::string& owner, const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second->owner() != owner) return nullptr;
  return it->second;
}

void JobRegistry::Remove(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  if (!it->second->request_id().empty()) {
    by_request_id_.erase({it->second->owner(), it->second->request_id()});
  }
  jobs_.erase(it);
}

void JobRegistry::ReportMemory() const {
  if (!options_.on_device_memory) return;
  int64_t total = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) total += job->bytes_in_use();
  }
  options_.on_device_memory(total);
}

const TenantQuota* JobRegistry::QuotaOf(const std::string& owner) const {
  auto it = options_.tenant_quotas.find(owner);
  return it == options_.tenant_quotas.end() ? nullptr : &it->second;
}

int64_t JobRegistry::JobsOf(const std::string& owner) const {
  int64_t n = 0;
  for (const auto& [id, job] : jobs_) n += job->owner() == owner ? 1 : 0;
  return n;
}

absl::Status JobRegistry::CheckAdmission(const std::string& owner, const JobConfig& config) const {
  if (config.distributed.enabled()) {
    if (distributed_pool_ == nullptr) {
      return absl::FailedPreconditionError(
          "config.distributed: this ampd takes no distributed job; start it with "
          "--peer-address=HOST:PORT (and --max-distributed-jobs > 0)");
    }
    int64_t distributed = 0;
    for (const auto& [id, job] : jobs_) {
      if (job->Snapshot().config.distributed.enabled()) ++distributed;
    }
    if (distributed >= options_.max_distributed_jobs) {
      return WithReason(absl::ResourceExhaustedError(
                            absl::StrCat("config.distributed: the server already holds ",
                                         distributed, " distributed jobs (--max-distributed-jobs=",
                                         options_.max_distributed_jobs, "); delete one first")),
                        reason::kJobLimit,
                        {{"max_distributed_jobs", absl::StrCat(options_.max_distributed_jobs)}});
    }
  }
  if (options_.max_jobs > 0 && static_cast<int64_t>(jobs_.size()) >= options_.max_jobs) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "job_id: the server already holds ", jobs_.size(),
                          " jobs (--max-jobs=", options_.max_jobs, "); delete one first")),
                      reason::kJobLimit, {{"max_jobs", absl::StrCat(options_.max_jobs)}});
  }
  if (options_.max_memory_bytes > 0) {
    const int64_t used = MemoryHeld(nullptr);
    const int64_t need = EstimateJobBytes(config);
    if (SaturatingAdd(used, need) > options_.max_memory_bytes) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "config.model: the job needs an estimated ", need, " bytes and jobs hold ", used,
              " of --max-memory-bytes=", options_.max_memory_bytes)),
          reason::kMemoryLimit,
          {{"limit_bytes", absl::StrCat(options_.max_memory_bytes)},
           {"requested_bytes", absl::StrCat(need)}});
    }
  }
  const TenantQuota* quota = QuotaOf(owner);
  if (quota == nullptr) return absl::OkStatus();
  if (quota->max_jobs > 0) {
    const int64_t held = JobsOf(owner);
    if (held >= quota->max_jobs) {
      return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                            "job_id: tenant '", owner, "' already holds ", held,
                            " jobs, its quota (max_jobs=", quota->max_jobs, "); delete one first")),
                        reason::kJobLimit,
                        {{"tenant", owner}, {"max_jobs", absl::StrCat(quota->max_jobs)}});
    }
  }
  if (quota->max_memory_bytes > 0) {
    const int64_t used = MemoryHeld(nullptr, &owner);
    const int64_t need = EstimateJobBytes(config);
    if (SaturatingAdd(used, need) > quota->max_memory_bytes) {
      return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                            "config.model: the job needs an estimated ", need,
                            " bytes and the jobs of tenant '", owner, "' hold ", used,
                            " of its quota (max_memory_bytes=", quota->max_memory_bytes, ")")),
                        reason::kMemoryLimit,
                        {{"tenant", owner},
                         {"limit_bytes", absl::StrCat(quota->max_memory_bytes)},
                         {"requested_bytes", absl::StrCat(need)}});
    }
  }
  return absl::OkStatus();
}

int64_t JobRegistry::MemoryHeld(const Job* except, const std::string* owner) const {
  int64_t used = 0;
  for (const auto& [id, job] : jobs_) {
    if (owner != nullptr && job->owner() != *owner) continue;
    used = SaturatingAdd(used, job->estimated_bytes());
    if (job.get() != except) used = SaturatingAdd(used, job->workspace_bytes());
  }
  return used;
}

bool JobRegistry::MemoryRefuses(const std::string& owner, int64_t need) const {
  if (options_.max_memory_bytes > 0 &&
      SaturatingAdd(MemoryHeld(nullptr), need) > options_.max_memory_bytes) {
    return true;
  }
  const TenantQuota* quota = QuotaOf(owner);
  return quota != nullptr && quota->max_memory_bytes > 0 &&
         SaturatingAdd(MemoryHeld(nullptr, &owner), need) > quota->max_memory_bytes;
}

int64_t JobRegistry::ReleaseIdleWorkspaces(const Job* except) {
  std::vector<std::shared_ptr<Job>> holding;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (job.get() != except && job->workspace_bytes() > 0) holding.push_back(job);
    }
  }
  // Outside the lock: freeing takes the jobs' strands (never waiting for
  // one), and other jobs' admissions go on meanwhile.
  int64_t freed = 0;
  for (const std::shared_ptr<Job>& job : holding) {
    freed = SaturatingAdd(freed, job->ReleaseWorkspacesIfIdle());
  }
  if (freed > 0) ReportMemory();
  return freed;
}

absl::Status JobRegistry::AdmitStep(Job& job, int64_t workspace_bytes) {
  absl::Status admitted = TryAdmitStep(job, workspace_bytes);
  if (!admitted.ok() && ReleaseIdleWorkspaces(&job) > 0) {
    admitted = TryAdmitStep(job, workspace_bytes);
  }
  return admitted;
}

absl::Status JobRegistry::TryAdmitStep(Job& job, int64_t workspace_bytes) {
  absl::MutexLock lock(&mu_);
  if (options_.max_memory_bytes > 0) {
    const int64_t used = MemoryHeld(&job);
    if (SaturatingAdd(used, workspace_bytes) > options_.max_memory_bytes) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "micro_batches: they need an estimated ", workspace_bytes,
              " bytes of activation and workspace memory for its batch sizes, and the jobs' "
              "weights and other jobs' workspaces hold ",
              used, " of --max-memory-bytes=", options_.max_memory_bytes,
              "; send smaller micro-batches")),
          reason::kMemoryLimit,
          {{"limit_bytes", absl::StrCat(options_.max_memory_bytes)},
           {"requested_bytes", absl::StrCat(workspace_bytes)}});
    }
  }
  if (const TenantQuota* quota = QuotaOf(job.owner());
      quota != nullptr && quota->max_memory_bytes > 0) {
    const int64_t used = MemoryHeld(&job, &job.owner());
    if (SaturatingAdd(used, workspace_bytes) > quota->max_memory_bytes) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "micro_batches: they need an estimated ", workspace_bytes,
              " bytes of activation and workspace memory for its batch sizes, and the weights "
              "and other workspaces of tenant '",
              job.owner(), "' hold ", used, " of its quota (max_memory_bytes=",
              quota->max_memory_bytes, "); send smaller micro-batches")),
          reason::kMemoryLimit,
          {{"tenant", job.owner()},
           {"limit_bytes", absl::StrCat(quota->max_memory_bytes)},
           {"requested_bytes", absl::StrCat(workspace_bytes)}});
    }
  }
  // Reserved under the lock, so two jobs stepping at once cannot both fit
  // into the same free bytes.
  job.set_workspace_bytes(workspace_bytes);
  return absl::OkStatus();
}

void JobRegistry::CreateJob(const std::string& owner, JobConfig config, std::string request_id,
                            std::function<void(absl::StatusOr<JobSnapshot>)> done) {
  // The one validation of a create: the Job and its Trainer take the proof.
  absl::StatusOr<ValidJobConfig> valid = ValidJobConfig::Check(std::move(config));
  if (!valid.ok()) {
    done(absl::Status(valid.status().code(), absl::StrCat("config.", valid.status().message())));
    return;
  }
  // Memory pressure: when the memory limits alone would refuse the job,
  // the idle jobs first give up their cached workspaces, and the admission
  // below decides on what is left.
  const int64_t need = EstimateJobBytes(valid->get());
  bool refused = false;
  {
    absl::MutexLock lock(&mu_);
    refused = MemoryRefuses(owner, need);
  }
  if (refused) (void)ReleaseIdleWorkspaces(nullptr);
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      done(Draining());
      return;
    }
    if (!request_id.empty()) {
      auto it = by_request_id_.find({owner, request_id});
      if (it != by_request_id_.end()) {
        std::shared_ptr<Job> existing = jobs_.at(it->second);
        // After the first creation's task: the job is built (or failed) by then.
        existing->Post([existing, done = std::move(done)] {
          if (existing->closed()) {
            done(WithReason(absl::AbortedError("request_id: the first CreateJob with this "
                                               "request_id failed; retry"),
                            reason::kRetryCreate));
          } else {
            done(existing->Snapshot());
          }
        });
        return;
      }
    }
    if (absl::Status s = CheckAdmission(owner, valid->get()); !s.ok()) {
      done(s);
      return;
    }
    std::string id = NewJobId();
    while (jobs_.contains(id)) id = NewJobId();
    job = std::make_shared<Job>(id, owner, request_id, *std::move(valid), context_.get());
    jobs_[id] = job;
    if (!request_id.empty()) by_request_id_[{owner, request_id}] = id;
  }
  job->Post([this, job, done = std::move(done)] {
    absl::Status s = job->Initialize(options_.device);
    if (s.ok()) s = job->Checkpoint();
    if (!s.ok()) {
      (void)job->Close(/*remove_checkpoint=*/true);
      Remove(job->id());
      LogEvent(absl::StrCat("job ", job->id(), " failed to create: ", s.ToString()));
      done(s);
      return;
    }
    JobSnapshot snapshot = job->Snapshot();
    LogEvent(absl::StrCat("job ", job->id(), " created (", snapshot.parameter_count,
                          " parameters, ", model::PrecisionName(snapshot.config.precision), ")"));
    if (options_.observer != nullptr)
      options_.observer->OnJobCreated(job->id(), job->owner(), snapshot.config);
    ReportMemory();
    done(std::move(snapshot));
  });
}

absl::StatusOr<JobSnapshot> JobRegistry::GetJob(const std::string& owner,
                                                const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) return JobNotFound(job_id);
  return job->Snapshot();
}

std::vector<std::string> JobRegistry::PeerSecrets(const std::string& group) const {
  std::vector<std::string> secrets;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    const dist::DistributedSpec& spec = job->distributed_spec();
    if (spec.enabled() && spec.rank == 0 && spec.group == group) secrets.push_back(spec.secret);
  }
  return secrets;
}

absl::StatusOr<JobPage> JobRegistry::ListJobs(const std::string& owner, int page_size,
                                              const std::string& page_token) const {
  if (page_size < 0) return absl::InvalidArgumentError("page_size: must be >= 0");
  const size_t size = page_size == 0 ? 100 : static_cast<size_t>(std::min(page_size, 1000));
  std::vector<std::shared_ptr<Job>> page;
  bool more = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = page_token.empty() ? jobs_.begin() : jobs_.upper_bound(page_token);
    for (; it != jobs_.end(); ++it) {
      if (it->second->owner() != owner) continue;
      if (page.size() == size) {
        more = true;
        break;
      }
      page.push_back(it->second);
    }
  }
  JobPage result;
  for (const auto& job : page) result.jobs.push_back(job->Snapshot());
  if (more) result.next_page_token = page.back()->id();
  return result;
}

void JobRegistry::DeleteJob(const std::string& owner, const std::string& job_id,
                            std::function<void(absl::Status)> done) {
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) {
    done(JobNotFound(job_id));
    return;
  }
  // Out of the table at once (no new work finds it); queued work runs first.
  Remove(job_id);
  job->Post([this, job, done = std::move(done)] {
    absl::Status s = job->Close(/*remove_checkpoint=*/true);
    if (options_.observer != nullptr) options_.observer->OnJobDeleted(job->id());
    LogEvent(absl::StrCat("job ", job->id(), " deleted"));
    ReportMemory();
    done(s);
  });
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::AcceptWork(const absl::Status& input_check,
                                                             const std::string& owner,
                                                             const std::string& job_id) const {
  AMPD_RETURN_IF_ERROR(input_check);
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return Draining();
  }
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) return JobNotFound(job_id);
  return job;
}

void JobRegistry::Step(const std::string& owner, const std::string& job_id, int64_t sequence,
                       StepInput input, std::function<void(absl::StatusOr<StepReport>)> done) {
  // A malformed request is refused before it is queued, whatever the job's
  // state or sequence (the Trainer checks the batches against the model).
  absl::StatusOr<std::shared_ptr<Job>> found = AcceptWork(CheckStepInput(input), owner, job_id);
  if (!found.ok()) {
    done(found.status());
    return;
  }
  std::shared_ptr<Job> job = *std::move(found);
  auto shared_input = std::make_shared<StepInput>(std::move(input));
  job->Post([this, job, sequence, shared_input, done = std::move(done)] {
    absl::StatusOr<StepReport> report = job->Step(sequence, std::move(*shared_input));
    const std::optional<ErrorReason> why = GetErrorReason(report.status());
    if (report.ok()) {
      ReportMemory();
    } else if (why.has_value() && why->reason == reason::kScalerAtMinScale) {
      LogEvent(absl::StrCat("job ", job->id(), " failed at step ", sequence, ": ",
                            report.status().message()));
    } else if (report.status().code() != absl::StatusCode::kInvalidArgument &&
               report.status().code() != absl::StatusCode::kFailedPrecondition &&
               report.status().code() != absl::StatusCode::kNotFound) {
      LogEvent(absl::StrCat("job ", job->id(), " step ", sequence,
                            " failed: ", report.status().ToString()));
    }
    done(std::move(report));
  });
}

void JobRegistry::Evaluate(const std::string& owner, const std::string& job_id, EvaluateInput input,
                           std::function<void(absl::StatusOr<EvaluateReport>)> done) {
  absl::StatusOr<std::shared_ptr<Job>> found = AcceptWork(CheckEvaluateInput(input), owner, job_id);
  if (!found.ok()) {
    done(found.status());
    return;
  }
  std::shared_ptr<Job> job = *std::move(found);
  auto shared_input = std::make_shared<EvaluateInput>(std::move(input));
  job->Post([this, job, shared_input, done = std::move(done)] {
    absl::StatusOr<EvaluateReport> report = job->Evaluate(*shared_input);
    if (report.ok()) {
      ReportMemory();
    } else if (report.status().code() != absl::StatusCode::kInvalidArgument &&
               report.status().code() != absl::StatusCode::kNotFound) {
      LogEvent(absl::StrCat("job ", job->id(), " evaluate failed: ", report.status().ToString()));
    }
    done(std::move(report));
  });
}

void JobRegistry::ExportState(
    const std::string& owner, const std::string& job_id,
    std::function<void(absl::StatusOr<checkpoint::EncodedSafetensors>)> done) {
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) {
    done(JobNotFound(job_id));
    return;
  }
  job->Post([job, done = std::move(done)] { done(job->ExportSafetensors()); });
}

void JobRegistry::ImportState(const std::string& owner, const std::string& job_id,
                              checkpoint::StateDict state, bool partial,
                              std::function<void(absl::StatusOr<int64_t>)> done) {
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) {
    done(JobNotFound(job_id));
    return;
  }
  auto shared_state = std::make_shared<checkpoint::StateDict>(std::move(state));
  job->Post([job, shared_state, partial, done = std::move(done)] {
    absl::StatusOr<int64_t> tensors = job->ImportSafetensors(std::move(*shared_state), partial);
    if (tensors.ok()) LogEvent(absl::StrCat("job ", job->id(), " state loaded"));
    done(std::move(tensors));
  });
}

absl::Status JobRegistry::RestoreAll(const CreateRequestDecoder& legacy_decode) {
  if (!state_dir_) return absl::OkStatus();
  AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> ids, state_dir_->ListJobs());
  // Most recently written first: when --max-jobs or --max-memory-bytes cannot
  // hold every checkpoint, the jobs that trained last are the ones restored.
  std::vector<std::pair<int64_t, std::string>> order;
  for (const std::string& id : ids) {
    absl::StatusOr<int64_t> written = state_dir_->WriteTimeNanos(id);
    order.emplace_back(written.ok() ? *written : 0, id);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::string> candidates;
  for (const auto& [written, id] : order) candidates.push_back(id);
  // Admission, then the parallel rebuild. A job admitted from its header
  // whose file then fails to restore keeps its place: it stays listed as
  // failed (Job::KeepUnrestored), to be loaded again or deleted.
  std::vector<std::string> turned_away;
  std::vector<std::string> refusals;
  RestoreInParallel(AdmitForRestore(candidates, legacy_decode, &turned_away, &refusals));
  for (const std::string& line : refusals) LogEvent(line);
  ReportMemory();
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Job>> JobRegistry::AdmitForRestore(
    const std::vector<std::string>& ids, const CreateRequestDecoder& legacy_decode,
    std::vector<std::string>* turned_away, std::vector<std::string>* refusals) {
  // In order, from the headers alone: an admitted job enters the table at
  // once, so its bytes count against the limits for the next.
  std::vector<std::shared_ptr<Job>> admitted;
  for (const std::string& id : ids) {
    {
      absl::MutexLock lock(&mu_);
      if (options_.max_jobs > 0 && static_cast<int64_t>(jobs_.size()) >= options_.max_jobs) {
        turned_away->push_back(id);
        refusals->push_back(absl::StrCat("job ", id,
                                         " not restored: --max-jobs=", options_.max_jobs,
                                         " jobs are held; its checkpoint is left on disk"));
        continue;
      }
    }
    absl::StatusOr<std::map<std::string, std::string>> metadata = state_dir_->ReadMetadata(id);
    if (!metadata.ok()) {
      LogEvent(absl::StrCat("job ", id, " failed to restore: ", metadata.status().ToString()));
      continue;
    }
    absl::StatusOr<RestoredConfig> request = ConfigOfCheckpoint(*metadata, legacy_decode);
    if (!request.ok()) {
      LogEvent(absl::StrCat("job ", id, " failed to restore: ", request.status().ToString()));
      continue;
    }
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckAdmission(request->owner, request->config.get()); !s.ok()) {
      turned_away->push_back(id);
      refusals->push_back(absl::StrCat("job ", id, " not restored: ", s.message(),
                                       "; its checkpoint is left on disk"));
      continue;
    }
    auto job = std::make_shared<Job>(id, request->owner, request->request_id, request->config,
                                     context_.get());
    jobs_[id] = job;
    if (!request->request_id.empty()) by_request_id_[{request->owner, request->request_id}] = id;
    admitted.push_back(std::move(job));
  }
  return admitted;
}

void JobRegistry::RestoreInParallel(const std::vector<std::shared_ptr<Job>>& jobs) {
  // Reading, decoding and rebuilding (backend, weights, optimizer state)
  // dominate a restart: the jobs run them in parallel, at most one per
  // worker thread, so at most that many files are in host memory at once.
  absl::BlockingCounter pending(static_cast<int>(jobs.size()));
  for (const std::shared_ptr<Job>& job : jobs) {
    pool_->Post([this, job, &pending] {
      absl::Status s = [&]() -> absl::Status {
        AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDict state, state_dir_->Read(job->id()));
        return job->Restore(options_.device, state);
      }();
      if (s.ok()) {
        LogEvent(absl::StrCat("job ", job->id(), " restored at step ", job->Snapshot().step));
      } else {
        // Never dropped: listed as failed with the reason, its file kept.
        job->KeepUnrestored(options_.device, s.ToString());
        LogEvent(absl::StrCat("job ", job->id(), " failed to restore: ", s.ToString(),
                              "; it is listed as failed and its checkpoint is left on disk"));
      }
      if (options_.observer != nullptr) {
        options_.observer->OnJobCreated(job->id(), job->owner(), job->Snapshot().config);
      }
      pending.DecrementCount();
    });
  }
  pending.Wait();
}

void JobRegistry::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

absl::Status JobRegistry::CheckpointAll() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  absl::BlockingCounter pending(static_cast<int>(jobs.size()));
  absl::Mutex status_mu;
  absl::Status first_error;
  for (const auto& job : jobs) {
    job->Post([&, job] {
      absl::Status s = job->closed() ? absl::OkStatus() : job->Checkpoint();
      if (!s.ok()) {
        LogEvent(absl::StrCat("job ", job->id(), " final checkpoint failed: ", s.ToString()));
        absl::MutexLock lock(&status_mu);
        if (first_error.ok()) first_error = s;
      }
      pending.DecrementCount();
    });
  }
  pending.Wait();
  return first_error;
}

}  // namespace ampd::engine
