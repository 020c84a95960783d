// JobRegistry's memory admission: a new job against --max-jobs,
// --max-memory-bytes, --max-distributed-jobs and its tenant's quota; a
// step's (or an evaluation's) workspace against the memory limits, reserved
// for it while it runs; and the idle jobs' cached workspaces given up under
// memory pressure.
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/error_reason.h"
#include "server/engine/jobs/job.h"
#include "server/engine/jobs/job_registry.h"

namespace ampd::engine {

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
      return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                            "config.distributed: the server holds as many distributed jobs as "
                            "--max-distributed-jobs=",
                            options_.max_distributed_jobs, " allows; retry once one is deleted")),
                        reason::kJobLimit,
                        {{"max_distributed_jobs", absl::StrCat(options_.max_distributed_jobs)}});
    }
  }
  // The server-wide refusals name the limit and the caller's own figures
  // only: how many jobs or bytes the server holds is other tenants' too.
  if (options_.max_jobs > 0 && static_cast<int64_t>(jobs_.size()) >= options_.max_jobs) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "job_id: the server holds as many jobs as --max-jobs=", options_.max_jobs,
                          " allows, ", JobsOf(owner), " of them yours; retry once one is deleted")),
                      reason::kJobLimit, {{"max_jobs", absl::StrCat(options_.max_jobs)}});
  }
  if (options_.max_memory_bytes > 0) {
    const int64_t need = NewJobBytes(config, nullptr);
    if (SaturatingAdd(MemoryHeld(nullptr), need) > options_.max_memory_bytes) {
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "config.model: the job needs an estimated ", need,
              " bytes, more than --max-memory-bytes=", options_.max_memory_bytes,
              " leaves free now; your jobs hold ", MemoryHeld(nullptr, &owner), " of it")),
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
    const int64_t need = NewJobBytes(config, &owner);
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
  // A base shared by LoRA jobs counts once, however many jobs are on it.
  std::set<std::pair<std::string, model::Precision>> bases;
  for (const auto& [id, job] : jobs_) {
    if (owner != nullptr && job->owner() != *owner) continue;
    const JobConfig& config = job->config();
    if (SharesBase(config) && bases.emplace(config.base_model, config.precision).second) {
      used = SaturatingAdd(used, SharedBaseBytes(config));
    }
    used = SaturatingAdd(used, SaturatingAdd(job->estimated_bytes(), job->snapshot_bytes()));
    if (job.get() == except) continue;
    // A step's reservation stands in for the job's cached workspace, which
    // it holds again once the step is over.
    auto reserved = reserved_.find(job.get());
    used = SaturatingAdd(used,
                         reserved != reserved_.end() ? reserved->second : job->workspace_bytes());
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

absl::StatusOr<WorkspaceReservation> JobRegistry::AdmitStep(Job& job, int64_t workspace_bytes) {
  absl::StatusOr<WorkspaceReservation> admitted = TryAdmitStep(job, workspace_bytes);
  if (!admitted.ok() && ReleaseIdleWorkspaces(&job) > 0) {
    admitted = TryAdmitStep(job, workspace_bytes);
  }
  return admitted;
}

absl::StatusOr<WorkspaceReservation> JobRegistry::TryAdmitStep(Job& job, int64_t workspace_bytes) {
  absl::MutexLock lock(&mu_);
  if (options_.max_memory_bytes > 0 &&
      SaturatingAdd(MemoryHeld(&job), workspace_bytes) > options_.max_memory_bytes) {
    return WithReason(
        absl::ResourceExhaustedError(
            absl::StrCat("micro_batches: they need an estimated ", workspace_bytes,
                         " bytes of activation and workspace memory for its batch sizes, more than "
                         "--max-memory-bytes=",
                         options_.max_memory_bytes,
                         " leaves free now; your jobs' weights and other workspaces hold ",
                         MemoryHeld(&job, &job.owner()), " of it; send smaller micro-batches")),
        reason::kMemoryLimit,
        {{"limit_bytes", absl::StrCat(options_.max_memory_bytes)},
         {"requested_bytes", absl::StrCat(workspace_bytes)}});
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
  reserved_[&job] = workspace_bytes;
  return WorkspaceReservation([this, key = &job] {
    absl::MutexLock release_lock(&mu_);
    reserved_.erase(key);
  });
}

absl::Status JobRegistry::AdmitSnapshot(Job& job, int64_t bytes) {
  absl::Status admitted = TryAdmitSnapshot(job, bytes);
  // The job's own cached workspace too: a save runs outside its steps.
  if (!admitted.ok() && ReleaseIdleWorkspaces(nullptr) > 0) {
    admitted = TryAdmitSnapshot(job, bytes);
  }
  return admitted;
}

absl::Status JobRegistry::TryAdmitSnapshot(Job& job, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  // The job's own cached workspace counts: unlike a step's, the snapshot
  // is held beside it.
  if (options_.max_memory_bytes > 0 &&
      SaturatingAdd(MemoryHeld(nullptr), bytes) > options_.max_memory_bytes) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "snapshot: a sampler snapshot of this job needs ", bytes,
                          " bytes (its trainable weights), more than --max-memory-bytes=",
                          options_.max_memory_bytes, " leaves free now; your jobs hold ",
                          MemoryHeld(nullptr, &job.owner()), " of it; delete a snapshot first")),
                      reason::kMemoryLimit,
                      {{"field", "snapshot"},
                       {"limit_bytes", absl::StrCat(options_.max_memory_bytes)},
                       {"requested_bytes", absl::StrCat(bytes)}});
  }
  if (const TenantQuota* quota = QuotaOf(job.owner());
      quota != nullptr && quota->max_memory_bytes > 0) {
    const int64_t used = MemoryHeld(nullptr, &job.owner());
    if (SaturatingAdd(used, bytes) > quota->max_memory_bytes) {
      return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                            "snapshot: a sampler snapshot of this job needs ", bytes,
                            " bytes and the jobs of tenant '", job.owner(), "' hold ", used,
                            " of its quota (max_memory_bytes=", quota->max_memory_bytes,
                            "); delete a snapshot first")),
                        reason::kMemoryLimit,
                        {{"field", "snapshot"},
                         {"tenant", job.owner()},
                         {"limit_bytes", absl::StrCat(quota->max_memory_bytes)},
                         {"requested_bytes", absl::StrCat(bytes)}});
    }
  }
  // Counted under the lock, as a step's reservation is.
  job.HoldSnapshotBytes(bytes);
  return absl::OkStatus();
}

}  // namespace ampd::engine
