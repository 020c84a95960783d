// GradientAllReduce over NCCL for CUDA backends: one communicator per
// formed group, its unique id made by rank 0 and broadcast over Gloo. Each
// Start is one NCCL group of in-place all-reduces on a communication stream
// that first waits (an event) for the job's stream to have written those
// gradients, so they overlap the backward kernels that follow; Finish makes
// the job's stream wait for the communication stream before the check and
// update kernels. No host wait anywhere: the step's one device read stays
// at its end.
#include "server/engine/dist/nccl_all_reduce.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::engine::dist {

namespace {

absl::Status NcclError(absl::string_view what, ncclResult_t result) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(result)));
}

absl::StatusOr<ncclDataType_t> NcclType(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kF32:
      return ncclFloat32;
    case kernels::DType::kF16:
      return ncclFloat16;
    case kernels::DType::kBF16:
      return ncclBfloat16;
    default:
      return absl::InvalidArgumentError("all-reduce: only F32, F16 and BF16 tensors are summed");
  }
}

// Events recorded per Start, reused round-robin: an event may be recorded
// again once the wait on its previous record has been enqueued, which
// happens inside the same Start.
constexpr int kEvents = 64;

class NcclAllReduce final : public GradientAllReduce {
 public:
  NcclAllReduce(ncclComm_t comm, cudaStream_t compute, cudaStream_t comm_stream,
                std::vector<cudaEvent_t> events)
      : comm_(comm), compute_(compute), comm_stream_(comm_stream), events_(std::move(events)) {}
  ~NcclAllReduce() override {
    ncclCommDestroy(comm_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(comm_stream_);
  }

  // The sums run on the communication stream after the compute stream's
  // kernels enqueued so far (those that wrote the gradients), beside the
  // backward kernels enqueued next.
  absl::Status Start(absl::Span<kernels::Tensor* const> tensors) override {
    if (tensors.empty()) return absl::OkStatus();
    AMPD_RETURN_IF_ERROR(Order(compute_, comm_stream_));
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return NcclError("ncclGroupStart", r);
    for (kernels::Tensor* t : tensors) {
      absl::StatusOr<ncclDataType_t> type = NcclType(t->dtype());
      if (!type.ok()) {
        ncclGroupEnd();
        return type.status();
      }
      r = ncclAllReduce(t->data(), t->data(), static_cast<size_t>(t->numel()), *type, ncclSum,
                        comm_, comm_stream_);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        return NcclError("ncclAllReduce", r);
      }
    }
    r = ncclGroupEnd();
    if (r != ncclSuccess) return NcclError("ncclGroupEnd", r);
    started_ = true;
    return absl::OkStatus();
  }

  // The compute stream waits for the communication stream: no host wait.
  absl::Status Finish() override {
    if (!started_) return absl::OkStatus();
    started_ = false;
    return Order(comm_stream_, compute_);
  }

 private:
  // `after` runs what it is given next only once `before`'s work so far is done.
  absl::Status Order(cudaStream_t before, cudaStream_t after) {
    cudaEvent_t e = events_[next_event_];
    next_event_ = (next_event_ + 1) % events_.size();
    if (cudaEventRecord(e, before) != cudaSuccess ||
        cudaStreamWaitEvent(after, e, 0) != cudaSuccess) {
      return absl::InternalError("ordering the NCCL stream against the job's stream failed");
    }
    return absl::OkStatus();
  }

  ncclComm_t comm_;
  cudaStream_t compute_;
  cudaStream_t comm_stream_;
  std::vector<cudaEvent_t> events_;
  size_t next_event_ = 0;
  bool started_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeNcclAllReduce(ProcessGroup& group,
                                                                     kernels::Backend& backend) {
  const kernels::Backend::NativeStream native = backend.native_stream();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (group.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError("ncclGetUniqueId", r);
  }
  std::string bytes(reinterpret_cast<const char*>(&id), sizeof(id));
  AMPD_RETURN_IF_ERROR(group.Broadcast(bytes, 0));
  if (bytes.size() != sizeof(id))
    return absl::DataLossError("NCCL unique id: wrong size from rank 0");
  std::memcpy(&id, bytes.data(), sizeof(id));
  if (cudaSetDevice(native.device) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaSetDevice(", native.device, ") failed"));
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, group.world_size(), id, group.rank());
  if (r != ncclSuccess) return NcclError("ncclCommInitRank", r);
  // The communication stream and its events, made here, never in a step.
  cudaStream_t comm_stream = nullptr;
  std::vector<cudaEvent_t> events(kEvents, nullptr);
  bool ok = cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking) == cudaSuccess;
  for (cudaEvent_t& e : events) {
    ok = ok && cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
  }
  if (!ok) {
    for (cudaEvent_t e : events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (comm_stream != nullptr) cudaStreamDestroy(comm_stream);
    ncclCommDestroy(comm);
    return absl::ResourceExhaustedError("NCCL all-reduce: cannot create its stream and events");
  }
  return std::unique_ptr<GradientAllReduce>(new NcclAllReduce(
      comm, static_cast<cudaStream_t>(native.stream), comm_stream, std::move(events)));
}

}  // namespace ampd::engine::dist
