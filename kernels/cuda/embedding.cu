// Embedding forward (gather rows of the table) and backward (deterministic
// scatter-add of dout into the table).
//
// Forward copies each element's raw 2- or 4-byte storage, so it is bit for
// bit the CPU oracle's memcpy (a trip through fp32 would canonicalise NaN
// payloads).
//
// Backward reproduces the CPU oracle's order exactly: for each touched row,
// its contributions are summed in fp32 in batch order, added to the old
// value and rounded once (old + (c1 + c2 + ...)). fp32 atomics would add in
// whatever order threads arrive, and rounding an fp16/bf16 table after each
// add (or copying the whole table to fp32 and back, which costs the full
// vocabulary per step) is not acceptable either. Instead:
//   1. keys = ids (a bad id becomes the sentinel V), values = positions;
//   2. cub::DeviceRadixSort::SortPairs, which is stable, so equal ids keep
//      batch order (only bit_width(V) key bits are sorted);
//   3. the first index of every run of equal keys is flagged and compacted
//      (cub::DeviceSelect::Flagged) into the list of run heads;
//   4. one thread per (run, column) adds the run's dout rows in order and
//      updates that table element once. Only touched rows are read/written.
// A very frequent id serialises its run per column (the price of the fixed
// order); the columns still run in parallel.
//
// Ids are checked on the device: an id outside [0, V) never indexes memory.
// Forward writes a zero row for it, backward drops it, and either sets
// kErrorEmbeddingId in the backend's error word, which the backend turns
// into InvalidArgument at the next ReadBack, Synchronize or CopyToHost (the
// fused optimizer reads the word and skips the step). The word is an int in
// device memory, written only on that error path and read back with the
// step's scalars, never mapped host memory.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__device__ __forceinline__ void RaiseFlag(int* flags, int bit) {
  atomicOr(flags, bit);  // device memory; rare (bad input only), so contention is moot
}

// ---- forward ----------------------------------------------------------------
template <typename T>  // raw storage: uint16_t (F16, BF16) or uint32_t (F32)
__global__ void embedding_forward_kernel(const void* ids, DType id_dtype, int64_t n, const T* table,
                                         int64_t vocab, int64_t cols, T* out, int* error_flags) {
  // ids (n); table (vocab, cols); out (n, cols)
  const int64_t total = n * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols;
    const int64_t c = i - row * cols;
    const int64_t id = LoadIndex(ids, row, id_dtype);
    if (id < 0 || id >= vocab) {
      if (c == 0) RaiseFlag(error_flags, kErrorEmbeddingId);
      out[i] = T{0};  // +0.0 in every float format
      continue;
    }
    out[i] = table[id * cols + c];
  }
}

// The same lookup with every element times scale in fp32, rounded once.
__global__ void embedding_forward_scaled_kernel(const void* ids, DType id_dtype, int64_t n,
                                                const void* table, DType dtype, int64_t vocab,
                                                int64_t cols, float scale, void* out,
                                                int* error_flags) {
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
    StoreAs(out, i, dtype, LoadAs(table, id * cols + c, dtype) * scale);
  }
}

template <typename T>
absl::Status Forward(const void* ids, DType id_dtype, int64_t n, const void* table, int64_t vocab,
                     int64_t cols, void* out, int* error_flags, cudaStream_t stream) {
  embedding_forward_kernel<T>
      <<<GridFor(n * cols), kThreads, 0, stream>>>(ids, id_dtype, n, static_cast<const T*>(table),
                                                   vocab, cols, static_cast<T*>(out), error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

// ---- backward ---------------------------------------------------------------
using Key = uint64_t;      // an id in [0, V), or V for a bad one
using Position = int64_t;  // a row of dout
constexpr int kColumnThreads = 128;
constexpr int64_t kMaxRunBlocks = 65535;

int KeyBits(int64_t vocab) {
  // Bits of the sentinel V, the largest key; at least 1 for cub.
  int bits = 0;
  for (auto v = static_cast<uint64_t>(vocab); v != 0; v >>= 1) ++bits;
  return bits == 0 ? 1 : bits;
}

size_t AlignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Where each array lives in the caller's scratch (every offset 256-aligned).
struct ScratchLayout {
  size_t keys_in = 0, keys_out = 0, positions_in = 0, positions_out = 0, flags = 0, num_runs = 0,
         temp = 0, temp_bytes = 0, total = 0;
};

cudaError_t Layout(int64_t n, int64_t vocab, ScratchLayout* layout) {
  const int bits = KeyBits(vocab);
  size_t sort_bytes = 0;
  cudaError_t error = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const Key*>(nullptr), static_cast<Key*>(nullptr),
      static_cast<const Position*>(nullptr), static_cast<Position*>(nullptr), n, 0, bits);
  if (error != cudaSuccess) return error;
  size_t select_bytes = 0;
  error = cub::DeviceSelect::Flagged(nullptr, select_bytes, static_cast<const Position*>(nullptr),
                                     static_cast<const unsigned char*>(nullptr),
                                     static_cast<Position*>(nullptr),
                                     static_cast<int64_t*>(nullptr), n);
  if (error != cudaSuccess) return error;
  const auto count = static_cast<size_t>(n);
  size_t offset = 0;
  auto take = [&offset](size_t bytes) {
    const size_t at = offset;
    offset += AlignUp(bytes);
    return at;
  };
  layout->keys_in = take(count * sizeof(Key));
  layout->keys_out = take(count * sizeof(Key));
  layout->positions_in = take(count * sizeof(Position));
  layout->positions_out = take(count * sizeof(Position));
  layout->flags = take(count);
  layout->num_runs = take(sizeof(int64_t));
  layout->temp_bytes = std::max(sort_bytes, select_bytes);
  layout->temp = take(layout->temp_bytes);
  layout->total = offset;
  return cudaSuccess;
}

__global__ void embedding_keys_kernel(const void* ids, DType id_dtype, int64_t n, int64_t vocab,
                                      Key* keys, Position* positions, int* error_flags) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t id = LoadIndex(ids, i, id_dtype);
    const bool bad = id < 0 || id >= vocab;
    if (bad) RaiseFlag(error_flags, kErrorEmbeddingId);
    keys[i] = static_cast<Key>(bad ? vocab : id);
    positions[i] = i;
  }
}

__global__ void embedding_run_heads_kernel(const Key* sorted_keys, int64_t n,
                                           unsigned char* flags) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    flags[i] = i == 0 || sorted_keys[i] != sorted_keys[i - 1];
  }
}

__global__ void embedding_accumulate_kernel(const Key* sorted_keys,
                                            const Position* sorted_positions,
                                            const Position* run_heads, const int64_t* num_runs,
                                            int64_t n, const void* dout, DType dout_dtype,
                                            float scale, void* dtable, DType dtable_dtype,
                                            int64_t vocab, int64_t cols) {
  // Block (x, y): runs x, x + gridDim.x, ...; columns of chunk y, y + gridDim.y, ...
  const int64_t runs = *num_runs;
  for (int64_t r = blockIdx.x; r < runs; r += gridDim.x) {
    const int64_t begin = run_heads[r];
    const int64_t end = r + 1 < runs ? run_heads[r + 1] : n;
    const Key key = sorted_keys[begin];
    if (key == static_cast<Key>(vocab)) continue;  // the bad ids' run: dropped
    const int64_t row = static_cast<int64_t>(key) * cols;
    for (int64_t c = blockIdx.y * int64_t{kColumnThreads} + threadIdx.x; c < cols;
         c += int64_t{gridDim.y} * kColumnThreads) {
      float sum = 0.0f;  // batch order: the sort is stable
      for (int64_t j = begin; j < end; ++j) {
        // The multiply's gradient in dout's dtype (exact at scale 1).
        sum +=
            RoundAs(LoadAs(dout, sorted_positions[j] * cols + c, dout_dtype) * scale, dout_dtype);
      }
      StoreAs(dtable, row + c, dtable_dtype, LoadAs(dtable, row + c, dtable_dtype) + sum);
    }
  }
}

}  // namespace

absl::Status LaunchEmbeddingForward(const void* ids, DType id_dtype, int64_t n, const void* table,
                                    DType dtype, int64_t vocab, int64_t cols, float scale,
                                    void* out, int* error_flags, cudaStream_t stream) {
  if (n == 0 || cols == 0) return absl::OkStatus();
  if (scale != 1.0f) {
    embedding_forward_scaled_kernel<<<GridFor(n * cols), kThreads, 0, stream>>>(
        ids, id_dtype, n, table, dtype, vocab, cols, scale, out, error_flags);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  }
  if (SizeOf(dtype) == 2) {
    return Forward<uint16_t>(ids, id_dtype, n, table, vocab, cols, out, error_flags, stream);
  }
  return Forward<uint32_t>(ids, id_dtype, n, table, vocab, cols, out, error_flags, stream);
}

absl::Status EmbeddingBackwardScratchBytes(int64_t n, int64_t vocab, size_t* bytes) {
  ScratchLayout layout;
  AMPD_CUDA_RETURN_IF_ERROR(Layout(n, vocab, &layout));
  *bytes = layout.total;
  return absl::OkStatus();
}

absl::Status LaunchEmbeddingBackward(const void* ids, DType id_dtype, int64_t n, const void* dout,
                                     DType dout_dtype, float scale, void* dtable,
                                     DType dtable_dtype, int64_t vocab, int64_t cols, void* scratch,
                                     size_t scratch_bytes, int* error_flags, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  ScratchLayout layout;
  AMPD_CUDA_RETURN_IF_ERROR(Layout(n, vocab, &layout));
  if (scratch == nullptr || scratch_bytes < layout.total) {
    return absl::InternalError("LaunchEmbeddingBackward: scratch is smaller than its layout");
  }
  auto* base = static_cast<unsigned char*>(scratch);
  auto* keys_in = reinterpret_cast<Key*>(base + layout.keys_in);
  auto* keys_out = reinterpret_cast<Key*>(base + layout.keys_out);
  auto* positions_in = reinterpret_cast<Position*>(base + layout.positions_in);
  auto* positions_out = reinterpret_cast<Position*>(base + layout.positions_out);
  auto* flags = base + layout.flags;
  auto* num_runs = reinterpret_cast<int64_t*>(base + layout.num_runs);
  void* temp = base + layout.temp;
  // keys_in is free once sorted: it receives the run heads.
  auto* run_heads = reinterpret_cast<Position*>(keys_in);

  // Bad ids are flagged even when cols == 0, as in the forward pass.
  embedding_keys_kernel<<<GridFor(n), kThreads, 0, stream>>>(ids, id_dtype, n, vocab, keys_in,
                                                             positions_in, error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  if (cols == 0) return absl::OkStatus();
  size_t temp_bytes = layout.temp_bytes;
  AMPD_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out,
                                                            positions_in, positions_out, n, 0,
                                                            KeyBits(vocab), stream));
  embedding_run_heads_kernel<<<GridFor(n), kThreads, 0, stream>>>(keys_out, n, flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  // positions_in still holds 0..n-1 (SortPairs leaves its inputs alone), so
  // selecting it by the head flags lists the sorted index of every run head.
  temp_bytes = layout.temp_bytes;
  AMPD_CUDA_RETURN_IF_ERROR(cub::DeviceSelect::Flagged(
      temp, temp_bytes, static_cast<const Position*>(positions_in),
      static_cast<const unsigned char*>(flags), run_heads, num_runs, n, stream));
  // The run count stays on the device: blocks stride over at most
  // min(n, V + 1) runs, and over column chunks of kColumnThreads.
  const int64_t col_chunks = (cols + kColumnThreads - 1) / kColumnThreads;
  const int64_t y_blocks = std::min(col_chunks, kMaxRunBlocks);
  const int64_t max_runs = std::min(n, vocab + 1);
  const int64_t x_blocks =
      std::max<int64_t>(1, std::min(max_runs, std::max<int64_t>(1, 32768 / y_blocks)));
  const dim3 grid(static_cast<unsigned>(x_blocks), static_cast<unsigned>(y_blocks));
  embedding_accumulate_kernel<<<grid, kColumnThreads, 0, stream>>>(
      keys_out, positions_out, run_heads, num_runs, n, dout, dout_dtype, scale, dtable,
      dtable_dtype, vocab, cols);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
