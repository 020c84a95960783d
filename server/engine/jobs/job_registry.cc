// JobRegistry: the job table and the orchestration of jobs' strand tasks.
// Memory admission is in job_admission.cc, restore at start in
// job_restore.cc.
#include "server/engine/jobs/job_registry.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/checked_math.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "kernels/backend_factory.h"
#include "server/engine/checkpoint/state_directory.h"
#include "server/engine/jobs/base_models.h"
#include "server/engine/jobs/checkpoint_writer.h"
#include "server/engine/jobs/job.h"

namespace ampd::engine {
namespace {

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

// A call whose caller is gone by its turn on the job's strand is not
// started: the token's status, or OK to run it.
absl::Status NotStarted(const CallToken& call) {
  return call.Check("the call stopped before its turn on the job's worker came");
}

}  // namespace

void JobRegistry::LogEvent(const std::string& line) {
  std::fprintf(stderr, "ampd: %s\n", line.c_str());
}

absl::StatusOr<DeviceInfo> ResolveDevice(const std::string& device) {
  AMPD_ASSIGN_OR_RETURN(const std::unique_ptr<kernels::Backend> backend,
                        kernels::CreateBackend(device));
  return DeviceInfo{backend->name(), backend->MemoryCapacityBytes()};
}

JobRegistry::JobRegistry(RegistryOptions options)
    : options_(std::move(options)), context_(std::make_unique<JobContext>()) {}

absl::StatusOr<std::unique_ptr<JobRegistry>> JobRegistry::Create(RegistryOptions options) {
  auto registry = std::unique_ptr<JobRegistry>(new JobRegistry(std::move(options)));
  registry->bases_ = std::make_unique<BaseModels>(registry->options_.models_dir);
  registry->context_->bases = registry->bases_.get();
  if (!registry->options_.state_dir.empty()) {
    AMPD_ASSIGN_OR_RETURN(checkpoint::StateDirectory dir,
                          checkpoint::StateDirectory::Open(registry->options_.state_dir));
    registry->state_dir_ = std::make_unique<checkpoint::StateDirectory>(std::move(dir));
  }
  // Long tasks (Samples) may hold all threads but one: whatever they are
  // asked for, the other jobs' steps and reads still find a thread.
  const int threads = std::max(1, registry->options_.worker_threads);
  registry->pool_ = std::make_unique<WorkerPool>(threads, std::max(1, threads - 1));
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
  registry->context_->admit_snapshot = [self](Job& job, int64_t bytes) {
    return self->AdmitSnapshot(job, bytes);
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
  const BaseModels::Held bases = bases_->held();
  if (options_.observer != nullptr) options_.observer->OnSharedBases(bases.count, bases.bytes);
  if (!options_.on_device_memory) return;
  int64_t total = bases.bytes;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) total += job->bytes_in_use();
  }
  options_.on_device_memory(total);
}

std::vector<std::string> JobRegistry::ListModels() const { return bases_->List(); }

absl::Status JobRegistry::ApplyBaseModel(JobConfig& config) const {
  if (absl::Status s = CheckBaseModelName(config.base_model); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("config.", s.message()));
  }
  model::ModelSpec& request = config.model;
  if (!request.layers.empty() || request.gpt() != nullptr) {
    return absl::InvalidArgumentError(
        "config.model: set by base_model's config.json; send only decoder.lora (and "
        "loss_multiplier)");
  }
  AMPD_ASSIGN_OR_RETURN(model::ModelSpec spec, bases_->Spec(config.base_model));
  std::optional<model::LoraSpec> lora;
  if (const model::LoraSpec* requested = model::LoraOf(request)) lora = *requested;
  if (lora.has_value() && spec.decoder() == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.model.decoder.lora: base_model ", config.base_model,
                     " is a GPT-2; LoRA adapters are a decoder's (llama, qwen2)"));
  }
  if (model::DecoderSpec* decoder = spec.decoder()) decoder->lora = std::move(lora);
  spec.loss_multiplier = request.loss_multiplier;
  config.model = std::move(spec);
  return absl::OkStatus();
}

int64_t JobRegistry::NewJobBytes(const JobConfig& config, const std::string* owner) const {
  int64_t need = EstimateJobBytes(config);
  if (!SharesBase(config)) return need;
  for (const auto& [id, job] : jobs_) {
    if (owner != nullptr && job->owner() != *owner) continue;
    const JobConfig& held = job->config();
    if (SharesBase(held) && held.base_model == config.base_model &&
        held.precision == config.precision) {
      return need;
    }
  }
  return SaturatingAdd(need, SharedBaseBytes(config));
}

void JobRegistry::CreateJob(const std::string& owner, JobConfig config, std::string request_id,
                            std::function<void(absl::StatusOr<JobSnapshot>)> done) {
  if (!config.base_model.empty()) {
    if (absl::Status s = ApplyBaseModel(config); !s.ok()) {
      done(s);
      return;
    }
  }
  // The one validation of a create: the Job and its Trainer take the proof.
  absl::StatusOr<ValidJobConfig> valid = ValidJobConfig::Check(std::move(config));
  if (!valid.ok()) {
    done(absl::Status(valid.status().code(), absl::StrCat("config.", valid.status().message())));
    return;
  }
  // Memory pressure: when the memory limits alone would refuse the job,
  // the idle jobs first give up their cached workspaces, and the admission
  // below decides on what is left.
  bool refused = false;
  {
    absl::MutexLock lock(&mu_);
    refused = MemoryRefuses(owner, NewJobBytes(valid->get(), &owner));
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

std::vector<JobRegistry::PeerSecret> JobRegistry::PeerSecrets(const std::string& group) const {
  std::vector<PeerSecret> secrets;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    const dist::DistributedSpec& spec = job->distributed_spec();
    if (spec.enabled() && spec.rank == 0 && spec.group == group) {
      secrets.push_back(PeerSecret{spec.secret, job->owner()});
    }
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
                                                             const std::string& job_id,
                                                             bool drain_refuses) const {
  AMPD_RETURN_IF_ERROR(input_check);
  if (drain_refuses) {
    absl::MutexLock lock(&mu_);
    if (draining_) return Draining();
  }
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) return JobNotFound(job_id);
  return job;
}

void JobRegistry::AfterCall(const Job& job, absl::string_view what, int64_t sequence,
                            bool long_call, const absl::Status& status) {
  const std::optional<ErrorReason> why = GetErrorReason(status);
  if (status.ok()) {
    ReportMemory();
  } else if (StoppedByCaller(status) ||
             (long_call && status.code() == absl::StatusCode::kUnavailable)) {
    LogEvent(absl::StrCat("job ", job.id(), " ", what, " stopped: ", status.ToString()));
  } else if (why.has_value() && why->reason == reason::kScalerAtMinScale) {
    LogEvent(absl::StrCat("job ", job.id(), " failed at step ", sequence, ": ", status.message()));
  } else if (status.code() != absl::StatusCode::kInvalidArgument &&
             status.code() != absl::StatusCode::kFailedPrecondition &&
             status.code() != absl::StatusCode::kNotFound &&
             status.code() != absl::StatusCode::kAlreadyExists) {
    // Refusals of what the client sent are the client's to read, not the log's.
    LogEvent(absl::StrCat("job ", job.id(), " ", what, " failed: ", status.ToString()));
  }
}

namespace {

// A Sample is a long call: its length is set by max_tokens, not by the
// request's size (WorkerPool::Lane::kLong), and a drain stops it.
template <typename Request>
constexpr bool kLongCall = std::is_same_v<Request, SampleRequest>;
// A drain lets a state's export and import in (it checkpoints every job
// itself; a client may still read or put its state); every other call is
// refused while the server drains.
template <typename Request>
constexpr bool kDrainRefuses =
    !std::is_same_v<Request, ExportStateRequest> && !std::is_same_v<Request, ImportStateRequest>;

// The call as the log names it: "step 3", "forward_backward 3.1", "sample".
template <typename Request>
std::string Describe(const Request& request) {
  std::string what(Request::kName);
  if constexpr (requires { request.sequence; }) absl::StrAppend(&what, " ", request.sequence);
  if constexpr (requires { request.index; }) absl::StrAppend(&what, ".", request.index);
  return what;
}

}  // namespace

template <typename Request>
void JobRegistry::Submit(const std::string& owner, const std::string& job_id, Request request,
                         Done<Request> done, CallToken call) {
  using Report = typename Request::Report;
  const std::string what = Describe(request);
  int64_t sequence = 0;
  if constexpr (requires { request.sequence; }) sequence = request.sequence;
  absl::StatusOr<Valid<Request>> valid = Valid<Request>::Check(std::move(request));
  absl::StatusOr<std::shared_ptr<Job>> found =
      AcceptWork(valid.status(), owner, job_id, kDrainRefuses<Request>);
  if (!found.ok()) {
    done(found.status());
    return;
  }
  uint64_t long_call = 0;
  if (kLongCall<Request> && !AddLongCall(&long_call, call)) {
    done(Draining());
    return;
  }
  std::shared_ptr<Job> job = *std::move(found);
  auto shared = std::make_shared<Valid<Request>>(*std::move(valid));
  job->Post(
      [this, job, shared, call, long_call, what, sequence, done = std::move(done)] {
        const absl::Status not_started = NotStarted(call);
        absl::StatusOr<Report> report = not_started.ok() ? job->Run(std::move(*shared), call)
                                                         : absl::StatusOr<Report>(not_started);
        if (kLongCall<Request>) RemoveLongCall(long_call);
        AfterCall(*job, what, sequence, kLongCall<Request>, report.status());
        done(std::move(report));
      },
      kLongCall<Request> ? WorkerPool::Lane::kLong : WorkerPool::Lane::kShort);
}

// The calls the registry takes (api.h), each run by its Job::Run.
template void JobRegistry::Submit(const std::string&, const std::string&, StepRequest,
                                  Done<StepRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, ForwardBackwardRequest,
                                  Done<ForwardBackwardRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, OptimStepRequest,
                                  Done<OptimStepRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, EvaluateRequest,
                                  Done<EvaluateRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, SampleRequest,
                                  Done<SampleRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&,
                                  SaveSamplerSnapshotRequest, Done<SaveSamplerSnapshotRequest>,
                                  CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&,
                                  DeleteSamplerSnapshotRequest, Done<DeleteSamplerSnapshotRequest>,
                                  CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, ExportStateRequest,
                                  Done<ExportStateRequest>, CallToken);
template void JobRegistry::Submit(const std::string&, const std::string&, ImportStateRequest,
                                  Done<ImportStateRequest>, CallToken);

bool JobRegistry::AddLongCall(uint64_t* id, const CallToken& call) {
  absl::MutexLock lock(&mu_);
  if (draining_) return false;
  *id = next_long_call_++;
  long_calls_.emplace(*id, call);
  return true;
}

void JobRegistry::RemoveLongCall(uint64_t id) {
  absl::MutexLock lock(&mu_);
  long_calls_.erase(id);
}

absl::StatusOr<std::vector<SamplerSnapshotInfo>> JobRegistry::ListSamplerSnapshots(
    const std::string& owner, const std::string& job_id) const {
  std::shared_ptr<Job> job = Find(owner, job_id);
  if (job == nullptr) return JobNotFound(job_id);
  return job->SamplerSnapshots();
}

void JobRegistry::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  for (const auto& [id, call] : long_calls_) call.Cancel(Draining());
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
