// TransformerModel::Forward: the embeddings, the blocks and the final norm,
// saving what the backward pass reads (transformer_workspace.h). Each
// projection is one GEMM in its layout (Linear's (out, in) transposed,
// Conv1D's (in, out) not) with its bias, and the GELU MLP's GELU, in the
// epilogue; the q|k|v projection is one GEMM over GPT-2's fused parameter
// or the decoders' stacked weight (transformer_model.h). RoPE rotates the
// q and k heads in place, and grouped K/V heads are expanded so that the
// fused causal attention runs unchanged. The LM head runs in Loss
// (transformer_lm_head.cc), fused with the cross-entropy. A LoRA job's
// adapters add their terms to their projections' outputs
// (transformer_adapters.cc), before the q/k norm, RoPE, the residual adds
// and the gated product. With qk_norm (Qwen3) each q and k head of the
// fused rows is RMSNorm-ed in place before RoPE, by one call per weight.
//
// The order is Hugging Face's (Qwen3Attention.forward): q_norm(q_proj(x))
// then RoPE; the norm computes in fp32 and rounds once (HF rounds x *
// rstd to the dtype before the weight multiply: the same in fp32).
//
// Gemma 3's parts: every RMSNorm by 1 + w (Norm), the GeGLU gate, the
// sandwich norms on the attention's and the MLP's outputs before their
// residual adds, x_0 scaled by sqrt(hidden_size), and each layer's
// attention options and RoPE frequencies (a sliding layer's window and
// local base).
//
// BlockForward is one block's code, shared by Forward and the sampler's
// decode step (transformer_sampling.cc): only the attention differs (over
// the whole sequence here, over the KV cache there), and where the stacked
// q|k|v weight comes from: Forward copies each block's into the
// workspace's one stack (the weights change between steps), a decode step
// reads its state's per-block stacks, filled once at Prefill.
#include "common/status_macros.h"
#include "server/engine/model/transformer/lora.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;
constexpr kernels::GemmActivation kNone = kernels::GemmActivation::kNone;
constexpr kernels::GemmActivation kGELUTanh = kernels::GemmActivation::kGELUTanh;

absl::Status TransformerModel::Project(const Tensor& x, const Tensor& weight, const Tensor* bias,
                                       kernels::GemmActivation act, Tensor& y, Tensor* pre_act) {
  // Linear: y = x W^T; Conv1D: y = x W.
  const bool transpose = parts_.layout == WeightLayout::kLinear;
  return backend_.GemmBiasActivation(false, transpose, x, weight, bias, act, y, pre_act);
}

absl::Status TransformerModel::QkvForward(const BlockParams& p, BlockBuffers& sv, QkvStack& stack,
                                          bool restack) {
  if (parts_.fused_qkv) {
    return Project(sv.ln_1, Value(p.q_weight), ValueOrNull(p.q_bias), kNone, sv.qkv, nullptr);
  }
  Tensor* qkv_bias = stack.b.empty() ? nullptr : &stack.b;
  if (restack) {
    AMPD_RETURN_IF_ERROR(CopyQkv(p, /*grads=*/false, /*to_params=*/false, stack.w, qkv_bias));
  }
  AMPD_RETURN_IF_ERROR(Project(sv.ln_1, stack.w, qkv_bias, kNone, sv.qkv, nullptr));
  if (qkv_targets_.empty()) return absl::OkStatus();
  if (restack) AMPD_RETURN_IF_ERROR(StackQkvAdapters(p, stack));
  return LoraForward(backend_, lora_scale_, sv.ln_1, stack.lora_a, stack.lora_b, sv.lora_u_qkv,
                     sv.qkv);
}

absl::Status TransformerModel::BlockForward(size_t l, const Tensor& x, BlockBuffers& sv,
                                            QkvStack& stack, bool restack, const Attend& attend,
                                            Tensor& x_next) {
  kernels::Backend& b = backend_;
  const TransformerParts& s = parts_;
  const BlockParams& p = blocks_[l];
  // Attention branch: r_l = x_l + o(attention(positions(qkv(norm(x_l))))),
  // o's output normed first with sandwich norms.
  AMPD_RETURN_IF_ERROR(Norm(x, p.input_norm, sv.ln_1, sv.mean_1, sv.rstd_1));
  AMPD_RETURN_IF_ERROR(QkvForward(p, sv, stack, restack));
  AMPD_RETURN_IF_ERROR(QkNormForward(p, sv));
  AMPD_RETURN_IF_ERROR(attend(l, sv));
  Tensor& o = s.sandwich_norms ? sv.attn_o : sv.resid;
  AMPD_RETURN_IF_ERROR(
      Project(sv.attn_y, Value(p.o_weight), ValueOrNull(p.o_bias), kNone, o, nullptr));
  if (p.lora[kO].present()) {
    AMPD_RETURN_IF_ERROR(AdapterForward(p.lora[kO], sv.attn_y, sv.lora_u[kO - kO], o));
  }
  if (s.sandwich_norms) {
    AMPD_RETURN_IF_ERROR(Norm(sv.attn_o, {p.attn_out_norm}, sv.resid, sv.mean_2, sv.rstd_ao));
  }
  AMPD_RETURN_IF_ERROR(b.Add(x, sv.resid));
  // MLP branch from m = norm(r_l), its output normed first with sandwich
  // norms: x_{l+1} = r_l + down(act(gate(m)) * up(m)), or r_l +
  // down(gelu_tanh(up(m))) whose GELU (and its input, the backward's) comes
  // from up's GEMM epilogue on the fp32 sums.
  AMPD_RETURN_IF_ERROR(Norm(sv.resid, p.post_norm, sv.ln_2, sv.mean_2, sv.rstd_2));
  if (s.gated()) {
    AMPD_RETURN_IF_ERROR(Project(sv.ln_2, Value(p.gate), nullptr, kNone, sv.gate, nullptr));
    AMPD_RETURN_IF_ERROR(
        Project(sv.ln_2, Value(p.up), ValueOrNull(p.up_bias), kNone, sv.up, nullptr));
    if (p.lora[kGate].present()) {
      AMPD_RETURN_IF_ERROR(AdapterForward(p.lora[kGate], sv.ln_2, sv.lora_u[kGate - kO], sv.gate));
    }
    if (p.lora[kUp].present()) {
      AMPD_RETURN_IF_ERROR(AdapterForward(p.lora[kUp], sv.ln_2, sv.lora_u[kUp - kO], sv.up));
    }
    AMPD_RETURN_IF_ERROR(b.GatedMulForward(s.gate, sv.gate, sv.up, sv.act));
  } else {
    AMPD_RETURN_IF_ERROR(
        Project(sv.ln_2, Value(p.up), ValueOrNull(p.up_bias), kGELUTanh, sv.act, &sv.gate));
  }
  Tensor& m = s.sandwich_norms ? sv.mlp_o : x_next;
  AMPD_RETURN_IF_ERROR(Project(sv.act, Value(p.down), ValueOrNull(p.down_bias), kNone, m, nullptr));
  if (p.lora[kDown].present()) {
    AMPD_RETURN_IF_ERROR(AdapterForward(p.lora[kDown], sv.act, sv.lora_u[kDown - kO], m));
  }
  if (s.sandwich_norms) {
    AMPD_RETURN_IF_ERROR(Norm(sv.mlp_o, {p.mlp_out_norm}, x_next, sv.mean_2, sv.rstd_mo));
  }
  return b.Add(sv.resid, x_next);
}

absl::Status TransformerModel::QkNormForward(const BlockParams& p, BlockBuffers& sv) {
  if (p.q_norm < 0) return absl::OkStatus();
  kernels::Backend& b = backend_;
  const TransformerParts& s = parts_;
  if (!sv.qkv_pre.empty()) AMPD_RETURN_IF_ERROR(b.Copy(sv.qkv, sv.qkv_pre));
  // The q heads open each row, the k heads follow from column Q.
  AMPD_RETURN_IF_ERROR(b.HeadRmsNormForward(sv.qkv, 0, s.heads, Value(p.q_norm), s.norm_eps,
                                            s.norm_offset, sv.qkv, sv.rstd_q));
  return b.HeadRmsNormForward(sv.qkv, s.q_width(), s.kv_heads, Value(p.k_norm), s.norm_eps,
                              s.norm_offset, sv.qkv, sv.rstd_k);
}

absl::Status TransformerModel::Forward(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * own, Own<TransformerWorkspace>(any));
  TransformerWorkspace& ws = *own;
  kernels::Backend& b = backend_;
  const TransformerParts& s = parts_;
  // The whole sequence's causal attention, its log-sum-exp saved.
  const Attend attend = [&](size_t l, BlockBuffers& sv) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(Tensor qkv, sv.qkv.View(0, {ws.batch, ws.seq, sv.qkv.dim(1)}));
    if (!s.learned_positions()) {
      // The q heads and then the k heads open each row: one call rotates both.
      AMPD_RETURN_IF_ERROR(b.Rope(qkv, s.heads + s.kv_heads, s.head_dim,
                                  InvFreqOf(l, ws.inv_freq, ws.inv_freq_local),
                                  /*positions=*/nullptr, false));
    }
    if (!sv.qkv_x.empty()) {
      AMPD_ASSIGN_OR_RETURN(Tensor expanded, sv.qkv_x.View(0, {ws.batch, ws.seq, sv.qkv_x.dim(1)}));
      AMPD_RETURN_IF_ERROR(b.ExpandKvHeads(qkv, s.heads, s.kv_heads, expanded));
    }
    const Tensor& attention_in = sv.attention_input();
    AMPD_ASSIGN_OR_RETURN(const Tensor fused,
                          attention_in.View(0, {ws.batch, ws.seq, attention_in.dim(1)}));
    AMPD_ASSIGN_OR_RETURN(Tensor attn_y, sv.attn_y.View(0, {ws.batch, ws.seq, sv.attn_y.dim(1)}));
    return b.AttentionForward(fused, s.heads, AttentionOptionsOf(l), attn_y, sv.lse);
  };
  AMPD_RETURN_IF_ERROR(b.EmbeddingForward(ws.ids, Value(embed_), embed_scale_, ws.x[0]));
  if (positions_ >= 0) {
    // + the position table's first T rows, broadcast over the batch as one
    // bias of T*C over (B, T*C).
    AMPD_ASSIGN_OR_RETURN(const Tensor rows, Value(positions_).View(0, {ws.seq * s.hidden}));
    AMPD_ASSIGN_OR_RETURN(Tensor x0_rows, ws.x[0].View(0, {ws.batch, ws.seq * s.hidden}));
    AMPD_RETURN_IF_ERROR(b.AddBias(rows, x0_rows));
  }
  for (size_t l = 0; l < blocks_.size(); ++l) {
    AMPD_RETURN_IF_ERROR(
        BlockForward(l, ws.x[l], ws.blocks[l], ws.stack, /*restack=*/true, attend, ws.x[l + 1]));
  }
  return Norm(ws.x.back(), norm_, ws.ln_f, ws.mean_f, ws.rstd_f);
}

}  // namespace ampd::engine::model
