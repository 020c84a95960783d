// JobRegistry's restore at start: the checkpoints in the state directory,
// most recently written first, admitted from their headers against the
// limits, then rebuilt in parallel on the worker pool. A checkpoint's config
// is its ampd.config, or an earlier version's ampd.create_request read by
// the rpc layer's decoder.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/status_macros.h"
#include "server/common/worker_pool.h"
#include "server/engine/checkpoint/state_directory.h"
#include "server/engine/jobs/job.h"
#include "server/engine/jobs/job_registry.h"

namespace ampd::engine {
namespace {

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
      // After the job is announced, so that their gauges carry its labels.
      if (s.ok()) job->RestoreSamplerSnapshots();
      pending.DecrementCount();
    });
  }
  pending.Wait();
}

}  // namespace ampd::engine
