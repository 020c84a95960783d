// The activations' scalar formulas on the device, in fp32, shared by the
// pointwise kernels (activation.cu, whose LaunchActivationBackwardF32Grad
// is also GemmActivationBackward's unfused epilogue) and the Linear GEMMs'
// forward epilogue (gemm_bias_activation.cu): the same fp32
// operations in the same order as the CPU oracle's
// (kernels/cpu/activation_math.h), unfused (--fmad=false), so the backends
// differ only by their erfcf/expf/tanhf ulps.
//   gelu(x)       = x Phi(x),  Phi(x) = 0.5 erfc(-x / sqrt 2)
//   gelu'(x)      = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi)
//   u             = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu_tanh(x)  = 0.5 x (1 + tanh u)
//   gelu_tanh'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// CUDA C++17.
#pragma once

#include <cuda_runtime.h>

namespace ampd::kernels::cuda {

constexpr float kInvSqrt2 = 0.7071067811865475f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhKappa = 0.044715f;

// Phi(x) as 0.5 erfc(-x / sqrt 2): 0.5 (1 + erf(x / sqrt 2)) would cancel
// for x < 0 and leave erff's absolute error, which differs between
// libraries, as a 1% relative difference in GELU's small negative tail.
__device__ __forceinline__ float NormalCdf(float x) { return 0.5f * erfcf(-x * kInvSqrt2); }

__device__ __forceinline__ float Gelu(float x) { return x * NormalCdf(x); }

__device__ __forceinline__ float GeluGrad(float x) {
  const float cdf = NormalCdf(x);
  const float pdf = kInvSqrt2Pi * expf(-0.5f * x * x);
  return cdf + x * pdf;
}

__device__ __forceinline__ float GeluTanh(float x) {
  const float cube = x * x * x;
  const float inner = kSqrt2OverPi * (x + kGeluTanhKappa * cube);
  return 0.5f * x * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float GeluTanhGrad(float x) {
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

}  // namespace ampd::kernels::cuda
