// Rendezvous: how a distributed job's rank reaches the meeting point its
// group shares (rank 0's ampd.v1.Peer service, docs/DISTRIBUTED.md): a
// barrier that forms a round of the group, and a key-value store the ranks
// exchange transport addresses through. The engine defines it; the rpc
// layer implements it over gRPC (server/rpc/peer_client.h), and the tests
// in process over RendezvousTable.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ampd::engine::dist {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Blocks until world_size ranks of `group` have joined one round with the
  // same fingerprint; returns the round's number. DeadlineExceeded when the
  // others do not come within timeout, FailedPrecondition when a rank's
  // fingerprint or world_size differs, Unavailable when the meeting point
  // cannot be reached; none of them later than timeout.
  virtual absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                                       const std::string& fingerprint, absl::Duration timeout) = 0;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to timeout for the key; DeadlineExceeded when it never comes.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

// Opens a Rendezvous to the meeting point at `address` (HOST:PORT) for the
// ranks of `group`, whose calls it signs with the key of the job's `secret`
// (dist/peer_auth.h).
using RendezvousConnector = std::function<absl::StatusOr<std::unique_ptr<Rendezvous>>(
    const std::string& address, const std::string& group, const std::string& secret)>;

}  // namespace ampd::engine::dist
