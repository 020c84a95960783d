// GradientAllReduce: how a distributed job's step sums tensors on its
// backend across the ranks: the gradients after the backward pass, then
// the step's loss sum and overflow flag (docs/DISTRIBUTED.md). The CPU
// backend's tensors are host memory, summed by Gloo (ProcessGroup) in
// buckets; a CUDA backend's are summed by NCCL on the backend's own stream,
// so the sum is ordered with the kernels around it and the step still
// makes its one device read at the end. The sums overlap the backward pass:
// a step starts each layer's gradients as backward finishes them (Gloo sums
// them on a thread of its own, NCCL on a communication stream ordered after
// the kernels that wrote them), and finishes them all before the check
// pass. Not thread-safe: one step at a time.
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
  // Begins the element-wise sums of `tensors` over the ranks, in place, and
  // returns; the sums run beside whatever the caller does next (the rest of
  // the backward pass) until Finish. Every rank must start the same tensors
  // in the same order. The tensors must not be written until Finish.
  virtual absl::Status Start(absl::Span<kernels::Tensor* const> tensors) = 0;
  // Waits for every sum started (on CUDA: makes the backend's stream wait
  // for them, without a host wait); every rank then holds the same bytes.
  // Unavailable when the group broke: the sums' results are then undefined.
  virtual absl::Status Finish() = 0;
  // Start, then Finish.
  absl::Status Sum(absl::Span<kernels::Tensor* const> tensors) {
    absl::Status started = Start(tensors);
    absl::Status finished = Finish();
    return started.ok() ? finished : started;
  }
};

// The most bytes Gloo sums in one collective: smaller tensors are packed
// into a bucket of up to this size (a staging buffer allocated here, never in
// a step), larger ones are summed in place alone.
inline constexpr size_t kBucketBytes = size_t{16} << 20;
// A bucket is sent once it holds this much (or at Finish): small enough that
// the first sums start early in the backward pass, large enough that a
// model of many small tensors costs few round trips (PyTorch DDP's first
// bucket is 1 MiB, its others 25 MiB).
inline constexpr size_t kBucketSendBytes = size_t{4} << 20;

// For a job on `backend` whose largest Sum is `grads` (sizes the staging
// buffer): Gloo for a host backend, NCCL for a CUDA one (Unimplemented in a
// build without NCCL). `group` must outlive the result.
absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeGradientAllReduce(
    ProcessGroup& group, kernels::Backend& backend, absl::Span<kernels::Tensor* const> grads);

}  // namespace ampd::engine::dist
