// The gated MLP's product act(gate) * up, forward and backward,
// elementwise in fp32 with one rounding per stored element (the contract
// in kernels/backend.h): SwiGLU (Llama/Qwen, act = SiLU) and GeGLU (Gemma,
// act = GELU's tanh form, activation_math.h's formula, the one
// ActivationForward evaluates). The sigmoid is 1 / (1 + exp(-g)) with
// glibc's expf, in this operation order on every backend.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/activation_math.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// act(g) and act'(g) in fp32 for one gate value.
struct GateValues {
  float act;
  float grad;
};

inline float Sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

template <GluActivation kAct>
inline float GateForward(float g) {
  if constexpr (kAct == GluActivation::kSiLU) {
    return g * Sigmoid(g);
  } else {
    return GeluTanh(g);
  }
}

template <GluActivation kAct>
inline GateValues GateBoth(float g) {
  if constexpr (kAct == GluActivation::kSiLU) {
    const float s = Sigmoid(g);
    return {g * s, s * (1.0f + g * (1.0f - s))};
  } else {
    return {GeluTanh(g), GeluTanhGrad(g)};
  }
}

template <GluActivation kAct>
absl::Status Forward(ThreadPool& pool, const Tensor& gate, const Tensor& up, Tensor& y) {
  return VisitFloat(gate.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* g = Ptr<Tag>(gate);  // (N, F)
    const auto* u = Ptr<Tag>(up);    // (N, F)
    auto* out = Ptr<Tag>(y);         // (N, F), may be gate or up
    pool.ParallelFor(gate.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        out[i] = Tag::Store(GateForward<kAct>(Tag::Load(g[i])) * Tag::Load(u[i]));
      }
    });
    return absl::OkStatus();
  });
}

template <GluActivation kAct>
absl::Status Backward(ThreadPool& pool, const Tensor& gate, const Tensor& up, const Tensor& dy,
                      Tensor& dgate, Tensor& dup) {
  return VisitFloat(gate.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* g = Ptr<Tag>(gate);  // (N, F)
    const auto* u = Ptr<Tag>(up);    // (N, F)
    const auto* d = Ptr<Tag>(dy);    // (N, F)
    auto* dg = Ptr<Tag>(dgate);      // (N, F)
    auto* du = Ptr<Tag>(dup);        // (N, F)
    pool.ParallelFor(gate.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float dv = Tag::Load(d[i]);
        const GateValues a = GateBoth<kAct>(Tag::Load(g[i]));
        dg[i] = Tag::Store((dv * Tag::Load(u[i])) * a.grad);
        du[i] = Tag::Store(dv * a.act);
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace

absl::Status GatedMulForward(ThreadPool& pool, GluActivation act, const Tensor& gate,
                             const Tensor& up, Tensor& y) {
  AMPD_RETURN_IF_ERROR(ValidateGluActivation(act, "GatedMulForward"));
  AMPD_RETURN_IF_ERROR(ValidateGatedMulForward(gate, up, y));
  if (act == GluActivation::kSiLU) return Forward<GluActivation::kSiLU>(pool, gate, up, y);
  return Forward<GluActivation::kGELUTanh>(pool, gate, up, y);
}

absl::Status GatedMulBackward(ThreadPool& pool, GluActivation act, const Tensor& gate,
                              const Tensor& up, const Tensor& dy, Tensor& dgate, Tensor& dup) {
  AMPD_RETURN_IF_ERROR(ValidateGluActivation(act, "GatedMulBackward"));
  AMPD_RETURN_IF_ERROR(ValidateGatedMulBackward(gate, up, dy, dgate, dup));
  if (act == GluActivation::kSiLU) {
    return Backward<GluActivation::kSiLU>(pool, gate, up, dy, dgate, dup);
  }
  return Backward<GluActivation::kGELUTanh>(pool, gate, up, dy, dgate, dup);
}

}  // namespace ampd::kernels::cpu
