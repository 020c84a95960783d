// GradientAllReduce: how a distributed job's step sums tensors on its
// backend across the ranks: the gradients after the backward pass, then
// the step's loss sum and overflow flag (docs/DISTRIBUTED.md). The CPU
// backend's tensors are host memory, summed by Gloo (ProcessGroup) in
// buckets; a CUDA backend's are summed by NCCL on the backend's own stream,
// so the sum is ordered with the kernels around it and the step still
// makes its one device read at the end. Not thread-safe: one step at a time.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/engine/dist/process_group.h"

namespace ampd::engine::dist {

class GradientAllReduce {
 public:
  virtual ~GradientAllReduce() = default;
  // Element-wise sums of `tensors` over the ranks, in place; every rank ends
  // with the same bytes. Unavailable when the group broke.
  virtual absl::Status Sum(absl::Span<kernels::Tensor* const> tensors) = 0;
};

// The most bytes Gloo sums in one collective: smaller tensors are packed
// into a bucket of up to this size (a staging buffer allocated here, never in
// a step), larger ones are summed in place alone.
inline constexpr size_t kBucketBytes = size_t{16} << 20;

// For a job on `backend` whose largest Sum is `grads` (sizes the staging
// buffer): Gloo for a host backend, NCCL for a CUDA one (Unimplemented in a
// build without NCCL). `group` must outlive the result.
absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeGradientAllReduce(
    ProcessGroup& group, kernels::Backend& backend, absl::Span<kernels::Tensor* const> grads);

}  // namespace ampd::engine::dist
