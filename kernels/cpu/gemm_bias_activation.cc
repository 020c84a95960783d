// GemmBiasActivation: a Linear's forward with its epilogue. The fp32 sums
// of op(a) @ op(b) (GemmF32: OpenBLAS, or the batch-invariant order) get the bias added in fp32,
// the pre-activation is stored rounded once, and the activation is evaluated on the unrounded fp32
// value and rounded once: the contract cuBLASLt's BIAS and GELU_AUX_BIAS epilogues implement
// (kernels/backend.h). The epilogue's rows are split over the backend's thread pool.
#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/activation_math.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// The pool's fp32 sums (ThreadPool::Scratch), reused across calls: a step
// repeats its shapes, so after the first step no call allocates.
std::vector<float>& Sums(ThreadPool& pool, int64_t elements) {
  std::vector<float>& sums = pool.Scratch(ThreadPool::kBiasActivationSums);
  if (sums.capacity() < static_cast<size_t>(elements)) {
    sums = std::vector<float>();  // frees the smaller one first
    sums.reserve(static_cast<size_t>(elements));
  }
  sums.resize(static_cast<size_t>(elements));
  return sums;
}

}  // namespace

absl::Status GemmBiasActivation(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                                const Tensor& a, const Tensor& b, const Tensor* bias,
                                GemmActivation act, Tensor& c, Tensor* pre) {
  AMPD_RETURN_IF_ERROR(ValidateGemmBiasActivation(trans_a, trans_b, a, b, bias, act, c, pre));
  const int64_t rows = c.dim(0);  // M
  const int64_t cols = c.dim(1);  // N
  if (rows == 0 || cols == 0) return absl::OkStatus();
  std::vector<float>& sums = Sums(pool, rows * cols);  // (M, N) fp32 sums of op(a) @ op(b)
  GemmF32(pool, order, trans_a, trans_b, 1.0f, a, b, sums.data());
  return VisitFloat(c.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* bias_in = bias != nullptr ? Ptr<Tag>(*bias) : nullptr;  // (N)
    auto* out = Ptr<Tag>(c);                                            // (M, N)
    auto* pre_out = pre != nullptr ? Ptr<Tag>(*pre) : nullptr;          // (M, N)
    const float* acc = sums.data();
    const int64_t rows_per_chunk =
        std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1));
    pool.ParallelFor(rows, rows_per_chunk, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t i = r * cols + j;
          const float p = bias_in != nullptr ? acc[i] + Tag::Load(bias_in[j]) : acc[i];
          if (act == GemmActivation::kGELUTanh) {
            pre_out[i] = Tag::Store(p);
            out[i] = Tag::Store(GeluTanh(p));
          } else {
            out[i] = Tag::Store(p);
          }
        }
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
