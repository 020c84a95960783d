// RendezvousTable: the meeting point a distributed job's ranks share,
// held in memory by the ampd that serves ampd.v1.Peer (rank 0's): per group
// a barrier that forms rounds (Join), and a key-value store (Set/Get) the
// ranks of a round exchange their transport addresses through. Keys are
// "<group>/<round>/<name>"; when a round of a group forms, the keys of its
// older rounds are dropped. Every size is bounded, so a peer that floods it
// gets ResourceExhausted, not the server's memory. Thread-safe; Join and
// Get block their caller (a gRPC thread) up to their timeout.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ampd::engine::dist {

class RendezvousTable {
 public:
  struct Limits {
    size_t max_groups = 1024;
    size_t max_keys = 16384;
    size_t max_key_bytes = 512;
    size_t max_value_bytes = 64 * 1024;
    size_t max_fingerprint_bytes = 64;
    absl::Duration max_wait = absl::Minutes(10);
  };
  RendezvousTable() : RendezvousTable(Limits()) {}
  explicit RendezvousTable(Limits limits) : limits_(limits) {}

  // Rendezvous::Join's contract (dist/rendezvous.h). Aborted for a waiter
  // whose rank joined again from elsewhere (it restarted): the newer one
  // holds the place.
  // `cancelled` (nullable) is polled while a call waits: a caller that went
  // away (its RPC cancelled) frees its place and its thread at once rather
  // than at the timeout. Cancelled is then the result.
  using CancelCheck = std::function<bool()>;
  absl::StatusOr<int64_t> Join(const std::string& group, int32_t rank, int32_t world_size,
                               const std::string& fingerprint, absl::Duration timeout,
                               const CancelCheck& cancelled = nullptr);
  absl::Status Set(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout,
                                  const CancelCheck& cancelled = nullptr);

  // Blocks until at least `calls` Join or Get calls are waiting (blocked,
  // the lock released) or the timeout passes; true in the first case. How
  // a caller (a test) knows a rank is waiting before it acts on the table.
  bool AwaitWaiting(size_t calls, absl::Duration timeout);

 private:
  struct Group {
    int32_t world_size = 0;
    std::string fingerprint;
    int64_t open_round = 0;              // the round joiners are gathering for
    int64_t formed_round = -1;           // the last round that formed
    std::map<int32_t, uint64_t> joined;  // rank -> ticket of its waiter, in open_round
    int32_t waiters = 0;                 // Joins blocked on it (it is never evicted then)
    absl::Time last_used;
  };
  absl::Status CheckKey(const std::string& key) const;
  absl::StatusOr<Group*> FindOrAddGroup(const std::string& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropKeysBefore(const std::string& group, int64_t round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until condition holds, the deadline passes or `cancelled` says
  // so (polled every kCancelPoll); true when the condition holds.
  bool WaitFor(const absl::Condition& condition, absl::Time deadline, const CancelCheck& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  absl::Mutex mu_;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;  // calls blocked in WaitFor
};

}  // namespace ampd::engine::dist
