// absl::Status -> grpc::Status with a google.rpc.ErrorInfo in its details,
// and gRPC code names for metrics. The code itself is a cast; what is ampd's
// own is the reason every error carries and the cut of long messages.
#include "server/rpc/status_mapping.h"

#include <optional>
#include <string>
#include <vector>

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

// absl::StatusCode and grpc::StatusCode number the same canonical codes,
// OK (0) to UNAUTHENTICATED (16): a code converts by a cast.
constexpr int kCanonicalCodes = static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) + 1;
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) + 1 == kCanonicalCodes);
static_assert(static_cast<int>(absl::StatusCode::kInvalidArgument) ==
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));

// "config.optimizer.lr: must be finite" -> "config.optimizer.lr": the
// field-path prefix every InvalidArgument of ampd starts with, when there is
// one. An index may name an element of a 2-D tensor
// ("micro_batches[0].inputs[1, 3]: 96 is outside [0, 96)").
std::optional<std::string> FieldOfMessage(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == 0 || colon == absl::string_view::npos) return std::nullopt;
  const absl::string_view field = message.substr(0, colon);
  bool in_index = false;
  for (char c : field) {
    const bool alnum = absl::ascii_isalnum(static_cast<unsigned char>(c));
    if (c == '[' && !in_index) {
      in_index = true;
    } else if (c == ']' && in_index) {
      in_index = false;
    } else if (in_index ? !(alnum || c == ',' || c == ' ' || c == '-')
                        : !(alnum || c == '_' || c == '.')) {
      return std::nullopt;
    }
  }
  if (in_index) return std::nullopt;
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
  // code() is always canonical (absl reads any other raw code as kUnknown).
  const auto code = static_cast<grpc::StatusCode>(status.code());
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
  // absl spells every canonical code as gRPC does; kept so the views last.
  static const auto* const names = [] {
    auto* built = new std::vector<std::string>;
    for (int i = 0; i < kCanonicalCodes; ++i) {
      built->push_back(absl::StatusCodeToString(static_cast<absl::StatusCode>(i)));
    }
    return built;
  }();
  const int i = static_cast<int>(code);
  return i >= 0 && i < kCanonicalCodes ? absl::string_view((*names)[i]) : "UNKNOWN";
}

}  // namespace ampd::rpc
