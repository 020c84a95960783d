// GptModel::Loss: the LM head fused with the token loss (model/lm_head.h,
// shared with the decoder) over row chunks of ln_f's output (LmHeadChunkRows:
// all N rows at once unless their logits exceed the model's chunk bytes,
// kLmHeadChunkBytes). The head is wte when tied. EvalLoss runs the logits
// and the loss only: the two backward GEMMs are skipped and no gradient is
// touched. kept, the micro-batch's targets other than kIgnoreIndex, was
// counted on the host by LoadBatch, so the mean needs no device read.
#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/gpt/gpt_workspace.h"
#include "server/engine/model/lm_head.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status GptModel::Loss(Workspace& ws, float grad_scale, Tensor& loss) {
  return HeadLoss(ws, grad_scale, /*with_grad=*/true, loss);
}

absl::Status GptModel::EvalLoss(Workspace& ws, Tensor& loss) {
  return HeadLoss(ws, 0.0f, /*with_grad=*/false, loss);
}

absl::Status GptModel::HeadLoss(Workspace& any, float grad_scale, bool with_grad, Tensor& loss) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * ws, Own<GptWorkspace>(any));
  return LmHeadLoss(backend_, *ws, params()[head_weight()], head_grad_alpha_,
                    spec().loss_multiplier, grad_scale, with_grad, loss);
}

absl::StatusOr<const Tensor*> GptModel::TokenLogprobs(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * ws, Own<GptWorkspace>(any));
  return TokenLogprobsOf(*ws);
}

absl::StatusOr<const Tensor*> GptModel::TokenLosses(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * ws, Own<GptWorkspace>(any));
  return TokenLossesOf(*ws);
}

}  // namespace ampd::engine::model
