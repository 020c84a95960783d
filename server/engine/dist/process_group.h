// ProcessGroup: one formed round of a distributed job's ranks, connected
// by Gloo over TCP (docs/DISTRIBUTED.md). Connect meets the other ranks at
// the group's Rendezvous (one round of its barrier), exchanges the Gloo
// transport's addresses through the round's keys and connects the full
// mesh. Its collectives are the host-side ones a job needs: the step's
// header (AllGather), the state a rank that fell behind copies (Broadcast)
// and the CPU backend's gradient sums (AllReduceSum). A collective that
// fails (a rank died, the timeout passed) returns Unavailable and leaves
// the group broken: the job drops it and meets again. Not thread-safe: the
// job's strand is its only caller.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/dtype.h"
#include "server/engine/config/distributed_spec.h"
#include "server/engine/dist/rendezvous.h"

namespace gloo {
class Context;
}

namespace ampd::engine::dist {

class ProcessGroup {
 public:
  // Joins spec.group's next round with `fingerprint` (every rank's must be
  // equal) and connects Gloo's mesh, its transport bound to `peer_host`
  // (this ampd's --peer-address host). Rendezvous::Join's errors, and
  // Unavailable when the mesh cannot be connected in spec.timeout_ms.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Connect(const DistributedSpec& spec,
                                                               const std::string& fingerprint,
                                                               const std::string& peer_host,
                                                               Rendezvous& rendezvous);
  ~ProcessGroup();

  int32_t rank() const { return rank_; }
  int32_t world_size() const { return world_size_; }
  int64_t round() const { return round_; }

  // Every rank's `mine` (each the same length), rank by rank.
  absl::StatusOr<std::vector<int64_t>> AllGather(absl::Span<const int64_t> mine);
  // `bytes` of rank `root` to every rank (any length; the others' are
  // replaced).
  absl::Status Broadcast(std::string& bytes, int32_t root);
  // Element-wise sum over the ranks, in place, of `count` host elements of
  // `dtype` (F32, F16 or BF16; 16-bit sums are rounded to the dtype after
  // each addition, as a sum of tensors of that dtype is).
  absl::Status AllReduceSum(void* data, int64_t count, kernels::DType dtype);

 private:
  ProcessGroup(int32_t rank, int32_t world_size, int64_t round,
               std::shared_ptr<gloo::Context> context);

  const int32_t rank_;
  const int32_t world_size_;
  const int64_t round_;
  std::shared_ptr<gloo::Context> context_;
};

}  // namespace ampd::engine::dist
