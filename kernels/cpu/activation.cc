// Pointwise activations and their derivatives: ReLU, GELU (exact form,
// PyTorch's default approximate='none', evaluated through erfc), Tanh, and
// GELU's tanh approximation (PyTorch's approximate='tanh', in the operation
// order of its kernels, which the CUDA twin repeats). Same dtype and shape in
// and out; math in fp32, one rounding per stored element. In-place use
// (y aliasing x, dx aliasing dy) is safe: each element is read before it is
// written. The elements are split over the backend's thread pool; the
// scalar formulas are in activation_math.h.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/activation_math.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

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
