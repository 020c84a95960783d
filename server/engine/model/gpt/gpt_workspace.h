// GptWorkspace: the buffers of one GPT micro-batch shape (B, T), shared by
// the GptModel's files (gpt_model.cc allocates them, gpt_forward.cc,
// gpt_lm_head.cc and gpt_backward.cc use them). Private to gpt/.
// Row-major 2-D (N, width) tensors, N = B*T; the attention ops take 3-D
// views of them (Tensor::View, no copies). Attention is fused: per block it
// saves only its output and each row's log-sum-exp, nothing T x T.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

// One block's activations over N rows: what a training forward saves for
// the backward (one per block in GptWorkspace), or a sampler's decode
// step's buffers for its S rows (one, reused by every block; no lse).
struct GptBlockBuffers {
  kernels::Tensor ln_1, mean_1, rstd_1;  // (N, C) working; (N) F32 twice
  kernels::Tensor qkv;                   // (N, 3C)
  kernels::Tensor lse;                   // (B, n_head, T) F32 attention log-sum-exp
  kernels::Tensor attn_y;                // (N, C) attention output, c_proj's input
  kernels::Tensor resid;                 // (N, C) r_l = x_l + attention branch
  kernels::Tensor ln_2, mean_2, rstd_2;  // (N, C); (N) F32 twice
  kernels::Tensor fc_pre, fc_post;       // (N, H) before and after GELU
};

// The batch, ln_f's output, its gradient d_ln and the head's buffers are
// LmWorkspace's (lm_head.h).
struct GptWorkspace : LmWorkspace {
  // What forward saves for backward, per block.
  using Block = GptBlockBuffers;
  std::vector<kernels::Tensor> x;  // x_0..x_L (N, C): the residual stream into each block
  std::vector<Block> blocks;
  kernels::Tensor mean_f, rstd_f;  // ln_f's statistics, (N) F32 twice

  // Backward scratch, reused by every block.
  kernels::Tensor d_res;  // (N, C) gradient of the residual stream
  kernels::Tensor d_tmp;  // (N, C) a LayerNorm's dx, or the attention output's gradient
  kernels::Tensor d_pre;  // (N, H) gradient of the GELU's input (c_fc's output)
  kernels::Tensor d_qkv;  // (N, 3C)
};

}  // namespace ampd::engine::model
