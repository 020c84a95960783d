// Pointwise activations and their derivatives: ReLU, GELU (exact form,
// PyTorch's default approximate='none', evaluated through erfc), Tanh, and
// GELU's tanh approximation (PyTorch's approximate='tanh', in the operation
// order of its kernels, which the CUDA twin repeats). Same dtype and shape in
// and out; math in fp32, one rounding per stored element. In-place use
// (y aliasing x, dx aliasing dy) is safe: each element is read before it is
// written. The elements are split over the backend's thread pool.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1 / sqrt(2 pi), the normal pdf's factor

inline float Relu(float x) {
  // NaN propagates (x > 0 is false for NaN), as torch.relu does; the scaler
  // must see a NaN produced upstream, not a silent zero.
  return x > 0.0f ? x : (x != x ? x : 0.0f);
}
// Phi(x), the standard normal CDF, as 0.5 erfc(-x / sqrt 2) rather than
// 0.5 (1 + erf(x / sqrt 2)): for x < 0 the erf form subtracts two numbers
// near 1 and keeps only erf's absolute error (~6e-8), a relative error of
// 1% at x = -4.5; erfc is accurate relative to its (small) value there.
// The CUDA kernel (activation.cu) evaluates exactly this sequence of fp32
// operations, so the two backends differ only by their erfcf/expf ulps.
inline float NormalCdf(float x) { return 0.5f * std::erfc(-x * kInvSqrt2); }
inline float Gelu(float x) { return x * NormalCdf(x); }
// d/dx [x Phi(x)] = Phi(x) + x phi(x).
inline float GeluGrad(float x) {
  const float cdf = NormalCdf(x);
  const float pdf = kInvSqrt2Pi * std::exp(-0.5f * x * x);
  return cdf + x * pdf;
}

// GELU, tanh approximation: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhKappa = 0.044715f;
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

template <typename Tag, Activation kAct>
void ForwardLoop(const typename Tag::Storage* x, typename Tag::Storage* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = Tag::Load(x[i]);
    float r;
    if constexpr (kAct == Activation::kReLU) {
      r = Relu(v);
    } else if constexpr (kAct == Activation::kGELU) {
      r = Gelu(v);
    } else if constexpr (kAct == Activation::kGELUTanh) {
      r = GeluTanh(v);
    } else {
      r = std::tanh(v);
    }
    y[i] = Tag::Store(r);
  }
}

template <typename Tag, Activation kAct>
void BackwardLoop(const typename Tag::Storage* x, const typename Tag::Storage* dy,
                  typename Tag::Storage* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = Tag::Load(x[i]);
    const float g = Tag::Load(dy[i]);
    float r;
    if constexpr (kAct == Activation::kReLU) {
      // Derivative 0 at x <= 0 (PyTorch's threshold_backward): the gradient
      // is selected, not multiplied, so an inf/NaN dy at x <= 0 becomes 0.
      r = v > 0.0f ? g : 0.0f;
    } else if constexpr (kAct == Activation::kGELU) {
      r = g * GeluGrad(v);
    } else if constexpr (kAct == Activation::kGELUTanh) {
      r = g * GeluTanhGrad(v);
    } else {
      // tanh recomputed from x in fp32 (not the rounded forward output).
      const float t = std::tanh(v);
      r = g * (1.0f - t * t);
    }
    dx[i] = Tag::Store(r);
  }
}

}  // namespace

absl::Status ActivationForward(ThreadPool& pool, Activation act, const Tensor& x, Tensor& y) {
  AMPD_RETURN_IF_ERROR(ValidateActivationForward(act, x, y));
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);
    auto* out = Ptr<Tag>(y);
    pool.ParallelFor(x.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      switch (act) {
        case Activation::kReLU:
          ForwardLoop<Tag, Activation::kReLU>(in + b, out + b, e - b);
          break;
        case Activation::kGELU:
          ForwardLoop<Tag, Activation::kGELU>(in + b, out + b, e - b);
          break;
        case Activation::kTanh:
          ForwardLoop<Tag, Activation::kTanh>(in + b, out + b, e - b);
          break;
        case Activation::kGELUTanh:
          ForwardLoop<Tag, Activation::kGELUTanh>(in + b, out + b, e - b);
          break;
      }
    });
    return absl::OkStatus();
  });
}

absl::Status ActivationBackward(ThreadPool& pool, Activation act, const Tensor& x, const Tensor& dy,
                                Tensor& dx) {
  AMPD_RETURN_IF_ERROR(ValidateActivationBackward(act, x, dy, dx));
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(x);
    const auto* grad_out = Ptr<Tag>(dy);
    auto* grad_in = Ptr<Tag>(dx);
    pool.ParallelFor(x.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      switch (act) {
        case Activation::kReLU:
          BackwardLoop<Tag, Activation::kReLU>(in + b, grad_out + b, grad_in + b, e - b);
          break;
        case Activation::kGELU:
          BackwardLoop<Tag, Activation::kGELU>(in + b, grad_out + b, grad_in + b, e - b);
          break;
        case Activation::kTanh:
          BackwardLoop<Tag, Activation::kTanh>(in + b, grad_out + b, grad_in + b, e - b);
          break;
        case Activation::kGELUTanh:
          BackwardLoop<Tag, Activation::kGELUTanh>(in + b, grad_out + b, grad_in + b, e - b);
          break;
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
