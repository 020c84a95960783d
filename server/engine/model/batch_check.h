// CheckBatchFitsModel: whether one micro-batch's inputs and targets fit a
// model (dtypes, shapes, row counts, byte lengths, ids and labels in range).
// The Trainer checks every Step with it before touching any state. The rule
// itself is the codec's (codec/batch_layout.h), which ampctl applies to
// batch files too, so both refuse exactly the same batches with the same
// messages; this adds what only the engine knows, the model's two ends.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/batch_layout.h"
#include "server/engine/api.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/host_tensor.h"

namespace ampd::engine::model {

// The layout of a valid spec's batches: for a GPT, (B, T) token sequences
// with T <= context_length and ids below vocab_size (targets may also be
// kIgnoreIndex), a decoder's likewise with max_position_embeddings; for a layer stack, ids when the
// first layer is an Embedding, InputFeatures(spec) float columns otherwise; labels for
// cross-entropy, OutputFeatures(spec) F32 columns for MSE.
codec::BatchLayout LayoutOf(const ModelSpec& spec);

// inputs: (N, in_features) F32/F16/BF16, or (N) I32/I64 ids in
// [0, num_embeddings) when the first layer is Embedding; targets: (N, out)
// F32 for MSE, (N) I32/I64 labels in [0, out) for cross-entropy; N >= 1.
// A GPT: inputs (B, T) I32/I64 token ids, targets (B, T) I32/I64 ids or
// kIgnoreIndex, not all ignored. Ids are host data here, so every one is
// checked before anything reaches the device.
// InvalidArgument naming inputs_name / targets_name (and the element index
// of an id or label out of range).
absl::Status CheckBatchFitsModel(const ModelSpec& spec, const HostTensor& inputs,
                                 const HostTensor& targets, absl::string_view inputs_name,
                                 absl::string_view targets_name);

// The per-token inputs a step's LossFn reads (api.h), beside a micro-batch
// that fits the model (CheckBatchFitsModel first): none for kModel; for a
// token loss, a GPT, and weights (kCrossEntropy, optional), advantages and
// sampling_logprobs (every other token loss, required), each F32 of
// the targets' shape with every value finite. InvalidArgument naming
// "<prefix>.weights" (and the element of a non-finite value), or
// "loss_fn" when the model has no token loss.
absl::Status CheckTokenLossInputs(const ModelSpec& spec, const LossFn& fn, const MicroBatch& mb,
                                  absl::string_view prefix);

}  // namespace ampd::engine::model
