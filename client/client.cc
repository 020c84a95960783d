// ampd::Client: deadlines, bounded retries with backoff, streaming helpers.
#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "codec/host_tensor.h"
#include "common/pem_file.h"
#include "common/status_macros.h"
#include "google/rpc/status.pb.h"

namespace ampd {
namespace {

// Codes after which a resend may succeed and cannot do harm (the callers of
// WithRetries are the idempotent calls).
bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::ABORTED;
}

std::string NewRequestId() {
  absl::BitGen gen;
  return absl::StrFormat("req-%016x%016x", absl::Uniform<uint64_t>(gen),
                         absl::Uniform<uint64_t>(gen));
}

}  // namespace

namespace {
constexpr char kErrorInfoUrl[] = "type.googleapis.com/google.rpc.ErrorInfo";
}  // namespace

std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const grpc::Status& status) {
  if (status.ok() || status.error_details().empty()) return std::nullopt;
  google::rpc::Status details;
  if (!details.ParseFromString(status.error_details())) return std::nullopt;
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    if (any.UnpackTo(&info)) return info;
  }
  return std::nullopt;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(status); info.has_value()) {
    result.SetPayload(kErrorInfoUrl, absl::Cord(info->SerializeAsString()));
  }
  return result;
}

std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorInfoUrl);  // absl::optional
  if (!payload.has_value()) return std::nullopt;
  google::rpc::ErrorInfo info;
  if (!info.ParseFromString(std::string(*payload))) return std::nullopt;
  return info;
}

std::string DescribeError(const absl::Status& status) {
  const std::string code = absl::StatusCodeToString(status.code());
  std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(status);
  if (!info.has_value()) return absl::StrCat(code, ": ", status.message());
  // Sorted, so the line reads the same every time (map order is unspecified).
  std::vector<std::string> facts;
  for (const auto& [key, value] : info->metadata()) facts.push_back(absl::StrCat(key, "=", value));
  std::sort(facts.begin(), facts.end());
  facts.insert(facts.begin(), info->reason());
  return absl::StrCat(code, " [", absl::StrJoin(facts, " "), "]: ", status.message());
}

absl::Status LoadTlsFiles(const std::string& ca_path, const std::string& cert_path,
                          const std::string& key_path, ClientOptions& options) {
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!ca_path.empty()) {
    AMPD_ASSIGN_OR_RETURN(options.tls_ca_pem, ReadPemFile("--tls-ca", ca_path));
    options.tls = true;
  }
  if (!cert_path.empty()) {
    AMPD_ASSIGN_OR_RETURN(std::string cert, ReadPemFile("--tls-cert", cert_path));
    AMPD_ASSIGN_OR_RETURN(std::string key, ReadPemFile("--tls-key", key_path));
    options.tls_cert_pem = std::move(cert);
    options.tls_key_pem = std::move(key);
    options.tls = true;
  }
  return absl::OkStatus();
}

std::unique_ptr<Client> Client::Connect(const std::string& target, ClientOptions options) {
  grpc::ChannelArguments args;
  // A connection of its own: gRPC otherwise shares one TCP connection among
  // every channel of the process with the same target and arguments, and
  // one HTTP/2 connection is read and written by one thread at a time on
  // each side, so clients stepping different jobs in parallel would queue
  // behind each other's batches.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return std::make_unique<Client>(grpc::CreateCustomChannel(target, credentials, args), options);
}

Client::Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      options_(options),
      stub_(v1::Trainer::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

void Client::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
  // Per call rather than as call credentials: gRPC only attaches call
  // credentials to TLS channels, and an operator may run tokens over
  // plaintext on loopback.
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
}

template <typename Fn>
grpc::Status Client::WithRetries(Fn attempt) {
  absl::Duration backoff = options_.initial_backoff;
  absl::BitGen gen;
  grpc::Status status;
  for (int i = 0; i < std::max(1, options_.max_attempts); ++i) {
    if (i > 0) {
      // Full jitter keeps clients that failed together from retrying together.
      absl::SleepFor(
          absl::Milliseconds(absl::Uniform<double>(gen, 0.0, absl::ToDoubleMilliseconds(backoff))));
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
    grpc::ClientContext context;
    Prepare(context);
    status = attempt(context);
    if (status.ok() || !Retryable(status.error_code())) return status;
  }
  return status;
}

absl::StatusOr<v1::Job> Client::CreateJob(v1::CreateJobRequest request) {
  if (request.request_id().empty()) request.set_request_id(NewRequestId());
  v1::CreateJobResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->CreateJob(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response.job();
}

absl::StatusOr<v1::Job> Client::GetJob(const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::GetJobResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->GetJob(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response.job();
}

absl::StatusOr<v1::ListJobsResponse> Client::ListJobs(int page_size,
                                                      const std::string& page_token) {
  v1::ListJobsRequest request;
  request.set_page_size(page_size);
  request.set_page_token(page_token);
  v1::ListJobsResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->ListJobs(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<std::vector<v1::Job>> Client::ListAllJobs() {
  std::vector<v1::Job> jobs;
  std::string token;
  do {
    AMPD_ASSIGN_OR_RETURN(v1::ListJobsResponse page, ListJobs(0, token));
    jobs.insert(jobs.end(), page.jobs().begin(), page.jobs().end());
    token = page.next_page_token();
  } while (!token.empty());
  return jobs;
}

absl::StatusOr<std::vector<std::string>> Client::ListModels() {
  v1::ListModelsResponse response;
  grpc::Status s = WithRetries([&](grpc::ClientContext& context) {
    return stub_->ListModels(&context, v1::ListModelsRequest(), &response);
  });
  if (!s.ok()) return FromGrpcStatus(s);
  return std::vector<std::string>(response.models().begin(), response.models().end());
}

absl::Status Client::DeleteJob(const std::string& job_id) {
  v1::DeleteJobRequest request;
  request.set_job_id(job_id);
  v1::DeleteJobResponse response;
  grpc::ClientContext context;
  Prepare(context);
  return FromGrpcStatus(stub_->DeleteJob(&context, request, &response));
}

absl::StatusOr<v1::StepResponse> Client::Step(const v1::StepRequest& request) {
  v1::StepResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->Step(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::ForwardBackwardResponse> Client::ForwardBackward(
    const v1::ForwardBackwardRequest& request) {
  v1::ForwardBackwardResponse response;
  grpc::Status s = WithRetries([&](grpc::ClientContext& context) {
    return stub_->ForwardBackward(&context, request, &response);
  });
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::StepResponse> Client::OptimStep(const v1::OptimStepRequest& request) {
  v1::StepResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->OptimStep(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::EvaluateResponse> Client::Evaluate(const v1::EvaluateRequest& request) {
  v1::EvaluateResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return stub_->Evaluate(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<std::string> Client::GetStateDict(const std::string& job_id, v1::StateView view) {
  v1::GetStateDictRequest request;
  request.set_job_id(job_id);
  request.set_view(view);
  std::string bytes;
  grpc::Status s = WithRetries([&](grpc::ClientContext& context) {
    bytes.clear();
    std::unique_ptr<grpc::ClientReader<v1::StateDictChunk>> reader =
        stub_->GetStateDict(&context, request);
    v1::StateDictChunk chunk;  // one message, its buffer reused by every read
    while (reader->Read(&chunk)) {
      // The first chunk gives the file's length: allocated once, rather
      // than grown (and copied) at every doubling. A length the client
      // cannot hold is left to the appends to find out.
      if (bytes.empty() && chunk.total_bytes() > 0 &&
          chunk.total_bytes() <= options_.max_state_dict_bytes) {
        codec::ReserveForBulkCopy(&bytes, static_cast<size_t>(chunk.total_bytes()));
      }
      bytes.append(chunk.data());
    }
    return reader->Finish();
  });
  if (!s.ok()) return FromGrpcStatus(s);
  return bytes;
}

absl::StatusOr<v1::LoadStateDictResponse> Client::LoadStateDict(const std::string& job_id,
                                                                absl::string_view safetensors,
                                                                bool partial) {
  grpc::ClientContext context;
  Prepare(context);
  v1::LoadStateDictResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer =
      stub_->LoadStateDict(&context, &response);
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(1, options_.state_chunk_bytes));
  size_t offset = 0;
  v1::LoadStateDictRequest message;  // one message, its buffer reused for every chunk
  do {
    if (offset == 0) {
      message.set_job_id(job_id);
      message.set_partial(partial);
    } else {
      message.clear_job_id();
      message.clear_partial();
    }
    const size_t n = std::min(chunk, safetensors.size() - offset);
    message.mutable_data()->assign(safetensors.data() + offset, n);
    offset += n;
    // A failed write means the server already finished the call; Finish says why.
    if (!writer->Write(message)) break;
  } while (offset < safetensors.size());
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = WithRetries(
      [&](grpc::ClientContext& context) { return health_->Check(&context, request, &response); });
  if (!s.ok()) return FromGrpcStatus(s);
  return response.status();
}

}  // namespace ampd
