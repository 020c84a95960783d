// The per-device caching allocator (see memory_pool.h for the policy).
#include "kernels/cuda/memory_pool.h"

#include <bit>
#include <memory>

#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/cuda_status.h"

namespace ampd::kernels::cuda {
namespace {

constexpr size_t kSmallStep = 512;               // cudaMalloc aligns to 256; keep 512
constexpr size_t kSmallLimit = size_t{1} << 20;  // 1 MiB
constexpr int kClassesPerOctave = 8;

}  // namespace

size_t DevicePool::SizeClass(size_t bytes) {
  if (bytes <= kSmallLimit) {
    const size_t n = bytes == 0 ? 1 : bytes;
    return (n + kSmallStep - 1) / kSmallStep * kSmallStep;
  }
  // Step = an eighth of the power of two just below `bytes`.
  const int octave = std::bit_width(bytes) - 1;
  const size_t step = size_t{1} << (octave - 3);
  static_assert(kClassesPerOctave == 8, "step shift above assumes 8 classes per octave");
  return (bytes + step - 1) / step * step;
}

DevicePool& DevicePool::ForDevice(int device) {
  static std::mutex* mu = new std::mutex;
  static auto* pools = new std::map<int, DevicePool*>;
  std::lock_guard<std::mutex> lock(*mu);
  DevicePool*& pool = (*pools)[device];
  if (pool == nullptr) pool = new DevicePool(device);
  return *pool;
}

absl::StatusOr<DevicePool::Block*> DevicePool::Allocate(size_t bytes, cudaStream_t stream) {
  const size_t size = SizeClass(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    Block* block = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= static_cast<int64_t>(size);
    if (block->event_valid && block->last_stream != stream) {
      const cudaError_t error = cudaStreamWaitEvent(stream, block->freed, 0);
      if (error != cudaSuccess) {
        // Not handed out: back on its list, or the pool would lose track of
        // it (neither cached nor owned, never freed).
        it->second.push_back(block);
        stats_.cached_bytes += static_cast<int64_t>(size);
        AMPD_CUDA_RETURN_IF_ERROR(error);
      }
    }
    block->last_stream = stream;
    return block;
  }
  DeviceGuard guard(device_);
  AMPD_CUDA_RETURN_IF_ERROR(guard.error());
  void* ptr = nullptr;
  cudaError_t error = cudaMalloc(&ptr, size);
  if (error == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it before the retry
    EmptyCacheLocked();
    error = cudaMalloc(&ptr, size);
  }
  AMPD_CUDA_RETURN_IF_ERROR(error);
  ++stats_.device_allocations;
  stats_.reserved_bytes += static_cast<int64_t>(size);
  auto block = std::make_unique<Block>();
  block->ptr = ptr;
  block->size = size;
  block->last_stream = stream;
  return block.release();
}

void DevicePool::Free(Block* block) {
  if (block == nullptr) return;
  DeviceGuard guard(device_);
  if (block->freed == nullptr) {
    if (cudaEventCreateWithFlags(&block->freed, cudaEventDisableTiming) != cudaSuccess) {
      block->freed = nullptr;
    }
  }
  block->event_valid =
      block->freed != nullptr && cudaEventRecord(block->freed, block->last_stream) == cudaSuccess;
  if (!block->event_valid) {
    // Without an event another stream could not be ordered after this
    // block's last use; keep it out of circulation rather than risk a race.
    (void)cudaGetLastError();
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  free_[block->size].push_back(block);
  stats_.cached_bytes += static_cast<int64_t>(block->size);
}

void DevicePool::EmptyCache() {
  std::lock_guard<std::mutex> lock(mu_);
  EmptyCacheLocked();
}

void DevicePool::EmptyCacheLocked() {
  DeviceGuard guard(device_);
  for (auto& [size, blocks] : free_) {
    for (Block* block : blocks) {
      // cudaFree waits for the device, so pending work on the block is done.
      (void)cudaFree(block->ptr);
      if (block->freed != nullptr) (void)cudaEventDestroy(block->freed);
      stats_.reserved_bytes -= static_cast<int64_t>(block->size);
      stats_.cached_bytes -= static_cast<int64_t>(block->size);
      delete block;
    }
    blocks.clear();
  }
}

PoolStats DevicePool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace ampd::kernels::cuda
