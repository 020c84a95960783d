// WorkerPool: the threads and their FIFO queues (short and long tasks).
#include "server/common/worker_pool.h"

#include <algorithm>
#include <utility>

namespace ampd {

WorkerPool::WorkerPool(int threads, int max_long)
    : max_long_(max_long <= 0 || max_long > std::max(threads, 1) ? std::max(threads, 1)
                                                                 : max_long) {
  if (threads < 1) threads = 1;
  threads_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Shutdown(); }

void WorkerPool::Post(std::function<void()> task, Lane lane) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  (lane == Lane::kLong ? long_ : short_).push_back(Queued{posted_++, std::move(task)});
}

bool WorkerPool::Idle() const { return short_.empty() && long_.empty() && running_ == 0; }

bool WorkerPool::Runnable() const {
  return !short_.empty() || (!long_.empty() && running_long_ < max_long_);
}

void WorkerPool::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](WorkerPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->Idle(); }, this));
}

void WorkerPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void WorkerPool::Run() {
  for (;;) {
    std::function<void()> task;
    bool is_long = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->Runnable() || (p->stopping_ && p->short_.empty() && p->long_.empty());
          },
          this));
      // Drain what is queued even when stopping: the owners' tasks finish
      // calls and write acknowledged state.
      if (!Runnable()) return;  // stopping, and nothing is left
      // The older of the two fronts, unless long tasks are at their limit.
      is_long = short_.empty() || (!long_.empty() && running_long_ < max_long_ &&
                                   long_.front().order < short_.front().order);
      std::deque<Queued>& queue = is_long ? long_ : short_;
      task = std::move(queue.front().task);
      queue.pop_front();
      ++running_;
      if (is_long) ++running_long_;
    }
    task();
    task = nullptr;  // what it captured goes before the pool counts it done
    absl::MutexLock lock(&mu_);
    --running_;
    if (is_long) --running_long_;
  }
}

}  // namespace ampd
