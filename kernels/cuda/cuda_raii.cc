// RAII wrappers for CUDA objects (see cuda_raii.h). Destructors ignore the
// release result: there is nobody to return it to, and a failed release
// means the context is already lost.
#include "kernels/cuda/cuda_raii.h"

#include <utility>

#include "kernels/cuda/cuda_status.h"

namespace ampd::kernels::cuda {

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();  // unknown: set it below, which reports the real problem
    current = -1;
  }
  if (current != device) error_ = cudaSetDevice(device);
  // The result is kept in error_ (callers check it, or are destructors that
  // cannot report it); clear the runtime's latched copy so that it does not
  // resurface at the next launch check.
  if (error_ != cudaSuccess) (void)cudaGetLastError();
}

absl::StatusOr<Stream> Stream::Create() {
  Stream s;
  AMPD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
  return s;
}
Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  std::swap(stream_, other.stream_);
  return *this;
}
Stream::~Stream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::StatusOr<Event> Event::Create(bool timing) {
  Event e;
  AMPD_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}
Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
Event& Event::operator=(Event&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}
Event::~Event() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

absl::StatusOr<CublasHandle> CublasHandle::Create() {
  CublasHandle h;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasCreate(&h.handle_));
  return h;
}
CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)) {}
CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  std::swap(handle_, other.handle_);
  return *this;
}
CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
}

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Create(size_t bytes) {
  PinnedHostBuffer b;
  AMPD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&b.data_, bytes, cudaHostAllocDefault));
  b.bytes_ = bytes;
  return b;
}
PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}
PinnedHostBuffer::~PinnedHostBuffer() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
}

}  // namespace ampd::kernels::cuda
