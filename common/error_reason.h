// Machine-readable error reasons that travel inside an absl::Status. The
// engine tags a status with a stable reason ("SEQUENCE_MISMATCH") and a few
// key/value facts ("expected_sequence" -> "5") without including protobuf;
// server/rpc/status_mapping.cc turns the tag into a google.rpc.ErrorInfo in
// the gRPC status details, so clients branch on the reason instead of
// parsing the message. Also the one helper that bounds client input echoed
// back in error messages. Header-only; every layer may use it.
#pragma once

#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace ampd {

// The reasons ampd reports (ErrorInfo.reason, domain "ampd"). docs/API.md's error
// table lists each with its code and metadata; keep the two in step.
namespace reason {
inline constexpr char kInvalidField[] = "INVALID_FIELD";            // metadata: field
inline constexpr char kInvalidStateDict[] = "INVALID_STATE_DICT";   // LoadStateDict's file
inline constexpr char kJobNotFound[] = "JOB_NOT_FOUND";             // metadata: job_id
inline constexpr char kSequenceMismatch[] = "SEQUENCE_MISMATCH";    // expected_sequence
inline constexpr char kScalerAtMinScale[] = "SCALER_AT_MIN_SCALE";  // the step that raised
inline constexpr char kJobFailed[] = "JOB_FAILED";                  // later steps of that job
// A ForwardBackward or OptimStep that counts on accumulated calls the job
// no longer holds (a restart, a state load or a failed call dropped them):
// metadata pending_lost (how many to resend), expected_index.
inline constexpr char kAccumulationLost[] = "ACCUMULATION_LOST";
// A Step while ForwardBackward calls are accumulated: metadata pending.
inline constexpr char kAccumulationPending[] = "ACCUMULATION_PENDING";
inline constexpr char kJobLimit[] = "JOB_LIMIT";        // --max-jobs
inline constexpr char kMemoryLimit[] = "MEMORY_LIMIT";  // limit_bytes
inline constexpr char kRetryCreate[] = "CREATE_RETRY";  // request_id's first try failed
inline constexpr char kServerDraining[] = "SERVER_DRAINING";
// A distributed job's other ranks are not there (yet): metadata group, rank.
inline constexpr char kPeerUnavailable[] = "PEER_UNAVAILABLE";
// A distributed job's ranks disagree (config, state, the step they were
// sent): metadata group.
inline constexpr char kReplicasDiffer[] = "REPLICAS_DIFFER";
inline constexpr char kUnauthenticated[] = "UNAUTHENTICATED";  // no or an unknown token
// Sampler snapshots: a name the job does not hold (NOT_FOUND), a name it
// holds for other weights (ALREADY_EXISTS), the job's count at its limit
// (RESOURCE_EXHAUSTED, max_snapshots). Metadata field and snapshot.
inline constexpr char kSnapshotNotFound[] = "SNAPSHOT_NOT_FOUND";
inline constexpr char kSnapshotExists[] = "SNAPSHOT_EXISTS";
inline constexpr char kSnapshotLimit[] = "SNAPSHOT_LIMIT";
}  // namespace reason

// The domain every ampd ErrorInfo carries.
inline constexpr char kErrorDomain[] = "ampd";

struct ErrorReason {
  std::string reason;
  std::map<std::string, std::string> metadata;
};

// absl::Status payload type URL of the tag (never leaves the process).
inline constexpr char kErrorReasonPayloadUrl[] = "type.ampd/ampd.ErrorReason";

// Client input echoed in a message is cut to this many bytes, so that a 1 MiB
// job id never comes back as 1 MiB of status details.
inline constexpr size_t kMaxEchoBytes = 64;

// `input` for an error message: C-escaped (a message stays printable) and,
// when longer than kMaxEchoBytes, cut with a note of its full length.
inline std::string Echo(absl::string_view input) {
  if (input.size() <= kMaxEchoBytes) return absl::CEscape(input);
  return absl::StrCat(absl::CEscape(input.substr(0, kMaxEchoBytes)), "...(", input.size(),
                      " bytes)");
}

// `status` with the reason attached (OK stays OK). Values are stored
// escaped, so any bytes survive the line-based encoding.
inline absl::Status WithReason(
    absl::Status status, absl::string_view reason_name,
    std::initializer_list<std::pair<absl::string_view, absl::string_view>> metadata = {}) {
  if (status.ok()) return status;
  std::string text(reason_name);
  for (const auto& [key, value] : metadata) {
    absl::StrAppend(&text, "\n", key, "=", absl::CEscape(value));
  }
  status.SetPayload(kErrorReasonPayloadUrl, absl::Cord(text));
  return status;
}

// The one shape of an error in a request's field: InvalidArgument
// "field: what", tagged INVALID_FIELD with the field's path, so a client can
// point at the field without parsing the message.
inline absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return WithReason(absl::InvalidArgumentError(absl::StrCat(field, ": ", what)),
                    reason::kInvalidField, {{"field", field}});
}

// The reason WithReason attached, if any.
inline std::optional<ErrorReason> GetErrorReason(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorReasonPayloadUrl);  // absl::optional
  if (!payload.has_value()) return std::nullopt;
  const std::string text(*payload);
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  ErrorReason result;
  result.reason = std::string(lines.front());
  for (size_t i = 1; i < lines.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(lines[i], absl::MaxSplits('=', 1));
    std::string value;
    if (!absl::CUnescape(kv.second, &value)) value = std::string(kv.second);
    result.metadata[std::string(kv.first)] = std::move(value);
  }
  return result;
}

}  // namespace ampd
