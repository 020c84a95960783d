// Activations forward and backward, elementwise in fp32, one rounding per
// store, with the formulas of activation_math.cuh (the CPU oracle's fp32
// operations in its order). GELU is the exact form (PyTorch's default
// approximate='none'); GELUTanh the tanh approximation (approximate='tanh').
// Tanh's backward is computed from the forward input x, as the interface
// passes x: dx = dy (1 - tanh(x)^2). ReLU's backward selects instead of
// multiplying (PyTorch's threshold_backward, and the CPU oracle):
// dx = x > 0 ? dy : 0, so an inf/NaN dy at x <= 0 gives 0 (not NaN) and a
// negative dy gives +0 (not -0); it is therefore bitwise equal to the CPU.
// Each kernel is a template on the storage type and moves 16 bytes per
// access where its operands are aligned (device_common.cuh's GridStride).
// The backward also takes an fp32 dy: GemmActivationBackward's separate
// path multiplies the GEMM's unrounded fp32 sums by the derivative.
#include "kernels/cuda/activation_math.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__device__ __forceinline__ float Forward(Activation act, float x) {
  switch (act) {
    case Activation::kReLU:
      // x <= 0 is false for NaN, so NaN propagates (as torch.relu does).
      return x <= 0.0f ? 0.0f : x;
    case Activation::kGELU:
      return Gelu(x);
    case Activation::kTanh:
      return tanhf(x);
    case Activation::kGELUTanh:
      return GeluTanh(x);
  }
  return x;
}

// dx from x and dy. NaN x is not > 0, so ReLU selects 0, as on the CPU.
__device__ __forceinline__ float Backward(Activation act, float x, float g) {
  switch (act) {
    case Activation::kReLU:
      return x > 0.0f ? g : 0.0f;
    case Activation::kGELU:
      return g * GeluGrad(x);
    case Activation::kTanh: {
      const float t = tanhf(x);
      return g * (1.0f - t * t);
    }
    case Activation::kGELUTanh:
      return g * GeluTanhGrad(x);
  }
  return g;
}

template <typename T>
__global__ void activation_forward_kernel(Activation act, const T* x, T* y, int64_t n,
                                          bool vectorized) {
  // x, y: (n); y may be x.
  constexpr int N = VecWidth<T>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<T, N> in = LoadVec<N>(x, i);
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.v[j] = FromFloat<T>(Forward(act, ToFloat(in.v[j])));
        StoreVec<N>(y, i, out);
      },
      [&](int64_t i) { y[i] = FromFloat<T>(Forward(act, ToFloat(x[i]))); });
}

// G is T, or float for an fp32 dy (its vectors are then 4 wide like T's
// when T is float, and 8 wide, two 16-byte loads, when T is 16-bit).
template <typename T, typename G>
__global__ void activation_backward_kernel(Activation act, const T* x, const G* dy, T* dx,
                                           int64_t n, bool vectorized) {
  // x, dy, dx: (n); dx may be dy.
  constexpr int N = VecWidth<T>();
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<T, N> xs = LoadVec<N>(x, i);
        const Vec<G, N> gs = LoadVec<N>(dy, i);
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          out.v[j] = FromFloat<T>(Backward(act, ToFloat(xs.v[j]), ToFloat(gs.v[j])));
        }
        StoreVec<N>(dx, i, out);
      },
      [&](int64_t i) { dx[i] = FromFloat<T>(Backward(act, ToFloat(x[i]), ToFloat(dy[i]))); });
}

template <typename T, typename G>
absl::Status Backward(Activation act, const void* x, const G* dy, void* dx, int64_t n,
                      cudaStream_t stream) {
  constexpr int N = VecWidth<T>();
  const T* xt = static_cast<const T*>(x);
  T* dxt = static_cast<T*>(dx);
  const bool vectorized = VecAligned<N>(xt) && VecAligned<N>(dy) && VecAligned<N>(dxt);
  activation_backward_kernel<T, G>
      <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(act, xt, dy, dxt, n, vectorized);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchActivationForward(Activation act, const void* x, void* y, DType dtype, int64_t n,
                                     cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    const bool vectorized = VecAligned<N>(xt) && VecAligned<N>(yt);
    activation_forward_kernel<T>
        <<<GridForVec<N>(n, vectorized), kThreads, 0, stream>>>(act, xt, yt, n, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

absl::Status LaunchActivationBackward(Activation act, const void* x, const void* dy, void* dx,
                                      DType dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    return Backward<T, T>(act, x, static_cast<const T*>(dy), dx, n, stream);
  });
}

absl::Status LaunchActivationBackwardF32Grad(Activation act, const void* x, const float* dy,
                                             void* dx, DType dtype, int64_t n,
                                             cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    return Backward<T, float>(act, x, dy, dx, n, stream);
  });
}

}  // namespace ampd::kernels::cuda
