// WriteKvRows (the contract in kernels/backend.h): each sequence's new key
// and value, column blocks of its fused row, into its own position of a
// layer's cache: byte copies, no rounding. Positions are all checked before
// anything is written, so a bad one leaves both caches untouched.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col, const Tensor& positions,
                         Tensor& k_cache, Tensor& v_cache) {
  AMPD_RETURN_IF_ERROR(ValidateWriteKvRows(rows, k_col, v_col, positions, k_cache, v_cache));
  const int64_t seqs = rows.dim(0);       // S
  const int64_t t_max = k_cache.dim(1);   // T_max
  const int64_t width = k_cache.dim(2);   // W
  const int64_t row_width = rows.dim(1);  // R
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t t = LoadIndex(positions, s);
    if (t < 0 || t >= t_max) {
      return absl::InvalidArgumentError(
          absl::StrCat("WriteKvRows: positions[", s, "] = ", t, " is outside [0, ", t_max, ")"));
    }
  }
  const auto elem = static_cast<int64_t>(SizeOf(rows.dtype()));
  const auto* src = static_cast<const unsigned char*>(rows.data());  // (S, R)
  auto* keys = static_cast<unsigned char*>(k_cache.data());          // (S, T_max, W)
  auto* values = static_cast<unsigned char*>(v_cache.data());        // (S, T_max, W)
  const size_t bytes = static_cast<size_t>(width * elem);
  // A few rows of a few KiB each: not worth the thread pool's hand-off.
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t slot = (s * t_max + LoadIndex(positions, s)) * width * elem;
    const unsigned char* row = src + s * row_width * elem;
    if (bytes == 0) continue;
    std::memcpy(keys + slot, row + k_col * elem, bytes);
    std::memcpy(values + slot, row + v_col * elem, bytes);
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
