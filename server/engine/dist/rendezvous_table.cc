// RendezvousTable: rounds by barrier, keys by wait, every call counted
// against the table's bounds before it waits or stores anything.
#include "server/engine/dist/rendezvous_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "server/engine/dist/peer_auth.h"

namespace ampd::engine::dist {

namespace {

// How often a waiting call looks whether its caller went away.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);

size_t EntryBytes(const std::string& key, const std::string& value) {
  return key.size() + value.size() + RendezvousTable::kEntryOverhead;
}

}  // namespace

bool RendezvousTable::WaitFor(const absl::Condition& condition, absl::Time deadline,
                              const CancelCheck& cancelled) {
  ++waiting_;
  bool met = false;
  for (;;) {
    const absl::Time slice = cancelled ? std::min(deadline, absl::Now() + kCancelPoll) : deadline;
    if (mu_.AwaitWithDeadline(condition, slice)) {
      met = true;
      break;
    }
    if (absl::Now() >= deadline || (cancelled && cancelled())) break;
  }
  --waiting_;
  return met;
}

bool RendezvousTable::AwaitWaiting(size_t calls, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, calls]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ >= calls; };
  return mu_.AwaitWithDeadline(absl::Condition(&enough), absl::Now() + timeout);
}

size_t RendezvousTable::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::Status RendezvousTable::Authenticate(const std::string& group, const ExpectedProof& expected,
                                           absl::string_view proof) {
  if (!secrets_) return absl::OkStatus();
  const std::vector<std::string> secrets = secrets_(group);
  if (secrets.empty()) {
    return absl::NotFoundError(absl::StrCat("group ", group.substr(0, 128),
                                            ": no job of this ampd meets its ranks (yet)"));
  }
  bool matched = false;
  for (const std::string& secret : secrets) {
    if (ProofMatches(expected(GroupKey(secret, group)), proof)) {
      matched = true;
      break;
    }
  }
  if (!matched) {
    return absl::UnauthenticatedError(absl::StrCat(
        "group ", group.substr(0, 128),
        ": the call's proof is not signed with the group's key (distributed.secret differs, or "
        "the caller is no rank of the job)"));
  }
  ForgetGoneGroups();
  return absl::OkStatus();
}

void RendezvousTable::ForgetGoneGroups() {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_sweep_ < limits_.sweep_every) return;
    last_sweep_ = now;
    for (const auto& [name, g] : groups_) names.push_back(name);
  }
  std::vector<std::string> gone;
  for (const std::string& name : names) {
    if (secrets_(name).empty()) gone.push_back(name);
  }
  if (gone.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const std::string& name : gone) {
    auto it = groups_.find(name);
    // A waiter holds a reference to its group: the group goes once its
    // waits end (at their timeout, which the job's timeout_ms bounds).
    if (it == groups_.end() || it->second.waiters > 0 || !it->second.joined.empty()) continue;
    DropKeysBefore(name, INT64_MAX);
    groups_.erase(it);
  }
}

absl::Status RendezvousTable::CheckWaiters(const std::string& name, const Group& group) const {
  if (waiting_ >= limits_.max_waiters) {
    return absl::ResourceExhaustedError(absl::StrCat("the meeting point's ", limits_.max_waiters,
                                                     " waits are all taken; retry later"));
  }
  // Its ranks need at most world_size - 1 waits at a time (Joins, then
  // Gets): twice that leaves room for ranks that retry, and keeps a group
  // that misbehaves from taking the waits of the others.
  const size_t cap = std::min(limits_.max_group_waiters,
                              2 * static_cast<size_t>(std::max<int32_t>(group.world_size, 1)));
  if (group.waiters >= cap) {
    return absl::ResourceExhaustedError(
        absl::StrCat("group ", name, ": its ", cap, " waits are all taken; retry later"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RendezvousTable::Group*> RendezvousTable::GroupOf(const std::string& key) {
  const std::string name(GroupOfKey(key));
  auto it = groups_.find(name);
  if (name.empty() || it == groups_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", key.substr(0, 128),
                     ": keys are '<group>/...' of a group that has met here, and its group has "
                     "not"));
  }
  return &it->second;
}

absl::Status RendezvousTable::CheckKey(const std::string& key) const {
  if (key.empty() || key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: 1 to ", limits_.max_key_bytes, " bytes are required, got ", key.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<RendezvousTable::Group*> RendezvousTable::FindOrAddGroup(const std::string& group) {
  auto it = groups_.find(group);
  if (it != groups_.end()) return &it->second;
  if (groups_.size() >= limits_.max_groups) {
    // Make room by forgetting the group idle longest (nobody waiting in it):
    // its next Join starts it afresh, which costs nothing but a round number.
    auto oldest = groups_.end();
    for (auto g = groups_.begin(); g != groups_.end(); ++g) {
      if (!g->second.joined.empty() || g->second.waiters > 0) continue;
      if (oldest == groups_.end() || g->second.last_used < oldest->second.last_used) oldest = g;
    }
    if (oldest == groups_.end()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("group: ", limits_.max_groups, " groups are meeting here already"));
    }
    DropKeysBefore(oldest->first, INT64_MAX);
    groups_.erase(oldest);
  }
  return &groups_[group];
}

void RendezvousTable::DropKeysBefore(const std::string& group, int64_t round) {
  const std::string prefix = group + "/";
  for (auto it = values_.lower_bound(prefix);
       it != values_.end() && absl::StartsWith(it->first, prefix);) {
    const absl::string_view rest = absl::string_view(it->first).substr(prefix.size());
    int64_t key_round = 0;
    const bool numbered = absl::SimpleAtoi(rest.substr(0, rest.find('/')), &key_round);
    if (!numbered || key_round < round) {
      const size_t entry = EntryBytes(it->first, it->second);
      bytes_ -= entry;
      if (auto g = groups_.find(group); g != groups_.end()) g->second.bytes -= entry;
      it = values_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<int64_t> RendezvousTable::Join(const std::string& group, int32_t rank,
                                              int32_t world_size, const std::string& fingerprint,
                                              absl::Duration timeout,
                                              const CancelCheck& cancelled) {
  if (group.empty() || group.size() > limits_.max_key_bytes / 2 ||
      group.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("group: 1 to 256 bytes without '/' are required");
  }
  if (world_size < 1 || rank < 0 || rank >= world_size || world_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of world_size ", world_size, " is not a rank of a group"));
  }
  if (fingerprint.size() > limits_.max_fingerprint_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("fingerprint: at most ",
                                                   limits_.max_fingerprint_bytes, " bytes, got ",
                                                   fingerprint.size()));
  }
  const absl::Time deadline = absl::Now() + std::min(timeout, limits_.max_wait);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Group*> found = FindOrAddGroup(group);
  if (!found.ok()) return found.status();
  Group& g = **found;
  g.last_used = absl::Now();
  // The first to wait sets what the round is; a rank of another job (or
  // tenant) under the same group name is refused, never let to replace a
  // waiter, even one of the same rank.
  if (g.joined.empty()) {
    g.world_size = world_size;
    g.fingerprint = fingerprint;
  } else if (g.world_size != world_size || g.fingerprint != fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", group, " does not match the ranks waiting for it: ",
        g.world_size != world_size
            ? absl::StrCat("world_size ", world_size, " against their ", g.world_size)
            : std::string("its job config differs from theirs (every rank needs the same "
                          "config but for its rank)")));
  }
  const int64_t round = g.open_round;
  const bool completes =
      static_cast<int32_t>(g.joined.size() + (g.joined.contains(rank) ? 0 : 1)) == g.world_size;
  if (!completes) AMPD_RETURN_IF_ERROR(CheckWaiters(group, g));
  const uint64_t ticket = next_ticket_++;
  g.joined[rank] = ticket;
  if (completes) {
    g.formed_round = round;
    ++g.open_round;
    g.joined.clear();
    DropKeysBefore(group, round);
    return round;
  }
  auto settled = [&g, round, rank, ticket]() {
    if (g.formed_round >= round) return true;
    auto it = g.joined.find(rank);
    return it == g.joined.end() || it->second != ticket;
  };
  ++g.waiters;
  WaitFor(absl::Condition(&settled), deadline, cancelled);
  --g.waiters;
  if (g.formed_round >= round) return round;
  auto it = g.joined.find(rank);
  if (it == g.joined.end() || it->second != ticket) {
    return absl::AbortedError(
        absl::StrCat("rank ", rank, " of group ", group, " joined again from elsewhere"));
  }
  const size_t present = g.joined.size();
  g.joined.erase(it);
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("rank ", rank, " of group ", group, " went away"));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(present, " of ", g.world_size, " ranks of group ", group, " met within ",
                   absl::FormatDuration(timeout), "; the others have not joined"));
}

absl::Status RendezvousTable::Set(const std::string& key, const std::string& value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: at most ", limits_.max_value_bytes, " bytes, got ", value.size()));
  }
  absl::MutexLock lock(&mu_);
  AMPD_ASSIGN_OR_RETURN(Group * g, GroupOf(key));
  auto it = values_.find(key);
  const size_t old_bytes = it == values_.end() ? 0 : EntryBytes(it->first, it->second);
  const size_t new_bytes = EntryBytes(key, value);
  if (g->bytes - old_bytes + new_bytes > limits_.max_group_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("key: group ", GroupOfKey(key), " holds ",
                                                     g->bytes, " bytes of keys already, at most ",
                                                     limits_.max_group_bytes));
  }
  if (bytes_ - old_bytes + new_bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("key: the meeting point holds ", bytes_,
                                                     " bytes of keys already, at most ",
                                                     limits_.max_bytes));
  }
  g->bytes = g->bytes - old_bytes + new_bytes;
  bytes_ = bytes_ - old_bytes + new_bytes;
  g->last_used = absl::Now();
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousTable::Get(const std::string& key, absl::Duration timeout,
                                                 const CancelCheck& cancelled) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + std::min(timeout, limits_.max_wait);
  absl::MutexLock lock(&mu_);
  AMPD_ASSIGN_OR_RETURN(Group * g, GroupOf(key));
  if (!values_.contains(key)) {
    AMPD_RETURN_IF_ERROR(CheckWaiters(std::string(GroupOfKey(key)), *g));
    auto present = [this, &key]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.count(key) == 1; };
    // The group stays while it has a waiter (neither evicted nor forgotten).
    ++g->waiters;
    WaitFor(absl::Condition(&present), deadline, cancelled);
    --g->waiters;
  }
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::DeadlineExceededError(
        absl::StrCat("key ", key, " was not set within ", absl::FormatDuration(timeout)));
  }
  return it->second;
}

}  // namespace ampd::engine::dist
