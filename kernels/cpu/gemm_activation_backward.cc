// GemmActivationBackward: the input gradient through a Linear and its
// activation, c = g * act'(pre) rounded once with g = alpha op(a) @ op(b)
// the fp32 sums (GemmF32, in the backend's GemmOrder), never rounded on the way: the contract of
// cuBLASLt's DGELU epilogue (kernels/backend.h). act' is
// ActivationBackward's GELUTanh derivative (activation_math.h). The
// elements are split over the backend's thread pool.
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/activation_math.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// The pool's fp32 sums (ThreadPool::Scratch), reused across calls: a step
// repeats its shapes, so after the first step no call allocates.
std::vector<float>& Sums(ThreadPool& pool, int64_t elements) {
  std::vector<float>& sums = pool.Scratch(ThreadPool::kActivationBackwardSums);
  if (sums.capacity() < static_cast<size_t>(elements)) {
    sums = std::vector<float>();  // frees the smaller one first
    sums.reserve(static_cast<size_t>(elements));
  }
  sums.resize(static_cast<size_t>(elements));
  return sums;
}

}  // namespace

absl::Status GemmActivationBackward(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                                    float alpha, const Tensor& a, const Tensor& b,
                                    GemmActivation act, const Tensor* pre, Tensor& c) {
  AMPD_RETURN_IF_ERROR(ValidateGemmActivationBackward(trans_a, trans_b, a, b, act, pre, c));
  const int64_t n = c.numel();  // M * N
  if (n == 0) return absl::OkStatus();
  std::vector<float>& sums = Sums(pool, n);  // (M, N) g = alpha op(a) @ op(b), fp32
  GemmF32(pool, order, trans_a, trans_b, alpha, a, b, sums.data());
  return VisitFloat(c.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* pre_in = pre != nullptr ? Ptr<Tag>(*pre) : nullptr;  // (M, N)
    auto* out = Ptr<Tag>(c);                                         // (M, N)
    const float* g = sums.data();
    pool.ParallelFor(n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out[i] = act == GemmActivation::kGELUTanh
                     ? Tag::Store(g[i] * GeluTanhGrad(Tag::Load(pre_in[i])))
                     : Tag::Store(g[i]);
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
