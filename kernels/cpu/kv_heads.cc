// Grouped-query attention's shared K/V heads (the contract in
// kernels/backend.h): ExpandKvHeads copies each kv head to its group of
// query heads (Hugging Face's repeat_kv on a fused q|k|v row), and
// ReduceKvHeads, its backward, sums a group's gradients in query-head
// order in fp32 and rounds once.
#include <cstring>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status ExpandKvHeads(ThreadPool& pool, const Tensor& src, int64_t heads, int64_t kv_heads,
                           Tensor& dst) {
  AMPD_RETURN_IF_ERROR(ValidateKvHeads("ExpandKvHeads", src, heads, kv_heads, dst));
  const int64_t rows = src.dim(0) * src.dim(1);           // B * T
  const int64_t d = src.dim(2) / (heads + 2 * kv_heads);  // D
  const int64_t group = heads / kv_heads;                 // G
  const size_t head_bytes = static_cast<size_t>(d) * SizeOf(src.dtype());
  const auto* in = static_cast<const unsigned char*>(src.data());  // (B T, (H + 2 Hkv) D)
  auto* out = static_cast<unsigned char*>(dst.data());             // (B T, 3 H D)
  pool.ParallelFor(rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const unsigned char* s = in + static_cast<size_t>(r * (heads + 2 * kv_heads)) * head_bytes;
      unsigned char* o = out + static_cast<size_t>(r * 3 * heads) * head_bytes;
      std::memcpy(o, s, static_cast<size_t>(heads) * head_bytes);  // q
      for (int64_t part = 1; part <= 2; ++part) {                  // k, then v
        const unsigned char* kv =
            s + static_cast<size_t>(heads + (part - 1) * kv_heads) * head_bytes;
        unsigned char* dst_part = o + static_cast<size_t>(part * heads) * head_bytes;
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(dst_part + static_cast<size_t>(h) * head_bytes,
                      kv + static_cast<size_t>(h / group) * head_bytes, head_bytes);
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status ReduceKvHeads(ThreadPool& pool, const Tensor& dexpanded, int64_t heads,
                           int64_t kv_heads, Tensor& dsrc) {
  AMPD_RETURN_IF_ERROR(ValidateKvHeads("ReduceKvHeads", dsrc, heads, kv_heads, dexpanded));
  const int64_t rows = dsrc.dim(0) * dsrc.dim(1);          // B * T
  const int64_t d = dsrc.dim(2) / (heads + 2 * kv_heads);  // D
  const int64_t group = heads / kv_heads;                  // G
  return VisitFloat(dsrc.dtype(), [&](auto tag) {
    using Tag = decltype(tag);
    const auto* in = Ptr<Tag>(dexpanded);  // (B T, 3 H D)
    auto* out = Ptr<Tag>(dsrc);            // (B T, (H + 2 Hkv) D)
    pool.ParallelFor(rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto* e = in + r * 3 * heads * d;
        auto* o = out + r * (heads + 2 * kv_heads) * d;
        for (int64_t c = 0; c < heads * d; ++c) o[c] = e[c];  // dq
        for (int64_t part = 1; part <= 2; ++part) {           // dk, then dv
          for (int64_t g = 0; g < kv_heads; ++g) {
            for (int64_t c = 0; c < d; ++c) {
              float sum = 0.0f;
              for (int64_t j = 0; j < group; ++j) {
                sum += Tag::Load(e[(part * heads + g * group + j) * d + c]);
              }
              o[(heads + (part - 1) * kv_heads + g) * d + c] = Tag::Store(sum);
            }
          }
        }
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cpu
