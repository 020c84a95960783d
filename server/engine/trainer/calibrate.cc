// Trainer::Impl::CalibrateLossScale: the adaptive scaler's calibrated start
// (server/engine/amp/adaptive_policy.h). The step's micro-batches run
// forward and backward at a loss scale of 1 (each micro-batch's gradient
// carrying 1 / K, or 1 for a token loss's sum, as in the step; a
// distributed job's K and summed gradients are every rank's), the fused
// check pass produces max|g|,
// and one small read brings found_inf and the max back; the scaler then
// starts at the largest power of two that keeps max|g| * S under its
// overflow margin. S = 1 is the safe scale: gradients overflow there only
// when they exceed fp16's range unscaled, which no scale could help (the
// scaler then starts at 1 and backs off from the step's real overflow).
// The gradients it leaves are overwritten by the step that follows
// (ZeroGrads, beta = 0 on micro-batch 0). It runs once per job, and once
// after a state without scaler keys is loaded: its cost is one extra
// forward and backward and one extra read, on that step only.
// With per-layer scales every group runs at S = 1 (no rescaling between
// groups), each group's check pass keeps its own max|g|, and each group
// starts at the scale its own max gives (all at 1 when anything
// overflowed, as the job-wide scale does).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

absl::Status Trainer::Impl::CalibrateLossScale(const StepInput& input,
                                               const DataParallelStep* data_parallel,
                                               const CallToken& call) {
  kernels::Backend& b = *backend;
  const auto k = static_cast<int64_t>(input.micro_batches.size());
  // A distributed job calibrates on the whole batch's gradient, the same on
  // every rank, so every rank's scaler starts at the same scale.
  const int64_t global_k = data_parallel != nullptr ? data_parallel->global_micro_batches : k;
  const bool per_layer = config.scaler.per_layer_scales;
  if (per_layer) {
    std::fill(group_scales.begin(), group_scales.end(), 1.0f);
    AMPD_RETURN_IF_ERROR(model->SetGroupScales(group_scales));
  }
  model::Network::BackwardHooks hooks;
  if (per_layer) hooks.group_entry = GroupEntryCheck();
  AMPD_RETURN_IF_ERROR(model->ZeroGrads());
  AMPD_RETURN_IF_ERROR(b.Fill(found_inf, 0.0f));
  for (ScaleGroup& g : groups) AMPD_RETURN_IF_ERROR(b.Fill(g.max_abs, 0.0f));
  for (int64_t i = 0; i < k; ++i) {
    // As the step's own micro-batches (step.cc): a distributed share runs on.
    if (data_parallel == nullptr) {
      AMPD_RETURN_IF_ERROR(
          call.Check(absl::StrCat("the step stopped in its calibration, before micro-batch ", i,
                                  " of ", k, "; nothing was applied")));
    }
    const MicroBatch& mb = input.micro_batches[static_cast<size_t>(i)];
    AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, WorkspaceFor(mb.inputs.shape));
    AMPD_RETURN_IF_ERROR(model->LoadBatch(mb.inputs, mb.targets,
                                          model::TokenLossInputs::Of(input.loss_fn, mb), *ws));
    AMPD_RETURN_IF_ERROR(model->Forward(*ws));
    // The step's own loss gradient at scale 1 (a token loss sums, the
    // model's loss averages over the micro-batches).
    const float grad_scale =
        input.loss_fn.kind != LossFnKind::kModel ? 1.0f : 1.0f / static_cast<float>(global_k);
    AMPD_RETURN_IF_ERROR(model->Loss(*ws, grad_scale, /*first_micro_batch=*/i == 0, loss));
    AMPD_RETURN_IF_ERROR(model->Backward(*ws, /*first_micro_batch=*/i == 0, hooks));
  }
  if (data_parallel != nullptr) AMPD_RETURN_IF_ERROR(data_parallel->all_reduce->Sum(grads));
  for (ScaleGroup& g : groups) {
    AMPD_RETURN_IF_ERROR(b.UnscaleAndCheck(g.grads, 1.0f, /*in_place=*/false, found_inf,
                                           /*norm_sq=*/nullptr, &g.max_abs));
  }
  // The step's read list without the loss sum: [found_inf, norm_sq (not
  // computed here, unused), max_abs of group 0, 1, ...].
  const auto scalars = absl::MakeConstSpan(read_scalars).subspan(1);
  const absl::Span<float> host = absl::MakeSpan(read_values).subspan(1);
  AMPD_RETURN_IF_ERROR(b.ReadScalars(scalars, host));
  const absl::Span<const float> max_abs = host.subspan(2);
  if (host[0] != 0.0f) {
    scaler.Calibrate(std::numeric_limits<float>::infinity());
  } else if (per_layer) {
    scaler.CalibrateLayers(max_abs);
  } else {
    scaler.Calibrate(max_abs[0]);
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine
