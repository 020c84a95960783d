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

struct DistributedSpec {
  int32_t world_size = 1;
  int32_t rank = 0;
  std::string group;       // the same on every rank; [A-Za-z0-9._-]{1,128}
  std::string rendezvous;  // HOST:PORT of rank 0's --peer-address
  // How long a rank waits for the others, to meet and inside a collective.
  int64_t timeout_ms = kDefaultTimeoutMs;

  bool enabled() const { return world_size > 1; }
  bool operator==(const DistributedSpec&) const = default;
};

// InvalidArgument naming the field ("world_size", "rank", "group",
// "rendezvous", "timeout_ms"). A spec of world_size 1 must leave the rest
// unset (rank 0, no group, no rendezvous, the default timeout).
absl::Status ValidateDistributedSpec(const DistributedSpec& spec);

}  // namespace ampd::engine::dist
