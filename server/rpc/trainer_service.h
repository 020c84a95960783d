// TrainerService: the ampd.v1.Trainer gRPC service on the callback API. Each
// job call's handler is one path (ServeJobCall, trainer_service.cc): the
// tenant, the request decoded into the engine's (translate.h), the
// registry's one hand-off (JobRegistry::Submit, which checks it and runs it
// on the job's ordered worker), the call finished from the completion; no
// reaction ever trains, checkpoints or waits.
// The long calls (Step, Evaluate, Sample, the state dict streams) hand the
// engine a CallToken of their deadline, stopped when gRPC cancels the call
// (call_stop.h), so work nobody waits for ends at its next unit.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/message_allocator.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "ampd/v1/trainer.grpc.pb.h"
#include "server/engine/jobs/job_registry.h"
#include "server/rpc/auth.h"

namespace ampd::rpc {

// Records one finished call: method ("Step"), code name ("OK"), seconds.
using RpcRecorder = std::function<void(absl::string_view, absl::string_view, double)>;

struct ServiceOptions {
  // LoadStateDict refuses streams whose bytes add up to more than this.
  int64_t max_state_dict_bytes = int64_t{4} << 30;
  // Bytes all LoadStateDict streams together may hold in memory at once
  // (received and not yet loaded); past it a stream fails with
  // RESOURCE_EXHAUSTED (MEMORY_LIMIT) and frees what it held.
  int64_t max_state_dict_buffer_bytes = int64_t{4} << 30;
  // GetStateDict sends the file in chunks of this size.
  int64_t chunk_bytes = int64_t{1} << 20;
  // Checks each call's bearer token before anything else; null or open:
  // every call passes. Must outlive the service.
  const Authenticator* authenticator = nullptr;
};

// A server-wide count of bytes held against a limit, shared by concurrent
// streams without a lock.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  // Adds n unless that would pass the limit; false (nothing added) then.
  bool TryAcquire(int64_t n);
  void Release(int64_t n) { held_.fetch_sub(n, std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }
  int64_t held() const { return held_.load(std::memory_order_relaxed); }

 private:
  const int64_t limit_;
  std::atomic<int64_t> held_{0};
};

// Request and response of one unary call, made by the service rather than
// by gRPC: gRPC hands a handler its request as const, and only an object
// the service allocated itself is one it may then change, as Step and
// Evaluate do when they move the batch bytes out of the request instead of
// copying megabytes once more.
template <typename Request, typename Response>
class OwnedMessages final : public grpc::MessageHolder<Request, Response> {
 public:
  OwnedMessages() {
    this->set_request(&request_);
    this->set_response(&response_);
  }
  void Release() override { delete this; }

 private:
  Request request_;
  Response response_;
};

template <typename Request, typename Response>
class OwnedMessageAllocator final : public grpc::MessageAllocator<Request, Response> {
 public:
  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    return new OwnedMessages<Request, Response>();
  }
};

class TrainerService final : public v1::Trainer::CallbackService {
 public:
  // registry must outlive the service; record may be empty.
  TrainerService(engine::JobRegistry* registry, RpcRecorder record, ServiceOptions options = {});

  grpc::ServerUnaryReactor* CreateJob(grpc::CallbackServerContext* context,
                                      const v1::CreateJobRequest* request,
                                      v1::CreateJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::GetJobResponse* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* context,
                                      const v1::DeleteJobRequest* request,
                                      v1::DeleteJobResponse* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerUnaryReactor* Evaluate(grpc::CallbackServerContext* context,
                                     const v1::EvaluateRequest* request,
                                     v1::EvaluateResponse* response) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* context,
                                            const v1::ForwardBackwardRequest* request,
                                            v1::ForwardBackwardResponse* response) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* context,
                                      const v1::OptimStepRequest* request,
                                      v1::StepResponse* response) override;
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* context,
                                   const v1::SampleRequest* request,
                                   v1::SampleResponse* response) override;
  grpc::ServerUnaryReactor* SaveSamplerSnapshot(grpc::CallbackServerContext* context,
                                                const v1::SaveSamplerSnapshotRequest* request,
                                                v1::SaveSamplerSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* ListSamplerSnapshots(
      grpc::CallbackServerContext* context, const v1::ListSamplerSnapshotsRequest* request,
      v1::ListSamplerSnapshotsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSamplerSnapshot(
      grpc::CallbackServerContext* context, const v1::DeleteSamplerSnapshotRequest* request,
      v1::DeleteSamplerSnapshotResponse* response) override;
  grpc::ServerWriteReactor<v1::StateDictChunk>* GetStateDict(
      grpc::CallbackServerContext* context, const v1::GetStateDictRequest* request) override;
  grpc::ServerReadReactor<v1::LoadStateDictRequest>* LoadStateDict(
      grpc::CallbackServerContext* context, v1::LoadStateDictResponse* response) override;

  // Finishes a unary call (from any thread) and records it.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, absl::string_view method, absl::Time start,
                   const absl::Status& status) const;
  void Record(absl::string_view method, const grpc::Status& status, absl::Time start) const;
  // The tenant the call authenticated as ("" when the server runs open).
  // Every Trainer handler calls it before anything else and keeps the name
  // in scope, where per-tenant job ownership will use it.
  absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext& context) const;

 private:
  engine::JobRegistry* const registry_;
  const RpcRecorder record_;
  const ServiceOptions options_;
  ByteBudget state_dict_buffer_;
  // Step's, Evaluate's and ForwardBackward's messages (OwnedMessages); they outlive every call
  // because the server is shut down before the service is destroyed.
  OwnedMessageAllocator<v1::StepRequest, v1::StepResponse> step_messages_;
  OwnedMessageAllocator<v1::EvaluateRequest, v1::EvaluateResponse> evaluate_messages_;
  OwnedMessageAllocator<v1::ForwardBackwardRequest, v1::ForwardBackwardResponse>
      forward_backward_messages_;
};

}  // namespace ampd::rpc
