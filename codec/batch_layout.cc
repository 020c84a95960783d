// The per-micro-batch checks shared by the engine and ampctl (batch_layout.h).
#include "codec/batch_layout.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::codec {
namespace {

bool IsIndex(DType d) { return d == DType::kI32 || d == DType::kI64; }

std::string Got(const HostTensor& t) {
  return absl::StrCat(DTypeName(t.dtype), ShapeToString(t.shape));
}

int64_t LoadIndex(const HostTensor& t, int64_t i) {
  if (t.dtype == DType::kI32) {
    int32_t v;
    std::memcpy(&v, t.data.data() + i * 4, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, t.data.data() + i * 8, 8);
  return v;
}

// Host-side, before any device work: an id out of range must be refused
// before the step writes anything (a device can only report it afterwards).
absl::Status CheckIndicesBelow(const HostTensor& t, int64_t limit, absl::string_view what) {
  for (int64_t i = 0; i < t.shape[0]; ++i) {
    const int64_t id = LoadIndex(t, i);
    if (id < 0 || id >= limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: ", id, " is outside [0, ", limit, ")"));
    }
  }
  return absl::OkStatus();
}

// Sequence targets: ids below `limit` or kIgnoreTarget, at least one kept.
absl::Status CheckTargetsBelow(const HostTensor& t, int64_t limit, absl::string_view what) {
  const int64_t n = NumElements(t.shape);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = LoadIndex(t, i);
    if (id == kIgnoreTarget) continue;
    if (id < 0 || id >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", i / t.shape[1], ", ",
                                                     i % t.shape[1], "]: ", id, " is outside [0, ",
                                                     limit, ") and not ", kIgnoreTarget));
    }
    ++kept;
  }
  // The model's own loss is a mean over the kept targets, a token loss a
  // sum over them; either way a micro-batch with none has nothing to train
  // on, and is refused rather than sent through the model for nothing.
  if (kept == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": every target is ", kIgnoreTarget,
                     "; a micro-batch needs at least one target token to train on"));
  }
  return absl::OkStatus();
}

absl::Status CheckSequences(const BatchLayout& layout, const HostTensor& inputs,
                            const HostTensor& targets, absl::string_view inputs_name,
                            absl::string_view targets_name) {
  if (!IsIndex(inputs.dtype) || inputs.shape.size() != 2 || inputs.shape[0] < 1 ||
      inputs.shape[1] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        inputs_name, ": expected I32 or I64 (B, T) token ids with B, T >= 1, got ", Got(inputs)));
  }
  const int64_t t = inputs.shape[1];
  if (t > layout.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat(inputs_name, ": T = ", t, " exceeds context_length ", layout.context_length));
  }
  if (!IsIndex(targets.dtype) || targets.shape != inputs.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(targets_name, ": expected I32 or I64 ", ShapeToString(inputs.shape),
                     " token ids (the inputs' shape), got ", Got(targets)));
  }
  const int64_t n = NumElements(inputs.shape);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = LoadIndex(inputs, i);
    if (id < 0 || id >= layout.num_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(inputs_name, "[", i / t, ", ", i % t,
                                                     "]: ", id, " is outside [0, ",
                                                     layout.num_embeddings, ")"));
    }
  }
  return CheckTargetsBelow(targets, layout.outputs, targets_name);
}

}  // namespace

absl::Status CheckBatchLayout(const BatchLayout& layout, const HostTensor& inputs,
                              const HostTensor& targets, absl::string_view inputs_name,
                              absl::string_view targets_name) {
  AMPD_RETURN_IF_ERROR(inputs.Validate(inputs_name));
  AMPD_RETURN_IF_ERROR(targets.Validate(targets_name));
  if (layout.sequences) {
    return CheckSequences(layout, inputs, targets, inputs_name, targets_name);
  }
  // Inputs fix N; N >= 1 since every loss is a mean.
  int64_t rows = 0;
  if (layout.input_ids) {
    if (!IsIndex(inputs.dtype) || inputs.shape.size() != 1 || inputs.shape[0] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          inputs_name, ": expected I32 or I64 (N) ids with N >= 1, got ", Got(inputs)));
    }
    rows = inputs.shape[0];
    AMPD_RETURN_IF_ERROR(CheckIndicesBelow(inputs, layout.num_embeddings, inputs_name));
  } else {
    if (!IsFloating(inputs.dtype) || inputs.shape.size() != 2 ||
        inputs.shape[1] != layout.input_features || inputs.shape[0] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(inputs_name, ": expected F32, F16 or BF16 (N, ", layout.input_features,
                       ") with N >= 1, got ", Got(inputs)));
    }
    rows = inputs.shape[0];
  }
  if (layout.target_labels) {
    if (!IsIndex(targets.dtype) || targets.shape.size() != 1 || targets.shape[0] != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(targets_name, ": expected I32 or I64 (N) labels with N = ", rows,
                       " (the inputs' rows), got ", Got(targets)));
    }
    return CheckIndicesBelow(targets, layout.outputs, targets_name);
  }
  if (targets.dtype != DType::kF32 || targets.shape.size() != 2 ||
      targets.shape[1] != layout.outputs || targets.shape[0] != rows) {
    return absl::InvalidArgumentError(absl::StrCat(targets_name, ": expected F32 (N, ",
                                                   layout.outputs, ") with N = ", rows,
                                                   " (the inputs' rows), got ", Got(targets)));
  }
  return absl::OkStatus();
}

}  // namespace ampd::codec
