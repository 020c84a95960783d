// GptModel::Forward: embeddings, the blocks and the final LayerNorm,
// saving what the backward pass reads (gpt_workspace.h). Each Conv1D is one
// GEMM with its bias (and c_fc's GELU) in the epilogue. The LM head runs
// in Loss (gpt_lm_head.cc), fused with the cross-entropy.
//
// BlockForward is one block's code, shared by Forward and the sampler's
// decode step (gpt_sampling.cc): only the attention differs (over the
// whole sequence here, over the KV cache there).
#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/gpt/gpt_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;
constexpr kernels::GemmActivation kNone = kernels::GemmActivation::kNone;
constexpr kernels::GemmActivation kGELUTanh = kernels::GemmActivation::kGELUTanh;

absl::Status GptModel::BlockForward(size_t l, const Tensor& x, GptBlockBuffers& s,
                                    const Attend& attend, Tensor& x_next) {
  kernels::Backend& b = backend_;
  const float eps = gpt().layer_norm_eps;
  auto value = [this](int index) -> const Tensor& { return params()[index].value(); };
  const BlockParams& p = blocks_[l];
  // Attention branch: r_l = x_l + c_proj(attention(c_attn(ln_1(x_l)))).
  AMPD_RETURN_IF_ERROR(b.LayerNormForward(x, &value(p.ln_1_weight), &value(p.ln_1_bias), eps,
                                          s.ln_1, s.mean_1, s.rstd_1));
  AMPD_RETURN_IF_ERROR(b.GemmBiasActivation(false, false, s.ln_1, value(p.c_attn_weight),
                                            &value(p.c_attn_bias), kNone, s.qkv, nullptr));
  AMPD_RETURN_IF_ERROR(attend(s));
  AMPD_RETURN_IF_ERROR(b.GemmBiasActivation(false, false, s.attn_y, value(p.attn_proj_weight),
                                            &value(p.attn_proj_bias), kNone, s.resid, nullptr));
  AMPD_RETURN_IF_ERROR(b.Add(x, s.resid));
  // MLP branch: x_{l+1} = r_l + c_proj(gelu_tanh(c_fc(ln_2(r_l)))).
  AMPD_RETURN_IF_ERROR(b.LayerNormForward(s.resid, &value(p.ln_2_weight), &value(p.ln_2_bias), eps,
                                          s.ln_2, s.mean_2, s.rstd_2));
  // fc_post = gelu_tanh(fc_pre) and fc_pre itself (the backward's) from
  // one GEMM: bias and GELU in its epilogue, on the fp32 sums.
  AMPD_RETURN_IF_ERROR(b.GemmBiasActivation(false, false, s.ln_2, value(p.c_fc_weight),
                                            &value(p.c_fc_bias), kGELUTanh, s.fc_post, &s.fc_pre));
  AMPD_RETURN_IF_ERROR(b.GemmBiasActivation(false, false, s.fc_post, value(p.mlp_proj_weight),
                                            &value(p.mlp_proj_bias), kNone, x_next, nullptr));
  return b.Add(s.resid, x_next);
}

absl::Status GptModel::Forward(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * own, Own<GptWorkspace>(any));
  GptWorkspace& ws = *own;
  kernels::Backend& b = backend_;
  const GptSpec& g = gpt();
  const int64_t c = g.d_model;
  auto value = [this](int index) -> const Tensor& { return params()[index].value(); };

  // x_0 = wte[ids] + wpe[0..T): the position rows broadcast over the batch
  // as one bias of T*C over (B, T*C).
  AMPD_RETURN_IF_ERROR(b.EmbeddingForward(ws.ids, value(wte_), ws.x[0]));
  AMPD_ASSIGN_OR_RETURN(const Tensor positions, value(wpe_).View(0, {ws.seq * c}));
  AMPD_ASSIGN_OR_RETURN(Tensor x0_rows, ws.x[0].View(0, {ws.batch, ws.seq * c}));
  AMPD_RETURN_IF_ERROR(b.AddBias(positions, x0_rows));

  // The whole sequence's causal attention, its log-sum-exp saved.
  const Attend attend = [&](GptBlockBuffers& s) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(const Tensor qkv, s.qkv.View(0, {ws.batch, ws.seq, 3 * c}));
    AMPD_ASSIGN_OR_RETURN(Tensor attn_y, s.attn_y.View(0, {ws.batch, ws.seq, c}));
    return b.AttentionForward(qkv, g.n_head, attn_y, s.lse);
  };
  for (size_t l = 0; l < blocks_.size(); ++l) {
    AMPD_RETURN_IF_ERROR(BlockForward(l, ws.x[l], ws.blocks[l], attend, ws.x[l + 1]));
  }
  return b.LayerNormForward(ws.x.back(), &value(ln_f_weight_), &value(ln_f_bias_), g.layer_norm_eps,
                            ws.ln_f, ws.mean_f, ws.rstd_f);
}

}  // namespace ampd::engine::model
