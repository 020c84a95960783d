// Embedding forward (gather rows of the table) and backward (scatter-add of
// dout into an fp32 table with atomicAdd, so repeated ids accumulate in fp32;
// the caller rounds to the table's dtype once afterwards).
//
// Ids are checked on the device: an id outside [0, V) never indexes memory.
// Forward writes a zero row for it, backward drops it, and either sets
// kErrorEmbeddingId in the backend's mapped error word, which the backend
// turns into InvalidArgument at the next Synchronize or CopyToHost. The flag
// word lives in host memory, written only on that error path.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__device__ __forceinline__ void RaiseFlag(int* flags, int bit) {
  volatile int* word = flags;
  *word = *word | bit;  // one op per stream at a time sets one bit value: no lost update
}

__global__ void embedding_forward_kernel(const void* ids, DType id_dtype, int64_t n,
                                         const void* table, DType dtype, int64_t vocab,
                                         int64_t cols, void* out, int* error_flags) {
  // ids (n); table (vocab, cols); out (n, cols)
  const int64_t total = n * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols;
    const int64_t c = i - row * cols;
    const int64_t id = LoadIndex(ids, row, id_dtype);
    if (id < 0 || id >= vocab) {
      if (c == 0) RaiseFlag(error_flags, kErrorEmbeddingId);
      StoreAs(out, i, dtype, 0.0f);
      continue;
    }
    // Same dtype in and out: a load/store through fp32 is exact.
    StoreAs(out, i, dtype, LoadAs(table, id * cols + c, dtype));
  }
}

__global__ void embedding_backward_kernel(const void* ids, DType id_dtype, int64_t n,
                                          const void* dout, DType dout_dtype, float* dtable,
                                          int64_t vocab, int64_t cols, int* error_flags) {
  // ids (n); dout (n, cols); dtable (vocab, cols) F32
  const int64_t total = n * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols;
    const int64_t c = i - row * cols;
    const int64_t id = LoadIndex(ids, row, id_dtype);
    if (id < 0 || id >= vocab) {
      if (c == 0) RaiseFlag(error_flags, kErrorEmbeddingId);
      continue;
    }
    atomicAdd(dtable + id * cols + c, LoadAs(dout, i, dout_dtype));
  }
}

}  // namespace

absl::Status LaunchEmbeddingForward(const void* ids, DType id_dtype, int64_t n, const void* table,
                                    DType dtype, int64_t vocab, int64_t cols, void* out,
                                    int* error_flags, cudaStream_t stream) {
  if (n == 0 || cols == 0) return absl::OkStatus();
  embedding_forward_kernel<<<GridFor(n * cols), kThreads, 0, stream>>>(
      ids, id_dtype, n, table, dtype, vocab, cols, out, error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

absl::Status LaunchEmbeddingBackward(const void* ids, DType id_dtype, int64_t n, const void* dout,
                                     DType dout_dtype, float* dtable, int64_t vocab, int64_t cols,
                                     int* error_flags, cudaStream_t stream) {
  if (n == 0 || cols == 0) return absl::OkStatus();
  embedding_backward_kernel<<<GridFor(n * cols), kThreads, 0, stream>>>(
      ids, id_dtype, n, dout, dout_dtype, dtable, vocab, cols, error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
