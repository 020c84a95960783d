// The attention ops' score scale, 1/sqrt(D) for heads of D channels, as
// every backend computes it: in double, rounded once to fp32. It is the
// alpha of the CUDA GEMMs and the CPU oracle's factor, so both start from
// the same fp32 value. Plain C++, included by the host compiler and nvcc.
#pragma once

#include <cmath>
#include <cstdint>

namespace ampd::kernels {

inline float AttentionScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

}  // namespace ampd::kernels
