// DevicePool: the caching allocator every CUDA backend on one GPU shares.
//
// Requests are rounded up to a size class (512-byte steps up to 1 MiB, then
// eight classes per power of two, so at most 12.5% is wasted) and freed
// blocks go to that class's free list instead of back to cudaFree; after the
// first training step has allocated its working set, later steps are served
// from the lists without a cudaMalloc (which would synchronise the device).
//
// Blocks are reused across streams safely: when a block is freed, an event
// is recorded on the stream that last used it; if a different stream takes
// it, that stream first waits on the event (a device-side wait, no host
// round trip). Reuse on the same stream needs nothing: stream order already
// puts the old work first. All methods are thread-safe.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"

namespace ampd::kernels::cuda {

struct PoolStats {
  int64_t reserved_bytes = 0;      // held from cudaMalloc, in use or cached
  int64_t cached_bytes = 0;        // on the free lists
  int64_t device_allocations = 0;  // cudaMalloc calls so far (warm-up only, ideally)
};

class DevicePool {
 public:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;                     // the size class, >= the request
    cudaStream_t last_stream = nullptr;  // the stream that used it last
    cudaEvent_t freed = nullptr;         // recorded on last_stream at free
    bool event_valid = false;
  };

  // The process-wide pool of `device`; created on first use and never
  // destroyed, so tensors released during static destruction stay safe.
  static DevicePool& ForDevice(int device);

  // A block of at least `bytes` usable in order on `stream`. On
  // cudaErrorMemoryAllocation the cached blocks are released and the
  // allocation retried once; then ResourceExhausted.
  absl::StatusOr<Block*> Allocate(size_t bytes, cudaStream_t stream);
  // Returns the block to its free list; `stream` may still be using it.
  void Free(Block* block);

  // Releases every cached block back to the driver.
  void EmptyCache();
  PoolStats stats() const;
  int device() const { return device_; }

  static size_t SizeClass(size_t bytes);

 private:
  explicit DevicePool(int device) : device_(device) {}
  void EmptyCacheLocked();

  const int device_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<Block*>> free_;  // by size class
  PoolStats stats_;
};

}  // namespace ampd::kernels::cuda
