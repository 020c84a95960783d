// ThreadPool: the CPU backend's parallel-for. A fixed set of worker threads
// is started once with the backend; each call hands them a count of chunks
// and a function, the calling thread works too, and the call returns when
// every chunk has run. Nothing is allocated per call.
//
// Chunks are claimed dynamically and a call returns as soon as every chunk
// has run, without waiting for workers that have not woken up yet (on a
// busy machine a descheduled worker would otherwise stall every op). Which
// thread runs a chunk varies from call to call; the ops stay bit-exact because each chunk's result
// depends only on its index: elementwise ops write disjoint elements, and reductions give every
// chunk its own slot and combine the slots in chunk order, with chunk boundaries fixed by the data
// size, never by the thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace ampd::kernels::cpu {

class ThreadPool {
 public:
  // threads >= 1 counts the caller: threads - 1 workers are started.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(c) once for every c in [0, chunks). Concurrent calls from
  // different threads are serialised; a call made from inside a chunk runs
  // its chunks on the calling thread.
  void ForEachChunk(int64_t chunks, absl::FunctionRef<void(int64_t)> fn);

  // fn(begin, end) over [0, n) in chunks of `grain` elements (the last one
  // shorter); a range of one chunk runs on the caller.
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> fn);

  // The thread count a backend uses when none is given: the AMPD_CPU_THREADS
  // environment variable when it holds a positive number, else the
  // hardware's concurrency.
  static int DefaultThreads();

  // fp32 scratch the backend's GEMMs reuse from call to call: one set per
  // pool, i.e. per backend (a job's ops run one at a time, on its strand),
  // not per calling thread, so that a job holds it once, counts it
  // (CpuBackend::ScratchBytes) and gives it up (ReleaseScratch) with its
  // workspaces, instead of every worker thread that ever ran a step keeping
  // the largest one it saw.
  enum ScratchSlot {
    kWidenA,                  // a 16-bit GEMM's first operand, widened
    kWidenB,                  // its second operand
    kAccumulate,              // a 16-bit GEMM's result, accumulated in fp32
    kBiasActivationSums,      // GemmBiasActivation's fp32 sums
    kActivationBackwardSums,  // GemmActivationBackward's fp32 sums
    kPackB,                   // the batch-invariant GEMM's packed op(b) panels
    kScratchSlots,
  };
  std::vector<float>& Scratch(ScratchSlot slot) { return scratch_[slot]; }
  // Frees every slot's memory.
  void ReleaseScratch();

 private:
  void WorkerLoop();
  // Claims and runs chunks of job `tag` until none is left (or the job is
  // no longer the current one).
  void Drain(uint32_t tag, const absl::FunctionRef<void(int64_t)>* fn, int64_t chunks);

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ForEachChunk at a time
  std::mutex mu_;       // guards the job fields below and the wake-ups
  std::condition_variable wake_;
  std::condition_variable finished_;
  uint32_t generation_ = 0;
  bool stop_ = false;
  const absl::FunctionRef<void(int64_t)>* fn_ = nullptr;
  int64_t chunks_ = 0;
  // (generation << 32) | next chunk: a worker that wakes after its job has
  // finished fails the generation check instead of claiming a chunk of the
  // next job with the old function.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};  // chunks of the current job finished
  std::vector<float> scratch_[kScratchSlots];
};

// Elements per chunk for streaming passes: 64 KiB of fp32, large enough that
// the hand-off costs little beside the work, small enough to split a
// (256, 1024) activation over several threads.
inline constexpr int64_t kElementwiseGrain = 16384;

}  // namespace ampd::kernels::cpu
