// A job's sampler snapshots: named, immutable copies of the weights Sample
// reads, on the job's device, each admitted against the memory limits
// before it is made and, with a state directory, written to a file of its
// own (snapshots/<job id>/<name>.safetensors) before it is acknowledged,
// so a restart brings it back bit for bit. They are never part of the
// job's checkpoint: written once (they never change), removed with
// DeleteSamplerSnapshot or the job.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "server/engine/jobs/allocation_guard.h"
#include "server/engine/jobs/job.h"

namespace ampd::engine {

namespace {

absl::Status SnapshotNotFound(absl::string_view field, const std::string& name) {
  return WithReason(absl::NotFoundError(absl::StrCat(field, ": the job holds no sampler snapshot '",
                                                     Echo(name), "'")),
                    reason::kSnapshotNotFound, {{"field", field}, {"snapshot", Echo(name)}});
}

}  // namespace

absl::StatusOr<SamplerWeights*> Job::FindSnapshot(absl::string_view field,
                                                  const std::string& name) {
  auto it = snapshots_.find(name);
  if (it == snapshots_.end()) return SnapshotNotFound(field, name);
  return &it->second.weights;
}

absl::StatusOr<const checkpoint::StateDirectory*> Job::SnapshotDirectory() {
  if (context_->state_dir == nullptr) return nullptr;
  if (snapshot_dir_ == nullptr) {
    AMPD_ASSIGN_OR_RETURN(checkpoint::StateDirectory dir,
                          checkpoint::StateDirectory::Open(
                              absl::StrCat(context_->state_dir->path(), "/snapshots/", id_)));
    snapshot_dir_ = std::make_unique<checkpoint::StateDirectory>(std::move(dir));
  }
  return snapshot_dir_.get();
}

absl::Status Job::AdmitSnapshot(int64_t bytes) {
  if (context_->admit_snapshot) return context_->admit_snapshot(*this, bytes);
  HoldSnapshotBytes(bytes);
  return absl::OkStatus();
}

void Job::SnapshotsChanged() {
  std::vector<SamplerSnapshotInfo> infos;
  infos.reserve(snapshots_.size());
  for (const auto& [name, stored] : snapshots_) infos.push_back(stored.info);
  if (trainer_ != nullptr) {
    bytes_in_use_.store(trainer_->backend().BytesInUse(), std::memory_order_relaxed);
  }
  if (context_->observer != nullptr) {
    context_->observer->OnSamplerSnapshots(id_, static_cast<int64_t>(infos.size()),
                                           snapshot_bytes());
  }
  absl::MutexLock lock(&mu_);
  snapshot_infos_ = std::move(infos);
}

std::vector<SamplerSnapshotInfo> Job::SamplerSnapshots() const {
  absl::MutexLock lock(&mu_);
  return snapshot_infos_;
}

bool Job::HoldsWeightsNow(StoredSnapshot& stored) {
  if (stored.version == weights_version_) return true;
  // A snapshot restored at start (version -1) is the resend's when the job
  // came back at its step with nothing run or loaded since, and its bits
  // are the weights' (a load between the save and the restart keeps the
  // step count but not the weights): the client's save whose answer the
  // restart lost is answered as it was.
  if (stored.version != -1 || weights_version_ != 0 || stored.info.step != trainer_->steps_run() ||
      stored.info.applied_steps != trainer_->applied_steps()) {
    return false;
  }
  absl::StatusOr<bool> same = AllocationGuard(
      "SaveSamplerSnapshot", [&] { return trainer_->HoldsSamplerWeights(stored.weights); });
  if (!same.ok() || !*same) return false;
  stored.version = weights_version_;  // the next resend needs no read
  return true;
}

absl::StatusOr<SamplerSnapshotInfo> Job::Run(Valid<SaveSamplerSnapshotRequest> request,
                                             const CallToken& /*call*/) {
  if (trainer_ == nullptr) return NotOpen();
  const std::string& name = request->name;
  // A name held for exactly the weights now is this call's resend.
  auto same_weights = [&](const std::string& n) {
    auto it = snapshots_.find(n);
    return it != snapshots_.end() && HoldsWeightsNow(it->second);
  };
  std::string chosen = name;
  if (chosen.empty()) {
    const std::string base = absl::StrCat("step-", trainer_->steps_run());
    chosen = base;
    for (int k = 2; snapshots_.contains(chosen) && !same_weights(chosen); ++k) {
      chosen = absl::StrCat(base, "-", k);
    }
  }
  if (same_weights(chosen)) return snapshots_.at(chosen).info;
  if (snapshots_.contains(chosen)) {
    return WithReason(absl::AlreadyExistsError(absl::StrCat(
                          "snapshot: the job holds a sampler snapshot '", chosen,
                          "' of other weights (taken at step ", snapshots_.at(chosen).info.step,
                          "); delete it first or choose another name")),
                      reason::kSnapshotExists, {{"field", "snapshot"}, {"snapshot", chosen}});
  }
  if (static_cast<int64_t>(snapshots_.size()) >= kMaxSamplerSnapshots) {
    return WithReason(
        absl::ResourceExhaustedError(
            absl::StrCat("snapshot: the job holds ", snapshots_.size(),
                         " sampler snapshots, the most a job may; delete one first")),
        reason::kSnapshotLimit,
        {{"field", "snapshot"}, {"max_snapshots", absl::StrCat(kMaxSamplerSnapshots)}});
  }
  const int64_t bytes = trainer_->sampler_weights_bytes();
  AMPD_RETURN_IF_ERROR(AdmitSnapshot(bytes));
  // From here on a failure gives the admitted bytes back.
  absl::StatusOr<SamplerSnapshotInfo> saved =
      AllocationGuard("SaveSamplerSnapshot", [&]() -> absl::StatusOr<SamplerSnapshotInfo> {
        StoredSnapshot stored;
        AMPD_ASSIGN_OR_RETURN(stored.weights, trainer_->CopySamplerWeights());
        stored.info = SamplerSnapshotInfo{chosen, trainer_->steps_run(), trainer_->applied_steps(),
                                          stored.weights.bytes()};
        stored.version = weights_version_;
        AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDirectory* dir, SnapshotDirectory());
        if (dir != nullptr) {
          // Durable before it is acknowledged, as a loaded state dict is.
          AMPD_ASSIGN_OR_RETURN(checkpoint::StateDict state,
                                trainer_->ExportSamplerWeights(stored.weights));
          // emplace, not operator[] =: GCC 12's -Wrestrict misfires on the
          // latter (as in job.cc). The map is the export's, empty.
          state.metadata.emplace(kMetaSnapshotFormat, std::string(kSnapshotFormatVersion));
          state.metadata.emplace(kMetaConfigDigest, ConfigDigest(config_json_));
          state.metadata.emplace(kMetaSnapshotStep, absl::StrCat(stored.info.step));
          state.metadata.emplace(kMetaSnapshotAppliedSteps,
                                 absl::StrCat(stored.info.applied_steps));
          AMPD_RETURN_IF_ERROR(dir->Write(chosen, state));
        }
        SamplerSnapshotInfo info = stored.info;
        snapshots_.emplace(chosen, std::move(stored));
        return info;
      });
  if (!saved.ok()) {
    HoldSnapshotBytes(-bytes);
  }
  SnapshotsChanged();
  return saved;
}

absl::StatusOr<NoReport> Job::Run(Valid<DeleteSamplerSnapshotRequest> request,
                                  const CallToken& /*call*/) {
  if (trainer_ == nullptr) return NotOpen();
  const std::string& name = request->name;
  auto it = snapshots_.find(name);
  if (it == snapshots_.end()) return SnapshotNotFound("snapshot", name);
  AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDirectory* dir, SnapshotDirectory());
  // The file first: a snapshot whose file could not be removed stays, as
  // it would come back at the next start.
  if (dir != nullptr) AMPD_RETURN_IF_ERROR(dir->Remove(name));
  HoldSnapshotBytes(-it->second.info.bytes);
  snapshots_.erase(it);
  SnapshotsChanged();
  return NoReport{};
}

absl::Status Job::DropSnapshots(bool remove_files) {
  if (!snapshots_.empty()) {
    int64_t bytes = 0;
    for (const auto& [name, stored] : snapshots_) bytes += stored.info.bytes;
    snapshots_.clear();
    HoldSnapshotBytes(-bytes);
    SnapshotsChanged();
  }
  if (!remove_files || context_->state_dir == nullptr) return absl::OkStatus();
  // The directory may hold files never restored (no memory for them then).
  AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDirectory* dir, SnapshotDirectory());
  const absl::Status removed = dir->RemoveAll();
  snapshot_dir_.reset();
  return removed;
}

void Job::RestoreSamplerSnapshots() {
  if (trainer_ == nullptr || context_->state_dir == nullptr) return;
  auto log = [&](const std::string& name, const absl::Status& why) {
    std::fprintf(stderr,
                 "ampd: job %s sampler snapshot %s not restored: %s; its file is left on disk\n",
                 id_.c_str(), name.c_str(), why.ToString().c_str());
  };
  absl::StatusOr<const checkpoint::StateDirectory*> dir = SnapshotDirectory();
  if (!dir.ok()) {
    log("(all)", dir.status());
    return;
  }
  absl::StatusOr<std::vector<std::string>> names = (*dir)->ListJobs();
  if (!names.ok()) {
    log("(all)", names.status());
    return;
  }
  for (const std::string& name : *names) {
    if (snapshots_.contains(name) || !CheckSnapshotName("snapshot", name).ok()) continue;
    if (static_cast<int64_t>(snapshots_.size()) >= kMaxSamplerSnapshots) {
      log(name, absl::ResourceExhaustedError("the job holds as many snapshots as it may"));
      continue;
    }
    const int64_t bytes = trainer_->sampler_weights_bytes();
    bool held = false;  // admitted and not (yet) in snapshots_
    absl::Status s = AllocationGuard("restore", [&]() -> absl::Status {
      AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDict state, (*dir)->Read(name));
      auto meta = [&](const char* key) -> std::string {
        auto it = state.metadata.find(key);
        return it == state.metadata.end() ? std::string() : it->second;
      };
      if (meta(kMetaSnapshotFormat) != kSnapshotFormatVersion) {
        return absl::DataLossError(absl::StrCat(kMetaSnapshotFormat, ": format \"",
                                                meta(kMetaSnapshotFormat), "\", this build reads ",
                                                kSnapshotFormatVersion));
      }
      if (meta(kMetaConfigDigest) != ConfigDigest(config_json_)) {
        return absl::DataLossError(
            absl::StrCat(kMetaConfigDigest, ": the snapshot is not of this job's config"));
      }
      StoredSnapshot stored;
      stored.info.name = name;
      if (!absl::SimpleAtoi(meta(kMetaSnapshotStep), &stored.info.step) ||
          !absl::SimpleAtoi(meta(kMetaSnapshotAppliedSteps), &stored.info.applied_steps)) {
        return absl::DataLossError(absl::StrCat(kMetaSnapshotStep, ": not a count"));
      }
      AMPD_RETURN_IF_ERROR(AdmitSnapshot(bytes));
      held = true;
      AMPD_ASSIGN_OR_RETURN(stored.weights, trainer_->LoadSamplerWeights(state));
      stored.info.bytes = stored.weights.bytes();
      snapshots_.emplace(name, std::move(stored));  // version -1: restored
      held = false;
      return absl::OkStatus();
    });
    if (held) HoldSnapshotBytes(-bytes);
    if (!s.ok()) log(name, s);
  }
  SnapshotsChanged();
}

}  // namespace ampd::engine
