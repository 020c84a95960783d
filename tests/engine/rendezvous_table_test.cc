// RendezvousTable, the meeting point of a distributed job's ranks: a round
// forms only when every rank of the group has joined with the same
// fingerprint and world size, a rank that joins again takes its own place,
// waits end at their timeout, older rounds' keys are dropped, and every size
// a peer sends is bounded.
#include "server/engine/dist/rendezvous_table.h"

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

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

TEST(RendezvousTable, GetWaitsForSetAndOlderRoundsKeysGo) {
  RendezvousTable table;
  auto get = std::async(std::launch::async, [&table] { return table.Get("g/0/addr", kLong); });
  ASSERT_TRUE(table.AwaitWaiting(1, kLong));
  ASSERT_TRUE(table.Set("g/0/addr", "bytes").ok());
  EXPECT_EQ(*get.get(), "bytes");
  // Rounds 0 and 1 form: round 1's forming drops round 0's keys.
  for (int round = 0; round < 2; ++round) {
    auto other =
        std::async(std::launch::async, [&table] { return table.Join("g", 1, 2, "f", kLong); });
    ASSERT_TRUE(table.Join("g", 0, 2, "f", kLong).ok());
    ASSERT_TRUE(other.get().ok());
  }
  EXPECT_EQ(table.Get("g/0/addr", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(RendezvousTable, EverySizeIsBounded) {
  RendezvousTable::Limits limits;
  limits.max_groups = 2;
  limits.max_keys = 3;
  limits.max_value_bytes = 8;
  RendezvousTable table(limits);
  EXPECT_EQ(table.Set(std::string(513, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Set("k", std::string(9, 'v')).code(), absl::StatusCode::kInvalidArgument);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(table.Set(absl::StrCat("k", i), "v").ok());
  EXPECT_EQ(table.Set("k3", "v").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.Set("k0", "w").ok());  // replacing a key holds no more
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
  // Now idle, the older groups make room for a new one.
  auto c = std::async(std::launch::async, [&table] { return table.Join("c", 0, 2, "f", kLong); });
  EXPECT_TRUE(table.Join("c", 1, 2, "f", kLong).ok());
  EXPECT_TRUE(c.get().ok());
}

}  // namespace
}  // namespace ampd::engine::dist
