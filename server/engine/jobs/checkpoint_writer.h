// CheckpointWriter: writes jobs' periodic checkpoints off their strands. A
// job snapshots its state into host memory (the only part that stalls its
// steps) and hands the snapshot here; writer threads encode it, write it
// atomically (StateDirectory::Write) and fsync it. One write per job at a
// time; a snapshot queued while an older one of the same job still waits
// replaces it, so a slow disk costs at most one pending and one in-flight
// snapshot per job, never a growing queue. A job waits (WaitForJob) for its
// previous snapshot before it queues the next, so in practice it has one.
// The writes run on a WorkerPool of the writer's own: the strands wait for
// them (WaitForJob), so they must never queue behind the strands' work.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/common/worker_pool.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/checkpoint/state_directory.h"

namespace ampd::engine {

class CheckpointWriter {
 public:
  // dir must outlive the writer.
  CheckpointWriter(const checkpoint::StateDirectory* dir, int threads);
  ~CheckpointWriter();  // Shutdown()
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Queues `state` (taken at `step`) as job_id's next checkpoint, replacing
  // one of the same job that has not started. Ignored after Shutdown.
  void Enqueue(const std::string& job_id, int64_t step, checkpoint::StateDict state);
  // Drops job_id's queued snapshot and waits for its write in flight, if
  // any. When it returns nothing of job_id's is written until the next
  // Enqueue: the caller may then write or remove the file itself without an
  // older background write landing after it.
  void Cancel(const std::string& job_id);
  // Waits until job_id has no snapshot queued or being written (each is on
  // disk, or its write failed). A job calls it before it queues its next
  // snapshot, so that it never holds more than one unwritten: that bounds
  // how far its acknowledged steps run ahead of its last durable
  // checkpoint (Job::CheckpointInBackground).
  void WaitForJob(const std::string& job_id);
  // Waits until every snapshot queued before the call is on disk (or failed).
  void Flush();
  // Writes what is queued, then joins the threads. Idempotent.
  void Shutdown();

 private:
  struct Pending {
    int64_t step = 0;
    checkpoint::StateDict state;
  };
  // A pool task: writes the ready snapshots, oldest first, until none is
  // ready. Each id put in ready_ by Enqueue posts one; one that a write's
  // end puts back is taken by the loop that wrote it.
  void WriteReady();
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const checkpoint::StateDirectory* const dir_;
  absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  // Ids with a pending snapshot and no write in flight, oldest first.
  std::deque<std::string> ready_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> in_flight_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  WorkerPool pool_;  // last: its threads start once every member above exists
};

}  // namespace ampd::engine
