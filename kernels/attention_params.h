// What every backend's attention ops share so that they compute the same
// algorithm (the contract in kernels/backend.h): the score scale (1/sqrt(D)
// for heads of D channels unless the model sets its own, computed in double
// and rounded once to fp32), the sliding window's first visible key, and
// the key block of the online softmax, whose boundaries are absolute key
// positions. Plain C++, included by the host compiler and nvcc.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

namespace ampd::kernels {

// Keys per block of the online softmax. The CUDA tensor-core kernels also
// use it as their query tile, so every query of a tile ends in the same
// key block and none ever visits a block that is wholly after it.
inline constexpr int kAttentionKeyBlock = 64;

inline float AttentionScale(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

// What a causal attention call computes beyond plain causality.
struct AttentionOptions {
  // The score scale S = (q . k) * scale; unset: AttentionScale(D). (Gemma 3
  // scales by query_pre_attn_scalar^-1/2, which need not be D's.)
  std::optional<float> scale;
  // 0: query t sees every key s <= t. W > 0: a sliding window, query t sees
  // keys t - W < s <= t (Hugging Face's sliding_window_overlay: kv_idx >
  // q_idx - sliding_window), W keys counting its own.
  int64_t window = 0;
};

inline float AttentionScaleOf(const AttentionOptions& options, int64_t head_dim) {
  return options.scale.has_value() ? *options.scale : AttentionScale(head_dim);
}

// The first key query t sees under a window (0 without one).
inline int64_t AttentionFirstKey(int64_t t, int64_t window) {
  return window > 0 && t >= window ? t - window + 1 : 0;
}

}  // namespace ampd::kernels
