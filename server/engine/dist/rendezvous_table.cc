// RendezvousTable: rounds by barrier, keys by wait, every call counted
// against the table's bounds before it waits or stores anything.
#include "server/engine/dist/rendezvous_table.h"

#include <algorithm>
#include <optional>
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

bool RendezvousTable::WaitFor(Group& group, const absl::Condition& condition, absl::Time deadline,
                              const CancelCheck& cancelled) {
  // The group stays while it has a waiter (neither evicted nor forgotten).
  ++group.waiters;
  ++waiting_;
  ++tenant_waiting_[group.tenant];
  bool met = false;
  for (;;) {
    const absl::Time slice = cancelled ? std::min(deadline, absl::Now() + kCancelPoll) : deadline;
    if (mu_.AwaitWithDeadline(condition, slice)) {
      met = true;
      break;
    }
    if (absl::Now() >= deadline || (cancelled && cancelled())) break;
  }
  if (--tenant_waiting_[group.tenant] == 0) tenant_waiting_.erase(group.tenant);
  --waiting_;
  --group.waiters;
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

absl::string_view RendezvousTable::GroupOfName(absl::string_view key) { return GroupOfKey(key); }

absl::StatusOr<RendezvousTable::Member> RendezvousTable::Authenticate(const std::string& group,
                                                                      const ExpectedProof& expected,
                                                                      absl::string_view proof) {
  if (!secrets_) return Unauthenticated(group);
  const std::vector<GroupOwner> owners = secrets_(group);
  if (owners.empty()) {
    return absl::NotFoundError(absl::StrCat("group ", group.substr(0, 128),
                                            ": no job of this ampd meets its ranks (yet)"));
  }
  // Every owner's key is tried (no early exit), so the time taken does not
  // tell which of several jobs under the name the proof is for.
  std::optional<Member> member;
  for (const GroupOwner& owner : owners) {
    const std::string key = GroupKey(owner.secret, group);
    if (ProofMatches(expected(key), proof) && !member.has_value()) {
      member = Member{group, owner.tenant, absl::StrCat(group, "#", RoomId(key, owner.tenant))};
    }
  }
  if (!member.has_value()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "group ", group.substr(0, 128),
        ": the call's proof is not signed with the group's key (distributed.secret differs, or "
        "the caller is no rank of the job)"));
  }
  ForgetGoneGroups();
  return *std::move(member);
}

void RendezvousTable::ForgetGoneGroups() {
  std::vector<std::pair<std::string, std::string>> rooms;  // (room, group name)
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_sweep_ < limits_.sweep_every) return;
    last_sweep_ = now;
    for (const auto& [room, g] : groups_) rooms.emplace_back(room, g.name);
  }
  std::vector<std::string> gone;
  std::map<std::string, std::vector<std::string>> live;  // group name -> its owners' rooms
  for (const auto& [room, name] : rooms) {
    auto [it, added] = live.try_emplace(name);
    if (added) {
      for (const GroupOwner& owner : secrets_(name)) {
        const std::string key = GroupKey(owner.secret, name);
        it->second.push_back(absl::StrCat(name, "#", RoomId(key, owner.tenant)));
      }
    }
    if (std::find(it->second.begin(), it->second.end(), room) == it->second.end()) {
      gone.push_back(room);
    }
  }
  if (gone.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const std::string& room : gone) {
    auto it = groups_.find(room);
    // A waiter holds a reference to its group: the group goes once its
    // waits end (at their timeout, which the job's timeout_ms bounds).
    if (it == groups_.end() || it->second.waiters > 0 || !it->second.joined.empty()) continue;
    DropKeysBefore(room, INT64_MAX);
    groups_.erase(it);
  }
}

absl::Status RendezvousTable::CheckWaiters(const Group& group) const {
  if (waiting_ >= limits_.max_waiters) {
    return absl::ResourceExhaustedError(absl::StrCat("the meeting point's ", limits_.max_waiters,
                                                     " waits are all taken; retry later"));
  }
  // A tenant's groups together: what one tenant holds, another can still
  // form a group with (an open server's callers are all tenant "").
  if (!group.tenant.empty()) {
    auto held = tenant_waiting_.find(group.tenant);
    if (held != tenant_waiting_.end() && held->second >= limits_.max_tenant_waiters) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "group ", group.name, ": its tenant's groups hold the ", limits_.max_tenant_waiters,
          " waits a tenant may hold at the meeting point; retry later"));
    }
  }
  // Its ranks need at most world_size - 1 waits at a time (Joins, then
  // Gets): twice that leaves room for ranks that retry, and keeps a group
  // that misbehaves from taking the waits of the others.
  const size_t cap = std::min(limits_.max_group_waiters,
                              2 * static_cast<size_t>(std::max<int32_t>(group.world_size, 1)));
  if (group.waiters >= cap) {
    return absl::ResourceExhaustedError(
        absl::StrCat("group ", group.name, ": its ", cap, " waits are all taken; retry later"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousTable::RoomKey(const Member& member, const std::string& key) {
  if (member.group.empty() || GroupOfKey(key) != member.group) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", key.substr(0, 128), ": keys are '", member.group.substr(0, 128),
                     "/...', of the group the call is signed for"));
  }
  return absl::StrCat(member.room, absl::string_view(key).substr(member.group.size()));
}

absl::StatusOr<RendezvousTable::Group*> RendezvousTable::GroupOf(const Member& member,
                                                                 const std::string& key) {
  auto it = groups_.find(member.room);
  if (it == groups_.end()) {
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

absl::StatusOr<RendezvousTable::Group*> RendezvousTable::FindOrAddGroup(const Member& member) {
  auto it = groups_.find(member.room);
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
  Group& added = groups_[member.room];
  added.name = member.group;
  added.tenant = member.tenant;
  return &added;
}

void RendezvousTable::DropKeysBefore(const std::string& room, int64_t round) {
  const std::string prefix = room + "/";
  for (auto it = values_.lower_bound(prefix);
       it != values_.end() && absl::StartsWith(it->first, prefix);) {
    const absl::string_view rest = absl::string_view(it->first).substr(prefix.size());
    int64_t key_round = 0;
    const bool numbered = absl::SimpleAtoi(rest.substr(0, rest.find('/')), &key_round);
    if (!numbered || key_round < round) {
      const size_t entry = EntryBytes(it->first, it->second);
      bytes_ -= entry;
      if (auto g = groups_.find(room); g != groups_.end()) g->second.bytes -= entry;
      it = values_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<int64_t> RendezvousTable::Join(const Member& member, int32_t rank,
                                              int32_t world_size, const std::string& fingerprint,
                                              absl::Duration timeout,
                                              const CancelCheck& cancelled) {
  const std::string& group = member.group;
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
  absl::StatusOr<Group*> found = FindOrAddGroup(member);
  if (!found.ok()) return found.status();
  Group& g = **found;
  g.last_used = absl::Now();
  // The first to wait sets what the round is; a rank of another job of the
  // same owner under the same group name is refused, never let to replace
  // a waiter, even one of the same rank (another owner's is in its own
  // room).
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
  if (!completes) AMPD_RETURN_IF_ERROR(CheckWaiters(g));
  const uint64_t ticket = next_ticket_++;
  g.joined[rank] = ticket;
  if (completes) {
    g.formed_round = round;
    ++g.open_round;
    g.joined.clear();
    DropKeysBefore(member.room, round);
    return round;
  }
  auto settled = [&g, round, rank, ticket]() {
    if (g.formed_round >= round) return true;
    auto it = g.joined.find(rank);
    return it == g.joined.end() || it->second != ticket;
  };
  WaitFor(g, absl::Condition(&settled), deadline, cancelled);
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

absl::Status RendezvousTable::Set(const Member& member, const std::string& key,
                                  const std::string& value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: at most ", limits_.max_value_bytes, " bytes, got ", value.size()));
  }
  AMPD_ASSIGN_OR_RETURN(const std::string stored, RoomKey(member, key));
  absl::MutexLock lock(&mu_);
  AMPD_ASSIGN_OR_RETURN(Group * g, GroupOf(member, key));
  auto it = values_.find(stored);
  const size_t old_bytes = it == values_.end() ? 0 : EntryBytes(it->first, it->second);
  const size_t new_bytes = EntryBytes(stored, value);
  if (g->bytes - old_bytes + new_bytes > limits_.max_group_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("key: group ", member.group, " holds ",
                                                     g->bytes, " bytes of keys already, at most ",
                                                     limits_.max_group_bytes));
  }
  // The table's bytes are every owner's: the refusal names the bound only.
  if (bytes_ - old_bytes + new_bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("key: the meeting point holds as many bytes of keys as it may (",
                     limits_.max_bytes, "); retry later"));
  }
  g->bytes = g->bytes - old_bytes + new_bytes;
  bytes_ = bytes_ - old_bytes + new_bytes;
  g->last_used = absl::Now();
  values_[stored] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousTable::Get(const Member& member, const std::string& key,
                                                 absl::Duration timeout,
                                                 const CancelCheck& cancelled) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  AMPD_ASSIGN_OR_RETURN(const std::string stored, RoomKey(member, key));
  const absl::Time deadline = absl::Now() + std::min(timeout, limits_.max_wait);
  absl::MutexLock lock(&mu_);
  AMPD_ASSIGN_OR_RETURN(Group * g, GroupOf(member, key));
  if (!values_.contains(stored)) {
    AMPD_RETURN_IF_ERROR(CheckWaiters(*g));
    auto present = [this, &stored]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.count(stored) == 1; };
    WaitFor(*g, absl::Condition(&present), deadline, cancelled);
  }
  auto it = values_.find(stored);
  if (it == values_.end()) {
    return absl::DeadlineExceededError(
        absl::StrCat("key ", key, " was not set within ", absl::FormatDuration(timeout)));
  }
  return it->second;
}

}  // namespace ampd::engine::dist
