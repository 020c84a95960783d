// GptModel::Loss: the LM head fused with the token cross-entropy, over row
// chunks of ln_f's output (LmHeadChunkRows: all N rows at once unless their
// logits exceed the model's chunk bytes, kLmHeadChunkBytes). Per chunk of
// r rows, h (r, C), W the head (V, C):
//   logits (r, V) = h W^T
//   CrossEntropyChunk: loss += multiplier / kept * sum of the chunk's
//     per-token losses; logits <- dlogits = grad_scale * multiplier / kept
//     * (softmax - onehot), 0 on ignored rows (in place)
//   dh (r, C) = dlogits W          (into ws.d_ln, where Backward starts)
//   dW (V, C) += alpha dlogits^T h (the head's gradient: wte's when tied,
//                                   moved to wte's per-layer scale by alpha)
// The rounding contract of dW: one rounding per micro-batch, as every
// other weight gradient gets, however many chunks the head takes:
//   one chunk (the usual case), any dtype: one GEMM with beta = 1 into the
//     gradient, which forms alpha * sum + grad in fp32 (the Backend's GEMM
//     contract: cuBLAS with a 16-bit C and fp32 compute, and the CPU
//     oracle, convert C to fp32 and round the result once). The gradient
//     is read and written once per micro-batch, and no F32 buffer exists.
//   several chunks in fp16/bf16: each chunk's GEMM adds into an F32 sum
//     (beta = 0 for the first), which one Add puts into the gradient:
//     grad + sum in fp32, rounded once.
//   several chunks in fp32: each chunk's GEMM adds into the gradient
//     (fp32 throughout, so there is no 16-bit rounding to protect).
// The two 16-bit forms differ only in how the fp32 sum over the rows is
// associated (per chunk, then across chunks), so they agree to within the
// one rounding: a tested bound. The gradient starts each step at zero
// (ZeroGrads) and later micro-batches add to it.
// A token loss (LoadBatch's loss_fn: Tinker's cross_entropy,
// importance_sampling or ppo) runs the same chunks with the chunk's
// per-token inputs (TokenTermsOf) and sums instead of averaging: loss_scale
// = multiplier, grad_scale = loss scale * multiplier.
// kept, the micro-batch's targets other than kIgnoreIndex, was counted on
// the host by LoadBatch, so the mean needs no device read. EvalLoss runs the
// logits and the cross-entropy only: the two backward GEMMs are skipped and
// no gradient is touched.
#include <algorithm>

#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/gpt/gpt_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status GptModel::Loss(Workspace& ws, float grad_scale, Tensor& loss) {
  return HeadLoss(ws, grad_scale, /*with_grad=*/true, loss);
}

absl::Status GptModel::EvalLoss(Workspace& ws, Tensor& loss) {
  return HeadLoss(ws, 0.0f, /*with_grad=*/false, loss);
}

absl::StatusOr<kernels::TokenLossTerms> GptModel::TokenTermsOf(GptWorkspace& ws, int64_t start,
                                                               int64_t r) {
  kernels::TokenLossTerms terms;
  switch (ws.loss_fn.kind) {
    case LossFnKind::kModel:
    case LossFnKind::kCrossEntropy:
      terms.kind = kernels::TokenLossKind::kCrossEntropy;
      break;
    case LossFnKind::kImportanceSampling:
      terms.kind = kernels::TokenLossKind::kImportanceSampling;
      break;
    case LossFnKind::kPpo:
      terms.kind = kernels::TokenLossKind::kPpo;
      break;
  }
  terms.clip_low = ws.loss_fn.ppo_clip_low;
  terms.clip_high = ws.loss_fn.ppo_clip_high;
  auto view = [&](kernels::Tensor& all, kernels::Tensor& chunk,
                  const kernels::Tensor*& out) -> absl::Status {
    if (all.empty()) return absl::OkStatus();
    AMPD_ASSIGN_OR_RETURN(chunk, all.View(start, {r}));
    out = &chunk;
    return absl::OkStatus();
  };
  AMPD_RETURN_IF_ERROR(view(ws.token_weights, ws.chunk_weights, terms.weights));
  AMPD_RETURN_IF_ERROR(view(ws.token_advantages, ws.chunk_advantages, terms.advantages));
  AMPD_RETURN_IF_ERROR(
      view(ws.token_sampling_logprobs, ws.chunk_sampling_logprobs, terms.sampling_logprobs));
  return terms;
}

absl::Status GptModel::HeadLoss(Workspace& any, float grad_scale, bool with_grad, Tensor& loss) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * own, Own<GptWorkspace>(any));
  GptWorkspace& ws = *own;
  if (ws.kept <= 0) {
    return absl::FailedPreconditionError("targets: no target to average over (LoadBatch first)");
  }
  kernels::Backend& b = backend_;
  const GptSpec& g = gpt();
  const int64_t c = g.d_model;
  const int64_t v = g.vocab_size;
  Parameter& head = params()[head_weight()];
  // The model's own loss is the mean over kept targets; a token loss
  // (LoadBatch's loss_fn) is the sum over them.
  const bool token_loss = ws.loss_fn.kind != LossFnKind::kModel;
  const double per_target = static_cast<double>(spec().loss_multiplier) /
                            (token_loss ? 1.0 : static_cast<double>(ws.kept));
  const auto loss_scale = static_cast<float>(per_target);
  const auto logit_grad_scale = static_cast<float>(static_cast<double>(grad_scale) * per_target);
  AMPD_RETURN_IF_ERROR(b.Fill(loss, 0.0f));
  // The F32 sum (several 16-bit chunks) starts afresh at the first chunk;
  // without it the chunk, or the fp32 chunks, add straight into the
  // gradient, which ZeroGrads cleared at the step's start.
  Tensor& head_sum = ws.head_grad.empty() ? head.grad : ws.head_grad;
  auto sum_beta = [&ws](int64_t start) { return ws.head_grad.empty() || start > 0 ? 1.0f : 0.0f; };
  for (int64_t start = 0; start < ws.rows; start += ws.chunk_rows) {
    const int64_t r = std::min(ws.chunk_rows, ws.rows - start);
    AMPD_ASSIGN_OR_RETURN(const Tensor h, ws.ln_f.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(Tensor dh, ws.d_ln.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(const Tensor labels, ws.targets.View(start, {r}));
    AMPD_ASSIGN_OR_RETURN(Tensor logits, ws.logits.View(0, {r, v}));
    AMPD_RETURN_IF_ERROR(b.Gemm(false, true, 1.0f, h, head.value(), 0.0f, logits));
    AMPD_ASSIGN_OR_RETURN(const kernels::TokenLossTerms terms, TokenTermsOf(ws, start, r));
    AMPD_RETURN_IF_ERROR(b.CrossEntropyChunk(logits, labels, kIgnoreIndex, terms, loss_scale,
                                             logit_grad_scale, loss, logits));
    if (!with_grad) continue;
    AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, logits, head.value(), 0.0f, dh));
    AMPD_RETURN_IF_ERROR(
        b.Gemm(true, false, head_grad_alpha_, logits, h, sum_beta(start), head_sum));
  }
  if (with_grad && !ws.head_grad.empty()) AMPD_RETURN_IF_ERROR(b.Add(ws.head_grad, head.grad));
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
