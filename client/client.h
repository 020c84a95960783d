// ampd::Client: a C++ client for ampd.v1.Trainer with a deadline on every
// call and bounded retries with exponential backoff where a retry is safe:
// Step, ForwardBackward and OptimStep (sequence numbers make a resend
// exactly-once), GetJob/ListJobs/
// GetStateDict/Evaluate (reads), CreateJob (a request_id, generated when the caller
// gives none, makes a resend return the same job), and the health check.
// DeleteJob and LoadStateDict are sent once.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "ampd/v1/trainer.grpc.pb.h"
#include "google/rpc/error_details.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace ampd {

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(60);  // per attempt
  int max_attempts = 5;                         // for the retryable calls
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  int max_message_bytes = 256 << 20;  // send and receive
  int64_t state_chunk_bytes = 1 << 20;
  // GetStateDict allocates a file up to this size at once, from the length
  // the server announces; larger ones grow as they arrive.
  int64_t max_state_dict_bytes = int64_t{64} << 30;
  // Sent as "authorization: Bearer TOKEN" on every Trainer call when set.
  std::string token;
  // TLS: on when `tls` is set. tls_ca_pem verifies the server (empty: the
  // system's roots); tls_cert_pem with tls_key_pem is the client
  // certificate a server with --tls-client-ca asks for.
  bool tls = false;
  std::string tls_ca_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // The name the server's certificate must carry, when it is not the
  // target's host (e.g. a probe dialling 127.0.0.1 inside the pod of a
  // server whose certificate names only its service). Empty: the host.
  std::string tls_server_name;
};

// Reads PEM files into `options` and turns TLS on when any path is set
// (cert and key go together). Empty paths are skipped.
absl::Status LoadTlsFiles(const std::string& ca_path, const std::string& cert_path,
                          const std::string& key_path, ClientOptions& options);

// gRPC status -> absl::Status (same code and message). The google.rpc.ErrorInfo
// ampd sends in the status details rides along as a payload: read it with
// ErrorInfoOf, so callers branch on its reason ("SEQUENCE_MISMATCH") and
// metadata ("expected_sequence") rather than on the message's wording.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The ErrorInfo of a status FromGrpcStatus made; nullopt when the server
// sent none.
std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const absl::Status& status);
// The ErrorInfo of a grpc::Status, straight from its details.
std::optional<google::rpc::ErrorInfo> ErrorInfoOf(const grpc::Status& status);

// One line for people: "FAILED_PRECONDITION [SEQUENCE_MISMATCH
// expected_sequence=2]: sequence: expected 2, got 3" (no brackets without
// an ErrorInfo).
std::string DescribeError(const absl::Status& status);

class Client {
 public:
  // target: "HOST:PORT". Connects lazily; no call is made here. Each Client
  // made here has a connection of its own (not shared with other channels
  // of the process), so clients driving different jobs from one process
  // do not serialise on one HTTP/2 connection.
  static std::unique_ptr<Client> Connect(const std::string& target, ClientOptions options = {});
  // For tests and tools that bring their own channel.
  Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  absl::StatusOr<v1::Job> CreateJob(v1::CreateJobRequest request);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(int page_size, const std::string& page_token);
  // Every page.
  absl::StatusOr<std::vector<v1::Job>> ListAllJobs();
  absl::Status DeleteJob(const std::string& job_id);
  // The base models of the server's --models-dir (ListModels).
  absl::StatusOr<std::vector<std::string>> ListModels();
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& request);
  // A step in two halves: calls accumulate gradients (sequence and index
  // make a resend exactly-once), an OptimStep applies them (its sequence,
  // as Step's).
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(
      const v1::ForwardBackwardRequest& request);
  absl::StatusOr<v1::StepResponse> OptimStep(const v1::OptimStepRequest& request);
  // Forward and loss only; the job's weights and step sequence are unchanged.
  absl::StatusOr<v1::EvaluateResponse> Evaluate(const v1::EvaluateRequest& request);
  // The job's state as one safetensors file; a LoRA job's adapter or
  // merged view on request (GetStateDictRequest.view).
  absl::StatusOr<std::string> GetStateDict(const std::string& job_id,
                                           v1::StateView view = v1::STATE_VIEW_FULL);
  // partial: the file holds some of the model's weights (one file of a
  // sharded checkpoint; LoadStateDictRequest.partial).
  absl::StatusOr<v1::LoadStateDictResponse> LoadStateDict(const std::string& job_id,
                                                          absl::string_view safetensors,
                                                          bool partial = false);
  // grpc.health.v1 Check: the serving status ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  v1::Trainer::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  // Runs attempt(context) until it succeeds, fails with a code that is not
  // worth retrying, or max_attempts is reached; each attempt gets a fresh
  // context with the deadline.
  template <typename Fn>
  grpc::Status WithRetries(Fn attempt);
  void Prepare(grpc::ClientContext& context) const;

  std::shared_ptr<grpc::Channel> channel_;
  ClientOptions options_;
  std::unique_ptr<v1::Trainer::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

}  // namespace ampd
