// WorkerPool: the server's one worker-queue loop. A fixed set of threads
// runs posted tasks in post order (FIFO); with one thread, each task runs
// after every task posted before it has finished. Everything that runs work
// off its caller's thread is a WorkerPool or posts to one: the jobs' strands
// (jobs/job.h: one task of a job at a time over a shared pool), the
// checkpoint writer (jobs/checkpoint_writer.h: its own pool, so that a
// strand waiting for a write never holds the thread the write needs) and a
// distributed step's gradient sums (dist/gloo_all_reduce.cc: a pool of one
// thread, so the collectives run in the order every rank starts them).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ampd {

class WorkerPool {
 public:
  // At least one thread (`threads` < 1 makes one).
  explicit WorkerPool(int threads);
  ~WorkerPool();  // Shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`. Ignored once Shutdown has begun: the task never runs.
  void Post(std::function<void()> task);
  // Waits until every task posted before the call has run and none is
  // running. Never from one of the pool's own tasks (it would wait for
  // itself).
  void WaitIdle();
  // Runs what is queued, then joins the threads; Post is ignored from its
  // start. Idempotent; not to be called from one of the pool's own tasks.
  void Shutdown();

 private:
  void Run();
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;  // tasks taken and not yet finished
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ampd
