// How a distributed job's ranks prove at the meeting point (rank 0's
// ampd.v1.Peer, docs/DISTRIBUTED.md) that they belong to their group: every
// rank holds the job's secret (DistributedSpec::secret, sent by the job's
// owner in CreateJob and known to nobody else), derives the group's key from
// it, and signs each call with an HMAC of the call's fields. Rank 0's ampd
// derives the same key from its own job of the group and checks the proof
// before the call takes anything (a thread's wait, a key's bytes). The
// proof binds a call's fields, not its time: someone who can read the peer
// network could replay a call, as they could read or inject into Gloo's
// traffic; that network stays cluster-private.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace ampd::engine::dist {

// HMAC-SHA256(secret, "ampd.v1.Peer group key\0" group): 32 bytes.
std::string GroupKey(absl::string_view secret, absl::string_view group);

// The proofs of the Peer calls (HMAC-SHA256 under a group key of the
// method's name and fields, each length-prefixed so that no two calls sign
// the same bytes): 32 bytes each.
std::string JoinProof(absl::string_view key, absl::string_view group, int32_t rank,
                      int32_t world_size, absl::string_view fingerprint, int64_t timeout_ms);
std::string SetProof(absl::string_view key, absl::string_view name, absl::string_view value);
std::string GetProof(absl::string_view key, absl::string_view name, int64_t timeout_ms);

// The name of the meeting place (RendezvousTable's room) of the group whose
// key is `group_key` for jobs of `tenant`: 32 hex digits, a hash of both,
// so that two owners of one group name never share a room, and the key
// itself is not what the table holds.
std::string RoomId(absl::string_view group_key, absl::string_view tenant);

// Constant-time comparison of a proof received with the one expected.
bool ProofMatches(absl::string_view expected, absl::string_view received);

// The group a key of the store belongs to: its text before the first '/'
// ("<group>/<round>/<name>"); empty when it has none.
absl::string_view GroupOfKey(absl::string_view name);

}  // namespace ampd::engine::dist
