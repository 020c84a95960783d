// CheckpointWriter: the background half of a periodic checkpoint.
#include "server/engine/jobs/checkpoint_writer.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <utility>

namespace ampd::engine {

CheckpointWriter::CheckpointWriter(const checkpoint::StateDirectory* dir, int threads)
    : dir_(dir), pool_(threads) {}

CheckpointWriter::~CheckpointWriter() { Shutdown(); }

void CheckpointWriter::Enqueue(const std::string& job_id, int64_t step,
                               checkpoint::StateDict state) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  auto [it, inserted] = pending_.try_emplace(job_id);
  it->second.step = step;
  it->second.state = std::move(state);
  // A replaced snapshot keeps its place in ready_ (or waits for the write in
  // flight, whose end queues it).
  if (!inserted || in_flight_.contains(job_id)) return;
  ready_.push_back(job_id);
  // Under mu_: Shutdown sets stopping_ before it stops the pool, so a write
  // queued here is posted before the pool stops taking posts.
  pool_.Post([this] { WriteReady(); });
}

void CheckpointWriter::Cancel(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (pending_.erase(job_id) > 0) {
    ready_.erase(std::remove(ready_.begin(), ready_.end(), job_id), ready_.end());
  }
  struct Args {
    CheckpointWriter* self;
    const std::string* id;
  } args{this, &job_id};
  mu_.Await(absl::Condition(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !a->self->in_flight_.contains(*a->id); },
      &args));
}

void CheckpointWriter::WaitForJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  struct Args {
    CheckpointWriter* self;
    const std::string* id;
  } args{this, &job_id};
  mu_.Await(absl::Condition(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !a->self->pending_.contains(*a->id) && !a->self->in_flight_.contains(*a->id);
      },
      &args));
}

bool CheckpointWriter::Idle() const { return pending_.empty() && in_flight_.empty(); }

void CheckpointWriter::Flush() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->Idle(); }, this));
}

void CheckpointWriter::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // The pool runs the writes already posted, even now: those are
  // acknowledged steps.
  pool_.Shutdown();
}

void CheckpointWriter::WriteReady() {
  for (;;) {
    std::string job_id;
    Pending snapshot;
    {
      absl::MutexLock lock(&mu_);
      // Empty too when Cancel took the id this task was posted for.
      if (ready_.empty()) return;
      job_id = std::move(ready_.front());
      ready_.pop_front();
      auto it = pending_.find(job_id);
      snapshot = std::move(it->second);
      pending_.erase(it);
      in_flight_.insert(job_id);
    }
    absl::Status s;
    try {
      s = dir_->Write(job_id, snapshot.state);
    } catch (const std::bad_alloc&) {
      s = absl::ResourceExhaustedError("encoding the checkpoint: out of host memory");
    }
    if (s.ok()) {
      std::fprintf(stderr, "ampd: job %s checkpointed at step %lld\n", job_id.c_str(),
                   static_cast<long long>(snapshot.step));
    } else {
      std::fprintf(stderr, "ampd: job %s checkpoint failed at step %lld: %s\n", job_id.c_str(),
                   static_cast<long long>(snapshot.step), s.ToString().c_str());
    }
    snapshot.state = {};  // free the host copy before the next one is taken
    absl::MutexLock lock(&mu_);
    in_flight_.erase(job_id);
    // A snapshot that arrived during the write goes next (this loop, or
    // another task's, takes it).
    if (pending_.contains(job_id)) ready_.push_back(job_id);
  }
}

}  // namespace ampd::engine
