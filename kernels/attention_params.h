// What every backend's attention ops share so that they compute the same
// algorithm (the contract in kernels/backend.h): the score scale 1/sqrt(D)
// for heads of D channels, computed in double and rounded once to fp32, and
// the key block of the online softmax, whose boundaries are absolute key
// positions. Plain C++, included by the host compiler and nvcc.
#pragma once

#include <cmath>
#include <cstdint>

namespace ampd::kernels {

// Keys per block of the online softmax. The CUDA tensor-core kernels also
// use it as their query tile, so every query of a tile ends in the same
// key block and none ever visits a block that is wholly after it.
inline constexpr int kAttentionKeyBlock = 64;

inline float AttentionScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

}  // namespace ampd::kernels
