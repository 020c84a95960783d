// Rotary position embeddings in Hugging Face's rotate-half form, in place on
// the first `heads` heads of each (b, t) row (the contract in
// kernels/backend.h): fp32 angle = float(p) * inv_freq[i], glibc's cosf and
// sinf, one rounding per stored element. The inverse (transpose) rotation
// is the backward.
#include <cmath>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status Rope(ThreadPool& pool, Tensor& x, int64_t heads, int64_t head_dim,
                  const Tensor& inv_freq, const Tensor* positions, bool inverse) {
  AMPD_RETURN_IF_ERROR(ValidateRope(x, heads, head_dim, inv_freq, positions));
  const int64_t rows = x.dim(0) * x.dim(1);  // B * T
  const int64_t seq = x.dim(1);              // T
  const int64_t width = x.dim(2);            // W
  const int64_t half = head_dim / 2;
  const float* freq = inv_freq.data_as<float>();  // (D / 2)
  return VisitFloat(x.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    auto* data = Ptr<Tag>(x);  // (B, T, W)
    pool.ParallelFor(rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t p = positions != nullptr ? LoadIndex(*positions, r) : r % seq;
        auto* row = data + r * width;
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(p) * freq[i];
          const float c = std::cos(angle);
          const float s = inverse ? -std::sin(angle) : std::sin(angle);
          for (int64_t h = 0; h < heads; ++h) {
            auto* head = row + h * head_dim;
            const float x1 = Tag::Load(head[i]);
            const float x2 = Tag::Load(head[i + half]);
            head[i] = Tag::Store(x1 * c - x2 * s);
            head[i + half] = Tag::Store(x2 * c + x1 * s);
          }
        }
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
