// SwiGLU's gated product, forward and backward (the contract in
// kernels/backend.h): elementwise in fp32 in the CPU oracle's operation
// order, one rounding per stored element; 16-byte accesses where every
// operand is aligned. CUDA's expf may differ from glibc's by an ulp.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void silu_mul_forward_kernel(const T* gate, const T* up, T* y, int64_t n,
                                        bool vectorized) {
  // gate, up, y: (n); y may be gate or up (each element read before written).
  constexpr int N = VecWidth<T>();
  auto one = [](float g, float u) { return FromFloat<T>((g * Sigmoid(g)) * u); };
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<T, N> gs = LoadVec<N>(gate, i);
        const Vec<T, N> us = LoadVec<N>(up, i);
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.v[j] = one(ToFloat(gs.v[j]), ToFloat(us.v[j]));
        StoreVec<N>(y, i, out);
      },
      [&](int64_t i) { y[i] = one(ToFloat(gate[i]), ToFloat(up[i])); });
}

template <typename T>
__global__ void silu_mul_backward_kernel(const T* gate, const T* up, const T* dy, T* dgate, T* dup,
                                         int64_t n, bool vectorized) {
  // gate, up, dy, dgate, dup: (n); the outputs overlap no input.
  constexpr int N = VecWidth<T>();
  auto one = [](float g, float u, float d, T* dg, T* du) {
    const float s = Sigmoid(g);
    *dg = FromFloat<T>((d * u) * (s * (1.0f + g * (1.0f - s))));
    *du = FromFloat<T>(d * (g * s));
  };
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<T, N> gs = LoadVec<N>(gate, i);
        const Vec<T, N> us = LoadVec<N>(up, i);
        const Vec<T, N> ds = LoadVec<N>(dy, i);
        Vec<T, N> dg;
        Vec<T, N> du;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          one(ToFloat(gs.v[j]), ToFloat(us.v[j]), ToFloat(ds.v[j]), &dg.v[j], &du.v[j]);
        }
        StoreVec<N>(dgate, i, dg);
        StoreVec<N>(dup, i, du);
      },
      [&](int64_t i) {
        one(ToFloat(gate[i]), ToFloat(up[i]), ToFloat(dy[i]), &dgate[i], &dup[i]);
      });
}

}  // namespace

absl::Status LaunchSiluMulForward(const void* gate, const void* up, void* y, DType dtype, int64_t n,
                                  cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* gt = static_cast<const T*>(gate);
    const T* ut = static_cast<const T*>(up);
    T* yt = static_cast<T*>(y);
    const bool vectorized = VecAligned<N>(gt) && VecAligned<N>(ut) && VecAligned<N>(yt);
    silu_mul_forward_kernel<T>
        <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(gt, ut, yt, n, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

absl::Status LaunchSiluMulBackward(const void* gate, const void* up, const void* dy, void* dgate,
                                   void* dup, DType dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* gt = static_cast<const T*>(gate);
    const T* ut = static_cast<const T*>(up);
    const T* dyt = static_cast<const T*>(dy);
    T* dgt = static_cast<T*>(dgate);
    T* dut = static_cast<T*>(dup);
    const bool vectorized = VecAligned<N>(gt) && VecAligned<N>(ut) && VecAligned<N>(dyt) &&
                            VecAligned<N>(dgt) && VecAligned<N>(dut);
    silu_mul_backward_kernel<T><<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(
        gt, ut, dyt, dgt, dut, n, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
