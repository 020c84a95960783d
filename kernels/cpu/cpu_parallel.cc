// ThreadPool (cpu_parallel.h): a generation counter under a mutex wakes the
// workers; chunks are claimed with one atomic counter.
#include "kernels/cpu/cpu_parallel.h"

#include <algorithm>
#include <cstdlib>

namespace ampd::kernels::cpu {

ThreadPool::ThreadPool(int threads) {
  const int workers = std::max(threads, 1) - 1;
  workers_.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int ThreadPool::DefaultThreads() {
  if (const char* env = std::getenv("AMPD_CPU_THREADS"); env != nullptr) {
    const long v = std::strtol(env, nullptr, 10);
    if (v > 0) return static_cast<int>(std::min(v, 1024L));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void ThreadPool::Drain(absl::FunctionRef<void(int64_t)> fn, int64_t chunks) {
  for (int64_t c = next_.fetch_add(1, std::memory_order_relaxed); c < chunks;
       c = next_.fetch_add(1, std::memory_order_relaxed)) {
    fn(c);
  }
}

void ThreadPool::ForEachChunk(int64_t chunks, absl::FunctionRef<void(int64_t)> fn) {
  if (chunks <= 0) return;
  if (chunks == 1 || workers_.empty()) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    chunks_ = chunks;
    busy_ = static_cast<int>(workers_.size());
    next_.store(0, std::memory_order_relaxed);
    ++generation_;
  }
  wake_.notify_all();
  Drain(fn, chunks);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return busy_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  ForEachChunk(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    const absl::FunctionRef<void(int64_t)>* fn;
    int64_t chunks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      chunks = chunks_;
    }
    Drain(*fn, chunks);
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = --busy_ == 0;
    }
    if (last) done_.notify_one();
  }
}

}  // namespace ampd::kernels::cpu
