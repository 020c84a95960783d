// A model's batch layout, checked with the codec's rule (batch_check.h).
#include "server/engine/model/batch_check.h"

namespace ampd::engine::model {

codec::BatchLayout LayoutOf(const ModelSpec& spec) {
  if (spec.gpt.has_value() || spec.decoder.has_value()) {
    codec::BatchLayout layout;
    layout.sequences = true;
    layout.context_length =
        spec.gpt.has_value() ? spec.gpt->context_length : spec.decoder->max_position_embeddings;
    layout.num_embeddings = spec.gpt.has_value() ? spec.gpt->vocab_size : spec.decoder->vocab_size;
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

}  // namespace ampd::engine::model
