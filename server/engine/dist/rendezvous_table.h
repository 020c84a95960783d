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
// service's threads) per group and in all. With `secrets` set, a call is
// served only once Authenticate has checked its proof against the secret of
// one of this ampd's jobs of the group (dist/peer_auth.h): outsiders never
// wait and never store a byte. Thread-safe; Join and Get block their caller
// (a gRPC thread) up to their timeout.
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
    absl::Duration max_wait = absl::Minutes(10);
    // How often Authenticate looks for groups whose jobs have gone (each
    // look asks the registry for every group's secrets).
    absl::Duration sweep_every = absl::Seconds(1);
  };
  // What one stored entry costs beyond its key and value bytes (the map's
  // node and the strings' headers).
  static constexpr size_t kEntryOverhead = 96;

  // The secrets of this ampd's jobs that meet here under `group` (the
  // distributed jobs of rank 0 with that group name): none when the group
  // is not this ampd's to host. Called without the table's lock held.
  using GroupSecrets = std::function<std::vector<std::string>(const std::string& group)>;
  // Computes the proof a call should carry under a group's key.
  using ExpectedProof = std::function<std::string(absl::string_view group_key)>;

  RendezvousTable() : RendezvousTable(Limits()) {}
  // `secrets` null: every call is served unauthenticated (in-process use;
  // ampd always gives its jobs' secrets).
  explicit RendezvousTable(Limits limits, GroupSecrets secrets = nullptr)
      : limits_(limits), secrets_(std::move(secrets)) {}

  // Whether a call for `group` carries the proof `expected` computes under
  // the key of one of the group's secrets (GroupKey). NotFound when no job
  // of this ampd meets under that group (yet: rank 0's job may not have
  // been created or restored; a rank retries), Unauthenticated when the
  // proof matches none. OK for every call when the table has no secrets.
  // Also forgets, now and then, the groups whose jobs have gone.
  absl::Status Authenticate(const std::string& group, const ExpectedProof& expected,
                            absl::string_view proof);

  // Rendezvous::Join's contract (dist/rendezvous.h). Aborted for a waiter
  // whose rank joined again from elsewhere (it restarted): the newer one
  // holds the place. ResourceExhausted when the waits are all taken.
  // `cancelled` (nullable) is polled while a call waits: a caller that went
  // away (its RPC cancelled) frees its place and its thread at once rather
  // than at the timeout. Cancelled is then the result.
  using CancelCheck = std::function<bool()>;
  absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout,
                               const CancelCheck& cancelled = nullptr);
  // FailedPrecondition for a key whose group has not met here;
  // ResourceExhausted past the group's or the table's bytes.
  absl::Status Set(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout,
                                  const CancelCheck& cancelled = nullptr);

  // Blocks until at least `calls` Join or Get calls are waiting (blocked,
  // the lock released) or the timeout passes; true in the first case. How
  // a caller (a test) knows a rank is waiting before it acts on the table.
  bool AwaitWaiting(size_t calls, absl::Duration timeout);

  // Bytes of keys and values held (with kEntryOverhead each).
  size_t bytes() const;

 private:
  struct Group {
    int32_t world_size = 0;
    std::string fingerprint;
    int64_t open_round = 0;              // the round joiners are gathering for
    int64_t formed_round = -1;           // the last round that formed
    std::map<int32_t, uint64_t> joined;  // rank -> ticket of its waiter, in open_round
    size_t waiters = 0;                  // calls blocked on it (it is never evicted then)
    size_t bytes = 0;                    // its keys and values
    absl::Time last_used;
  };
  absl::Status CheckKey(const std::string& key) const;
  // The group a key belongs to; FailedPrecondition when it has not met here.
  absl::StatusOr<Group*> GroupOf(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Group*> FindOrAddGroup(const std::string& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ResourceExhausted when `group` may not start another wait.
  absl::Status CheckWaiters(const std::string& name, const Group& group) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropKeysBefore(const std::string& group, int64_t round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases the groups whose jobs have gone (nobody waiting in them), with
  // their keys; at most once a second.
  void ForgetGoneGroups() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until condition holds, the deadline passes or `cancelled` says
  // so (polled every kCancelPoll); true when the condition holds.
  bool WaitFor(const absl::Condition& condition, absl::Time deadline, const CancelCheck& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  const GroupSecrets secrets_;
  mutable absl::Mutex mu_;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;  // calls blocked in WaitFor
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace ampd::engine::dist
