// GEMM: c = alpha * op(a) @ op(b) + beta * c on OpenBLAS's cblas_sgemm, or
// in batch-invariant mode on gemm_invariant.cc's fixed order (GemmOrder).
// F32 inputs go straight to BLAS. F16/BF16 inputs are widened to fp32
// (exact), multiplied with fp32 accumulation, and the finished value
// alpha * sum + beta * c is rounded once to c's dtype: the tensor-core
// contract (fp16 in, fp32 accumulate, one rounding on the store). BLAS
// threads the product itself; the widening and the rounding store are split
// over the backend's thread pool.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// The pool's scratch (ThreadPool::Scratch), reused across calls: a training
// step runs the same shapes every time, so after the first step no GEMM
// allocates. Grown to exactly what a call needs, never more.
std::vector<float>& Sized(ThreadPool& pool, ThreadPool::ScratchSlot slot, int64_t elements) {
  std::vector<float>& buf = pool.Scratch(slot);
  if (buf.capacity() < static_cast<size_t>(elements)) {
    buf = std::vector<float>();  // frees the smaller one first
    buf.reserve(static_cast<size_t>(elements));
  }
  buf.resize(static_cast<size_t>(elements));
  return buf;
}

// Widens a float tensor of any dtype into fp32 scratch.
float* Widen(ThreadPool& pool, const Tensor& t, ThreadPool::ScratchSlot slot) {
  std::vector<float>& buf = Sized(pool, slot, t.numel());
  float* out = buf.data();
  (void)VisitFloat(t.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(t);
    pool.ParallelFor(t.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = Tag::Load(in[i]);
    });
    return absl::OkStatus();
  });
  return out;
}

}  // namespace

void GemmF32(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b, float alpha,
             const Tensor& a, const Tensor& b, float* out) {
  // op(a): (M, K), op(b): (K, N), out: (M, N).
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // the empty sum; BLAS rejects lda == 0
    std::fill(out, out + m * n, 0.0f);
    return;
  }
  const bool inputs_f32 = a.dtype() == DType::kF32;
  const float* pa = inputs_f32 ? a.data_as<float>() : Widen(pool, a, ThreadPool::kWidenA);
  const float* pb = inputs_f32 ? b.data_as<float>() : Widen(pool, b, ThreadPool::kWidenB);
  if (order == GemmOrder::kBatchInvariant) {
    GemmInvariantF32(pool, trans_a, trans_b, m, n, k, alpha, pa, a.dim(1), pb, b.dim(1), 0.0f, out);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, pa, static_cast<int>(a.dim(1)), pb,
              static_cast<int>(b.dim(1)), 0.0f, out, static_cast<int>(n));
}

absl::Status Gemm(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b, float alpha,
                  const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  AMPD_RETURN_IF_ERROR(ValidateGemm(trans_a, trans_b, a, b, c));
  // op(a): (M, K), op(b): (K, N), c: (M, N).
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  // ValidateGemm has matched op(b)'s rows to k and c to (M, N), and kept
  // m, n and k within BLAS's int.
  if (m == 0 || n == 0) return absl::OkStatus();

  // Row-major leading dimensions are the stored column counts.
  const int lda = static_cast<int>(a.dim(1));
  const int ldb = static_cast<int>(b.dim(1));
  const int ldc = static_cast<int>(n);
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;

  const bool inputs_f32 = a.dtype() == DType::kF32;
  const float* pa = inputs_f32 ? a.data_as<float>() : Widen(pool, a, ThreadPool::kWidenA);
  const float* pb = inputs_f32 ? b.data_as<float>() : Widen(pool, b, ThreadPool::kWidenB);

  // k == 0: the product is empty and c = beta * c; BLAS rejects lda == 0,
  // so handle it here. Likewise beta == 0 never reads c (BLAS convention:
  // a freshly allocated, unspecified c may hold NaN bit patterns).
  auto run_sgemm = [&](float* out) {
    if (order == GemmOrder::kBatchInvariant) {
      GemmInvariantF32(pool, trans_a, trans_b, m, n, k, alpha, pa, lda, pb, ldb, beta, out);
      return;
    }
    if (k == 0) {
      for (int64_t i = 0; i < m * n; ++i) out[i] = beta == 0.0f ? 0.0f : beta * out[i];
      return;
    }
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), alpha, pa, lda, pb, ldb, beta, out, ldc);
  };

  if (c.dtype() == DType::kF32) {
    run_sgemm(c.data_as<float>());
    return absl::OkStatus();
  }
  // 16-bit c: accumulate into fp32 scratch holding beta * c (widened only
  // when beta != 0), then round the finished value once.
  float* acc;
  if (beta != 0.0f) {
    acc = Widen(pool, c, ThreadPool::kAccumulate);
  } else {
    acc = Sized(pool, ThreadPool::kAccumulate, c.numel()).data();
  }
  run_sgemm(acc);
  return VisitFloat(c.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(c);  // (M, N)
    pool.ParallelFor(m * n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = Tag::Store(acc[i]);
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
