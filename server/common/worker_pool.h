// WorkerPool: the server's one worker-queue loop. A fixed set of threads
// runs posted tasks in post order (FIFO); with one thread, each task runs
// after every task posted before it has finished. Everything that runs work
// off its caller's thread is a WorkerPool or posts to one: the jobs' strands
// (jobs/job.h: one task of a job at a time over a shared pool), the
// checkpoint writer (jobs/checkpoint_writer.h: its own pool, so that a
// strand waiting for a write never holds the thread the write needs) and a
// distributed step's gradient sums (dist/gloo_all_reduce.cc: a pool of one
// thread, so the collectives run in the order every rank starts them).
//
// A task posted as long (Lane::kLong: work whose length the request sets
// rather than its size, a Sample's decode loop) runs only while fewer than
// `max_long` long tasks are running: the pool keeps the other threads for
// short tasks, which pass the long ones waiting for a thread, so calls of
// other jobs are served however many long calls are queued.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ampd {

class WorkerPool {
 public:
  enum class Lane { kShort, kLong };

  // At least one thread (`threads` < 1 makes one). max_long: how many
  // threads may run long tasks at once, at least one; 0 (or more than
  // `threads`): every thread.
  explicit WorkerPool(int threads, int max_long = 0);
  ~WorkerPool();  // Shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`. Ignored once Shutdown has begun: the task never runs.
  void Post(std::function<void()> task, Lane lane = Lane::kShort);
  // Waits until every task posted before the call has run and none is
  // running. Never from one of the pool's own tasks (it would wait for
  // itself).
  void WaitIdle();
  // Runs what is queued, then joins the threads; Post is ignored from its
  // start. Idempotent; not to be called from one of the pool's own tasks.
  void Shutdown();

 private:
  struct Queued {
    uint64_t order;  // post order across both queues
    std::function<void()> task;
  };
  void Run();
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A task a thread may take now: a short one, or a long one under max_long_.
  bool Runnable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_long_;
  absl::Mutex mu_;
  std::deque<Queued> short_ ABSL_GUARDED_BY(mu_);
  std::deque<Queued> long_ ABSL_GUARDED_BY(mu_);
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;       // tasks taken and not yet finished
  int64_t running_long_ ABSL_GUARDED_BY(mu_) = 0;  // of which long
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ampd
