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

struct GptWorkspace : Workspace {
  int64_t batch = 0;  // B
  int64_t seq = 0;    // T
  int64_t rows = 0;   // N = B*T
  int64_t chunk_rows = 0;
  int64_t kept = 0;  // targets other than kIgnoreIndex (LoadBatch counts them)

  kernels::Tensor ids;      // (N) I32/I64 as the client sent them
  kernels::Tensor targets;  // (N) I32/I64
  TokenLossState tokens;    // the token loss the next Loss trains on (LoadBatch sets it)

  // What forward saves for backward, per block.
  struct Block {
    kernels::Tensor ln_1, mean_1, rstd_1;  // (N, C) working; (N) F32 twice
    kernels::Tensor qkv;                   // (N, 3C)
    kernels::Tensor lse;                   // (B, n_head, T) F32 attention log-sum-exp
    kernels::Tensor attn_y;                // (N, C) attention output, c_proj's input
    kernels::Tensor resid;                 // (N, C) r_l = x_l + attention branch
    kernels::Tensor ln_2, mean_2, rstd_2;  // (N, C); (N) F32 twice
    kernels::Tensor fc_pre, fc_post;       // (N, H) before and after GELU
  };
  std::vector<kernels::Tensor> x;  // x_0..x_L (N, C): the residual stream into each block
  std::vector<Block> blocks;
  kernels::Tensor ln_f, mean_f, rstd_f;  // (N, C); (N) F32 twice

  // Backward scratch, reused by every block.
  kernels::Tensor d_res;   // (N, C) gradient of the residual stream
  kernels::Tensor d_tmp;   // (N, C) a LayerNorm's dx, or the attention output's gradient
  kernels::Tensor d_ln;    // (N, C) gradient of a LayerNorm's output (Loss writes ln_f's)
  kernels::Tensor d_pre;   // (N, H) gradient of the GELU's input (c_fc's output)
  kernels::Tensor d_qkv;   // (N, 3C)
  kernels::Tensor logits;  // (chunk_rows, V) one LM-head chunk, then its gradient
  // (V, C) F32: a 16-bit LM head's gradient summed over its chunks before
  // it is added to the parameter gradient in one rounding; empty in fp32
  // and when the head is one chunk (chunk_rows == rows), whose one GEMM
  // adds into the gradient itself.
  kernels::Tensor head_grad;
};

}  // namespace ampd::engine::model
