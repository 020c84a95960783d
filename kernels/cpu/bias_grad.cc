// Elementwise and broadcast ops: Fill, Cast between float dtypes, the
// same-shape Add (residuals, the step's loss sum), the Linear layer's bias
// add and its gradient. Every value is computed in fp32 and rounded once to
// the destination dtype. Each op splits its elements (rows, for AddBias;
// columns, for BiasGrad) over the backend's thread pool; no element's
// arithmetic depends on the split.
#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status Fill(ThreadPool& pool, Tensor& dst, float value) {
  if (absl::Status s = ValidateFill(dst); !s.ok()) return s;
  return VisitFloat(dst.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    // Round once, then replicate the stored pattern.
    const typename Tag::Storage stored = Tag::Store(value);
    auto* out = Ptr<Tag>(dst);
    pool.ParallelFor(dst.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      std::fill(out + begin, out + end, stored);
    });
    return absl::OkStatus();
  });
}

namespace {

template <typename SrcTag, typename DstTag>
void CastLoop(const typename SrcTag::Storage* src, typename DstTag::Storage* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = DstTag::Store(SrcTag::Load(src[i]));
}

}  // namespace

absl::Status Cast(ThreadPool& pool, const Tensor& src, Tensor& dst) {
  if (absl::Status s = ValidateCast(src, dst); !s.ok()) return s;
  // Widening is exact and narrowing rounds once; fp16 <-> bf16 goes through
  // fp32, which holds both exactly, so it too is a single rounding.
  return VisitFloat(src.dtype(), [&](auto src_tag) {
    using SrcTag = decltype(src_tag);
    return VisitFloat(dst.dtype(), [&](auto dst_tag) {
      using DstTag = decltype(dst_tag);
      const auto* in = Ptr<SrcTag>(src);
      auto* out = Ptr<DstTag>(dst);
      pool.ParallelFor(src.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        CastLoop<SrcTag, DstTag>(in + begin, out + begin, end - begin);
      });
      return absl::OkStatus();
    });
  });
}

absl::Status Add(ThreadPool& pool, const Tensor& x, Tensor& y) {
  if (absl::Status s = ValidateAdd(x, y); !s.ok()) return s;
  // Both loads are exact widenings, so the only rounding is the fp32 add
  // and the store into y's dtype, whatever mix of dtypes x and y are.
  return VisitFloat(x.dtype(), [&](auto x_tag) {
    using XTag = decltype(x_tag);
    return VisitFloat(y.dtype(), [&](auto y_tag) {
      using YTag = decltype(y_tag);
      const auto* in = Ptr<XTag>(x);  // same shape as y
      auto* out = Ptr<YTag>(y);
      // x may be y itself (y = 2y): each element is read before it is written.
      pool.ParallelFor(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] = YTag::Store(XTag::Load(in[i]) + YTag::Load(out[i]));
        }
      });
      return absl::OkStatus();
    });
  });
}

absl::Status AddBias(ThreadPool& pool, const Tensor& bias, Tensor& y) {
  if (absl::Status s = ValidateAddBias(bias, y); !s.ok()) return s;
  const int64_t rows = y.dim(0);  // N
  const int64_t cols = y.dim(1);  // C
  // The bias may be stored in any float dtype (the contract leaves it open);
  // widen it once to fp32 rather than per row.
  std::vector<float> b(static_cast<size_t>(cols));  // (C)
  absl::Status widened = VisitFloat(bias.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    for (int64_t c = 0; c < cols; ++c) b[static_cast<size_t>(c)] = Tag::Load(Ptr<Tag>(bias)[c]);
    return absl::OkStatus();
  });
  if (!widened.ok()) return widened;
  return VisitFloat(y.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(y);  // (N, C)
    const int64_t rows_per_chunk =
        std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1));
    pool.ParallelFor(rows, rows_per_chunk, [&](int64_t first, int64_t last) {
      for (int64_t n = first; n < last; ++n) {
        auto* row = out + n * cols;
        for (int64_t c = 0; c < cols; ++c) {
          row[c] = Tag::Store(Tag::Load(row[c]) + b[static_cast<size_t>(c)]);
        }
      }
    });
    return absl::OkStatus();
  });
}

absl::Status BiasGrad(ThreadPool& pool, const Tensor& dy, float beta, Tensor& dbias) {
  if (absl::Status s = ValidateBiasGrad(dy, dbias); !s.ok()) return s;
  const int64_t rows = dy.dim(0);  // N
  const int64_t cols = dy.dim(1);  // C
  // Column sums in fp32, rows added in order 0..N-1 for every column (the
  // row-outer loop keeps the reads contiguous without changing that order).
  // Threads take blocks of whole columns, so each column's order is kept.
  std::vector<float> sum(static_cast<size_t>(cols), 0.0f);  // (C)
  constexpr int64_t kColumnsPerChunk = 256;                 // 1 KiB of fp32 per row read
  const int64_t column_grain =
      rows * cols < kElementwiseGrain ? std::max<int64_t>(cols, 1) : kColumnsPerChunk;
  absl::Status summed = VisitFloat(dy.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(dy);  // (N, C)
    pool.ParallelFor(cols, column_grain, [&](int64_t c0, int64_t c1) {
      for (int64_t n = 0; n < rows; ++n) {
        const auto* row = in + n * cols;
        for (int64_t c = c0; c < c1; ++c) sum[static_cast<size_t>(c)] += Tag::Load(row[c]);
      }
    });
    return absl::OkStatus();
  });
  if (!summed.ok()) return summed;
  return VisitFloat(dbias.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* out = Ptr<Tag>(dbias);  // (C)
    for (int64_t c = 0; c < cols; ++c) {
      // BLAS convention: beta == 0 never reads dbias, so a freshly allocated
      // (unspecified, possibly NaN) buffer is simply overwritten.
      const float prev = beta == 0.0f ? 0.0f : beta * Tag::Load(out[c]);
      out[c] = Tag::Store(sum[static_cast<size_t>(c)] + prev);
    }
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
