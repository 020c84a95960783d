// CheckpointWriter: the background half of a periodic checkpoint.
#include "server/engine/jobs/checkpoint_writer.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <utility>

namespace ampd::engine {

CheckpointWriter::CheckpointWriter(const checkpoint::StateDirectory* dir, int threads) : dir_(dir) {
  threads = std::max(threads, 1);
  threads_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

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
  if (inserted && !in_flight_.contains(job_id)) ready_.push_back(job_id);
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
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  absl::MutexLock lock(&mu_);
  threads_.clear();
}

void CheckpointWriter::Run() {
  for (;;) {
    std::string job_id;
    Pending snapshot;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointWriter* w)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || !w->ready_.empty(); },
          this));
      // Drain what is queued even when stopping: those are acknowledged steps.
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
    // A snapshot that arrived during the write goes next.
    if (pending_.contains(job_id)) ready_.push_back(job_id);
  }
}

}  // namespace ampd::engine
