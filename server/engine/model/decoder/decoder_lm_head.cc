// DecoderModel::Loss: the LM head fused with the token cross-entropy over
// row chunks of the final norm's output, with the GPT's rounding contract
// (gpt/gpt_lm_head.cc): per chunk, logits = h W^T, CrossEntropyChunk turns
// them into dlogits in place, dh = dlogits W and dW += alpha dlogits^T h,
// one rounding per micro-batch whatever the chunk count. EvalLoss runs the
// logits and the cross-entropy only.
#include <algorithm>

#include "common/status_macros.h"
#include "server/engine/model/decoder/decoder_model.h"
#include "server/engine/model/decoder/decoder_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status DecoderModel::Loss(Workspace& ws, float grad_scale, Tensor& loss) {
  return HeadLoss(ws, grad_scale, /*with_grad=*/true, loss);
}

absl::Status DecoderModel::EvalLoss(Workspace& ws, Tensor& loss) {
  return HeadLoss(ws, 0.0f, /*with_grad=*/false, loss);
}

absl::Status DecoderModel::HeadLoss(Workspace& any, float grad_scale, bool with_grad,
                                    Tensor& loss) {
  AMPD_ASSIGN_OR_RETURN(DecoderWorkspace * own, Own<DecoderWorkspace>(any));
  DecoderWorkspace& ws = *own;
  if (ws.kept <= 0) {
    return absl::FailedPreconditionError("targets: no target to average over (LoadBatch first)");
  }
  kernels::Backend& b = backend_;
  const int64_t c = decoder().hidden_size;
  const int64_t v = decoder().vocab_size;
  Parameter& head = params()[static_cast<size_t>(head_weight())];
  const double per_target =
      static_cast<double>(spec().loss_multiplier) / static_cast<double>(ws.kept);
  const auto loss_scale = static_cast<float>(per_target);
  const auto logit_grad_scale = static_cast<float>(static_cast<double>(grad_scale) * per_target);
  AMPD_RETURN_IF_ERROR(b.Fill(loss, 0.0f));
  Tensor& head_sum = ws.head_grad.empty() ? head.grad : ws.head_grad;
  auto sum_beta = [&ws](int64_t start) { return ws.head_grad.empty() || start > 0 ? 1.0f : 0.0f; };
  for (int64_t start = 0; start < ws.rows; start += ws.chunk_rows) {
    const int64_t r = std::min(ws.chunk_rows, ws.rows - start);
    AMPD_ASSIGN_OR_RETURN(const Tensor h, ws.ln_f.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(Tensor dh, ws.d_ln.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(const Tensor labels, ws.targets.View(start, {r}));
    AMPD_ASSIGN_OR_RETURN(Tensor logits, ws.logits.View(0, {r, v}));
    AMPD_RETURN_IF_ERROR(b.Gemm(false, true, 1.0f, h, head.value(), 0.0f, logits));
    AMPD_RETURN_IF_ERROR(b.CrossEntropyChunk(logits, labels, kIgnoreIndex, loss_scale,
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
