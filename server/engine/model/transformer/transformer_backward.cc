// TransformerModel::Backward: from dh (ws.d_ln, written by Loss) back through
// the final RMSNorm, the blocks in reverse and the embedding. d_res carries
// the residual stream's gradient; each branch adds its RMSNorm's dx into
// it. Linear weights W (out, in) with y = x W^T: dW = dy^T x (beta 0 on the
// first micro-batch, 1 after; the bias gradient in the same GEMM), dx = dy
// W. The stacked q|k|v weight's gradient is formed in the workspace and
// copied into the three parameters' (transformer_model.h). With per-layer
// scales, block l's last residual add also moves d_res to block l - 1's
// group's scale, as the GPT's does. A LoRA job forms no gradient of its
// frozen base: the activations' gradients flow through the frozen weights,
// and each adapter adds its weights' gradients and its share of dx
// (transformer_adapters.cc). With qk_norm, the per-head norms' backward runs
// after RoPE's, in place on dq and dk, from the rows the forward saved
// before the norm; their weights' gradients accumulate as the other
// RMSNorms' do. With sandwich norms each branch's output norm runs back
// first (into d_branch), and the embedding's gradient carries x_0's scale.
#include "common/status_macros.h"
#include "server/engine/model/transformer/lora.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;
// dy is the GEMM's a (dW = dy^T x): the bias gradient sums it over rows.
constexpr kernels::BiasGradOf kOfA = kernels::BiasGradOf::kA;
constexpr bool kGrads = true;
constexpr bool kValues = false;
constexpr bool kToStack = false;
constexpr bool kToParams = true;

// Block l's MLP branch: d_res (dL/dx_{l+1}) gains the branch's RMSNorm
// dx; the branch's weight gradients with `beta`.
absl::Status TransformerModel::BackwardMlp(TransformerWorkspace& ws, size_t l, float beta) {
  kernels::Backend& b = backend_;
  std::vector<Parameter>& ps = params();
  auto value = [&ps](int index) -> const Tensor& { return ps[index].value(); };
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const BlockParams& p = blocks_[l];
  TransformerWorkspace::Block& sv = ws.blocks[l];
  const bool frozen = lora();
  const DecoderSpec& s = decoder();
  // MLP branch; d_res = dL/dx_{l+1}, dm = dL/d(down's output).
  if (s.sandwich_norms) {
    AMPD_RETURN_IF_ERROR(NormBackward(sv.mlp_o, p.mlp_out_norm, sv.rstd_mo, ws.d_res, ws.d_branch));
  }
  const Tensor& dm = s.sandwich_norms ? ws.d_branch : ws.d_res;
  if (!frozen) {
    AMPD_RETURN_IF_ERROR(b.Gemm(true, false, 1.0f, dm, sv.act, beta, grad(p.down)));
  }
  AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, dm, value(p.down), 0.0f, ws.d_act));
  if (p.lora[kDown].present()) {
    AMPD_RETURN_IF_ERROR(
        AdapterBackward(p.lora[kDown], ws, sv.act, sv.lora_u[kDown - kO], dm, beta, ws.d_act));
  }
  AMPD_RETURN_IF_ERROR(b.GatedMulBackward(GateOf(s), sv.gate, sv.up, ws.d_act, ws.d_gate, ws.d_up));
  if (!frozen) {
    AMPD_RETURN_IF_ERROR(b.Gemm(true, false, 1.0f, ws.d_gate, sv.ln_2, beta, grad(p.gate)));
    AMPD_RETURN_IF_ERROR(b.Gemm(true, false, 1.0f, ws.d_up, sv.ln_2, beta, grad(p.up)));
  }
  AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, ws.d_gate, value(p.gate), 0.0f, ws.d_ln));
  AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, ws.d_up, value(p.up), 1.0f, ws.d_ln));
  if (p.lora[kGate].present()) {
    AMPD_RETURN_IF_ERROR(AdapterBackward(p.lora[kGate], ws, sv.ln_2, sv.lora_u[kGate - kO],
                                         ws.d_gate, beta, ws.d_ln));
  }
  if (p.lora[kUp].present()) {
    AMPD_RETURN_IF_ERROR(
        AdapterBackward(p.lora[kUp], ws, sv.ln_2, sv.lora_u[kUp - kO], ws.d_up, beta, ws.d_ln));
  }
  AMPD_RETURN_IF_ERROR(NormBackward(sv.resid, p.post_norm, sv.rstd_2, ws.d_ln, ws.d_tmp));
  AMPD_RETURN_IF_ERROR(b.Add(ws.d_tmp, ws.d_res));
  return absl::OkStatus();
}

// Block l's attention branch: from d_res (dL/dr_l) to input_norm's dx in
// d_tmp, the stacked q|k|v gradient copied into the three parameters'.
absl::Status TransformerModel::BackwardAttention(TransformerWorkspace& ws, size_t l, bool first_micro_batch,
                                             float beta) {
  kernels::Backend& b = backend_;
  std::vector<Parameter>& ps = params();
  auto value = [&ps](int index) -> const Tensor& { return ps[index].value(); };
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const BlockParams& p = blocks_[l];
  TransformerWorkspace::Block& sv = ws.blocks[l];
  const DecoderSpec& s = decoder();
  const int64_t heads = s.num_attention_heads;
  const int64_t kv_heads = s.num_key_value_heads;
  const int64_t head_dim = DecoderHeadDim(s);
  Tensor* qkv_bias_grad = ws.db_qkv.empty() ? nullptr : &ws.db_qkv;
  const bool frozen = lora();
  // Attention branch; d_res = dL/dr_l, d_o = dL/d(o_proj's output).
  if (s.sandwich_norms) {
    AMPD_RETURN_IF_ERROR(
        NormBackward(sv.attn_o, p.attn_out_norm, sv.rstd_ao, ws.d_res, ws.d_branch));
  }
  const Tensor& d_o = s.sandwich_norms ? ws.d_branch : ws.d_res;
  if (frozen) {
    // No weight gradient of the frozen o_proj.
  } else if (p.o_bias >= 0) {
    AMPD_RETURN_IF_ERROR(
        b.GemmBiasGrad(true, false, d_o, sv.attn_y, beta, grad(p.o_weight), kOfA, grad(p.o_bias)));
  } else {
    AMPD_RETURN_IF_ERROR(b.Gemm(true, false, 1.0f, d_o, sv.attn_y, beta, grad(p.o_weight)));
  }
  AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, d_o, value(p.o_weight), 0.0f, ws.d_attn));
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
    AMPD_RETURN_IF_ERROR(b.AttentionBackward(fused, attn_y, d_attn, sv.lse, heads, options, d_qkv));
  } else {
    AMPD_ASSIGN_OR_RETURN(Tensor d_expanded,
                          ws.d_qkv_x.View(0, {ws.batch, ws.seq, ws.d_qkv_x.dim(1)}));
    AMPD_RETURN_IF_ERROR(
        b.AttentionBackward(fused, attn_y, d_attn, sv.lse, heads, options, d_expanded));
    AMPD_RETURN_IF_ERROR(b.ReduceKvHeads(d_expanded, heads, kv_heads, d_qkv));
  }
  // RoPE is a rotation: its backward is the inverse rotation of dq, dk.
  AMPD_RETURN_IF_ERROR(b.Rope(d_qkv, heads + kv_heads, head_dim,
                              InvFreqOf(l, ws.inv_freq, ws.inv_freq_local), /*positions=*/nullptr,
                              true));
  AMPD_RETURN_IF_ERROR(QkNormBackward(p, sv, ws.d_qkv));
  // The stacked projection's gradient: later micro-batches start from
  // the parameters' gradients so that the GEMM's beta = 1 sum rounds
  // each element once, as every other weight gradient is.
  if (!frozen && !first_micro_batch) {
    AMPD_RETURN_IF_ERROR(CopyQkv(p, kGrads, kToStack, ws.dw_qkv, qkv_bias_grad));
  }
  if (frozen) {
    // No weight gradient of the frozen q, k, v.
  } else if (qkv_bias_grad != nullptr) {
    AMPD_RETURN_IF_ERROR(
        b.GemmBiasGrad(true, false, ws.d_qkv, sv.ln_1, beta, ws.dw_qkv, kOfA, ws.db_qkv));
  } else {
    AMPD_RETURN_IF_ERROR(b.Gemm(true, false, 1.0f, ws.d_qkv, sv.ln_1, beta, ws.dw_qkv));
  }
  if (!frozen) AMPD_RETURN_IF_ERROR(CopyQkv(p, kGrads, kToParams, ws.dw_qkv, qkv_bias_grad));
  AMPD_RETURN_IF_ERROR(CopyQkv(p, kValues, kToStack, ws.stack.w, nullptr));
  AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, ws.d_qkv, ws.stack.w, 0.0f, ws.d_ln));
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
  AMPD_RETURN_IF_ERROR(NormBackward(ws.x[l], p.input_norm, sv.rstd_1, ws.d_ln, ws.d_tmp));
  return absl::OkStatus();
}

absl::Status TransformerModel::QkNormBackward(const BlockParams& p, const BlockBuffers& sv,
                                          Tensor& d_qkv) {
  if (p.q_norm < 0) return absl::OkStatus();
  kernels::Backend& b = backend_;
  const DecoderSpec& s = decoder();
  const DecoderWidths wd(s);
  const float offset = DecoderNormOffset(s);
  AMPD_RETURN_IF_ERROR(b.HeadRmsNormBackward(sv.qkv_pre, 0, s.num_attention_heads,
                                             params()[p.q_norm].value(), offset, sv.rstd_q, d_qkv,
                                             d_qkv, GradOrNull(p.q_norm)));
  return b.HeadRmsNormBackward(sv.qkv_pre, wd.q, s.num_key_value_heads, params()[p.k_norm].value(),
                               offset, sv.rstd_k, d_qkv, d_qkv, GradOrNull(p.k_norm));
}

absl::Status TransformerModel::Backward(Workspace& any, bool first_micro_batch,
                                    const BackwardHooks& hooks) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * own, Own<TransformerWorkspace>(any));
  TransformerWorkspace& ws = *own;
  kernels::Backend& b = backend_;
  const float beta = first_micro_batch ? 0.0f : 1.0f;
  std::vector<Parameter>& ps = params();
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const GradsReady& ready = hooks.grads_ready;
  if (hooks.group_entry) {
    AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_.back(), ws.d_ln));
  }

  // The final norm: d_res = dL/dx_L.
  AMPD_RETURN_IF_ERROR(NormBackward(ws.x.back(), norm_, ws.rstd_f, ws.d_ln, ws.d_res));
  if (ready) {
    const int done[2] = {norm_, lm_head_};
    AMPD_RETURN_IF_ERROR(ready(absl::MakeConstSpan(done, lm_head_ >= 0 ? 2 : 1)));
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    const BlockParams& p = blocks_[l];
    AMPD_RETURN_IF_ERROR(BackwardMlp(ws, l, beta));
    AMPD_RETURN_IF_ERROR(BackwardAttention(ws, l, first_micro_batch, beta));
    AMPD_RETURN_IF_ERROR(b.AddScaled(ws.d_tmp, residual_grad_scale_[l], ws.d_res));
    if (hooks.group_entry && l > 0 && block_group_[l - 1] != block_group_[l]) {
      AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_[l - 1], ws.d_res));
    }
    if (ready) AMPD_RETURN_IF_ERROR(ready(p.All()));
  }
  // A frozen embedding needs nothing of d_res.
  if (!lora()) {
    AMPD_RETURN_IF_ERROR(b.EmbeddingBackward(ws.ids, ws.d_res, embed_scale_, grad(embed_)));
  }
  if (ready) {
    const int done[1] = {embed_};
    AMPD_RETURN_IF_ERROR(ready(done));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
