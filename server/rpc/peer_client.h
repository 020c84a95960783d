// The engine's dist::Rendezvous over gRPC: a distributed job's rank calls
// its group's meeting point (rank 0's ampd.v1.Peer) on the cluster-private
// peer network.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/dist/rendezvous.h"

namespace ampd::rpc {

// A Rendezvous to the Peer service at `address` (HOST:PORT) for the ranks
// of `group`, signing each call with the key of `secret`. The channel
// connects lazily: an unreachable address fails the first call, at its
// timeout (Unavailable or DeadlineExceeded).
absl::StatusOr<std::unique_ptr<engine::dist::Rendezvous>> ConnectRendezvous(
    const std::string& address, const std::string& group, const std::string& secret);

}  // namespace ampd::rpc
