// HostTensor <-> ampd.v1.Tensor, the one encoding of a tensor on the wire:
// ampctl encodes the batches it sends with it and the server decodes Step
// requests with it. Kept apart from the rest of the codec (its own target,
// ampd_codec_proto) so that code reading files, the engine's checkpoints
// among it, never sees protobuf.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ampd/v1/trainer.pb.h"
#include "codec/host_tensor.h"

namespace ampd::codec {

// The tensor a request carries. InvalidArgument tagged INVALID_FIELD
// (common/error_reason.h) naming `field` + ".dtype", ".shape" or ".data"
// when the dtype is unset or unknown, a dim is negative or the element count
// passes 2^40, or the bytes do not match shape and dtype. Every size is
// checked before it is multiplied, so a hostile shape allocates nothing.
absl::StatusOr<HostTensor> TensorFromProto(const v1::Tensor& proto, absl::string_view field);
// The same checks; on success the bytes are moved out of *proto (left
// empty) instead of copied: a batch of megabytes is received once, not
// twice. On an error *proto is unchanged.
absl::StatusOr<HostTensor> TakeTensorFromProto(v1::Tensor* proto, absl::string_view field);
// A U8 or BOOL tensor (which the wire has no dtype for) gets dtype unset.
v1::Tensor TensorToProto(const HostTensor& tensor);

}  // namespace ampd::codec
