// Embedding lookup and its gradient. Forward copies table rows bit for bit
// (same dtype, so nothing to round), or, with a scale other than 1 (Gemma's
// sqrt(hidden_size)), multiplies each element in fp32 and rounds once.
// Backward scatters dout rows (each element round(dout * scale) with a
// scale) into dtable: for each touched row the contributions are summed in
// fp32 in batch order, added to the old value, and rounded once, so a token
// seen many times in an fp16 batch is not rounded once per occurrence.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale, Tensor& out) {
  constexpr absl::string_view kOp = "EmbeddingForward";
  AMPD_RETURN_IF_ERROR(ValidateEmbeddingForward(ids, table, out));
  AMPD_RETURN_IF_ERROR(ValidateEmbeddingScale(scale, "EmbeddingForward"));
  AMPD_RETURN_IF_ERROR(CheckIdsInRange(kOp, "ids", ids, table.dim(0)));
  if (scale != 1.0f) {
    const int64_t cols = table.dim(1);  // C
    return VisitFloat(table.dtype(), [&](auto tag) {
      using Tag = decltype(tag);
      const auto* src = Ptr<Tag>(table);  // (V, C)
      auto* dst = Ptr<Tag>(out);          // (N, C)
      for (int64_t n = 0; n < ids.dim(0); ++n) {
        const auto* row = src + LoadIndex(ids, n) * cols;
        for (int64_t c = 0; c < cols; ++c)
          dst[n * cols + c] = Tag::Store(Tag::Load(row[c]) * scale);
      }
      return absl::OkStatus();
    });
  }
  const size_t row_bytes = static_cast<size_t>(table.dim(1)) * SizeOf(table.dtype());
  const auto* src = static_cast<const unsigned char*>(table.data());  // (V, C)
  auto* dst = static_cast<unsigned char*>(out.data());                // (N, C)
  for (int64_t n = 0; n < ids.dim(0); ++n) {
    if (row_bytes == 0) break;
    std::memcpy(dst + static_cast<size_t>(n) * row_bytes,
                src + static_cast<size_t>(LoadIndex(ids, n)) * row_bytes, row_bytes);
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale, Tensor& dtable) {
  constexpr absl::string_view kOp = "EmbeddingBackward";
  AMPD_RETURN_IF_ERROR(ValidateEmbeddingBackward(ids, dout, dtable));
  AMPD_RETURN_IF_ERROR(ValidateEmbeddingScale(scale, "EmbeddingBackward"));
  AMPD_RETURN_IF_ERROR(CheckIdsInRange(kOp, "ids", ids, dtable.dim(0)));
  const int64_t count = ids.dim(0);    // N
  const int64_t cols = dtable.dim(1);  // C
  // Batch positions grouped by id, batch order kept within a group (stable),
  // which fixes the fp32 summation order independently of threads or hashing.
  std::vector<int64_t> order(static_cast<size_t>(count));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t l, int64_t r) { return LoadIndex(ids, l) < LoadIndex(ids, r); });
  std::vector<float> acc(static_cast<size_t>(cols));  // (C) one table row's sum
  return VisitFloat(dout.dtype(), [&](auto dout_tag) {
    using DoutTag = decltype(dout_tag);
    return VisitFloat(dtable.dtype(), [&](auto table_tag) {
      using TableTag = decltype(table_tag);
      const auto* grad = Ptr<DoutTag>(dout);  // (N, C)
      auto* table = Ptr<TableTag>(dtable);    // (V, C)
      size_t i = 0;
      while (i < order.size()) {
        const int64_t id = LoadIndex(ids, order[i]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (; i < order.size() && LoadIndex(ids, order[i]) == id; ++i) {
          const auto* row = grad + order[i] * cols;
          for (int64_t c = 0; c < cols; ++c) {
            // The multiply's gradient in dout's dtype (exact at scale 1).
            acc[static_cast<size_t>(c)] +=
                DoutTag::Load(DoutTag::Store(DoutTag::Load(row[c]) * scale));
          }
        }
        auto* trow = table + id * cols;
        for (int64_t c = 0; c < cols; ++c) {
          trow[c] = TableTag::Store(TableTag::Load(trow[c]) + acc[static_cast<size_t>(c)]);
        }
      }
      return absl::OkStatus();
    });
  });
}

}  // namespace ampd::kernels::cpu
