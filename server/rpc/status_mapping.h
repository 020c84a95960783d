// The one place an engine absl::Status becomes a gRPC status (Triton's rule:
// the rpc layer only translates, and errors are mapped in one function).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ampd::rpc {

// Same code (absl and gRPC share the canonical numbering), same message
// (cut at 1 KiB), and a google.rpc.Status in the details holding one
// google.rpc.ErrorInfo (domain "ampd"): the reason the status was tagged with
// (common/error_reason.h), else INVALID_FIELD with the message's field path
// for InvalidArgument, else the code's name.
grpc::Status ToGrpcStatus(const absl::Status& status);

// "OK", "INVALID_ARGUMENT", ... as metrics label the code.
absl::string_view GrpcCodeName(grpc::StatusCode code);

}  // namespace ampd::rpc
