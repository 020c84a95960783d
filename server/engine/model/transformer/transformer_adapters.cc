// TransformerModel's LoRA adapters (a decoder's) in its passes: one adapter's forward and
// backward term (lora.h), and the q/k/v adapters stacked as one
// A and a block-diagonal B so that the fused q|k|v rows take all their
// terms in one GEMM, their gradients copied out of the stacked ones.
#include "common/status_macros.h"
#include "server/engine/model/transformer/lora.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::Tensor;

namespace {

// Where module m (kQ, kK or kV) sits in the fused q|k|v rows: its first
// column and its width (Q or KV).
struct QkvBlock {
  int64_t offset = 0;
  int64_t width = 0;
};

}  // namespace

absl::Status TransformerModel::AdapterForward(const Adapter& adapter, const Tensor& x, Tensor& u,
                                              Tensor& y) {
  const std::vector<Parameter>& ps = params();
  return LoraForward(backend_, lora_scale_, x, ps[static_cast<size_t>(adapter.a)].value(),
                     ps[static_cast<size_t>(adapter.b)].value(), u, y);
}

absl::Status TransformerModel::AdapterBackward(const Adapter& adapter, TransformerWorkspace& ws,
                                               const Tensor& x, const Tensor& u, const Tensor& dy,
                                               float beta, Tensor& dx) {
  std::vector<Parameter>& ps = params();
  Parameter& a = ps[static_cast<size_t>(adapter.a)];
  Parameter& b = ps[static_cast<size_t>(adapter.b)];
  AMPD_ASSIGN_OR_RETURN(Tensor du, ws.lora_du.View(0, {x.dim(0), a.value().dim(0)}));
  return LoraBackward(backend_, lora_scale_, x, u, dy, a.value(), b.value(), beta, du, a.grad,
                      b.grad, dx);
}

absl::Status TransformerModel::ForEachStackedAdapter(const BlockParams& p,
                                                     StackedAdapterFn fn) const {
  const int64_t rank = parts_.lora->rank;
  const int64_t q = parts_.q_width();
  const int64_t kv = parts_.kv_width();
  const QkvBlock blocks[] = {{0, q}, {q, kv}, {q + kv, kv}};
  for (size_t slot = 0; slot < qkv_targets_.size(); ++slot) {
    const Module m = qkv_targets_[slot];
    const QkvBlock& block = blocks[m];
    AMPD_RETURN_IF_ERROR(fn(p.lora[static_cast<size_t>(m)], static_cast<int64_t>(slot) * rank,
                            block.offset, block.width));
  }
  return absl::OkStatus();
}

absl::Status TransformerModel::StackQkvAdapters(const BlockParams& p, QkvStack& stack) {
  const int64_t c = parts_.hidden;
  const int64_t rank = parts_.lora->rank;
  const int64_t stacked = stack.lora_b.dim(1);
  return ForEachStackedAdapter(
      p, [&](const Adapter& adapter, int64_t first, int64_t offset, int64_t width) -> absl::Status {
        AMPD_ASSIGN_OR_RETURN(Tensor a_rows, stack.lora_a.View(first * c, {rank, c}));
        AMPD_RETURN_IF_ERROR(
            backend_.Copy(params()[static_cast<size_t>(adapter.a)].value(), a_rows));
        AMPD_ASSIGN_OR_RETURN(Tensor b_rows, stack.lora_b.View(offset * stacked, {width, stacked}));
        return backend_.CopyColumns(params()[static_cast<size_t>(adapter.b)].value(), 0, rank,
                                    b_rows, first);
      });
}

absl::Status TransformerModel::CopyQkvAdapterGrads(const BlockParams& p, bool to_params,
                                                   TransformerWorkspace& ws) {
  const int64_t c = parts_.hidden;
  const int64_t rank = parts_.lora->rank;
  const int64_t stacked = ws.lora_db_qkv.dim(1);
  return ForEachStackedAdapter(
      p, [&](const Adapter& adapter, int64_t first, int64_t offset, int64_t width) -> absl::Status {
        Tensor& da = params()[static_cast<size_t>(adapter.a)].grad;
        Tensor& db = params()[static_cast<size_t>(adapter.b)].grad;
        AMPD_ASSIGN_OR_RETURN(Tensor da_rows, ws.lora_da_qkv.View(first * c, {rank, c}));
        AMPD_ASSIGN_OR_RETURN(Tensor db_rows,
                              ws.lora_db_qkv.View(offset * stacked, {width, stacked}));
        if (to_params) {
          AMPD_RETURN_IF_ERROR(backend_.Copy(da_rows, da));
          return backend_.CopyColumns(db_rows, first, rank, db, 0);
        }
        AMPD_RETURN_IF_ERROR(backend_.Copy(da, da_rows));
        return backend_.CopyColumns(db, 0, rank, db_rows, first);
      });
}

}  // namespace ampd::engine::model
