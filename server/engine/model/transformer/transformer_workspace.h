// TransformerWorkspace: the buffers of one transformer micro-batch shape
// (B, T), shared by the TransformerModel's files (transformer_model.cc
// allocates them, transformer_forward.cc, transformer_lm_head.cc and
// transformer_backward.cc use them). Private to transformer/. Row-major 2-D (N, width) tensors, N =
// B*T; the attention, RoPE and K/V ops take 3-D views of them. Widths as in transformer_model.h: C
// hidden, Q = H D query, KV = K D key/value, I intermediate.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/parts.h"

namespace ampd::engine::model {

// The widths of transformer_model.h: C hidden, D head, Q = H D, KV = K D,
// Q + 2 KV, I the MLP's, V vocabulary; all validated to fit.
struct Widths {
  int64_t c, d, q, kv, qkv, i, v;
  explicit Widths(const TransformerParts& p)
      : c(p.hidden),
        d(p.head_dim),
        q(p.q_width()),
        kv(p.kv_width()),
        qkv(p.qkv_width()),
        i(p.intermediate),
        v(p.vocab) {}
};

// Allocates a training workspace's or a decode state's buffers over n
// rows: alloc(dtype, shape, t); a norm's statistics (rstd, and a
// LayerNorm's mean) of n rows; RoPE's host frequencies uploaded (nothing
// for an empty vector).
struct RowAllocator {
  kernels::Backend& backend;
  const TransformerParts& parts;
  int64_t n;
  absl::Status operator()(kernels::DType dtype, const kernels::Shape& shape,
                          kernels::Tensor& t) const {
    absl::StatusOr<kernels::Tensor> allocated = backend.Allocate(dtype, shape);
    if (!allocated.ok()) return allocated.status();
    t = *std::move(allocated);
    return absl::OkStatus();
  }
  absl::Status Stats(kernels::Tensor& mean, kernels::Tensor& rstd) const {
    if (parts.layer_norm()) {
      absl::Status status = (*this)(kernels::DType::kF32, {n}, mean);
      if (!status.ok()) return status;
    }
    return (*this)(kernels::DType::kF32, {n}, rstd);
  }
  absl::Status Upload(const std::vector<float>& host, kernels::Tensor& t) const {
    if (host.empty()) return absl::OkStatus();
    absl::Status status = (*this)(kernels::DType::kF32, {static_cast<int64_t>(host.size())}, t);
    if (!status.ok()) return status;
    return backend.CopyFromHost(host.data(), host.size() * sizeof(float), t);
  }
};

// How many of a LoRA spec's targets are among q, k, v (the stacked
// adapters) and among o, gate, up, down; zeros without LoRA.
struct LoraTargets {
  int64_t qkv = 0;
  int64_t others = 0;
};
inline LoraTargets LoraTargetsOf(const TransformerParts& p) {
  LoraTargets t;
  if (!p.lora.has_value()) return t;
  for (const std::string& m : p.lora->target_modules) {
    (m == "q_proj" || m == "k_proj" || m == "v_proj" ? t.qkv : t.others) += 1;
  }
  return t;
}

// The stacked q|k|v projection a block's forward reads (transformer_model.h):
// its weight w (Q + 2 KV, C) and bias b (Q + 2 KV, empty without
// qkv_bias) copied from a block's parameters, and LoRA's stacked q|k|v
// adapters (lora.h): lora_a (t r, C) and the block-diagonal
// lora_b (Q + 2 KV, t r; its off-diagonal blocks stay zero), empty
// without q, k or v targets. A training workspace holds one, rebuilt for
// each block in each pass (the weights change between steps); a sampler's
// decode state holds one per block, filled once at Prefill (the weights
// cannot change during one Sample), so a decode step copies no weight.
struct QkvStack {
  kernels::Tensor w, b, lora_a, lora_b;
};

// One block's activations over N rows: what a training forward saves for
// the backward (one per block in TransformerWorkspace), or a sampler's decode
// step's buffers for its S rows (one, reused by every block).
struct BlockBuffers {
  // (N, C) working; (N) F32; mean_1 a LayerNorm's only (empty for RMSNorm).
  kernels::Tensor ln_1, mean_1, rstd_1;
  kernels::Tensor qkv;  // (N, Q + 2 KV) after the q/k norm and RoPE
  // With qk_norm: qkv as the projection wrote it, before the per-head
  // norm, whose backward reads it (empty in a sampler's decode step, which
  // has no backward, and without qk_norm); the norms' statistics, (N, H)
  // and (N, K) F32.
  kernels::Tensor qkv_pre;
  kernels::Tensor rstd_q, rstd_k;
  // (N, 3 Q): qkv with the K/V heads expanded to H; empty when K == H,
  // where qkv already has that layout.
  kernels::Tensor qkv_x;
  kernels::Tensor lse;     // (B, H, T) F32 attention log-sum-exp
  kernels::Tensor attn_y;  // (N, Q) attention output, o_proj's input
  // With sandwich_norms: o_proj's output and the MLP's (down_proj's) before
  // their norms (post_attention_layernorm, post_feedforward_layernorm),
  // which the backward reads, and those norms' statistics (N) F32.
  kernels::Tensor attn_o, rstd_ao;
  kernels::Tensor mlp_o, rstd_mo;
  kernels::Tensor resid;                 // (N, C) r_l = x_l + attention branch
  kernels::Tensor ln_2, mean_2, rstd_2;  // (N, C); (N) F32 (mean_2 as mean_1)
  // (N, I): gated, gate_proj's and up_proj's outputs and act(gate) * up;
  // the GELU MLP's c_fc output before the GELU in gate, after it in act
  // (up empty).
  kernels::Tensor gate, up, act;
  // LoRA's u = x A^T (lora.h) of the block's targets: the stacked
  // q|k|v adapters' (N, t r), and o, gate, up, down's (N, r) each (by
  // module - kO); empty where there is no such target.
  kernels::Tensor lora_u_qkv;
  std::array<kernels::Tensor, 4> lora_u;
  const kernels::Tensor& attention_input() const { return qkv_x.empty() ? qkv : qkv_x; }
};

// The batch, the final norm's output ln_f, its gradient d_ln and the head's
// buffers are LmWorkspace's (lm_head.h).
struct TransformerWorkspace : LmWorkspace {
  kernels::Tensor inv_freq;        // (D/2) F32, RoPE's frequencies; empty for learned positions
  kernels::Tensor inv_freq_local;  // (D/2) F32, the sliding layers'; empty without them

  // What forward saves for backward, per block.
  using Block = BlockBuffers;
  std::vector<kernels::Tensor> x;  // x_0..x_L (N, C): the residual stream into each block
  std::vector<Block> blocks;
  kernels::Tensor mean_f, rstd_f;  // the final norm's statistics, (N) F32 (mean_f a LayerNorm's)

  QkvStack stack;
  // The gradients of the stacked q|k|v weight and bias before they are
  // copied back (none for a LoRA job's frozen base), and of LoRA's stacked
  // adapters (lora_da_qkv (t r, C), lora_db_qkv (Q + 2 KV, t r)). Reused by
  // every block. lora_du (N, max(t, 1) r): dL/du of one adapter at a time.
  kernels::Tensor dw_qkv, db_qkv;
  kernels::Tensor lora_da_qkv, lora_db_qkv;
  kernels::Tensor lora_du;

  // Backward scratch, reused by every block.
  kernels::Tensor d_res;     // (N, C) gradient of the residual stream
  kernels::Tensor d_tmp;     // (N, C) a norm's dx
  kernels::Tensor d_branch;  // (N, C) with sandwich_norms: a branch output's gradient
  // (N, Q) gradient of the attention output: a view of d_tmp when Q == C
  // (the input norm's dx overwrites it only after the attention's backward).
  kernels::Tensor d_attn;
  kernels::Tensor d_qkv_x;  // (N, 3 Q) expanded q|k|v gradient; empty when K == H
  kernels::Tensor d_qkv;    // (N, Q + 2 KV)
  kernels::Tensor d_act;    // (N, I) gradient of act(gate) * up (gated only)
  kernels::Tensor d_gate;   // (N, I) gate's gradient (the GELU MLP's: its input's)
  kernels::Tensor d_up;     // (N, I) (gated only)
};

}  // namespace ampd::engine::model
