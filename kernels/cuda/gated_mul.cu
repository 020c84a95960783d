// The gated MLP's act(gate) * up, forward and backward (the contract in
// kernels/backend.h): SwiGLU (act = SiLU) and GeGLU (act = GELU's tanh
// form, activation_math.cuh's GeluTanh and GeluTanhGrad, the pointwise
// kernels' formulas). Elementwise in fp32 in the CPU oracle's operation
// order, one rounding per stored element; 16-byte accesses where every
// operand is aligned. CUDA's expf/tanhf may differ from glibc's by an ulp.
// One template per (dtype, activation), so the activation is no branch in
// the loop.
#include "kernels/cuda/activation_math.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// act(g), and act'(g) beside it for the backward.
template <GluActivation kAct>
__device__ __forceinline__ float GateAct(float g) {
  if constexpr (kAct == GluActivation::kSiLU) {
    return g * Sigmoid(g);
  } else {
    return GeluTanh(g);
  }
}

template <GluActivation kAct>
__device__ __forceinline__ void GateActGrad(float g, float* act, float* grad) {
  if constexpr (kAct == GluActivation::kSiLU) {
    const float s = Sigmoid(g);
    *act = g * s;
    *grad = s * (1.0f + g * (1.0f - s));
  } else {
    *act = GeluTanh(g);
    *grad = GeluTanhGrad(g);
  }
}

template <typename T, GluActivation kAct>
__global__ void gated_mul_forward_kernel(const T* gate, const T* up, T* y, int64_t n,
                                         bool vectorized) {
  // gate, up, y: (n); y may be gate or up (each element read before written).
  constexpr int N = VecWidth<T>();
  auto one = [](float g, float u) { return FromFloat<T>(GateAct<kAct>(g) * u); };
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

template <typename T, GluActivation kAct>
__global__ void gated_mul_backward_kernel(const T* gate, const T* up, const T* dy, T* dgate, T* dup,
                                          int64_t n, bool vectorized) {
  // gate, up, dy, dgate, dup: (n); the outputs overlap no input.
  constexpr int N = VecWidth<T>();
  auto one = [](float g, float u, float d, T* dg, T* du) {
    float act, grad;
    GateActGrad<kAct>(g, &act, &grad);
    *dg = FromFloat<T>((d * u) * grad);
    *du = FromFloat<T>(d * act);
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

template <typename T, GluActivation kAct>
void ForwardKernel(const T* g, const T* u, T* y, int64_t n, cudaStream_t stream) {
  constexpr int N = VecWidth<T>();
  const bool vectorized = VecAligned<N>(g) && VecAligned<N>(u) && VecAligned<N>(y);
  gated_mul_forward_kernel<T, kAct>
      <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(g, u, y, n, vectorized);
}

template <typename T, GluActivation kAct>
void BackwardKernel(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n,
                    cudaStream_t stream) {
  constexpr int N = VecWidth<T>();
  const bool vectorized = VecAligned<N>(g) && VecAligned<N>(u) && VecAligned<N>(dy) &&
                          VecAligned<N>(dg) && VecAligned<N>(du);
  gated_mul_backward_kernel<T, kAct>
      <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(g, u, dy, dg, du, n, vectorized);
}

}  // namespace

absl::Status LaunchGatedMulForward(GluActivation act, const void* gate, const void* up, void* y,
                                   DType dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* gt = static_cast<const T*>(gate);
    const T* ut = static_cast<const T*>(up);
    T* yt = static_cast<T*>(y);
    if (act == GluActivation::kSiLU) {
      ForwardKernel<T, GluActivation::kSiLU>(gt, ut, yt, n, stream);
    } else {
      ForwardKernel<T, GluActivation::kGELUTanh>(gt, ut, yt, n, stream);
    }
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

absl::Status LaunchGatedMulBackward(GluActivation act, const void* gate, const void* up,
                                    const void* dy, void* dgate, void* dup, DType dtype, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* gt = static_cast<const T*>(gate);
    const T* ut = static_cast<const T*>(up);
    const T* dyt = static_cast<const T*>(dy);
    T* dgt = static_cast<T*>(dgate);
    T* dut = static_cast<T*>(dup);
    if (act == GluActivation::kSiLU) {
      BackwardKernel<T, GluActivation::kSiLU>(gt, ut, dyt, dgt, dut, n, stream);
    } else {
      BackwardKernel<T, GluActivation::kGELUTanh>(gt, ut, dyt, dgt, dut, n, stream);
    }
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
