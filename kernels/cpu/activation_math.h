// The activations' scalar formulas in fp32, shared by the pointwise ops
// (activation.cc) and the Linear GEMMs' epilogues (gemm_bias_activation.cc,
// gemm_activation_backward.cc), so a GELU in an epilogue is the same
// sequence of fp32 operations as ActivationForward's. The CUDA twins
// (kernels/cuda/activation_math.cuh) evaluate the same sequences.
#pragma once

#include <cmath>

namespace ampd::kernels::cpu {

inline constexpr float kInvSqrt2 = 0.70710678118654752440f;
// 1 / sqrt(2 pi), the normal pdf's factor.
inline constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

inline float Relu(float x) {
  // NaN propagates (x > 0 is false for NaN), as torch.relu does; the scaler
  // must see a NaN produced upstream, not a silent zero.
  return x > 0.0f ? x : (x != x ? x : 0.0f);
}
// Phi(x), the standard normal CDF, as 0.5 erfc(-x / sqrt 2) rather than
// 0.5 (1 + erf(x / sqrt 2)): for x < 0 the erf form subtracts two numbers
// near 1 and keeps only erf's absolute error (~6e-8), a relative error of
// 1% at x = -4.5; erfc is accurate relative to its (small) value there.
// The CUDA kernel evaluates exactly this sequence of fp32 operations, so
// the two backends differ only by their erfcf/expf ulps.
inline float NormalCdf(float x) { return 0.5f * std::erfc(-x * kInvSqrt2); }
inline float Gelu(float x) { return x * NormalCdf(x); }
// d/dx [x Phi(x)] = Phi(x) + x phi(x).
inline float GeluGrad(float x) {
  const float cdf = NormalCdf(x);
  const float pdf = kInvSqrt2Pi * std::exp(-0.5f * x * x);
  return cdf + x * pdf;
}

// GELU, tanh approximation: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline constexpr float kSqrt2OverPi = 0.79788456080286535588f;
inline constexpr float kGeluTanhKappa = 0.044715f;
inline float GeluTanh(float x) {
  const float cube = x * x * x;
  const float inner = kSqrt2OverPi * (x + kGeluTanhKappa * cube);
  return 0.5f * x * (1.0f + std::tanh(inner));
}
// Its exact derivative, as PyTorch's GeluBackward (approximate='tanh') forms it:
// 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 kappa x^2), t = tanh(inner).
inline float GeluTanhGrad(float x) {
  const float sq = x * x;
  const float cube = sq * x;
  const float inner = kSqrt2OverPi * (x + kGeluTanhKappa * cube);
  const float t = std::tanh(inner);
  const float left = 0.5f * x;
  const float right = 1.0f + t;
  const float left_derivative = 0.5f * right;
  const float tanh_derivative = 1.0f - t * t;
  const float inner_derivative = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhKappa * sq);
  const float right_derivative = tanh_derivative * inner_derivative;
  return left_derivative + left * right_derivative;
}

}  // namespace ampd::kernels::cpu
