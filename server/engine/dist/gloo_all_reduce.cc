// GradientAllReduce for host backends: consecutive tensors of one dtype
// are packed into a staging bucket and summed in one Gloo collective, so a
// model of many small parameters costs a few round trips rather than one
// per tensor; a tensor larger than the bucket is summed in place alone.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/dist/gradient_all_reduce.h"
#include "server/engine/dist/nccl_all_reduce.h"

namespace ampd::engine::dist {

namespace {

class GlooAllReduce final : public GradientAllReduce {
 public:
  GlooAllReduce(ProcessGroup& group, size_t staging_bytes)
      : group_(group), staging_(staging_bytes) {}

  absl::Status Sum(absl::Span<kernels::Tensor* const> tensors) override {
    size_t i = 0;
    while (i < tensors.size()) {
      kernels::Tensor& first = *tensors[i];
      if (first.nbytes() > staging_.size()) {
        AMPD_RETURN_IF_ERROR(group_.AllReduceSum(first.data(), first.numel(), first.dtype()));
        ++i;
        continue;
      }
      // [i, end): the bucket, one dtype, fitting the staging buffer.
      size_t end = i;
      size_t bytes = 0;
      while (end < tensors.size() && tensors[end]->dtype() == first.dtype() &&
             bytes + tensors[end]->nbytes() <= staging_.size()) {
        bytes += tensors[end]->nbytes();
        ++end;
      }
      if (end == i + 1) {
        AMPD_RETURN_IF_ERROR(group_.AllReduceSum(first.data(), first.numel(), first.dtype()));
        i = end;
        continue;
      }
      size_t offset = 0;
      for (size_t t = i; t < end; ++t) {
        std::memcpy(staging_.data() + offset, tensors[t]->data(), tensors[t]->nbytes());
        offset += tensors[t]->nbytes();
      }
      AMPD_RETURN_IF_ERROR(group_.AllReduceSum(
          staging_.data(), static_cast<int64_t>(bytes / kernels::SizeOf(first.dtype())),
          first.dtype()));
      offset = 0;
      for (size_t t = i; t < end; ++t) {
        std::memcpy(tensors[t]->data(), staging_.data() + offset, tensors[t]->nbytes());
        offset += tensors[t]->nbytes();
      }
      i = end;
    }
    return absl::OkStatus();
  }

 private:
  ProcessGroup& group_;
  std::vector<char> staging_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeGradientAllReduce(
    ProcessGroup& group, kernels::Backend& backend, absl::Span<kernels::Tensor* const> grads) {
  if (backend.native_stream().stream != nullptr) return MakeNcclAllReduce(group, backend);
  size_t total = 64;  // at least the step's scalars
  for (const kernels::Tensor* g : grads) total += g->nbytes();
  return std::unique_ptr<GradientAllReduce>(
      new GlooAllReduce(group, std::min(total, kBucketBytes)));
}

}  // namespace ampd::engine::dist
