// DistributedSpec: where one replica of a data-parallel job stands among the
// others (docs/DISTRIBUTED.md): its rank of world_size, the group name the
// replicas share and the rendezvous address where they meet. Part of a
// job's config; world_size 1 is a job of one ampd alone.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace ampd::engine::dist {

inline constexpr int32_t kMaxWorldSize = 64;
inline constexpr int64_t kDefaultTimeoutMs = 30000;
inline constexpr int64_t kMaxTimeoutMs = 600000;
inline constexpr size_t kMaxGroupBytes = 128;
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 64;

struct DistributedSpec {
  int32_t world_size = 1;
  int32_t rank = 0;
  std::string group;       // the same on every rank; [A-Za-z0-9._-]{1,128}
  std::string rendezvous;  // HOST:PORT of rank 0's --peer-address
  // How long a rank waits for the others, to meet and inside a collective.
  int64_t timeout_ms = kDefaultTimeoutMs;
  // The same on every rank and known only to the job's owner (16..64
  // bytes, a random one per job): the ranks sign their calls to the
  // meeting point with a key derived from it (dist/peer_auth.h), so only
  // they can join the group or read its keys. Never echoed to clients.
  std::string secret;

  bool enabled() const { return world_size > 1; }
  bool operator==(const DistributedSpec&) const = default;
};

// InvalidArgument naming the field ("world_size", "rank", "group",
// "rendezvous", "timeout_ms", "secret"). A spec of world_size 1 must leave
// the rest unset (rank 0, no group, no rendezvous, the default timeout, no
// secret). The rendezvous is HOST:PORT: a host name or IPv4 address without
// ':', or an IPv6 literal in brackets, and a port of 1..65535 in digits.
absl::Status ValidateDistributedSpec(const DistributedSpec& spec);

}  // namespace ampd::engine::dist
