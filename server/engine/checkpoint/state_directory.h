// StateDirectory: one safetensors file per job under --state-dir, written
// atomically (temp file in the same directory, fsync, rename, fsync of the
// directory) so that a crash at any instant leaves either the previous
// checkpoint or the new one, never a torn file. The server restores every
// job listed here at start.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/engine/checkpoint/state_dict.h"

namespace ampd::engine::checkpoint {

class StateDirectory {
 public:
  // Creates the directory when missing; FailedPrecondition when it cannot be
  // created or written, naming the path and the OS error.
  static absl::StatusOr<StateDirectory> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // job_id must be a safe file name ([A-Za-z0-9_-]{1,128}), else
  // InvalidArgument; so must `state` (ValidateStateDict). The file is
  // <path>/<job_id>.safetensors; OS errors come back as Internal naming the
  // path and the OS error, with the temp file removed.
  absl::Status Write(const std::string& job_id, const StateDict& state) const;
  // Write in two steps, for a caller with other work to do while the file
  // is written and a decision to take before it replaces the checkpoint:
  // WriteTemp writes and fsyncs a temp file beside the checkpoint (which is
  // unchanged) and returns its path; Publish renames it over the checkpoint
  // and fsyncs the directory; Discard removes it. Errors as Write's, the
  // temp file removed on any of them.
  absl::StatusOr<std::string> WriteTemp(const std::string& job_id, const StateDict& state) const;
  absl::Status Publish(const std::string& job_id, const std::string& temp_path) const;
  void Discard(const std::string& temp_path) const;
  // NotFound when there is no checkpoint for job_id; DataLoss, naming the
  // file and the defect, when the file does not decode.
  absl::StatusOr<StateDict> Read(const std::string& job_id) const;
  // Only the metadata of job_id's checkpoint, reading the header and not the
  // tensors; errors as Read's.
  absl::StatusOr<std::map<std::string, std::string>> ReadMetadata(const std::string& job_id) const;
  // When job_id's checkpoint was last written (st_mtime, in ns since the
  // epoch); NotFound when there is none.
  absl::StatusOr<int64_t> WriteTimeNanos(const std::string& job_id) const;
  // Removing an absent checkpoint is OK.
  absl::Status Remove(const std::string& job_id) const;
  // Job ids with a checkpoint, sorted; leftover temp files are ignored (and
  // removed: they are the remains of a write a crash interrupted). Because
  // it removes them, call it when no Write is in flight (at start-up);
  // a concurrent Write's rename would otherwise fail.
  absl::StatusOr<std::vector<std::string>> ListJobs() const;
  // Removes every checkpoint in the directory (ListJobs's), then the
  // directory itself when nothing else is left in it: a sub-directory a
  // job kept files of its own in (its sampler snapshots), deleted with it.
  absl::Status RemoveAll() const;

 private:
  explicit StateDirectory(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace ampd::engine::checkpoint
