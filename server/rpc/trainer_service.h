// TrainerService: the ampd.v1.Trainer gRPC service on the callback API. Each
// handler decodes and validates its request, hands the work to the
// JobRegistry (which runs it on the job's ordered worker) and finishes the
// call from the completion; no reaction ever trains, checkpoints or waits.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "ampd/v1/trainer.grpc.pb.h"
#include "server/engine/jobs/job_registry.h"

namespace ampd::rpc {

// Records one finished call: method ("Step"), code name ("OK"), seconds.
using RpcRecorder = std::function<void(absl::string_view, absl::string_view, double)>;

struct ServiceOptions {
  // LoadStateDict refuses streams whose bytes add up to more than this.
  int64_t max_state_dict_bytes = int64_t{4} << 30;
  // GetStateDict sends the file in chunks of this size.
  int64_t chunk_bytes = int64_t{1} << 20;
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
  grpc::ServerWriteReactor<v1::StateDictChunk>* GetStateDict(
      grpc::CallbackServerContext* context, const v1::GetStateDictRequest* request) override;
  grpc::ServerReadReactor<v1::LoadStateDictRequest>* LoadStateDict(
      grpc::CallbackServerContext* context, v1::LoadStateDictResponse* response) override;

  // Finishes a unary call (from any thread) and records it.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, absl::string_view method, absl::Time start,
                   const absl::Status& status) const;
  void Record(absl::string_view method, const grpc::Status& status, absl::Time start) const;

 private:
  engine::JobRegistry* const registry_;
  const RpcRecorder record_;
  const ServiceOptions options_;
};

}  // namespace ampd::rpc
