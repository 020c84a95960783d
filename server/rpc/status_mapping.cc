// absl::Status -> grpc::Status with a google.rpc.ErrorInfo in its details,
// and gRPC code names for metrics.
#include "server/rpc/status_mapping.h"

#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace ampd::rpc {
namespace {

// The longest message sent back. Messages echo input through Echo(), so this
// only guards against a message that forgot to: status details must stay far
// below a client's default 4 MiB receive limit, and well below HTTP/2 header
// limits (trailers carry them).
constexpr size_t kMaxMessageBytes = 1024;

// "config.optimizer.lr: must be finite" -> "config.optimizer.lr": the
// field-path prefix every InvalidArgument of ampd starts with, when there is
// one.
std::optional<std::string> FieldOfMessage(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == 0 || colon == absl::string_view::npos) return std::nullopt;
  const absl::string_view field = message.substr(0, colon);
  for (char c : field) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '[' &&
        c != ']') {
      return std::nullopt;
    }
  }
  return std::string(field);
}

// The tag the engine or the rpc layer attached, else one derived from the
// code: every error carries a reason.
ErrorReason ReasonOf(const absl::Status& status, grpc::StatusCode code) {
  if (std::optional<ErrorReason> tagged = GetErrorReason(status); tagged.has_value()) {
    return *std::move(tagged);
  }
  ErrorReason derived;
  if (code == grpc::StatusCode::INVALID_ARGUMENT) {
    derived.reason = reason::kInvalidField;
    if (std::optional<std::string> field = FieldOfMessage(status.message()); field.has_value()) {
      derived.metadata["field"] = *std::move(field);
    }
    return derived;
  }
  derived.reason = std::string(GrpcCodeName(code));
  return derived;
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return grpc::Status::OK;
    case absl::StatusCode::kCancelled:
      code = grpc::StatusCode::CANCELLED;
      break;
    case absl::StatusCode::kUnknown:
      code = grpc::StatusCode::UNKNOWN;
      break;
    case absl::StatusCode::kInvalidArgument:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
      break;
    case absl::StatusCode::kNotFound:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case absl::StatusCode::kAlreadyExists:
      code = grpc::StatusCode::ALREADY_EXISTS;
      break;
    case absl::StatusCode::kPermissionDenied:
      code = grpc::StatusCode::PERMISSION_DENIED;
      break;
    case absl::StatusCode::kResourceExhausted:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case absl::StatusCode::kFailedPrecondition:
      code = grpc::StatusCode::FAILED_PRECONDITION;
      break;
    case absl::StatusCode::kAborted:
      code = grpc::StatusCode::ABORTED;
      break;
    case absl::StatusCode::kOutOfRange:
      code = grpc::StatusCode::OUT_OF_RANGE;
      break;
    case absl::StatusCode::kUnimplemented:
      code = grpc::StatusCode::UNIMPLEMENTED;
      break;
    case absl::StatusCode::kInternal:
      code = grpc::StatusCode::INTERNAL;
      break;
    case absl::StatusCode::kUnavailable:
      code = grpc::StatusCode::UNAVAILABLE;
      break;
    // A corrupt checkpoint or state dict is the server's data, not the caller's.
    case absl::StatusCode::kDataLoss:
      code = grpc::StatusCode::DATA_LOSS;
      break;
    case absl::StatusCode::kUnauthenticated:
      code = grpc::StatusCode::UNAUTHENTICATED;
      break;
    default:
      code = grpc::StatusCode::UNKNOWN;
      break;
  }
  std::string message(status.message());
  if (message.size() > kMaxMessageBytes) {
    message = absl::StrCat(message.substr(0, kMaxMessageBytes), "...(", message.size(), " bytes)");
  }
  const ErrorReason reason = ReasonOf(status, code);
  google::rpc::ErrorInfo info;
  info.set_reason(reason.reason);
  info.set_domain(kErrorDomain);
  for (const auto& [key, value] : reason.metadata) (*info.mutable_metadata())[key] = value;
  google::rpc::Status details;
  details.set_code(static_cast<int>(code));
  details.set_message(message);
  details.add_details()->PackFrom(info);
  return grpc::Status(code, message, details.SerializeAsString());
}

absl::string_view GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace ampd::rpc
