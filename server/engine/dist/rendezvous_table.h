// RendezvousTable: the meeting point a distributed job's ranks share,
// held in memory by the ampd that serves ampd.v1.Peer (rank 0's): per group
// a barrier that forms rounds (Join), and a key-value store (Set/Get) the
// ranks of a round exchange their transport addresses through. Keys are
// "<group>/<round>/<name>" and belong to their group: a group must have met
// here before its keys are set, when a round of it forms the keys of its
// older rounds are dropped, and when the group goes (its job on this ampd
// was deleted, or it was forgotten to make room) its keys go with it.
//
// What the table holds is bounded so that a flood gets ResourceExhausted,
// not the server: groups by count, keys and values in bytes per group and
// in all, and the calls blocked waiting (each holds one of the Peer
// service's threads) per group, per tenant and in all. With `secrets` set, a
// call is served only once Authenticate has checked its proof against the
// secret of one of this ampd's jobs of the group (dist/peer_auth.h):
// outsiders never wait and never store a byte.
//
// A group name belongs to the job whose secret signs its calls: the table
// keeps one meeting place (a "room") per group name, owning tenant and
// group key, so another tenant's job under the same name (with its own
// secret, since it cannot know the first one's) meets in a room of its own
// and never sees, joins or delays the first one's rounds and keys.
// Thread-safe; Join and Get block their caller (a gRPC thread) up to their
// timeout.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ampd::engine::dist {

class RendezvousTable {
 public:
  struct Limits {
    size_t max_groups = 1024;
    size_t max_key_bytes = 512;
    size_t max_value_bytes = 64 * 1024;
    size_t max_fingerprint_bytes = 64;
    // Bytes of keys and values (each entry counted with kEntryOverhead):
    // a group of 64 ranks stores a few KiB of Gloo addresses per round.
    size_t max_group_bytes = 1 << 20;
    size_t max_bytes = 16 << 20;
    // Calls blocked at once (Join and Get), in all and per group (at most
    // 2N for a group of N ranks, which needs N-1 waiting Joins, then N-1
    // waiting Gets).
    // The Peer service gives the port more threads than max_waiters, so
    // that calls that do not wait are still served when every wait is taken.
    size_t max_waiters = 192;
    size_t max_group_waiters = 128;
    // Calls blocked at once for the groups of one tenant (the owner of the
    // jobs whose secrets signed them), so that one tenant's groups cannot
    // take every wait while another tenant's group forms: half the waits
    // leave the others room for a group of 64 ranks (63 waiting Joins).
    // Not applied to the tenant "" of an open server, which is everybody.
    size_t max_tenant_waiters = 96;
    absl::Duration max_wait = absl::Minutes(10);
    // How often Authenticate looks for groups whose jobs have gone (each
    // look asks the registry for every group's secrets).
    absl::Duration sweep_every = absl::Seconds(1);
  };
  // What one stored entry costs beyond its key and value bytes (the map's
  // node and the strings' headers).
  static constexpr size_t kEntryOverhead = 96;

  // One of this ampd's jobs that meet here under a group name (a
  // distributed job of rank 0): its secret and the tenant that owns it.
  struct GroupOwner {
    std::string secret;
    std::string tenant;
  };
  // The owners of the jobs that meet here under `group`: none when the
  // group is not this ampd's to host. Called without the table's lock held.
  using GroupSecrets = std::function<std::vector<GroupOwner>(const std::string& group)>;
  // Computes the proof a call should carry under a group's key.
  using ExpectedProof = std::function<std::string(absl::string_view group_key)>;

  RendezvousTable() : RendezvousTable(Limits()) {}
  // `secrets` null: every call is served unauthenticated (in-process use;
  // ampd always gives its jobs' secrets).
  explicit RendezvousTable(Limits limits, GroupSecrets secrets = nullptr)
      : limits_(limits), secrets_(std::move(secrets)) {}

  // Whom an authenticated call acts for: the group name its ranks use, the
  // tenant owning the job whose secret signed the call, and the room the
  // table keeps for the two and that secret (never containing '/').
  struct Member {
    std::string group;
    std::string tenant;
    std::string room;
  };
  // The member of a table without secrets (in-process use): the room is the
  // group's name, of no tenant.
  static Member Unauthenticated(const std::string& group) { return Member{group, "", group}; }

  // Whom a call for `group` acts for, when it carries the proof `expected`
  // computes under the key (GroupKey) of one of the group's owners' secrets.
  // NotFound when no job of this ampd meets under that group (yet: rank 0's
  // job may not have been created or restored; a rank retries),
  // Unauthenticated when the proof matches none. Every call is
  // Unauthenticated(group) when the table has no secrets. Also forgets, now
  // and then, the rooms whose jobs have gone.
  absl::StatusOr<Member> Authenticate(const std::string& group, const ExpectedProof& expected,
                                      absl::string_view proof);

  // Rendezvous::Join's contract (dist/rendezvous.h), in the member's room.
  // Aborted for a waiter whose rank joined again from elsewhere (it
  // restarted): the newer one holds the place. ResourceExhausted when the
  // waits are all taken (in all, the group's or the tenant's). `cancelled`
  // (nullable) is polled while a call waits: a caller that went away (its
  // RPC cancelled) frees its place and its thread at once rather than at
  // the timeout. Cancelled is then the result.
  using CancelCheck = std::function<bool()>;
  absl::StatusOr<int64_t> Join(const Member& member, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout,
                               const CancelCheck& cancelled = nullptr);
  // Keys "<group>/<round>/<name>" of the member's group, kept in its room.
  // FailedPrecondition for a key of another group or of a group that has
  // not met in the room; ResourceExhausted past the group's or the table's
  // bytes.
  absl::Status Set(const Member& member, const std::string& key, const std::string& value);
  absl::StatusOr<std::string> Get(const Member& member, const std::string& key,
                                  absl::Duration timeout, const CancelCheck& cancelled = nullptr);

  // The same for a table without secrets, in the group's own room.
  absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout,
                               const CancelCheck& cancelled = nullptr) {
    return Join(Unauthenticated(group), rank, world_size, fingerprint, timeout, cancelled);
  }
  absl::Status Set(const std::string& key, const std::string& value) {
    return Set(Unauthenticated(std::string(GroupOfName(key))), key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout,
                                  const CancelCheck& cancelled = nullptr) {
    return Get(Unauthenticated(std::string(GroupOfName(key))), key, timeout, cancelled);
  }

  // Blocks until at least `calls` Join or Get calls are waiting (blocked,
  // the lock released) or the timeout passes; true in the first case. How
  // a caller (a test) knows a rank is waiting before it acts on the table.
  bool AwaitWaiting(size_t calls, absl::Duration timeout);

  // Bytes of keys and values held (with kEntryOverhead each).
  size_t bytes() const;

 private:
  // A room: one group name's meeting place for one owner.
  struct Group {
    std::string name;    // the group name its ranks use
    std::string tenant;  // the owner's, whose waits it counts against
    int32_t world_size = 0;
    std::string fingerprint;
    int64_t open_round = 0;              // the round joiners are gathering for
    int64_t formed_round = -1;           // the last round that formed
    std::map<int32_t, uint64_t> joined;  // rank -> ticket of its waiter, in open_round
    size_t waiters = 0;                  // calls blocked on it (it is never evicted then)
    size_t bytes = 0;                    // its keys and values
    absl::Time last_used;
  };
  // The text of a key before its first '/' (peer_auth's GroupOfKey).
  static absl::string_view GroupOfName(absl::string_view key);
  absl::Status CheckKey(const std::string& key) const;
  // Where the member's `key` is stored: its room in place of its group's
  // name. FailedPrecondition when the key is not of the member's group.
  static absl::StatusOr<std::string> RoomKey(const Member& member, const std::string& key);
  // The room a stored key belongs to; FailedPrecondition when it has not
  // met here (`key` is the caller's, for the message).
  absl::StatusOr<Group*> GroupOf(const Member& member, const std::string& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Group*> FindOrAddGroup(const Member& member) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ResourceExhausted when `group` may not start another wait.
  absl::Status CheckWaiters(const Group& group) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropKeysBefore(const std::string& room, int64_t round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases the rooms whose jobs have gone (nobody waiting in them), with
  // their keys; at most once a second.
  void ForgetGoneGroups() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits in `group` until condition holds, the deadline passes or
  // `cancelled` says so (polled every kCancelPoll); true when the condition
  // holds. The wait counts against the group, its tenant and the table.
  bool WaitFor(Group& group, const absl::Condition& condition, absl::Time deadline,
               const CancelCheck& cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  const GroupSecrets secrets_;
  mutable absl::Mutex mu_;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);  // by room
  // By the key's room in place of its group name: "<room>/<round>/<name>".
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;                            // calls blocked in WaitFor
  std::map<std::string, size_t> tenant_waiting_ ABSL_GUARDED_BY(mu_);  // of them, by tenant
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace ampd::engine::dist
