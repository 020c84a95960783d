// Rotary position embeddings in place, Hugging Face's rotate-half form (the
// contract in kernels/backend.h): one thread per (row, i) pair of columns
// i and i + D/2, rotating that pair in each of the row's first `heads`
// heads with one fp32 angle, cosf and sinf (CUDA's may differ from glibc's
// by an ulp or two). The inverse (transpose) rotation is the backward.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename T>
__global__ void rope_kernel(T* x, int64_t rows, int64_t seq, int64_t width, int64_t heads,
                            int64_t head_dim, const float* inv_freq, const void* positions,
                            DType position_dtype, bool inverse) {
  // x: (rows = B * T, width); inv_freq: (head_dim / 2); positions: (rows) or nullptr
  const int64_t half = head_dim / 2;
  const int64_t pairs = rows * half;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < pairs;
       k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = k / half;
    const int64_t i = k % half;
    const int64_t p = positions != nullptr ? LoadIndex(positions, r, position_dtype) : r % seq;
    const float angle = static_cast<float>(p) * inv_freq[i];
    const float c = cosf(angle);
    const float s = inverse ? -sinf(angle) : sinf(angle);
    T* row = x + r * width;
    for (int64_t h = 0; h < heads; ++h) {
      T* head = row + h * head_dim;
      const float x1 = ToFloat(head[i]);
      const float x2 = ToFloat(head[i + half]);
      head[i] = FromFloat<T>(x1 * c - x2 * s);
      head[i + half] = FromFloat<T>(x2 * c + x1 * s);
    }
  }
}

}  // namespace

absl::Status LaunchRope(void* x, DType dtype, int64_t batch, int64_t seq, int64_t width,
                        int64_t heads, int64_t head_dim, const float* inv_freq,
                        const void* positions, DType position_dtype, bool inverse,
                        cudaStream_t stream) {
  const int64_t pairs = batch * seq * (head_dim / 2);
  if (pairs == 0 || heads == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<GridFor(pairs), kThreads, 0, stream>>>(static_cast<T*>(x), batch * seq, seq,
                                                            width, heads, head_dim, inv_freq,
                                                            positions, position_dtype, inverse);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
