// What the attention forward and backward (attention_forward.cu,
// attention_backward.cu) share: where head h of batch row b lives in qkv,
// att and the (B, T, C) tensors, as the pointers, leading dimensions and
// strides a row-major strided-batched GEMM over the heads takes, and the
// grid of the row kernels (one warp per row of att). C++17, host and device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention_scale.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

inline constexpr int kAttentionRowsPerBlock = kThreads / 32;

inline unsigned AttentionRowBlocks(int64_t rows) { return GridFor(rows, kAttentionRowsPerBlock); }

struct AttentionGeometry {
  // The op checks (kernels/op_checks.cc) keep T, 3C and n_head within int.
  AttentionGeometry(DType dtype, int64_t seq, int64_t channels, int64_t n_head)
      : elem(static_cast<int64_t>(SizeOf(dtype))),
        t(static_cast<int>(seq)),
        d(static_cast<int>(channels / n_head)),
        heads(static_cast<int>(n_head)),
        ld_qkv(static_cast<int>(3 * channels)),
        ld_out(static_cast<int>(channels)),
        head_stride(channels / n_head),
        att_stride(seq * seq),
        c(channels),
        scale(AttentionScale(channels / n_head)) {}

  // Head 0 of part `which` (0: q, 1: k, 2: v) of batch row b in qkv (B, T, 3C).
  const void* Qkv(const void* qkv, int64_t b, int which) const {
    return static_cast<const char*>(qkv) + (b * t * 3 * c + which * c) * elem;
  }
  void* Qkv(void* qkv, int64_t b, int which) const {
    return static_cast<char*>(qkv) + (b * t * 3 * c + which * c) * elem;
  }
  // att[b, 0] of (B, H, T, T).
  const void* Att(const void* att, int64_t b) const {
    return static_cast<const char*>(att) + b * heads * att_stride * elem;
  }
  void* Att(void* att, int64_t b) const {
    return static_cast<char*>(att) + b * heads * att_stride * elem;
  }
  // Head 0 of batch row b in a (B, T, C) tensor.
  const void* Out(const void* out, int64_t b) const {
    return static_cast<const char*>(out) + b * t * c * elem;
  }
  void* Out(void* out, int64_t b) const { return static_cast<char*>(out) + b * t * c * elem; }

  int64_t elem;  // bytes per element
  int t;         // T
  int d;         // D = C / n_head
  int heads;
  int ld_qkv;           // 3C: the row length of qkv
  int ld_out;           // C: the row length of out, dout
  int64_t head_stride;  // D elements between heads' column blocks
  int64_t att_stride;   // T * T elements between heads' score blocks
  int64_t c;            // C
  float scale;
};

}  // namespace ampd::kernels::cuda
