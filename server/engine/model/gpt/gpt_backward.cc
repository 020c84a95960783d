// GptModel::Backward: from dh (ws.d_ln, written by Loss) back through ln_f,
// the blocks in reverse and the embeddings. d_res carries the residual
// stream's gradient; each branch adds its LayerNorm's dx into it. Conv1D
// weights W (in, out) with y = x W: dW = x^T dy (beta = 0 on the first
// micro-batch, 1 after) with db in the same GEMM, dx = dy W^T (through
// c_fc's GELU in the GEMM's epilogue). With per-layer scales, block l's
// last residual add also moves d_res to block l - 1's group's scale
// (residual_grad_scale_, gpt_model.h).
#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/gpt/gpt_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;
// Every Conv1D's dy is the GEMM's b: dW = x^T dy, db = column sums of dy.
constexpr kernels::BiasGradOf kOfB = kernels::BiasGradOf::kB;

// Block l's MLP branch: d_res (dL/dx_{l+1}) gains the branch's LayerNorm
// dx; the branch's parameter gradients with `beta`.
absl::Status GptModel::BackwardMlp(GptWorkspace& ws, size_t l, float beta) {
  kernels::Backend& b = backend_;
  std::vector<Parameter>& ps = params();
  auto value = [&ps](int index) -> const Tensor& { return ps[index].value(); };
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const BlockParams& p = blocks_[l];
  GptWorkspace::Block& s = ws.blocks[l];
  // MLP branch; d_res = dL/dx_{l+1}.
  AMPD_RETURN_IF_ERROR(b.GemmBiasGrad(true, false, s.fc_post, ws.d_res, beta,
                                      grad(p.mlp_proj_weight), kOfB, grad(p.mlp_proj_bias)));
  // d_pre = (d_res W^T) * gelu_tanh'(fc_pre): the derivative in the GEMM's
  // epilogue, on its fp32 sums.
  AMPD_RETURN_IF_ERROR(
      b.GemmActivationBackward(false, true, 1.0f, ws.d_res, value(p.mlp_proj_weight),
                               kernels::GemmActivation::kGELUTanh, &s.fc_pre, ws.d_pre));
  AMPD_RETURN_IF_ERROR(b.GemmBiasGrad(true, false, s.ln_2, ws.d_pre, beta, grad(p.c_fc_weight),
                                      kOfB, grad(p.c_fc_bias)));
  AMPD_RETURN_IF_ERROR(b.Gemm(false, true, 1.0f, ws.d_pre, value(p.c_fc_weight), 0.0f, ws.d_ln));
  AMPD_RETURN_IF_ERROR(b.LayerNormBackward(s.resid, &value(p.ln_2_weight), s.mean_2, s.rstd_2,
                                           ws.d_ln, ws.d_tmp, &grad(p.ln_2_weight),
                                           &grad(p.ln_2_bias)));
  AMPD_RETURN_IF_ERROR(b.Add(ws.d_tmp, ws.d_res));
  return absl::OkStatus();
}

// Block l's attention branch: from d_res (dL/dr_l) to ln_1's dx in d_tmp.
absl::Status GptModel::BackwardAttention(GptWorkspace& ws, size_t l, float beta) {
  kernels::Backend& b = backend_;
  std::vector<Parameter>& ps = params();
  auto value = [&ps](int index) -> const Tensor& { return ps[index].value(); };
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const BlockParams& p = blocks_[l];
  GptWorkspace::Block& s = ws.blocks[l];
  const int64_t c = gpt().d_model;
  // Attention branch; d_res = dL/dr_l. d_tmp holds the attention
  // output's gradient until LayerNorm's dx overwrites it.
  AMPD_RETURN_IF_ERROR(b.GemmBiasGrad(true, false, s.attn_y, ws.d_res, beta,
                                      grad(p.attn_proj_weight), kOfB, grad(p.attn_proj_bias)));
  AMPD_RETURN_IF_ERROR(
      b.Gemm(false, true, 1.0f, ws.d_res, value(p.attn_proj_weight), 0.0f, ws.d_tmp));
  AMPD_ASSIGN_OR_RETURN(const Tensor qkv, s.qkv.View(0, {ws.batch, ws.seq, 3 * c}));
  AMPD_ASSIGN_OR_RETURN(const Tensor attn_y, s.attn_y.View(0, {ws.batch, ws.seq, c}));
  AMPD_ASSIGN_OR_RETURN(const Tensor d_attn_y, ws.d_tmp.View(0, {ws.batch, ws.seq, c}));
  AMPD_ASSIGN_OR_RETURN(Tensor d_qkv, ws.d_qkv.View(0, {ws.batch, ws.seq, 3 * c}));
  AMPD_RETURN_IF_ERROR(b.AttentionBackward(qkv, attn_y, d_attn_y, s.lse, gpt().n_head, d_qkv));
  AMPD_RETURN_IF_ERROR(b.GemmBiasGrad(true, false, s.ln_1, ws.d_qkv, beta, grad(p.c_attn_weight),
                                      kOfB, grad(p.c_attn_bias)));
  AMPD_RETURN_IF_ERROR(b.Gemm(false, true, 1.0f, ws.d_qkv, value(p.c_attn_weight), 0.0f, ws.d_ln));
  AMPD_RETURN_IF_ERROR(b.LayerNormBackward(ws.x[l], &value(p.ln_1_weight), s.mean_1, s.rstd_1,
                                           ws.d_ln, ws.d_tmp, &grad(p.ln_1_weight),
                                           &grad(p.ln_1_bias)));
  return absl::OkStatus();
}

absl::Status GptModel::Backward(Workspace& any, bool first_micro_batch,
                                const BackwardHooks& hooks) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * own, Own<GptWorkspace>(any));
  GptWorkspace& ws = *own;
  kernels::Backend& b = backend_;
  const int64_t c = gpt().d_model;
  const float beta = first_micro_batch ? 0.0f : 1.0f;
  std::vector<Parameter>& ps = params();
  auto value = [&ps](int index) -> const Tensor& { return ps[index].value(); };
  auto grad = [&ps](int index) -> Tensor& { return ps[index].grad; };
  const GradsReady& ready = hooks.grads_ready;
  // (N, C) dh, the loss gradient, enters the last group.
  if (hooks.group_entry) {
    AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_.back(), ws.d_ln));
  }

  // ln_f: d_res = dL/dx_L.
  AMPD_RETURN_IF_ERROR(b.LayerNormBackward(ws.x.back(), &value(ln_f_weight_), ws.mean_f, ws.rstd_f,
                                           ws.d_ln, ws.d_res, &grad(ln_f_weight_),
                                           &grad(ln_f_bias_)));
  // ln_f is done, and an untied LM head (its gradient came from Loss); a
  // tied head's is wte's, done only after the embedding's backward.
  if (ready) {
    const int done[3] = {ln_f_weight_, ln_f_bias_, lm_head_};
    AMPD_RETURN_IF_ERROR(ready(absl::MakeConstSpan(done, lm_head_ >= 0 ? 3 : 2)));
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    const BlockParams& p = blocks_[l];
    AMPD_RETURN_IF_ERROR(BackwardMlp(ws, l, beta));
    AMPD_RETURN_IF_ERROR(BackwardAttention(ws, l, beta));
    // d_res = dL/dx_l, at block l - 1's scale from here on: its group's
    // entry when block l - 1 starts a new one.
    AMPD_RETURN_IF_ERROR(b.AddScaled(ws.d_tmp, residual_grad_scale_[l], ws.d_res));
    if (hooks.group_entry && l > 0 && block_group_[l - 1] != block_group_[l]) {
      AMPD_RETURN_IF_ERROR(hooks.group_entry(block_group_[l - 1], ws.d_res));
    }
    if (ready) {
      const std::array<int, 12> done = p.All();
      AMPD_RETURN_IF_ERROR(ready(done));
    }
  }
  // d_res = dL/dx_0: scatter into wte's rows, and the sum over the batch
  // into wpe's first T rows (both accumulate; ZeroGrads cleared them).
  AMPD_RETURN_IF_ERROR(b.EmbeddingBackward(ws.ids, ws.d_res, grad(wte_)));
  AMPD_ASSIGN_OR_RETURN(const Tensor d_rows, ws.d_res.View(0, {ws.batch, ws.seq * c}));
  AMPD_ASSIGN_OR_RETURN(Tensor d_positions, grad(wpe_).View(0, {ws.seq * c}));
  AMPD_RETURN_IF_ERROR(b.BiasGrad(d_rows, 1.0f, d_positions));
  if (ready) {
    const int done[2] = {wte_, wpe_};
    AMPD_RETURN_IF_ERROR(ready(done));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
