// ToGrpcStatus and GrpcCodeName against responses written out by hand: for
// every absl code the gRPC code, the message and the exact bytes of the
// google.rpc.Status details (ErrorInfo reason, domain and metadata), the
// field path derived for InvalidArgument, reasons the engine attached, the
// cut of long messages, and the names metrics label codes with.
#include "server/rpc/status_mapping.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/error_reason.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace ampd::rpc {
namespace {

// The details ToGrpcStatus must send for `code`, `message` and the reason.
std::string Details(int code, const std::string& message, const std::string& reason,
                    const std::map<std::string, std::string>& metadata = {}) {
  google::rpc::ErrorInfo info;
  info.set_reason(reason);
  info.set_domain("ampd");
  for (const auto& [key, value] : metadata) (*info.mutable_metadata())[key] = value;
  google::rpc::Status status;
  status.set_code(code);
  status.set_message(message);
  status.add_details()->PackFrom(info);
  return status.SerializeAsString();
}

void ExpectMapped(const absl::Status& in, grpc::StatusCode code, const std::string& message,
                  const std::string& reason, const std::map<std::string, std::string>& metadata) {
  const grpc::Status out = ToGrpcStatus(in);
  EXPECT_EQ(out.error_code(), code) << in;
  EXPECT_EQ(out.error_message(), message) << in;
  const std::string want = Details(static_cast<int>(code), message, reason, metadata);
  // Byte for byte where the bytes are defined: protobuf leaves the order of
  // several map entries to the implementation, so those compare as messages.
  if (metadata.size() <= 1) {
    EXPECT_EQ(out.error_details(), want) << in;
  }
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(out.error_details())) << in;
  google::rpc::Status want_details;
  ASSERT_TRUE(want_details.ParseFromString(want));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(details, want_details)) << in;
  ASSERT_EQ(details.details_size(), 1) << in;
  google::rpc::ErrorInfo info;
  ASSERT_TRUE(details.details(0).UnpackTo(&info)) << in;
  EXPECT_EQ(info.reason(), reason) << in;
  EXPECT_EQ(info.domain(), "ampd") << in;
  const std::map<std::string, std::string> got_metadata(info.metadata().begin(),
                                                        info.metadata().end());
  EXPECT_EQ(got_metadata, metadata) << in;
}

struct CodeCase {
  absl::StatusCode absl_code;
  grpc::StatusCode grpc_code;
  const char* name;
};

const std::vector<CodeCase>& AllCodes() {
  static const std::vector<CodeCase> cases = {
      {absl::StatusCode::kOk, grpc::StatusCode::OK, "OK"},
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED, "CANCELLED"},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN, "UNKNOWN"},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED,
       "DEADLINE_EXCEEDED"},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND, "NOT_FOUND"},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS, "ALREADY_EXISTS"},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED,
       "PERMISSION_DENIED"},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED,
       "RESOURCE_EXHAUSTED"},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION,
       "FAILED_PRECONDITION"},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED, "ABORTED"},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE, "OUT_OF_RANGE"},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED, "UNIMPLEMENTED"},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL, "INTERNAL"},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE, "UNAVAILABLE"},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS, "DATA_LOSS"},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED, "UNAUTHENTICATED"},
  };
  return cases;
}

TEST(StatusMapping, OkIsPlainOk) {
  const grpc::Status out = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(out.ok());
  EXPECT_EQ(out.error_message(), "");
  EXPECT_EQ(out.error_details(), "");
}

TEST(StatusMapping, EveryCodeKeepsItsCodeAndMessageAndCarriesItsName) {
  for (const CodeCase& c : AllCodes()) {
    if (c.absl_code == absl::StatusCode::kOk) continue;
    SCOPED_TRACE(c.name);
    // InvalidArgument's reason is INVALID_FIELD; this message names no field.
    const std::string reason =
        c.absl_code == absl::StatusCode::kInvalidArgument ? "INVALID_FIELD" : c.name;
    ExpectMapped(absl::Status(c.absl_code, "it broke"), c.grpc_code, "it broke", reason, {});
  }
}

TEST(StatusMapping, CodeOutsideTheCanonicalSetIsUnknown) {
  ExpectMapped(absl::Status(static_cast<absl::StatusCode>(99), "odd"), grpc::StatusCode::UNKNOWN,
               "odd", "UNKNOWN", {});
}

TEST(StatusMapping, InvalidArgumentNamesTheFieldItsMessageStartsWith) {
  const std::vector<std::pair<std::string, std::map<std::string, std::string>>> cases = {
      {"config.optimizer.lr: must be finite", {{"field", "config.optimizer.lr"}}},
      {"config.model.layers[2].linear.in_features: must be > 0",
       {{"field", "config.model.layers[2].linear.in_features"}}},
      {"scale: must be a plain decimal number", {{"field", "scale"}}},
      {"scaler state: key 'scale' must be finite", {}},  // a space: not a field path
      {": nothing before the colon", {}},
      {"no colon at all", {}},
      {"field:no space after the colon", {}},
      {"a-b: dash", {}},
      // An element of a 2-D batch (the token-id checks name them so).
      {"micro_batches[0].inputs[1, 3]: 96 is outside [0, 96)",
       {{"field", "micro_batches[0].inputs[1, 3]"}}},
      {"micro_batches[2].targets[0, 7]: 5 is outside [0, 4) and not -100",
       {{"field", "micro_batches[2].targets[0, 7]"}}},
      {"a[1, 2: unclosed", {}},
      {"a[1]]: unopened", {}},
      {"a b[1, 2]: a space outside the index", {}},
  };
  for (const auto& [message, metadata] : cases) {
    ExpectMapped(absl::InvalidArgumentError(message), grpc::StatusCode::INVALID_ARGUMENT, message,
                 "INVALID_FIELD", metadata);
  }
}

TEST(StatusMapping, AttachedReasonAndMetadataWin) {
  ExpectMapped(WithReason(absl::NotFoundError("job 'j\n' not found"), reason::kJobNotFound,
                          {{"job_id", "j\n"}}),
               grpc::StatusCode::NOT_FOUND, "job 'j\n' not found", "JOB_NOT_FOUND",
               {{"job_id", "j\n"}});
  // On InvalidArgument too, in place of the derived field.
  ExpectMapped(WithReason(absl::InvalidArgumentError("data: not a safetensors file"),
                          reason::kInvalidStateDict),
               grpc::StatusCode::INVALID_ARGUMENT, "data: not a safetensors file",
               "INVALID_STATE_DICT", {});
  ExpectMapped(WithReason(absl::FailedPreconditionError("sequence"), reason::kSequenceMismatch,
                          {{"expected_sequence", "5"}, {"got", "7"}}),
               grpc::StatusCode::FAILED_PRECONDITION, "sequence", "SEQUENCE_MISMATCH",
               {{"expected_sequence", "5"}, {"got", "7"}});
}

TEST(StatusMapping, LongMessagesAreCut) {
  const std::string exact(1024, 'x');
  ExpectMapped(absl::InternalError(exact), grpc::StatusCode::INTERNAL, exact, "INTERNAL", {});
  const std::string long_message(1025, 'y');
  ExpectMapped(absl::InternalError(long_message), grpc::StatusCode::INTERNAL,
               std::string(1024, 'y') + "...(1025 bytes)", "INTERNAL", {});
  // The field is read from the whole message, before the cut.
  const std::string field_message = "config.name: " + std::string(3000, 'z');
  ExpectMapped(absl::InvalidArgumentError(field_message), grpc::StatusCode::INVALID_ARGUMENT,
               field_message.substr(0, 1024) + "...(3013 bytes)", "INVALID_FIELD",
               {{"field", "config.name"}});
}

TEST(StatusMapping, CodeNamesForMetrics) {
  for (const CodeCase& c : AllCodes()) EXPECT_EQ(GrpcCodeName(c.grpc_code), c.name);
  EXPECT_EQ(GrpcCodeName(static_cast<grpc::StatusCode>(17)), "UNKNOWN");
  EXPECT_EQ(GrpcCodeName(static_cast<grpc::StatusCode>(-1)), "UNKNOWN");
  EXPECT_EQ(GrpcCodeName(grpc::StatusCode::DO_NOT_USE), "UNKNOWN");
}

}  // namespace
}  // namespace ampd::rpc
