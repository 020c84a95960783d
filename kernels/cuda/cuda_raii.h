// RAII owners for the CUDA objects a backend holds: its stream, events, the
// cuBLAS handle, the current-device switch, and pinned host buffers (the
// landing area of the step's scalar read, the upload arena). Each is created by a factory returning
// StatusOr (constructors cannot fail visibly) and released in its destructor.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"

namespace ampd::kernels::cuda {

// Makes `device` current for the calling thread, calling cudaSetDevice only
// when another device is current. It deliberately does not restore the
// previous device on scope exit: on a fresh thread the "previous" device is
// the default 0, and switching back would create a context on GPU 0 in a
// process that never uses it. Backends for different GPUs may still share a
// thread, because every entry point (and every pool call) sets its own device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  // The cudaSetDevice result: check it before launching anything.
  cudaError_t error() const { return error_; }

 private:
  cudaError_t error_ = cudaSuccess;
};

class Stream {
 public:
  // Non-blocking: it never serialises with the legacy default stream.
  static absl::StatusOr<Stream> Create();
  Stream() = default;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  // timing=false creates a cheaper event that can only order work.
  static absl::StatusOr<Event> Create(bool timing);
  Event() = default;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CublasHandle {
 public:
  static absl::StatusOr<CublasHandle> Create();
  CublasHandle() = default;
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle();
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// Page-locked host memory. A device-to-host cudaMemcpyAsync into pageable
// memory is staged and synchronous; into pinned memory it is a plain DMA
// that stays queued, so several copies can share one stream synchronisation.
class PinnedHostBuffer {
 public:
  static absl::StatusOr<PinnedHostBuffer> Create(size_t bytes);
  PinnedHostBuffer() = default;
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  ~PinnedHostBuffer();
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace ampd::kernels::cuda
