// A model's batch layout, checked with the codec's rule (batch_check.h).
#include "server/engine/model/batch_check.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "codec/dtype.h"
#include "codec/shape.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

codec::BatchLayout LayoutOf(const ModelSpec& spec) {
  if (IsSequenceModel(spec)) {
    const TokenShape tokens = TokenShapeOf(spec);
    codec::BatchLayout layout;
    layout.sequences = true;
    layout.context_length = tokens.max_positions;
    layout.num_embeddings = tokens.vocab_size;
    layout.outputs = layout.num_embeddings;
    return layout;
  }
  const LayerSpec& first = spec.layers.front();
  codec::BatchLayout layout;
  layout.input_ids = first.kind == LayerKind::kEmbedding;
  layout.num_embeddings = layout.input_ids ? first.num_embeddings : 0;
  layout.input_features = InputFeatures(spec);
  layout.target_labels = spec.loss == LossKind::kCrossEntropy;
  layout.outputs = OutputFeatures(spec);
  return layout;
}

absl::Status CheckBatchFitsModel(const ModelSpec& spec, const HostTensor& inputs,
                                 const HostTensor& targets, absl::string_view inputs_name,
                                 absl::string_view targets_name) {
  return codec::CheckBatchLayout(LayoutOf(spec), inputs, targets, inputs_name, targets_name);
}

namespace {

// One per-token input: present exactly when `read`, F32 of the targets'
// shape, finite.
absl::Status CheckTokenInput(const std::optional<HostTensor>& t, bool read, bool required,
                             const MicroBatch& mb, absl::string_view prefix, absl::string_view name,
                             absl::string_view loss_name) {
  const std::string field = absl::StrCat(prefix, ".", name);
  if (!t.has_value()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": required by loss_fn ", loss_name, " (one per target token)"));
  }
  if (!read) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": loss_fn ", loss_name, " does not read it; send none"));
  }
  AMPD_RETURN_IF_ERROR(t->Validate(field));
  if (t->dtype != codec::DType::kF32 || t->shape != mb.targets.shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be F32 of the targets' shape ", codec::ShapeToString(mb.targets.shape),
        ", got ", codec::DTypeName(t->dtype), codec::ShapeToString(t->shape)));
  }
  const size_t n = t->data.size() / sizeof(float);
  for (size_t i = 0; i < n; ++i) {
    float v = 0;
    std::memcpy(&v, t->data.data() + i * sizeof(float), sizeof(float));
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": element ", i, " is ", v, "; every value must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTokenLossInputs(const ModelSpec& spec, const LossFn& fn, const MicroBatch& mb,
                                  absl::string_view prefix) {
  const bool ce = fn.kind == LossFnKind::kCrossEntropy;
  const bool policy = ReadsSamplingLogprobs(fn.kind);
  const bool lm = IsSequenceModel(spec);
  if ((ce || policy) && !lm) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn: ", LossFnName(fn.kind),
                     " is a token loss, which needs a language model (gpt or decoder)"));
  }
  if (fn.temperature.has_value() && !lm) {
    return absl::InvalidArgumentError(
        "temperature: divides a language model's logits (gpt or decoder); send none");
  }
  const absl::string_view loss_name = LossFnName(fn.kind);
  AMPD_RETURN_IF_ERROR(CheckTokenInput(mb.weights, ce, false, mb, prefix, "weights", loss_name));
  AMPD_RETURN_IF_ERROR(
      CheckTokenInput(mb.advantages, policy, policy, mb, prefix, "advantages", loss_name));
  return CheckTokenInput(mb.sampling_logprobs, policy, policy, mb, prefix, "sampling_logprobs",
                         loss_name);
}

}  // namespace ampd::engine::model
