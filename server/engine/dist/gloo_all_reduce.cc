// GradientAllReduce for host backends: the tensors a step starts are
// gathered into buckets of one dtype (up to kBucketSendBytes, then sent) and
// summed by a thread of the job's own, one Gloo collective per bucket, so
// the sums of the last layers run while backward computes the first ones. A
// bucket of several tensors is packed into a staging buffer (allocated here,
// once); a tensor as large as the buffer is summed in place alone. The
// job's thread is a WorkerPool of one (server/common/worker_pool.h), which
// runs the buckets in the order they were sent.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "server/common/worker_pool.h"
#include "server/engine/dist/gradient_all_reduce.h"
#include "server/engine/dist/nccl_all_reduce.h"

namespace ampd::engine::dist {

namespace {

class GlooAllReduce final : public GradientAllReduce {
 public:
  GlooAllReduce(ProcessGroup& group, size_t staging_bytes)
      : group_(group), staging_(staging_bytes), pool_(1) {}

  ~GlooAllReduce() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // The sum running finishes (or fails with the group); the queued ones
    // return at once.
    pool_.Shutdown();
  }

  absl::Status Start(absl::Span<kernels::Tensor* const> tensors) override {
    for (kernels::Tensor* t : tensors) {
      if (!open_.empty() &&
          (t->dtype() != open_.front()->dtype() || open_bytes_ + t->nbytes() > staging_.size())) {
        Send();
      }
      open_.push_back(t);
      open_bytes_ += t->nbytes();
      if (open_bytes_ >= std::min(kBucketSendBytes, staging_.size())) Send();
    }
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    Send();
    pool_.WaitIdle();
    absl::MutexLock lock(&mu_);
    return std::exchange(error_, absl::OkStatus());
  }

 private:
  using Bucket = std::vector<kernels::Tensor*>;

  // Hands the open bucket to the pool's thread, behind the ones sent before.
  void Send() {
    if (open_.empty()) return;
    pool_.Post([this, bucket = std::move(open_)] { Sum(bucket); });
    open_.clear();
    open_bytes_ = 0;
  }

  // On the pool's one thread, in the order the buckets were sent: every
  // rank runs the same collectives in the same order.
  void Sum(const Bucket& bucket) {
    {
      absl::MutexLock lock(&mu_);
      // Stopping (the group is being dropped): what is queued is not sent.
      // After a failure the group is broken: the later buckets are not sent
      // either (they would wait out the timeout again), Finish reports the
      // first.
      if (stopping_ || !error_.ok()) return;
    }
    const absl::Status s = SumBucket(bucket);
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = s;
  }

  absl::Status SumBucket(const Bucket& bucket) {
    kernels::Tensor& first = *bucket.front();
    if (bucket.size() == 1) {
      return group_.AllReduceSum(first.data(), first.numel(), first.dtype());
    }
    size_t bytes = 0;
    for (const kernels::Tensor* t : bucket) {
      std::memcpy(staging_.data() + bytes, t->data(), t->nbytes());
      bytes += t->nbytes();
    }
    AMPD_RETURN_IF_ERROR(group_.AllReduceSum(
        staging_.data(), static_cast<int64_t>(bytes / kernels::SizeOf(first.dtype())),
        first.dtype()));
    bytes = 0;
    for (kernels::Tensor* t : bucket) {
      std::memcpy(t->data(), staging_.data() + bytes, t->nbytes());
      bytes += t->nbytes();
    }
    return absl::OkStatus();
  }

  ProcessGroup& group_;
  std::vector<char> staging_;  // the pool thread's
  // The bucket being gathered (the caller's thread only).
  Bucket open_;
  size_t open_bytes_ = 0;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  WorkerPool pool_;  // last: its thread starts once every member above exists
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
