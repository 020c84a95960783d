// ThreadPool (cpu_parallel.h): a generation counter under a mutex wakes the
// workers; chunks are claimed with one atomic word tagged by generation, and
// the caller waits for the count of finished chunks, not for the workers.
#include "kernels/cpu/cpu_parallel.h"

#include <algorithm>
#include <cstdlib>

namespace ampd::kernels::cpu {
namespace {

// Set while a thread runs a chunk: a ForEachChunk from inside a chunk runs
// inline rather than waiting on the pool it is part of.
thread_local bool in_chunk = false;

}  // namespace

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

void ThreadPool::Drain(uint32_t tag, const absl::FunctionRef<void(int64_t)>* fn, int64_t chunks) {
  for (;;) {
    uint64_t cur = claim_.load(std::memory_order_acquire);
    int64_t c;
    do {
      c = static_cast<int64_t>(cur & 0xffffffffu);
      if (static_cast<uint32_t>(cur >> 32) != tag || c >= chunks) return;
    } while (!claim_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel));
    // Dereferenced only now: a chunk of this tag is claimed, so its caller
    // is still waiting and *fn (on the caller's stack) is alive.
    in_chunk = true;
    (*fn)(c);
    in_chunk = false;
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
      std::lock_guard<std::mutex> lock(mu_);
      finished_.notify_all();
    }
  }
}

void ThreadPool::ForEachChunk(int64_t chunks, absl::FunctionRef<void(int64_t)> fn) {
  if (chunks <= 0) return;
  // The claim counter holds 32 bits of chunk index; larger counts (never
  // reached by the ops' grains) run on the caller.
  if (chunks == 1 || workers_.empty() || in_chunk || chunks > int64_t{0x7fffffff}) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  uint32_t tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tag = ++generation_;
    fn_ = &fn;
    chunks_ = chunks;
    done_.store(0, std::memory_order_relaxed);
    claim_.store(static_cast<uint64_t>(tag) << 32, std::memory_order_release);
  }
  wake_.notify_all();
  Drain(tag, &fn, chunks);
  if (done_.load(std::memory_order_acquire) != chunks) {
    std::unique_lock<std::mutex> lock(mu_);
    finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == chunks; });
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  ForEachChunk(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

void ThreadPool::WorkerLoop() {
  uint32_t seen = 0;
  for (;;) {
    const absl::FunctionRef<void(int64_t)>* fn;
    int64_t chunks;
    uint32_t tag;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = tag = generation_;
      fn = fn_;
      chunks = chunks_;
    }
    // fn is only read for a chunk claimed under this job's tag, i.e.
    // while the caller is still waiting for that chunk and fn is alive: a
    // worker that wakes after the job finished must not even copy it.
    Drain(tag, fn, chunks);
  }
}

void ThreadPool::ReleaseScratch() {
  for (std::vector<float>& slot : scratch_) std::vector<float>().swap(slot);
}

}  // namespace ampd::kernels::cpu
