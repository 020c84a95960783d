// TransformerModel::Loss: the LM head fused with the token loss (model/lm_head.h,
// shared with the GPT) over row chunks of the final norm's output, one
// rounding of the head's gradient per micro-batch whatever the chunk count.
// EvalLoss runs the logits and the loss only.
#include "common/status_macros.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status TransformerModel::Loss(Workspace& ws, float grad_scale, bool first_micro_batch,
                                    Tensor& loss) {
  return HeadLoss(ws, grad_scale, /*with_grad=*/true, first_micro_batch, loss);
}

absl::Status TransformerModel::EvalLoss(Workspace& ws, Tensor& loss) {
  return HeadLoss(ws, 0.0f, /*with_grad=*/false, /*first_micro_batch=*/false, loss);
}

absl::Status TransformerModel::HeadLoss(Workspace& any, float grad_scale, bool with_grad,
                                        bool first_micro_batch, Tensor& loss) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * ws, Own<TransformerWorkspace>(any));
  return LmHeadLoss(backend_, *ws, params()[static_cast<size_t>(head_weight())], head_grad_alpha_,
                    spec().loss_multiplier, grad_scale, with_grad, first_micro_batch, loss);
}

absl::StatusOr<const Tensor*> TransformerModel::TokenLogprobs(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * ws, Own<TransformerWorkspace>(any));
  return TokenLogprobsOf(*ws);
}

absl::StatusOr<const Tensor*> TransformerModel::TokenLosses(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * ws, Own<TransformerWorkspace>(any));
  return TokenLossesOf(*ws);
}

}  // namespace ampd::engine::model
