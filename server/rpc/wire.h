// Wire <-> engine conversions server/rpc's translation decodes requests
// with: model specs here, tensors from the codec (codec/tensor_proto.h, the
// encoding ampctl writes too). Decoding checks what only the wire can get
// wrong (unset oneofs and enums, NaN in optional fields, byte lengths) and
// names the request field (FieldError, common/error_reason.h).
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ampd/v1/trainer.pb.h"
#include "codec/tensor_proto.h"
#include "common/error_reason.h"
#include "server/engine/config/model_spec.h"

namespace ampd::rpc {

// The most bytes of a job id, request id, page token or display name: the
// server keeps them and sends them back in every ListJobs page, so their
// size must not be the client's choice.
inline constexpr size_t kMaxNameBytes = 256;
// FieldError unless value has at most kMaxNameBytes bytes.
absl::Status CheckLength(absl::string_view field, absl::string_view value);
// FieldError unless value is finite: NaN and infinities are never a
// meaningful hyperparameter, and range checks let NaN through (it compares
// false both ways).
absl::Status CheckFinite(absl::string_view field, double value);

// One of the model's kinds into *spec: a layer stack (proto's layers
// appended, and its loss), a GPT (mlp_ratio 4, layer_norm_eps 1e-5 and
// tie_embeddings true where unset) or a decoder of the Llama/Qwen/Gemma
// families (its parts and LoRA adapters); for a GPT or a decoder the layers
// must be empty and the loss unset or cross-entropy. field_prefix prefixes
// the names in errors ("config.model" -> "config.model.layers[2]: no layer
// kind set").
absl::Status ModelSpecFromProto(const v1::ModelSpec& proto, absl::string_view field_prefix,
                                engine::model::ModelSpec* spec);
// Every field set, defaults included (the effective model).
v1::ModelSpec ModelSpecToProto(const engine::model::ModelSpec& spec);

using codec::TensorFromProto;
using codec::TensorToProto;

}  // namespace ampd::rpc
