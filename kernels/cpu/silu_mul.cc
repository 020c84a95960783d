// SwiGLU's gated product (the Llama/Qwen2 MLP's act(gate) * up with SiLU),
// forward and backward, elementwise in fp32 with one rounding per stored
// element (the contract in kernels/backend.h). The sigmoid is
// 1 / (1 + exp(-g)) with glibc's expf, in this operation order on every
// backend.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status SiluMulForward(ThreadPool& pool, const Tensor& gate, const Tensor& up, Tensor& y) {
  AMPD_RETURN_IF_ERROR(ValidateSiluMulForward(gate, up, y));
  return VisitFloat(gate.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* g = Ptr<Tag>(gate);  // (N, F)
    const auto* u = Ptr<Tag>(up);    // (N, F)
    auto* out = Ptr<Tag>(y);         // (N, F), may be gate or up
    pool.ParallelFor(gate.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float gv = Tag::Load(g[i]);
        const float s = 1.0f / (1.0f + std::exp(-gv));
        out[i] = Tag::Store((gv * s) * Tag::Load(u[i]));
      }
    });
    return absl::OkStatus();
  });
}

absl::Status SiluMulBackward(ThreadPool& pool, const Tensor& gate, const Tensor& up,
                             const Tensor& dy, Tensor& dgate, Tensor& dup) {
  AMPD_RETURN_IF_ERROR(ValidateSiluMulBackward(gate, up, dy, dgate, dup));
  return VisitFloat(gate.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* g = Ptr<Tag>(gate);  // (N, F)
    const auto* u = Ptr<Tag>(up);    // (N, F)
    const auto* d = Ptr<Tag>(dy);    // (N, F)
    auto* dg = Ptr<Tag>(dgate);      // (N, F)
    auto* du = Ptr<Tag>(dup);        // (N, F)
    pool.ParallelFor(gate.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float gv = Tag::Load(g[i]);
        const float dv = Tag::Load(d[i]);
        const float s = 1.0f / (1.0f + std::exp(-gv));
        dg[i] = Tag::Store((dv * Tag::Load(u[i])) * (s * (1.0f + gv * (1.0f - s))));
        du[i] = Tag::Store(dv * (gv * s));
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
