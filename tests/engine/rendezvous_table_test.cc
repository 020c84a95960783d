// RendezvousTable, the meeting point of a distributed job's ranks: a round
// forms only when every rank of the group has joined with the same
// fingerprint and world size, a rank that joins again takes its own place,
// waits end at their timeout, older rounds' keys are dropped, every size a
// peer sends is bounded (keys in bytes per group and in all, waits per
// group, per tenant and in all), only calls signed with a group's key are
// served, another owner's job under the same group name meets apart, and a
// group's keys go with its job.
#include "server/engine/dist/rendezvous_table.h"

#include <atomic>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/engine/dist/peer_auth.h"

namespace ampd::engine::dist {
namespace {

constexpr absl::Duration kLong = absl::Seconds(20);

TEST(RendezvousTable, ARoundFormsWhenEveryRankHasJoined) {
  RendezvousTable table;
  std::vector<std::future<absl::StatusOr<int64_t>>> joins;
  for (int r = 0; r < 3; ++r) {
    joins.push_back(
        std::async(std::launch::async, [&table, r] { return table.Join("g", r, 3, "fp", kLong); }));
  }
  for (auto& j : joins) {
    absl::StatusOr<int64_t> round = j.get();
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(*round, 0);
  }
  // The next meeting is the next round.
  auto late =
      std::async(std::launch::async, [&table] { return table.Join("g", 1, 2, "x", kLong); });
  absl::StatusOr<int64_t> round = table.Join("g", 0, 2, "x", kLong);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(*round, 1);
  EXPECT_EQ(*late.get(), 1);
}

TEST(RendezvousTable, AMismatchedRankIsRefusedAndTakesNoWaitersPlace) {
  RendezvousTable table;
  auto waiter =
      std::async(std::launch::async, [&table] { return table.Join("g", 0, 2, "job-a", kLong); });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));
  absl::StatusOr<int64_t> other = table.Join("g", 0, 2, "job-b", absl::Seconds(1));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  other = table.Join("g", 1, 3, "job-a", absl::Seconds(1));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  EXPECT_NE(other.status().message().find("world_size 3"), std::string::npos);
  // The right rank 1 completes the waiter's round.
  EXPECT_TRUE(table.Join("g", 1, 2, "job-a", kLong).ok());
  EXPECT_TRUE(waiter.get().ok());
}

TEST(RendezvousTable, ARankJoiningAgainTakesItsOwnPlace) {
  RendezvousTable table;
  auto first =
      std::async(std::launch::async, [&table] { return table.Join("g", 0, 2, "f", kLong); });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));
  auto again =
      std::async(std::launch::async, [&table] { return table.Join("g", 0, 2, "f", kLong); });
  EXPECT_EQ(first.get().status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(table.Join("g", 1, 2, "f", kLong).ok());
  EXPECT_EQ(*again.get(), 0);
}

TEST(RendezvousTable, WaitsEndAtTheirTimeout) {
  RendezvousTable table;
  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> alone = table.Join("g", 0, 2, "f", absl::Milliseconds(200));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(alone.status().message().find("1 of 2 ranks"), std::string::npos) << alone.status();
  absl::StatusOr<std::string> missing = table.Get("g/0/key", absl::Milliseconds(100));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The timed-out rank left no place behind: a later round needs both again.
  EXPECT_EQ(table.Join("g", 1, 2, "f", absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(RendezvousTable, ACallerThatWentAwayFreesItsPlaceAtOnce) {
  RendezvousTable table;
  std::atomic<bool> gone{false};
  auto waiter = std::async(std::launch::async, [&] {
    return table.Join("g", 0, 2, "f", kLong, [&gone] { return gone.load(); });
  });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));  // the group has met: its keys may be read
  auto getter = std::async(std::launch::async, [&] {
    return table.Get("g/0/k", kLong, [&gone] { return gone.load(); });
  });
  ASSERT_TRUE(table.AwaitWaiting(2, kLong));
  const absl::Time start = absl::Now();
  gone = true;
  EXPECT_EQ(waiter.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(getter.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Its place is free: rank 0 must join again for a round to form.
  EXPECT_EQ(table.Join("g", 1, 2, "f", absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// Forms one round of group `g` of two ranks.
void FormRound(RendezvousTable& table, const std::string& g) {
  auto other =
      std::async(std::launch::async, [&table, g] { return table.Join(g, 1, 2, "f", kLong); });
  ASSERT_TRUE(table.Join(g, 0, 2, "f", kLong).ok());
  ASSERT_TRUE(other.get().ok());
}

TEST(RendezvousTable, GetWaitsForSetAndOlderRoundsKeysGo) {
  RendezvousTable table;
  // No key of a group that never met here.
  EXPECT_EQ(table.Set("g/0/addr", "bytes").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.Get("g/0/addr", kLong).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.Set("nogroup", "bytes").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "g"));
  auto get = std::async(std::launch::async, [&table] { return table.Get("g/0/addr", kLong); });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));
  ASSERT_TRUE(table.Set("g/0/addr", "bytes").ok());
  EXPECT_EQ(*get.get(), "bytes");
  EXPECT_EQ(table.bytes(), std::string("g/0/addr").size() + 5 + RendezvousTable::kEntryOverhead);
  // Round 1 forms: its forming drops round 0's keys, and their bytes.
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "g"));
  EXPECT_EQ(table.Get("g/0/addr", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(table.bytes(), 0u);
}

TEST(RendezvousTable, EverySizeIsBounded) {
  RendezvousTable::Limits limits;
  limits.max_groups = 2;
  limits.max_value_bytes = 8;
  RendezvousTable table(limits);
  EXPECT_EQ(table.Set(std::string(513, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set("k", std::string(9, 'v')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Join("g", 0, 2, std::string(65, 'f'), kLong).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Join("g", 2, 2, "f", kLong).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Join("a/b", 0, 2, "f", kLong).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Two groups wait; a third finds no idle group to forget.
  auto a = std::async(std::launch::async, [&table] { return table.Join("a", 0, 2, "f", kLong); });
  auto b = std::async(std::launch::async, [&table] { return table.Join("b", 0, 2, "f", kLong); });
  ASSERT_TRUE(table.AwaitWaiting(2, kLong));
  EXPECT_EQ(table.Join("c", 0, 2, "f", kLong).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.Join("a", 1, 2, "f", kLong).ok());
  EXPECT_TRUE(table.Join("b", 1, 2, "f", kLong).ok());
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
  ASSERT_TRUE(table.Set("a/0/k", "v").ok());
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "b"));  // a is now the idle longest
  // Now idle, the older group makes room for a new one, its keys with it.
  auto c = std::async(std::launch::async, [&table] { return table.Join("c", 0, 2, "f", kLong); });
  EXPECT_TRUE(table.Join("c", 1, 2, "f", kLong).ok());
  EXPECT_TRUE(c.get().ok());
  EXPECT_EQ(table.bytes(), 0u);
}

TEST(RendezvousTable, KeysAreBoundedInBytesPerGroupAndInAll) {
  RendezvousTable::Limits limits;
  limits.max_value_bytes = 1000;
  limits.max_group_bytes = 3 * (1000 + 16 + RendezvousTable::kEntryOverhead);
  limits.max_bytes = 5 * (1000 + 16 + RendezvousTable::kEntryOverhead);
  RendezvousTable table(limits);
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "a"));
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "b"));
  const std::string value(1000, 'v');
  // Keys of 16 bytes: "a/1/key-0000000N".
  auto key = [](const std::string& g, int i) { return absl::StrCat(g, "/1/key-", 10000000 + i); };
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(table.Set(key("a", i), value).ok()) << i;
  EXPECT_EQ(table.Set(key("a", 3), value).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.Set(key("a", 0), "w").ok());  // replacing a key holds no more
  EXPECT_TRUE(table.Set(key("a", 0), value).ok());
  ASSERT_TRUE(table.Set(key("b", 0), value).ok());
  ASSERT_TRUE(table.Set(key("b", 1), value).ok());
  // Group b is under its own bound, the table is at its own.
  const absl::Status full = table.Set(key("b", 2), value);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("meeting point holds"), std::string::npos) << full;
}

TEST(RendezvousTable, WaitsAreBoundedPerGroupAndInAll) {
  RendezvousTable::Limits limits;
  limits.max_waiters = 3;
  limits.max_group_waiters = 2;
  RendezvousTable table(limits);
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "a"));
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "b"));
  std::atomic<bool> gone{false};
  auto wait_for = [&](const std::string& key) {
    return std::async(std::launch::async, [&table, &gone, key] {
      return table.Get(key, kLong, [&gone] { return gone.load(); });
    });
  };
  auto a0 = wait_for("a/1/x");
  auto a1 = wait_for("a/1/y");
  ASSERT_TRUE(table.AwaitWaiting(2, kLong));
  // Group a has both its waits; b still has room, until the table is full.
  EXPECT_EQ(table.Get("a/1/z", kLong).status().code(), absl::StatusCode::kResourceExhausted);
  auto b0 = wait_for("b/1/x");
  ASSERT_TRUE(table.AwaitWaiting(3, kLong));
  const absl::StatusOr<std::string> refused = table.Get("b/1/y", kLong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(table.Join("b", 0, 2, "f", kLong).status().code(),
            absl::StatusCode::kResourceExhausted);
  // A key already there is answered without a wait, and a Join that
  // completes a round waits for nothing either.
  ASSERT_TRUE(table.Set("b/1/set", "v").ok());
  EXPECT_EQ(*table.Get("b/1/set", kLong), "v");
  gone = true;
  for (auto* f : {&a0, &a1, &b0}) {
    EXPECT_EQ(f->get().status().code(), absl::StatusCode::kDeadlineExceeded);
  }
}

TEST(RendezvousTable, AGroupWaitsAtMostTwiceItsWorldSize) {
  RendezvousTable table;  // the default bounds, far above a 2-rank group's
  ASSERT_NO_FATAL_FAILURE(FormRound(table, "a"));
  std::atomic<bool> gone{false};
  std::vector<std::future<absl::StatusOr<std::string>>> waits;
  for (int i = 0; i < 4; ++i) {
    waits.push_back(std::async(std::launch::async, [&table, &gone, i] {
      return table.Get(absl::StrCat("a/1/k", i), kLong, [&gone] { return gone.load(); });
    }));
  }
  ASSERT_TRUE(table.AwaitWaiting(4, kLong));
  EXPECT_EQ(table.Get("a/1/k4", kLong).status().code(), absl::StatusCode::kResourceExhausted);
  gone = true;
  for (auto& w : waits) EXPECT_EQ(w.get().status().code(), absl::StatusCode::kDeadlineExceeded);
}

// The owners of a table's groups, as JobRegistry::PeerSecrets gives them.
class Owners {
 public:
  void Add(const std::string& group, const std::string& secret, const std::string& tenant) {
    absl::MutexLock lock(&mu_);
    jobs_[group].push_back({secret, tenant});
  }
  void Remove(const std::string& group) {
    absl::MutexLock lock(&mu_);
    jobs_.erase(group);
  }
  RendezvousTable::GroupSecrets Secrets() {
    return [this](const std::string& group) {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(group);
      return it == jobs_.end() ? std::vector<RendezvousTable::GroupOwner>() : it->second;
    };
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<RendezvousTable::GroupOwner>> jobs_ ABSL_GUARDED_BY(mu_);
};

// The member a Join of `group` signed with `secret` acts for.
absl::StatusOr<RendezvousTable::Member> JoinAs(RendezvousTable& table, const std::string& group,
                                               const std::string& secret, int32_t rank = 0) {
  auto expected = [&](absl::string_view key) { return JoinProof(key, group, rank, 2, "f", 5); };
  return table.Authenticate(group, expected,
                            JoinProof(GroupKey(secret, group), group, rank, 2, "f", 5));
}

TEST(RendezvousTable, OnlyCallsSignedWithTheGroupsKeyAreServed) {
  Owners jobs;
  jobs.Add("g", std::string(32, 's'), "");
  jobs.Add("h", std::string(32, 'h'), "");
  // Every call looks for gone groups: the test need not outwait the interval.
  RendezvousTable::Limits limits;
  limits.sweep_every = absl::ZeroDuration();
  RendezvousTable table(limits, jobs.Secrets());
  auto set_proof = [](absl::string_view key) { return SetProof(key, "g/0/k", "v"); };
  const std::string right = SetProof(GroupKey(std::string(32, 's'), "g"), "g/0/k", "v");
  const std::string wrong = SetProof(GroupKey(std::string(32, 'x'), "g"), "g/0/k", "v");
  EXPECT_TRUE(table.Authenticate("g", set_proof, right).ok());
  EXPECT_EQ(table.Authenticate("g", set_proof, wrong).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(table.Authenticate("g", set_proof, "").status().code(),
            absl::StatusCode::kUnauthenticated);
  // Signed for another value: a proof binds the call's fields.
  const std::string other_value = SetProof(GroupKey(std::string(32, 's'), "g"), "g/0/k", "w");
  EXPECT_EQ(table.Authenticate("g", set_proof, other_value).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Another group's key signs nothing of this one.
  const std::string h_key = SetProof(GroupKey(std::string(32, 'h'), "h"), "g/0/k", "v");
  EXPECT_EQ(table.Authenticate("g", set_proof, h_key).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(table.Authenticate("other", set_proof, right).status().code(),
            absl::StatusCode::kNotFound);

  // The group's keys go with its job: once it is gone, the next call of
  // another group past the sweep's interval (zero here) forgets it.
  absl::StatusOr<RendezvousTable::Member> g0 = JoinAs(table, "g", std::string(32, 's'), 0);
  absl::StatusOr<RendezvousTable::Member> g1 = JoinAs(table, "g", std::string(32, 's'), 1);
  ASSERT_TRUE(g0.ok() && g1.ok()) << g0.status() << g1.status();
  auto other = std::async(std::launch::async, [&] { return table.Join(*g1, 1, 2, "f", kLong); });
  ASSERT_TRUE(table.Join(*g0, 0, 2, "f", kLong).ok());
  ASSERT_TRUE(other.get().ok());
  ASSERT_TRUE(table.Set(*g0, "g/0/k", "v").ok());
  EXPECT_GT(table.bytes(), 0u);
  jobs.Remove("g");
  EXPECT_EQ(table.Authenticate("g", set_proof, right).status().code(), absl::StatusCode::kNotFound);
  auto h_proof = [](absl::string_view key) { return GetProof(key, "h/0/k", 5); };
  ASSERT_TRUE(
      table.Authenticate("h", h_proof, GetProof(GroupKey(std::string(32, 'h'), "h"), "h/0/k", 5))
          .ok());
  EXPECT_EQ(table.bytes(), 0u);
  EXPECT_EQ(table.Set(*g0, "g/0/k", "v").code(), absl::StatusCode::kFailedPrecondition);
}

// Bob's job under Alice's group name, signed with his own secret, meets in
// a room of its own: his Join neither completes nor blocks her round, his
// Get never sees her keys, and she never sees his.
TEST(RendezvousTable, AnotherOwnersJobUnderTheSameNameMeetsApart) {
  Owners jobs;
  const std::string alice_secret(32, 'a');
  const std::string bob_secret(32, 'b');
  jobs.Add("shared", alice_secret, "alice");
  jobs.Add("shared", bob_secret, "bob");
  RendezvousTable table(RendezvousTable::Limits(), jobs.Secrets());
  absl::StatusOr<RendezvousTable::Member> alice = JoinAs(table, "shared", alice_secret);
  absl::StatusOr<RendezvousTable::Member> bob = JoinAs(table, "shared", bob_secret);
  ASSERT_TRUE(alice.ok() && bob.ok()) << alice.status() << bob.status();
  EXPECT_EQ(alice->tenant, "alice");
  EXPECT_EQ(bob->tenant, "bob");
  EXPECT_NE(alice->room, bob->room);
  // Bob waits as rank 0 with a fingerprint of his own; Alice's two ranks
  // still form their round (before, his waiter set the round's fingerprint
  // and hers were refused).
  auto bob_waits = std::async(std::launch::async,
                              [&] { return table.Join(*bob, 0, 2, "bob's", absl::Seconds(2)); });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));
  auto alice_rank1 =
      std::async(std::launch::async, [&] { return table.Join(*alice, 1, 2, "alice's", kLong); });
  absl::StatusOr<int64_t> round = table.Join(*alice, 0, 2, "alice's", kLong);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(*alice_rank1.get(), *round);
  ASSERT_TRUE(table.Set(*alice, absl::StrCat("shared/", *round, "/rank_0"), "alice-addr").ok());
  EXPECT_EQ(bob_waits.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  // His room holds nothing of hers: his Get of her round's key finds
  // nothing, and what he writes under that key stays in his room.
  const std::string key = absl::StrCat("shared/", *round, "/rank_0");
  EXPECT_EQ(table.Get(*bob, key, absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(table.Set(*bob, key, "bob-addr").ok());
  EXPECT_EQ(*table.Get(*alice, key, kLong), "alice-addr");
  EXPECT_EQ(*table.Get(*bob, key, kLong), "bob-addr");
  // A key of another group name is never the member's.
  EXPECT_EQ(table.Set(*alice, "other/0/k", "v").code(), absl::StatusCode::kFailedPrecondition);
}

// One tenant's groups together wait at most max_tenant_waiters calls, so
// another tenant's group still finds waits; an open server's tenant ""
// (everybody) is bound by the table's and the groups' bounds only.
TEST(RendezvousTable, ATenantsGroupsTakeAtMostItsShareOfTheWaits) {
  Owners jobs;
  for (const char* g : {"b1", "b2"}) jobs.Add(g, std::string(32, 'b'), "bob");
  jobs.Add("a1", std::string(32, 'a'), "alice");
  jobs.Add("o1", std::string(32, 'o'), "");
  jobs.Add("o2", std::string(32, 'p'), "");
  RendezvousTable::Limits limits;
  limits.max_waiters = 12;
  limits.max_tenant_waiters = 5;
  RendezvousTable table(limits, jobs.Secrets());
  auto member = [&](const std::string& g, char s) {
    absl::StatusOr<RendezvousTable::Member> m = JoinAs(table, g, std::string(32, s));
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  };
  const RendezvousTable::Member b1 = member("b1", 'b');
  const RendezvousTable::Member b2 = member("b2", 'b');
  const RendezvousTable::Member a1 = member("a1", 'a');
  std::atomic<bool> gone{false};
  std::vector<std::future<absl::StatusOr<int64_t>>> waits;
  auto wait = [&](const RendezvousTable::Member& m, int32_t rank, int32_t world) {
    waits.push_back(std::async(std::launch::async, [&table, &gone, m, rank, world] {
      return table.Join(m, rank, world, "f", kLong, [&gone] { return gone.load(); });
    }));
  };
  // Bob's two groups of 8 ranks: each could wait 7, together only 5.
  for (int r = 1; r <= 3; ++r) wait(b1, r, 8);
  for (int r = 1; r <= 2; ++r) wait(b2, r, 8);
  ASSERT_TRUE(table.AwaitWaiting(5, kLong));
  const absl::StatusOr<int64_t> refused = table.Join(b1, 4, 8, "f", kLong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("tenant"), std::string::npos) << refused.status();
  EXPECT_EQ(table.Join(b2, 3, 8, "f", kLong).status().code(), absl::StatusCode::kResourceExhausted);
  // Alice's group of 2 still forms.
  auto alice_rank1 =
      std::async(std::launch::async, [&] { return table.Join(a1, 1, 2, "f", kLong); });
  EXPECT_TRUE(table.Join(a1, 0, 2, "f", kLong).ok());
  EXPECT_TRUE(alice_rank1.get().ok());
  // The open server's callers: past 5 together, up to the table's 12.
  const RendezvousTable::Member o1 = member("o1", 'o');
  const RendezvousTable::Member o2 = member("o2", 'p');
  for (int r = 1; r <= 4; ++r) wait(o1, r, 8);
  for (int r = 1; r <= 3; ++r) wait(o2, r, 8);
  ASSERT_TRUE(table.AwaitWaiting(12, kLong));
  EXPECT_EQ(table.Join(o2, 4, 8, "f", kLong).status().code(), absl::StatusCode::kResourceExhausted);
  gone = true;
  for (auto& w : waits) EXPECT_EQ(w.get().status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace ampd::engine::dist
