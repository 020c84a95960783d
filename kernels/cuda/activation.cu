// Activations forward and backward, elementwise in fp32, one rounding per
// store. GELU is the exact form (PyTorch's default approximate='none'):
//   gelu(x)  = x Phi(x),  Phi(x) = 0.5 erfc(-x / sqrt 2)
//   gelu'(x) = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi)
// GELUTanh is the tanh approximation (PyTorch's approximate='tanh'):
//   u = sqrt(2/pi) (x + 0.044715 x^3),  gelu_tanh(x) = 0.5 x (1 + tanh u)
//   gelu_tanh'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// in the CPU oracle's operation order (kernels/cpu/activation.cc).
// Tanh's backward is computed from the forward input x, as the interface
// passes x: dx = dy (1 - tanh(x)^2). ReLU's backward selects instead of
// multiplying (PyTorch's threshold_backward, and the CPU oracle):
// dx = x > 0 ? dy : 0, so an inf/NaN dy at x <= 0 gives 0 (not NaN) and a
// negative dy gives +0 (not -0); it is therefore bitwise equal to the CPU.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr float kInvSqrt2 = 0.7071067811865475f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// Phi(x) as 0.5 erfc(-x / sqrt 2), the same fp32 operations in the same
// order as the CPU oracle (kernels/cpu/activation.cc; --fmad=false keeps
// them unfused). 0.5 (1 + erf(x / sqrt 2)) would cancel for x < 0 and leave
// erff's absolute error, which differs between libraries, as a 1% relative
// difference in GELU's small negative tail.
__device__ __forceinline__ float NormalCdf(float x) { return 0.5f * erfcf(-x * kInvSqrt2); }

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhKappa = 0.044715f;

__device__ __forceinline__ float GeluTanhInner(float x) {
  const float cube = x * x * x;
  return kSqrt2OverPi * (x + kGeluTanhKappa * cube);
}

__device__ __forceinline__ float Forward(Activation act, float x) {
  switch (act) {
    case Activation::kReLU:
      // x <= 0 is false for NaN, so NaN propagates (as torch.relu does).
      return x <= 0.0f ? 0.0f : x;
    case Activation::kGELU:
      return x * NormalCdf(x);
    case Activation::kTanh:
      return tanhf(x);
    case Activation::kGELUTanh:
      return 0.5f * x * (1.0f + tanhf(GeluTanhInner(x)));
  }
  return x;
}

// GELU and Tanh only: ReLU's gradient is a selection (see Backward below).
__device__ __forceinline__ float Derivative(Activation act, float x) {
  switch (act) {
    case Activation::kReLU:
      break;
    case Activation::kGELU: {
      const float cdf = NormalCdf(x);
      const float pdf = kInvSqrt2Pi * expf(-0.5f * x * x);
      return cdf + x * pdf;
    }
    case Activation::kTanh: {
      const float t = tanhf(x);
      return 1.0f - t * t;
    }
    case Activation::kGELUTanh: {
      const float sq = x * x;
      const float cube = sq * x;
      const float t = tanhf(kSqrt2OverPi * (x + kGeluTanhKappa * cube));
      const float left = 0.5f * x;
      const float right = 1.0f + t;
      const float left_derivative = 0.5f * right;
      const float tanh_derivative = 1.0f - t * t;
      const float inner_derivative = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhKappa * sq);
      return left_derivative + left * (tanh_derivative * inner_derivative);
    }
  }
  return 1.0f;
}

template <typename T>
__global__ void activation_forward_kernel(Activation act, const T* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = FromFloat<T>(Forward(act, ToFloat(x[i])));
  }
}

template <typename T>
__global__ void activation_backward_kernel(Activation act, const T* x, const T* dy, T* dx,
                                           int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = ToFloat(x[i]);
    const float g = ToFloat(dy[i]);
    // NaN x is not > 0, so it selects 0, as on the CPU.
    const float r = act == Activation::kReLU ? (v > 0.0f ? g : 0.0f) : g * Derivative(act, v);
    dx[i] = FromFloat<T>(r);
  }
}

template <typename T>
absl::Status Forward(Activation act, const void* x, void* y, int64_t n, cudaStream_t stream) {
  activation_forward_kernel<T>
      <<<GridFor(n), kThreads, 0, stream>>>(act, static_cast<const T*>(x), static_cast<T*>(y), n);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(Activation act, const void* x, const void* dy, void* dx, int64_t n,
                      cudaStream_t stream) {
  activation_backward_kernel<T><<<GridFor(n), kThreads, 0, stream>>>(
      act, static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchActivationForward(Activation act, const void* x, void* y, DType dtype, int64_t n,
                                     cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF16:
      return Forward<__half>(act, x, y, n, stream);
    case DType::kBF16:
      return Forward<__nv_bfloat16>(act, x, y, n, stream);
    default:
      return Forward<float>(act, x, y, n, stream);
  }
}

absl::Status LaunchActivationBackward(Activation act, const void* x, const void* dy, void* dx,
                                      DType dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF16:
      return Backward<__half>(act, x, dy, dx, n, stream);
    case DType::kBF16:
      return Backward<__nv_bfloat16>(act, x, dy, dx, n, stream);
    default:
      return Backward<float>(act, x, dy, dx, n, stream);
  }
}

}  // namespace ampd::kernels::cuda
