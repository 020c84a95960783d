// Grouped-query attention's shared K/V heads (the contract in
// kernels/backend.h): one thread per element of the compact (B T,
// (H + 2 Hkv) D) side. ExpandKvHeads copies a q element once and a k or v
// element to each of its group's G query heads; ReduceKvHeads sums those G
// gradients in query-head order in fp32 and rounds once, as the CPU oracle
// does, so the two backends agree bit for bit.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// Where compact column c of a row sits: part 0 (q), 1 (k) or 2 (v), the
// head within that part and the channel.
struct KvColumn {
  int64_t part, head, channel;
};
__device__ __forceinline__ KvColumn Locate(int64_t c, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t head = c / d;
  const int64_t channel = c % d;
  if (head < heads) return {0, head, channel};
  if (head < heads + kv_heads) return {1, head - heads, channel};
  return {2, head - heads - kv_heads, channel};
}

template <typename T>
__global__ void expand_kv_heads_kernel(const T* src, T* dst, int64_t rows, int64_t heads,
                                       int64_t kv_heads, int64_t d) {
  // src: (rows, (heads + 2 kv_heads) d); dst: (rows, 3 heads d)
  const int64_t width = (heads + 2 * kv_heads) * d;
  const int64_t group = heads / kv_heads;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * width;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width;
    const KvColumn col = Locate(i % width, heads, kv_heads, d);
    T* out = dst + r * 3 * heads * d;
    const T v = src[i];
    if (col.part == 0) {
      out[col.head * d + col.channel] = v;
    } else {
      for (int64_t j = 0; j < group; ++j) {
        out[(col.part * heads + col.head * group + j) * d + col.channel] = v;
      }
    }
  }
}

template <typename T>
__global__ void reduce_kv_heads_kernel(const T* dexpanded, T* dsrc, int64_t rows, int64_t heads,
                                       int64_t kv_heads, int64_t d) {
  // dexpanded: (rows, 3 heads d); dsrc: (rows, (heads + 2 kv_heads) d)
  const int64_t width = (heads + 2 * kv_heads) * d;
  const int64_t group = heads / kv_heads;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * width;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width;
    const KvColumn col = Locate(i % width, heads, kv_heads, d);
    const T* in = dexpanded + r * 3 * heads * d;
    if (col.part == 0) {
      dsrc[i] = in[col.head * d + col.channel];
    } else {
      float sum = 0.0f;
      for (int64_t j = 0; j < group; ++j) {
        sum += ToFloat(in[(col.part * heads + col.head * group + j) * d + col.channel]);
      }
      dsrc[i] = FromFloat<T>(sum);
    }
  }
}

}  // namespace

absl::Status LaunchKvHeads(bool expand, const void* in, void* out, DType dtype, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  const int64_t n = rows * (heads + 2 * kv_heads) * head_dim;
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (expand) {
      expand_kv_heads_kernel<T><<<GridFor(n), kThreads, 0, stream>>>(
          static_cast<const T*>(in), static_cast<T*>(out), rows, heads, kv_heads, head_dim);
    } else {
      reduce_kv_heads_kernel<T><<<GridFor(n), kThreads, 0, stream>>>(
          static_cast<const T*>(in), static_cast<T*>(out), rows, heads, kv_heads, head_dim);
    }
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
