// The row loop both CPU attention passes share: rows weighted and added
// onto an accumulator (acc += P v in the forward pass, dq += dS k in the
// backward), each channel's sum kept in sequential order over the rows so
// the result does not depend on how the compiler vectorises across
// channels.
#pragma once

#include <cstdint>

namespace ampd::kernels::cpu {

// acc[d] += w[j] * rows[j * d_len + d] for j = 0, 1, ..., n_rows - 1 in
// turn, for d < d_len.
inline void AccumulateRows(const float* w, const float* rows, int64_t n_rows, int64_t d_len,
                           float* acc) {
  for (int64_t j = 0; j < n_rows; ++j) {
    const float wj = w[j];
    const float* row = rows + j * d_len;
    for (int64_t d = 0; d < d_len; ++d) acc[d] += wj * row[d];
  }
}

}  // namespace ampd::kernels::cpu
