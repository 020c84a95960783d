// TransformerModel::Backward: from dh (ws.d_ln, written by Loss) back
// through the final norm, the blocks in reverse and the embeddings. d_res
// carries the residual stream's gradient; each branch adds its norm's dx
// into it. A projection's weight gradient is one GEMM with its bias's (beta
// 0 on the first micro-batch, 1 after): Linear's (out, in) dW = dy^T x,
// Conv1D's (in, out) dW = x^T dy; its dx = dy W or dy W^T, through the
// GELU MLP's derivative in the GEMM's epilogue. The decoders' stacked
// q|k|v weight's gradient is formed in the workspace and copied into the
// three parameters' (transformer_model.h); GPT-2's fused c_attn takes its
// own. With per-layer scales, block l's last residual add also moves d_res
// to block l - 1's group's scale. A LoRA job forms no gradient of its
// frozen base: the activations' gradients flow through the frozen weights,
// and each adapter adds its weights' gradients and its share of dx
// (transformer_adapters.cc). With qk_norm, the per-head norms' backward
// runs after RoPE's, in place on dq and dk, from the rows the forward saved
// before the norm; their weights' gradients accumulate as the other norms'
// do. With sandwich norms each branch's output norm runs back first (into
// d_branch), and the embedding's gradient carries x_0's scale; a learned
// position table's is the sum over the batch of dL/dx_0.
#include "common/status_macros.h"
#include "server/engine/model/transformer/lora.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;
constexpr bool kGrads = true;
constexpr bool kValues = false;
constexpr bool kToStack = false;
constexpr bool kToParams = true;

absl::Status TransformerModel::ProjectionWeightGrad(const Tensor& x, const Tensor& dy, float beta,
                                                    Tensor& weight_grad, Tensor* bias_grad) {
  kernels::Backend& b = backend_;
  if (parts_.layout == WeightLayout::kConv1D) {
    // dW (in, out) = x^T dy; dy is the GEMM's b, the bias gradient its
    // column sums.
    if (bias_grad == nullptr) return b.Gemm(true, false, 1.0f, x, dy, beta, weight_grad);
    return b.GemmBiasGrad(true, false, x, dy, beta, weight_grad, kernels::BiasGradOf::kB,
                          *bias_grad);
  }
  // dW (out, in) = dy^T x; dy is the GEMM's a.
  if (bias_grad == nullptr) return b.Gemm(true, false, 1.0f, dy, x, beta, weight_grad);
  return b.GemmBiasGrad(true, false, dy, x, beta, weight_grad, kernels::BiasGradOf::kA, *bias_grad);
}

absl::Status TransformerModel::ProjectionInputGrad(const Tensor& dy, const Tensor& weight,
                                                   float beta, Tensor& dx) {
  // Linear: dx = dy W; Conv1D: dx = dy W^T.
  const bool transpose = parts_.layout == WeightLayout::kConv1D;
  return backend_.Gemm(false, transpose, 1.0f, dy, weight, beta, dx);
}

absl::StatusOr<const Tensor*> TransformerModel::OutputBackward(TransformerWorkspace& ws,
                                                               const Tensor& pre_norm, int out_norm,
                                                               const Tensor& rstd, const Tensor& x,
                                                               int weight, int bias, float beta) {
  const Tensor* dy = &ws.d_res;
  if (parts_.sandwich_norms) {
    // RMSNorm only (no mean): the sandwich norms are Gemma's.
    AMPD_RETURN_IF_ERROR(NormBackward(pre_norm, {out_norm}, rstd, rstd, ws.d_res, ws.d_branch));
    dy = &ws.d_branch;
  }
  if (!lora()) {
    AMPD_RETURN_IF_ERROR(
        ProjectionWeightGrad(x, *dy, beta, Grad(weight), bias >= 0 ? &Grad(bias) : nullptr));
  }
  return dy;
}

// Block l's MLP branch: d_res (dL/dx_{l+1}) gains the branch's norm's dx;
// the branch's weight gradients with `beta`.
absl::Status TransformerModel::BackwardMlp(TransformerWorkspace& ws, size_t l, float beta) {
  kernels::Backend& b = backend_;
  const BlockParams& p = blocks_[l];
  TransformerWorkspace::Block& sv = ws.blocks[l];
  const bool frozen = lora();
  const TransformerParts& s = parts_;
  // d_res = dL/dx_{l+1}, dm = dL/d(down's output).
  AMPD_ASSIGN_OR_RETURN(
      const Tensor* dm_ptr,
      OutputBackward(ws, sv.mlp_o, p.mlp_out_norm, sv.rstd_mo, sv.act, p.down, p.down_bias, beta));
  const Tensor& dm = *dm_ptr;
  if (!s.gated()) {
    // d_gate = (dm W_d^T) * gelu_tanh'(c_fc's output): the derivative in
    // the GEMM's epilogue, on its fp32 sums.
    AMPD_RETURN_IF_ERROR(
        b.GemmActivationBackward(false, s.layout == WeightLayout::kConv1D, 1.0f, dm, Value(p.down),
                                 kernels::GemmActivation::kGELUTanh, &sv.gate, ws.d_gate));
    if (!frozen) {
      AMPD_RETURN_IF_ERROR(ProjectionWeightGrad(sv.ln_2, ws.d_gate, beta, Grad(p.up),
                                                p.up_bias >= 0 ? &Grad(p.up_bias) : nullptr));
    }
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(ws.d_gate, Value(p.up), 0.0f, ws.d_ln));
  } else {
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(dm, Value(p.down), 0.0f, ws.d_act));
    if (p.lora[kDown].present()) {
      AMPD_RETURN_IF_ERROR(
          AdapterBackward(p.lora[kDown], ws, sv.act, sv.lora_u[kDown - kO], dm, beta, ws.d_act));
    }
    AMPD_RETURN_IF_ERROR(b.GatedMulBackward(s.gate, sv.gate, sv.up, ws.d_act, ws.d_gate, ws.d_up));
    if (!frozen) {
      AMPD_RETURN_IF_ERROR(ProjectionWeightGrad(sv.ln_2, ws.d_gate, beta, Grad(p.gate), nullptr));
      AMPD_RETURN_IF_ERROR(ProjectionWeightGrad(sv.ln_2, ws.d_up, beta, Grad(p.up),
                                                p.up_bias >= 0 ? &Grad(p.up_bias) : nullptr));
    }
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(ws.d_gate, Value(p.gate), 0.0f, ws.d_ln));
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(ws.d_up, Value(p.up), 1.0f, ws.d_ln));
    if (p.lora[kGate].present()) {
      AMPD_RETURN_IF_ERROR(AdapterBackward(p.lora[kGate], ws, sv.ln_2, sv.lora_u[kGate - kO],
                                           ws.d_gate, beta, ws.d_ln));
    }
    if (p.lora[kUp].present()) {
      AMPD_RETURN_IF_ERROR(
          AdapterBackward(p.lora[kUp], ws, sv.ln_2, sv.lora_u[kUp - kO], ws.d_up, beta, ws.d_ln));
    }
  }
  AMPD_RETURN_IF_ERROR(
      NormBackward(sv.resid, p.post_norm, sv.mean_2, sv.rstd_2, ws.d_ln, ws.d_tmp));
  return b.Add(ws.d_tmp, ws.d_res);
}

// Block l's attention branch: from d_res (dL/dr_l) to the input norm's dx
// in d_tmp; a stacked q|k|v gradient copied into the three parameters'.
absl::Status TransformerModel::BackwardAttention(TransformerWorkspace& ws, size_t l,
                                                 bool first_micro_batch, float beta) {
  kernels::Backend& b = backend_;
  const BlockParams& p = blocks_[l];
  TransformerWorkspace::Block& sv = ws.blocks[l];
  const TransformerParts& s = parts_;
  const bool frozen = lora();
  // d_res = dL/dr_l, d_o = dL/d(o's output).
  AMPD_ASSIGN_OR_RETURN(const Tensor* d_o_ptr,
                        OutputBackward(ws, sv.attn_o, p.attn_out_norm, sv.rstd_ao, sv.attn_y,
                                       p.o_weight, p.o_bias, beta));
  const Tensor& d_o = *d_o_ptr;
  AMPD_RETURN_IF_ERROR(ProjectionInputGrad(d_o, Value(p.o_weight), 0.0f, ws.d_attn));
  if (p.lora[kO].present()) {
    AMPD_RETURN_IF_ERROR(
        AdapterBackward(p.lora[kO], ws, sv.attn_y, sv.lora_u[kO - kO], d_o, beta, ws.d_attn));
  }
  const Tensor& attention_in = sv.attention_input();
  AMPD_ASSIGN_OR_RETURN(const Tensor fused,
                        attention_in.View(0, {ws.batch, ws.seq, attention_in.dim(1)}));
  AMPD_ASSIGN_OR_RETURN(const Tensor attn_y,
                        sv.attn_y.View(0, {ws.batch, ws.seq, sv.attn_y.dim(1)}));
  AMPD_ASSIGN_OR_RETURN(const Tensor d_attn,
                        ws.d_attn.View(0, {ws.batch, ws.seq, ws.d_attn.dim(1)}));
  AMPD_ASSIGN_OR_RETURN(Tensor d_qkv, ws.d_qkv.View(0, {ws.batch, ws.seq, ws.d_qkv.dim(1)}));
  const kernels::AttentionOptions options = AttentionOptionsOf(l);
  if (ws.d_qkv_x.empty()) {
    AMPD_RETURN_IF_ERROR(
        b.AttentionBackward(fused, attn_y, d_attn, sv.lse, s.heads, options, d_qkv));
  } else {
    AMPD_ASSIGN_OR_RETURN(Tensor d_expanded,
                          ws.d_qkv_x.View(0, {ws.batch, ws.seq, ws.d_qkv_x.dim(1)}));
    AMPD_RETURN_IF_ERROR(
        b.AttentionBackward(fused, attn_y, d_attn, sv.lse, s.heads, options, d_expanded));
    AMPD_RETURN_IF_ERROR(b.ReduceKvHeads(d_expanded, s.heads, s.kv_heads, d_qkv));
  }
  if (!s.learned_positions()) {
    // RoPE is a rotation: its backward is the inverse rotation of dq, dk.
    AMPD_RETURN_IF_ERROR(b.Rope(d_qkv, s.heads + s.kv_heads, s.head_dim,
                                InvFreqOf(l, ws.inv_freq, ws.inv_freq_local),
                                /*positions=*/nullptr, true));
  }
  AMPD_RETURN_IF_ERROR(QkNormBackward(p, sv, ws.d_qkv));
  if (s.fused_qkv) {
    // One parameter: its gradient directly, as every other projection's.
    if (!frozen) {
      AMPD_RETURN_IF_ERROR(ProjectionWeightGrad(sv.ln_1, ws.d_qkv, beta, Grad(p.q_weight),
                                                p.q_bias >= 0 ? &Grad(p.q_bias) : nullptr));
    }
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(ws.d_qkv, Value(p.q_weight), 0.0f, ws.d_ln));
  } else {
    // The stacked projection's gradient: later micro-batches start from
    // the parameters' gradients so that the GEMM's beta = 1 sum rounds
    // each element once, as every other weight gradient is.
    Tensor* qkv_bias_grad = ws.db_qkv.empty() ? nullptr : &ws.db_qkv;
    if (!frozen) {
      if (!first_micro_batch) {
        AMPD_RETURN_IF_ERROR(CopyQkv(p, kGrads, kToStack, ws.dw_qkv, qkv_bias_grad));
      }
      AMPD_RETURN_IF_ERROR(ProjectionWeightGrad(sv.ln_1, ws.d_qkv, beta, ws.dw_qkv, qkv_bias_grad));
      AMPD_RETURN_IF_ERROR(CopyQkv(p, kGrads, kToParams, ws.dw_qkv, qkv_bias_grad));
    }
    AMPD_RETURN_IF_ERROR(CopyQkv(p, kValues, kToStack, ws.stack.w, nullptr));
    AMPD_RETURN_IF_ERROR(ProjectionInputGrad(ws.d_qkv, ws.stack.w, 0.0f, ws.d_ln));
  }
  if (!qkv_targets_.empty()) {
    // The stacked adapters as forward saw them for this block, their
    // gradients accumulated as the stacked weight's are.
    AMPD_RETURN_IF_ERROR(StackQkvAdapters(p, ws.stack));
    if (!first_micro_batch) AMPD_RETURN_IF_ERROR(CopyQkvAdapterGrads(p, kToStack, ws));
    AMPD_ASSIGN_OR_RETURN(Tensor du, ws.lora_du.View(0, sv.lora_u_qkv.shape()));
    AMPD_RETURN_IF_ERROR(LoraBackward(b, lora_scale_, sv.ln_1, sv.lora_u_qkv, ws.d_qkv,
                                      ws.stack.lora_a, ws.stack.lora_b, beta, du, ws.lora_da_qkv,
                                      ws.lora_db_qkv, ws.d_ln));
    AMPD_RETURN_IF_ERROR(CopyQkvAdapterGrads(p, kToParams, ws));
  }
  return NormBackward(ws.x[l], p.input_norm, sv.mean_1, sv.rstd_1, ws.d_ln, ws.d_tmp);
}

absl::Status TransformerModel::QkNormBackward(const BlockParams& p, const BlockBuffers& sv,
                                              Tensor& d_qkv) {
  if (p.q_norm < 0) return absl::OkStatus();
  kernels::Backend& b = backend_;
  const TransformerParts& s = parts_;
  AMPD_RETURN_IF_ERROR(b.HeadRmsNormBackward(sv.qkv_pre, 0, s.heads, Value(p.q_norm), s.norm_offset,
                                             sv.rstd_q, d_qkv, d_qkv, GradOrNull(p.q_norm)));
  return b.HeadRmsNormBackward(sv.qkv_pre, s.q_width(), s.kv_heads, Value(p.k_norm), s.norm_offset,
                               sv.rstd_k, d_qkv, d_qkv, GradOrNull(p.k_norm));
}

absl::Status TransformerModel::Backward(Workspace& any, bool first_micro_batch,
                                        const BackwardHooks& hooks) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * own, Own<TransformerWorkspace>(any));
  TransformerWorkspace& ws = *own;
  kernels::Backend& b = backend_;
  const float beta = first_micro_batch ? 0.0f : 1.0f;
  const GradsReady& ready = hooks.grads_ready;
  // (N, C) dh, the loss gradient, enters the last group.
  if (hooks.group_entry) {
    AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_.back(), ws.d_ln));
  }

  // The final norm: d_res = dL/dx_L.
  AMPD_RETURN_IF_ERROR(NormBackward(ws.x.back(), norm_, ws.mean_f, ws.rstd_f, ws.d_ln, ws.d_res));
  // The final norm is done, and an untied LM head (its gradient came from
  // Loss); a tied head's is the embedding's, done only after its backward.
  if (ready) {
    std::vector<int> done;
    for (const int index : {norm_.weight, norm_.bias, lm_head_}) {
      if (index >= 0) done.push_back(index);
    }
    AMPD_RETURN_IF_ERROR(ready(done));
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    const BlockParams& p = blocks_[l];
    AMPD_RETURN_IF_ERROR(BackwardMlp(ws, l, beta));
    AMPD_RETURN_IF_ERROR(BackwardAttention(ws, l, first_micro_batch, beta));
    // d_res = dL/dx_l, at block l - 1's scale from here on: its group's
    // entry when block l - 1 starts a new one.
    AMPD_RETURN_IF_ERROR(b.AddScaled(ws.d_tmp, residual_grad_scale_[l], ws.d_res));
    if (hooks.group_entry && l > 0 && block_group_[l - 1] != block_group_[l]) {
      AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_[l - 1], ws.d_res));
    }
    if (ready) AMPD_RETURN_IF_ERROR(ready(p.All()));
  }
  // d_res = dL/dx_0: scattered into the embedding's rows and, with learned
  // positions, summed over the batch into the table's first T rows (both
  // accumulate; ZeroGrads cleared them). A frozen embedding needs nothing.
  if (!lora()) {
    AMPD_RETURN_IF_ERROR(b.EmbeddingBackward(ws.ids, ws.d_res, embed_scale_, Grad(embed_)));
    if (positions_ >= 0) {
      const int64_t c = parts_.hidden;
      AMPD_ASSIGN_OR_RETURN(const Tensor d_rows, ws.d_res.View(0, {ws.batch, ws.seq * c}));
      AMPD_ASSIGN_OR_RETURN(Tensor d_positions, Grad(positions_).View(0, {ws.seq * c}));
      AMPD_RETURN_IF_ERROR(b.BiasGrad(d_rows, 1.0f, d_positions));
    }
  }
  if (ready) {
    std::vector<int> done = {embed_};
    if (positions_ >= 0) done.push_back(positions_);
    AMPD_RETURN_IF_ERROR(ready(done));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
