// GradientAllReduce over NCCL for CUDA backends: one communicator per
// formed group, its unique id made by rank 0 and broadcast over Gloo; each
// Sum is one NCCL group of in-place all-reduces enqueued on the backend's
// stream, so it runs after the backward kernels and before the check and
// update kernels with no host wait (the step's one device read stays at its
// end).
#include "server/engine/dist/nccl_all_reduce.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>

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

class NcclAllReduce final : public GradientAllReduce {
 public:
  NcclAllReduce(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {}
  ~NcclAllReduce() override { ncclCommDestroy(comm_); }

  absl::Status Sum(absl::Span<kernels::Tensor* const> tensors) override {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return NcclError("ncclGroupStart", r);
    for (kernels::Tensor* t : tensors) {
      absl::StatusOr<ncclDataType_t> type = NcclType(t->dtype());
      if (!type.ok()) {
        ncclGroupEnd();
        return type.status();
      }
      r = ncclAllReduce(t->data(), t->data(), static_cast<size_t>(t->numel()), *type, ncclSum,
                        comm_, stream_);
      if (r != ncclSuccess) {
        ncclGroupEnd();
        return NcclError("ncclAllReduce", r);
      }
    }
    r = ncclGroupEnd();
    if (r != ncclSuccess) return NcclError("ncclGroupEnd", r);
    return absl::OkStatus();
  }

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
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
  return std::unique_ptr<GradientAllReduce>(
      new NcclAllReduce(comm, static_cast<cudaStream_t>(native.stream)));
}

}  // namespace ampd::engine::dist
