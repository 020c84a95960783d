// Histogram of log2|g| over a list of gradients, for the dashboards that
// show how close gradients sit to fp16's underflow (2^-24) and overflow
// (2^16) edges. Bins (kGradHistogramBins = 53): 0 exact zeros, 1 below
// 2^-30, then one octave each from [2^-30, 2^-29) to [2^19, 2^20), and the
// last |g| >= 2^20 together with inf and NaN. The octave is read from the
// fp32 exponent field, which is exact (no log2 rounding at bin edges).
// Chunks of each gradient are counted on the backend's thread pool into
// local bins and added to the totals with atomic integer adds, which are
// exact in any order.
#include <atomic>
#include <bit>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

inline int Bin(float v) {
  const uint32_t abs = std::bit_cast<uint32_t>(v) & 0x7fffffffu;
  if (abs == 0) return 0;                                 // +0 and -0
  if (abs >= 0x7f800000u) return kGradHistogramBins - 1;  // inf, NaN
  // Subnormal floats have exponent field 0, i.e. below 2^-126: bin 1.
  const int exponent = static_cast<int>(abs >> 23) - 127;  // floor(log2|v|) for normals
  if (exponent < kGradHistogramMinLog2) return 1;
  if (exponent >= kGradHistogramMaxLog2) return kGradHistogramBins - 1;
  return 2 + (exponent - kGradHistogramMinLog2);
}

template <typename Tag>
void Count(const typename Tag::Storage* g, int64_t n, int64_t* bins) {
  for (int64_t i = 0; i < n; ++i) ++bins[Bin(Tag::Load(g[i]))];
}

}  // namespace

absl::Status GradLog2Histogram(ThreadPool& pool, absl::Span<const Tensor* const> grads,
                               Tensor& counts) {
  if (absl::Status s = ValidateGradLog2Histogram(grads, counts); !s.ok()) return s;
  int64_t* bins = counts.data_as<int64_t>();  // (kGradHistogramBins)
  for (const Tensor* grad : grads) {
    absl::Status s = VisitFloat(grad->dtype(), [&](auto tag) {
      using Tag = decltype(tag);
      const auto* g = Ptr<Tag>(*grad);
      pool.ParallelFor(grad->numel(), 4 * kElementwiseGrain, [&](int64_t begin, int64_t end) {
        int64_t local[kGradHistogramBins] = {};
        Count<Tag>(g + begin, end - begin, local);
        for (int b = 0; b < kGradHistogramBins; ++b) {
          if (local[b] != 0) {
            std::atomic_ref<int64_t>(bins[b]).fetch_add(local[b], std::memory_order_relaxed);
          }
        }
      });
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
