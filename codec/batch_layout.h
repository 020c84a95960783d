// BatchLayout: what one micro-batch's tensors must look like for a model,
// reduced to the facts of its two ends (float rows or ids in, regression
// targets or class labels out, and their widths; or token sequences in and
// next-token ids out for a GPT). The engine derives it from
// its model spec and checks every Step with it; ampctl derives it from the
// ampd.v1.ModelSpec it sends and checks batch files before creating a job.
// One check on both sides, so both refuse exactly the same batches with the
// same messages, and the client needs no model code to do it.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/host_tensor.h"

namespace ampd::codec {

// A sequence target with this value carries no loss (PyTorch's ignore_index).
inline constexpr int64_t kIgnoreTarget = -100;

struct BatchLayout {
  // Token sequences (a GPT): inputs (B, T) I32/I64 ids in
  // [0, num_embeddings) with 1 <= T <= context_length; targets (B, T)
  // I32/I64 ids in [0, outputs) or kIgnoreTarget, at least one of them not
  // ignored (every micro-batch trains on at least one target token, whether
  // its loss is their mean or their sum). The fields below it then only give
  // num_embeddings and outputs.
  bool sequences = false;
  int64_t context_length = 0;
  // Inputs: (N) I32/I64 ids in [0, num_embeddings) when true, otherwise
  // (N, input_features) F32/F16/BF16.
  bool input_ids = false;
  int64_t num_embeddings = 0;
  int64_t input_features = 0;
  // Targets: (N) I32/I64 labels in [0, outputs) when true (cross-entropy),
  // otherwise (N, outputs) F32 (MSE).
  bool target_labels = false;
  int64_t outputs = 0;
};

// OK when inputs and targets have the layout's dtypes and shapes, the same
// N >= 1 rows (and for sequences the same T), byte lengths that match their shapes, and every id
// and label in range. InvalidArgument naming inputs_name / targets_name (and the element index of
// an id or label out of range) otherwise.
absl::Status CheckBatchLayout(const BatchLayout& layout, const HostTensor& inputs,
                              const HostTensor& targets, absl::string_view inputs_name,
                              absl::string_view targets_name);

}  // namespace ampd::codec
