// TrainerService handlers and the two streaming reactors (state dict out and
// in). Handlers only translate; the registry's completions finish the calls.
#include "server/rpc/trainer_service.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/safetensors_receiver.h"
#include "common/error_reason.h"
#include "server/rpc/call_stop.h"
#include "server/rpc/status_mapping.h"
#include "server/rpc/translate.h"

namespace ampd::rpc {
namespace {

// Streams one safetensors file in chunks. The export runs on the job's
// worker; the writes are started from its completion and then from
// OnWriteDone reactions, which only hand the next slice to gRPC. Each chunk
// is copied straight from the header and the exported host tensors: the
// file is never concatenated in memory.
class StateDictWriter final : public grpc::ServerWriteReactor<v1::StateDictChunk> {
 public:
  StateDictWriter(const TrainerService* service, engine::JobRegistry* registry,
                  const grpc::CallbackServerContext& context, const std::string& tenant,
                  const std::string& job_id, int view, int64_t chunk_bytes)
      : service_(service),
        chunk_bytes_(static_cast<size_t>(chunk_bytes)),
        start_(absl::Now()),
        call_(CallTokenFor(context)) {
    if (absl::Status s = CheckLength("job_id", job_id); !s.ok()) {
      Done(ToGrpcStatus(s));
      return;
    }
    absl::StatusOr<engine::StateView> state_view = StateViewFromProto(view);
    if (!state_view.ok()) {
      Done(ToGrpcStatus(state_view.status()));
      return;
    }
    registry->Submit(
        tenant, job_id, engine::ExportStateRequest{*state_view},
        [this, job_id](absl::StatusOr<codec::EncodedSafetensors> file) {
          if (!file.ok()) {
            Done(ToGrpcStatus(file.status()));
            return;
          }
          file_ = *std::move(file);
          size_ = file_.size();
          exported_ = absl::Now();
          job_id_ = job_id;
          WriteNext();
        },
        call_);
  }

  // An export not started yet is skipped; chunks stop with OnWriteDone.
  void OnCancel() override { StopCancelledCall(call_); }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (offset_ >= size_) {
      Done(grpc::Status::OK);
      return;
    }
    const uint64_t n = std::min<uint64_t>(chunk_bytes_, size_ - offset_);
    std::string* data = chunk_.mutable_data();
    data->clear();  // keeps its capacity: one chunk buffer for the stream
    file_.CopyOut(offset_, n, data);
    // The first chunk says how long the file is, so the client can
    // allocate it once.
    chunk_.set_total_bytes(offset_ == 0 ? static_cast<int64_t>(size_) : 0);
    offset_ += n;
    StartWrite(&chunk_);
  }
  void Done(const grpc::Status& status) {
    service_->Record("GetStateDict", status, start_);
    if (status.ok()) {
      // Where a large export's time goes (the state's read back on the job's
      // worker, then the stream), for whoever tunes the node.
      const double total = absl::ToDoubleSeconds(absl::Now() - start_);
      std::fprintf(stderr,
                   "ampd: GetStateDict of job %s: %llu bytes, state read in %.3f s, streamed in "
                   "%.3f s (%.2f GB/s in all)\n",
                   job_id_.c_str(), static_cast<unsigned long long>(size_),
                   absl::ToDoubleSeconds(exported_ - start_),
                   absl::ToDoubleSeconds(absl::Now() - exported_),
                   total > 0 ? static_cast<double>(size_) / total / 1e9 : 0.0);
    }
    Finish(status);
  }

  const TrainerService* service_;
  const size_t chunk_bytes_;
  const absl::Time start_;
  absl::Time exported_;  // when the state was read, before the first chunk
  std::string job_id_;
  codec::EncodedSafetensors file_;
  uint64_t size_ = 0;
  uint64_t offset_ = 0;
  v1::StateDictChunk chunk_;
  const engine::CallToken call_;
};

// Receives a client stream of chunks (the first message names the job) and
// decodes the safetensors file as it arrives (codec::SafetensorsReceiver):
// each chunk's bytes are copied once, into the tensor they belong to, from
// the one request message reused for every read, so the stream holds the
// file once and no chunk outlives its read. A file that is not valid ends
// the call at the chunk that shows it. At the end the decoded state goes to
// the job's worker, which loads it. Memory is held against the per-stream
// and server-wide limits before it is allocated (a tensor's buffer when its
// first byte arrives).
class StateDictReader final : public grpc::ServerReadReactor<v1::LoadStateDictRequest> {
 public:
  StateDictReader(const TrainerService* service, engine::JobRegistry* registry,
                  const grpc::CallbackServerContext& context, std::string tenant,
                  v1::LoadStateDictResponse* response, int64_t max_bytes, ByteBudget* budget)
      : call_(CallTokenFor(context)),
        service_(service),
        registry_(registry),
        tenant_(std::move(tenant)),
        response_(response),
        max_bytes_(max_bytes),
        budget_(budget),
        start_(absl::Now()),
        receiver_([this](uint64_t n) { return Hold(n); }) {
    StartRead(&request_);
  }

  // A load not made yet is not made (JobRegistry::Submit).
  void OnCancel() override { StopCancelledCall(call_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // The client half-closed (the file is complete), or the call ended.
      if (absl::Status s = call_.Check("LoadStateDict stopped; nothing was loaded"); !s.ok()) {
        Done(s);
        return;
      }
      if (job_id_.empty()) {
        Done(FieldError("job_id", "the first message must name the job"));
        return;
      }
      absl::StatusOr<codec::StateDict> state = receiver_.Finish();
      if (!state.ok()) {
        Done(WithReason(state.status(), reason::kInvalidStateDict));
        return;
      }
      const auto size = static_cast<int64_t>(receiver_.received_bytes());
      const absl::Time received = absl::Now();
      registry_->Submit(
          tenant_, job_id_, engine::ImportStateRequest{*std::move(state), partial_},
          [this, size, received](absl::StatusOr<int64_t> n) {
            if (n.ok()) {
              response_->set_bytes(size);
              response_->set_tensors(*n);
              // Where a large import's time goes: the stream, then the load
              // on the job's worker (upload, and the checkpoint beside it).
              const double total = absl::ToDoubleSeconds(absl::Now() - start_);
              std::fprintf(stderr,
                           "ampd: LoadStateDict of job %s: %lld bytes received in %.3f s, loaded "
                           "in %.3f s (%.2f GB/s in all)\n",
                           job_id_.c_str(), static_cast<long long>(size),
                           absl::ToDoubleSeconds(received - start_),
                           absl::ToDoubleSeconds(absl::Now() - received),
                           total > 0 ? static_cast<double>(size) / total / 1e9 : 0.0);
            }
            Done(n.status());
          },
          call_);
      return;
    }
    if (absl::Status s = CheckLength("job_id", request_.job_id()); !s.ok()) {
      Done(s);
      return;
    }
    if (first_) {
      first_ = false;
      job_id_ = request_.job_id();
      partial_ = request_.partial();
      if (job_id_.empty()) {
        Done(FieldError("job_id", "the first message must name the job"));
        return;
      }
      // Before any byte is held: a job this tenant does not have (or
      // another tenant's, which answers the same) is known now, not after
      // the whole file.
      if (absl::Status s = registry_->GetJob(tenant_, job_id_).status(); !s.ok()) {
        Done(s);
        return;
      }
    } else if (!request_.job_id().empty() && request_.job_id() != job_id_) {
      Done(FieldError("job_id", absl::StrCat("later messages name job '", Echo(request_.job_id()),
                                             "' but the stream is for '", Echo(job_id_), "'")));
      return;
    }
    if (absl::Status s = Receive(request_.data()); !s.ok()) {
      Done(s);
      return;
    }
    // Keeps the string's capacity: the next chunk is parsed into it.
    request_.mutable_data()->clear();
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  // Appends a chunk to the file. The receiver allocates tensors' buffers
  // here, on a reaction thread: an allocation failure becomes the call's
  // error rather than an exception through gRPC.
  absl::Status Receive(absl::string_view data) {
    absl::Status s;
    try {
      s = receiver_.Append(data);
    } catch (const std::bad_alloc&) {
      s = absl::ResourceExhaustedError("data: out of host memory for the state dict");
    } catch (const std::length_error&) {
      s = absl::ResourceExhaustedError("data: a tensor of the state dict exceeds the maximum size");
    }
    if (!s.ok()) {
      return s.code() == absl::StatusCode::kInvalidArgument
                 ? WithReason(s, reason::kInvalidStateDict)
                 : s;
    }
    // The header declares the file's length: a file over the limit is
    // refused now rather than after its first gigabytes.
    if (const std::optional<uint64_t> declared = receiver_.declared_bytes();
        declared.has_value() && *declared > static_cast<uint64_t>(max_bytes_)) {
      return OverLimit();
    }
    return absl::OkStatus();
  }

  // The receiver's reserve: n more bytes held by this stream, against its
  // own limit and the server's budget.
  absl::Status Hold(uint64_t n) {
    if (n > static_cast<uint64_t>(max_bytes_ - held_)) return OverLimit();
    const auto bytes = static_cast<int64_t>(n);
    if (!budget_->TryAcquire(bytes)) {
      // The budget is every tenant's: the refusal names the limit and this
      // stream's own bytes only, never what the other streams hold.
      return WithReason(
          absl::ResourceExhaustedError(absl::StrCat(
              "data: the state dict's next ", n,
              " bytes do not fit beside the LoadStateDict streams in progress under the "
              "server's --max-state-dict-buffer-bytes=",
              budget_->limit(), " now; this stream holds ", held_, " bytes; retry later")),
          reason::kMemoryLimit, {{"limit_bytes", absl::StrCat(budget_->limit())}});
    }
    held_ += bytes;
    return absl::OkStatus();
  }

  absl::Status OverLimit() const {
    return WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "data: the state dict exceeds the server's limit of ", max_bytes_, " bytes")),
        reason::kMemoryLimit, {{"limit_bytes", absl::StrCat(max_bytes_)}});
  }

  void Done(const absl::Status& status) {
    // The bytes are freed (loaded, or dropped with the stream) by now.
    receiver_ = codec::SafetensorsReceiver(nullptr);
    budget_->Release(std::exchange(held_, 0));
    const grpc::Status grpc_status = ToGrpcStatus(status);
    service_->Record("LoadStateDict", grpc_status, start_);
    Finish(grpc_status);
  }

  const engine::CallToken call_;  // stopped by OnCancel; the load checks it
  const TrainerService* service_;
  engine::JobRegistry* registry_;
  const std::string tenant_;  // the caller's: only its own jobs are found
  v1::LoadStateDictResponse* response_;
  const int64_t max_bytes_;
  ByteBudget* const budget_;
  int64_t held_ = 0;  // of budget_, for this stream
  const absl::Time start_;
  v1::LoadStateDictRequest request_;
  bool partial_ = false;  // the first message's partial
  bool first_ = true;
  std::string job_id_;
  codec::SafetensorsReceiver receiver_;  // the file so far, decoded
};

// A stream refused before it started (the caller did not authenticate):
// finishes at once with `status`.
template <typename Reactor>
class RefusedStream final : public Reactor {
 public:
  RefusedStream(const TrainerService* service, absl::string_view method,
                const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    service->Record(method, grpc_status, absl::Now());
    this->Finish(grpc_status);
  }
  void OnDone() override { delete this; }
};

// Whether a call's work stops when gRPC cancels it (its deadline, its
// client gone): the long ones. The others run to their end once started.
enum class Stoppable { kNo, kYes };

// Every job call's handler: the tenant, the job id's length, the request
// decoded into the engine's (translate.h: `decode`, after the tenant is
// known), the registry's one hand-off (JobRegistry::Submit) and the
// response from its report (`encode`). A stoppable call's reactor hands
// the engine its CallToken.
template <typename Decode, typename Encode>
grpc::ServerUnaryReactor* ServeJobCall(const TrainerService& service, engine::JobRegistry& registry,
                                       grpc::CallbackServerContext* context,
                                       absl::string_view method, Stoppable stoppable,
                                       const std::string& job_id, Decode decode, Encode encode) {
  const absl::Time start = absl::Now();
  engine::CallToken call;
  grpc::ServerUnaryReactor* reactor = nullptr;
  if (stoppable == Stoppable::kYes) {
    auto* stoppable_reactor = new StoppableUnaryReactor(*context);
    call = stoppable_reactor->call();
    reactor = stoppable_reactor;
  } else {
    reactor = context->DefaultReactor();
  }
  absl::StatusOr<std::string> tenant = service.Authenticate(*context);
  absl::Status refused = tenant.status();
  if (refused.ok()) refused = CheckLength("job_id", job_id);
  using Decoded = decltype(decode());  // absl::StatusOr<the engine's request>
  Decoded request = refused.ok() ? decode() : Decoded(refused);
  if (!request.ok()) {
    service.FinishUnary(reactor, method, start, request.status());
    return reactor;
  }
  using Report = typename Decoded::value_type::Report;
  registry.Submit(
      *tenant, job_id, *std::move(request),
      [&service, reactor, method, start, encode](absl::StatusOr<Report> report) {
        if (report.ok()) encode(*report);
        service.FinishUnary(reactor, method, start, report.status());
      },
      call);
  return reactor;
}

// A decoded request that cannot fail, as the template above takes it.
template <typename Request>
absl::StatusOr<Request> Decoded(Request request) {
  return request;
}

}  // namespace

absl::StatusOr<std::string> TrainerService::Authenticate(
    const grpc::CallbackServerContext& context) const {
  if (options_.authenticator == nullptr) return std::string();
  return options_.authenticator->Authenticate(context);
}

bool ByteBudget::TryAcquire(int64_t n) {
  int64_t held = held_.load(std::memory_order_relaxed);
  do {
    if (n > limit_ - held) return false;
  } while (!held_.compare_exchange_weak(held, held + n, std::memory_order_relaxed));
  return true;
}

TrainerService::TrainerService(engine::JobRegistry* registry, RpcRecorder record,
                               ServiceOptions options)
    : registry_(registry),
      record_(std::move(record)),
      options_(options),
      state_dict_buffer_(options.max_state_dict_buffer_bytes) {
  SetMessageAllocatorFor_Step(&step_messages_);
  SetMessageAllocatorFor_Evaluate(&evaluate_messages_);
  SetMessageAllocatorFor_ForwardBackward(&forward_backward_messages_);
}

void TrainerService::Record(absl::string_view method, const grpc::Status& status,
                            absl::Time start) const {
  if (record_) {
    record_(method, GrpcCodeName(status.error_code()), absl::ToDoubleSeconds(absl::Now() - start));
  }
}

void TrainerService::FinishUnary(grpc::ServerUnaryReactor* reactor, absl::string_view method,
                                 absl::Time start, const absl::Status& status) const {
  const grpc::Status grpc_status = ToGrpcStatus(status);
  Record(method, grpc_status, start);
  reactor->Finish(grpc_status);
}

grpc::ServerUnaryReactor* TrainerService::CreateJob(grpc::CallbackServerContext* context,
                                                    const v1::CreateJobRequest* request,
                                                    v1::CreateJobResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    FinishUnary(reactor, "CreateJob", start, tenant.status());
    return reactor;
  }
  if (absl::Status s = CheckLength("request_id", request->request_id()); !s.ok()) {
    FinishUnary(reactor, "CreateJob", start, s);
    return reactor;
  }
  absl::StatusOr<engine::JobConfig> config = JobConfigFromProto(request->config());
  if (!config.ok()) {
    FinishUnary(reactor, "CreateJob", start, config.status());
    return reactor;
  }
  registry_->CreateJob(*tenant, *std::move(config), request->request_id(),
                       [this, reactor, response, start](absl::StatusOr<engine::JobSnapshot> job) {
                         if (job.ok()) *response->mutable_job() = JobToProto(*job);
                         FinishUnary(reactor, "CreateJob", start, job.status());
                       });
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::GetJob(grpc::CallbackServerContext* context,
                                                 const v1::GetJobRequest* request,
                                                 v1::GetJobResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    FinishUnary(reactor, "GetJob", start, tenant.status());
    return reactor;
  }
  if (absl::Status s = CheckLength("job_id", request->job_id()); !s.ok()) {
    FinishUnary(reactor, "GetJob", start, s);
    return reactor;
  }
  absl::StatusOr<engine::JobSnapshot> job = registry_->GetJob(*tenant, request->job_id());
  if (job.ok()) *response->mutable_job() = JobToProto(*job);
  FinishUnary(reactor, "GetJob", start, job.status());
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::ListJobs(grpc::CallbackServerContext* context,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    FinishUnary(reactor, "ListJobs", start, tenant.status());
    return reactor;
  }
  if (absl::Status s = CheckLength("page_token", request->page_token()); !s.ok()) {
    FinishUnary(reactor, "ListJobs", start, s);
    return reactor;
  }
  absl::StatusOr<engine::JobPage> page =
      registry_->ListJobs(*tenant, request->page_size(), request->page_token());
  if (page.ok()) {
    for (const engine::JobSnapshot& job : page->jobs) *response->add_jobs() = JobToProto(job);
    response->set_next_page_token(page->next_page_token);
  }
  FinishUnary(reactor, "ListJobs", start, page.status());
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::DeleteJob(grpc::CallbackServerContext* context,
                                                    const v1::DeleteJobRequest* request,
                                                    v1::DeleteJobResponse* /*response*/) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    FinishUnary(reactor, "DeleteJob", start, tenant.status());
    return reactor;
  }
  if (absl::Status s = CheckLength("job_id", request->job_id()); !s.ok()) {
    FinishUnary(reactor, "DeleteJob", start, s);
    return reactor;
  }
  registry_->DeleteJob(*tenant, request->job_id(), [this, reactor, start](absl::Status s) {
    FinishUnary(reactor, "DeleteJob", start, s);
  });
  return reactor;
}

// The requests of Step, ForwardBackward and Evaluate are this service's
// own (step_messages_, ...: OwnedMessages), not const objects: decoding
// moves the batch bytes out of them rather than copying.

grpc::ServerUnaryReactor* TrainerService::Step(grpc::CallbackServerContext* context,
                                               const v1::StepRequest* request,
                                               v1::StepResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "Step", Stoppable::kYes, request->job_id(),
      [request] { return StepRequestFromProto(const_cast<v1::StepRequest*>(request)); },
      [response](const engine::StepReport& r) { StepReportToProto(r, response); });
}

grpc::ServerUnaryReactor* TrainerService::ForwardBackward(grpc::CallbackServerContext* context,
                                                          const v1::ForwardBackwardRequest* request,
                                                          v1::ForwardBackwardResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "ForwardBackward", Stoppable::kYes, request->job_id(),
      [request] {
        return ForwardBackwardRequestFromProto(const_cast<v1::ForwardBackwardRequest*>(request));
      },
      [response](const engine::ForwardBackwardReport& r) {
        ForwardBackwardReportToProto(r, response);
      });
}

grpc::ServerUnaryReactor* TrainerService::OptimStep(grpc::CallbackServerContext* context,
                                                    const v1::OptimStepRequest* request,
                                                    v1::StepResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "OptimStep", Stoppable::kNo, request->job_id(),
      [request] { return Decoded(OptimStepRequestFromProto(*request)); },
      [response](const engine::StepReport& r) { StepReportToProto(r, response); });
}

grpc::ServerUnaryReactor* TrainerService::Evaluate(grpc::CallbackServerContext* context,
                                                   const v1::EvaluateRequest* request,
                                                   v1::EvaluateResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "Evaluate", Stoppable::kYes, request->job_id(),
      [request] { return EvaluateRequestFromProto(const_cast<v1::EvaluateRequest*>(request)); },
      [response](const engine::EvaluateReport& r) { EvaluateReportToProto(r, response); });
}

grpc::ServerUnaryReactor* TrainerService::Sample(grpc::CallbackServerContext* context,
                                                 const v1::SampleRequest* request,
                                                 v1::SampleResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "Sample", Stoppable::kYes, request->job_id(),
      [request] { return Decoded(SampleRequestFromProto(*request)); },
      [response](const engine::SampleReport& r) { SampleReportToProto(r, response); });
}

grpc::ServerUnaryReactor* TrainerService::SaveSamplerSnapshot(
    grpc::CallbackServerContext* context, const v1::SaveSamplerSnapshotRequest* request,
    v1::SaveSamplerSnapshotResponse* response) {
  return ServeJobCall(
      *this, *registry_, context, "SaveSamplerSnapshot", Stoppable::kNo, request->job_id(),
      [request] { return Decoded(engine::SaveSamplerSnapshotRequest{request->snapshot()}); },
      [response](const engine::SamplerSnapshotInfo& saved) {
        *response->mutable_snapshot() = SamplerSnapshotToProto(saved);
      });
}

grpc::ServerUnaryReactor* TrainerService::DeleteSamplerSnapshot(
    grpc::CallbackServerContext* context, const v1::DeleteSamplerSnapshotRequest* request,
    v1::DeleteSamplerSnapshotResponse* /*response*/) {
  return ServeJobCall(
      *this, *registry_, context, "DeleteSamplerSnapshot", Stoppable::kNo, request->job_id(),
      [request] { return Decoded(engine::DeleteSamplerSnapshotRequest{request->snapshot()}); },
      [](const engine::NoReport&) {});
}

grpc::ServerUnaryReactor* TrainerService::ListModels(grpc::CallbackServerContext* context,
                                                     const v1::ListModelsRequest* /*request*/,
                                                     v1::ListModelsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (tenant.ok()) {
    for (std::string& name : registry_->ListModels()) response->add_models(std::move(name));
  }
  FinishUnary(reactor, "ListModels", start, tenant.status());
  return reactor;
}

grpc::ServerUnaryReactor* TrainerService::ListSamplerSnapshots(
    grpc::CallbackServerContext* context, const v1::ListSamplerSnapshotsRequest* request,
    v1::ListSamplerSnapshotsResponse* response) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    FinishUnary(reactor, "ListSamplerSnapshots", start, tenant.status());
    return reactor;
  }
  if (absl::Status s = CheckLength("job_id", request->job_id()); !s.ok()) {
    FinishUnary(reactor, "ListSamplerSnapshots", start, s);
    return reactor;
  }
  absl::StatusOr<std::vector<engine::SamplerSnapshotInfo>> listed =
      registry_->ListSamplerSnapshots(*tenant, request->job_id());
  if (listed.ok()) {
    for (const engine::SamplerSnapshotInfo& info : *listed) {
      *response->add_snapshots() = SamplerSnapshotToProto(info);
    }
  }
  FinishUnary(reactor, "ListSamplerSnapshots", start, listed.status());
  return reactor;
}

grpc::ServerWriteReactor<v1::StateDictChunk>* TrainerService::GetStateDict(
    grpc::CallbackServerContext* context, const v1::GetStateDictRequest* request) {
  absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    return new RefusedStream<grpc::ServerWriteReactor<v1::StateDictChunk>>(this, "GetStateDict",
                                                                           tenant.status());
  }
  return new StateDictWriter(this, registry_, *context, *tenant, request->job_id(), request->view(),
                             options_.chunk_bytes);
}

grpc::ServerReadReactor<v1::LoadStateDictRequest>* TrainerService::LoadStateDict(
    grpc::CallbackServerContext* context, v1::LoadStateDictResponse* response) {
  absl::StatusOr<std::string> tenant = Authenticate(*context);
  if (!tenant.ok()) {
    return new RefusedStream<grpc::ServerReadReactor<v1::LoadStateDictRequest>>(
        this, "LoadStateDict", tenant.status());
  }
  return new StateDictReader(this, registry_, *context, *std::move(tenant), response,
                             options_.max_state_dict_bytes, &state_dict_buffer_);
}

}  // namespace ampd::rpc
