// `ampctl train --world-size=2` end to end: two real ampd replicas (CPU,
// Gloo on loopback) train the synthetic task with the same per-step skips
// and scales, and losses to fp16's rounding, as one ampd training each batch
// as two micro-batches (`--micro-batches=2`); SIGKILLed mid-run and
// restarted from its older checkpoint, a replica rejoins and ampctl
// finishes every step, each applied once (the step numbers run 1..N without
// a gap and match the uninterrupted run). The GPT's token batches split the
// same way.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

constexpr auto kRunDeadline = std::chrono::seconds(300);

struct StepLine {
  int64_t step = 0;
  double loss = 0;
  double scale = 0;
  bool skipped = false;
};

std::vector<StepLine> ParseSteps(const std::string& out) {
  std::vector<StepLine> steps;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct s;
    if (!google::protobuf::util::JsonStringToMessage(std::string(line), &s).ok()) {
      ADD_FAILURE() << "not JSON: " << line;
      continue;
    }
    const auto& f = s.fields();
    steps.push_back({static_cast<int64_t>(f.at("step").number_value()), f.at("loss").number_value(),
                     f.at("loss_scale").number_value(), f.at("skipped").bool_value()});
  }
  return steps;
}

class DistributedAmpctlTest : public ::testing::Test {
 protected:
  // Ports are the kernel's picks on a replica's first start; a restart
  // comes back on its gRPC port (ampctl dials it) and any peer port (only
  // rank 0's is the rendezvous).
  struct Replica {
    int port = 0;
    int peer_port = 0;
    std::unique_ptr<AmpdProcess> process;
  };

  void Start(int rank, const std::string& log_name, int checkpoint_every = 40) {
    Replica& r = replicas_[static_cast<size_t>(rank)];
    std::vector<std::string> flags = {
        "--peer-address=127.0.0.1:0",
        "--state-dir=" + (root_.path() / absl::StrCat("state", rank)).string(),
        absl::StrCat("--checkpoint-every=", checkpoint_every)};
    if (r.port != 0) flags.push_back(absl::StrCat("--listen=127.0.0.1:", r.port));
    r.process = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, root_.path() / log_name);
    ASSERT_NE(r.process->port(), 0) << r.process->Describe();
    ASSERT_NE(r.process->peer_port(), 0) << r.process->Describe();
    r.port = r.process->port();
    r.peer_port = r.process->peer_port();
  }

  std::vector<std::string> DistributedArgs(const std::vector<std::string>& flags) const {
    std::vector<std::string> args = {
        AMPCTL_BINARY,
        absl::StrCat("--server=127.0.0.1:", replicas_[0].port, ",127.0.0.1:", replicas_[1].port),
        "train",
        "--world-size=2",
        absl::StrCat("--rendezvous=127.0.0.1:", replicas_[0].peer_port),
        "--dist-timeout-ms=3000",
        "--retry-for-s=60",
        "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    return args;
  }

  // The same training on one ampd, each batch as two micro-batches.
  std::vector<StepLine> Alone(const std::vector<std::string>& flags) {
    AmpdProcess alone(AMPD_SERVER_BINARY, {}, root_.path() / "alone.log");
    EXPECT_NE(alone.port(), 0) << alone.Describe();
    std::vector<std::string> args = {AMPCTL_BINARY, "--server=" + alone.address(), "train",
                                     "--micro-batches=2", "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    const CommandResult result = RunCommand(args, kRunDeadline);
    EXPECT_EQ(result.status.code, 0) << result.out << result.err;
    return ParseSteps(result.out);
  }

  static void ExpectSameRun(const std::vector<StepLine>& alone, const std::vector<StepLine>& dist,
                            double tolerance) {
    ASSERT_EQ(alone.size(), dist.size());
    int skipped = 0;
    for (size_t i = 0; i < alone.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("step ", i + 1));
      EXPECT_EQ(dist[i].step, static_cast<int64_t>(i + 1));
      EXPECT_EQ(dist[i].skipped, alone[i].skipped);
      EXPECT_EQ(dist[i].scale, alone[i].scale);
      EXPECT_NEAR(dist[i].loss, alone[i].loss, tolerance * std::max(1.0, std::fabs(alone[i].loss)));
      skipped += dist[i].skipped ? 1 : 0;
    }
    EXPECT_GE(skipped, 2);  // fp16's opening backoffs from 65536, on both
  }

  TempDir root_{"ampd_distributed_ampctl"};
  std::vector<Replica> replicas_ = std::vector<Replica>(2);
};

TEST_F(DistributedAmpctlTest, SurvivesAReplicasSigkillWithTheSameLossesAndSkips) {
  const std::vector<std::string> flags = {"--steps=400", "--precision=fp16", "--seed=7"};
  const std::vector<StepLine> alone = Alone(flags);
  // Rank 1 keeps only its creation checkpoint, so wherever the kill lands
  // it comes back behind rank 0 and must take its state (a mid-run
  // checkpoint could coincide with rank 0's step; tests/distributed kills
  // at a fixed step after one).
  ASSERT_NO_FATAL_FAILURE(Start(0, "rank0.log"));
  ASSERT_NO_FATAL_FAILURE(Start(1, "rank1.log", /*checkpoint_every=*/100000));
  // ampctl's JSON lines come through a pipe: read (blocking) until 100
  // steps are reported, kill rank 1, then read the rest until ampctl exits.
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  absl::StatusOr<pid_t> ampctl = test_support::Spawn(DistributedArgs(flags), {-1, out[1], -1});
  close(out[1]);
  ASSERT_TRUE(ampctl.ok()) << ampctl.status();
  std::string text;
  auto read_more = [&]() {
    char chunk[4096];
    const ssize_t n = read(out[0], chunk, sizeof(chunk));
    if (n > 0) text.append(chunk, static_cast<size_t>(n));
    return n > 0 || (n < 0 && errno == EINTR);
  };
  while (std::count(text.begin(), text.end(), '\n') < 100 && read_more()) {
  }
  ASSERT_GE(std::count(text.begin(), text.end(), '\n'), 100) << text;
  replicas_[1].process->Signal(SIGKILL);
  replicas_[1].process->Wait(std::chrono::seconds(10));
  // ampctl's next step fails and is resent while the replica starts again.
  ASSERT_NO_FATAL_FAILURE(Start(1, "rank1-restarted.log", /*checkpoint_every=*/100000));
  while (read_more()) {
  }
  close(out[0]);
  const test_support::ExitStatus exit = test_support::WaitForExit(*ampctl, kRunDeadline);
  EXPECT_EQ(exit.code, 0) << exit.ToString();
  const std::vector<StepLine> dist = ParseSteps(text);
  ExpectSameRun(alone, dist, 2e-3);
  // The restarted replica came back behind rank 0 and took its state.
  EXPECT_NE(replicas_[1].process->Log().find("copied the state of rank 0"), std::string::npos)
      << replicas_[1].process->Log();
}

TEST_F(DistributedAmpctlTest, AGptSplitsItsSequencesAcrossTheRanks) {
  const std::vector<std::string> flags = {"--steps=30", "--precision=fp16", "--seed=3",
                                          "--layers=gpt:64:16:32:2:2", "--batch-size=4"};
  const std::vector<StepLine> alone = Alone(flags);
  ASSERT_NO_FATAL_FAILURE(Start(0, "rank0.log"));
  ASSERT_NO_FATAL_FAILURE(Start(1, "rank1.log"));
  const CommandResult result = RunCommand(DistributedArgs(flags), kRunDeadline);
  ASSERT_EQ(result.status.code, 0) << result.out << result.err;
  const std::vector<StepLine> dist = ParseSteps(result.out);
  ASSERT_EQ(dist.size(), alone.size());
  for (size_t i = 0; i < alone.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("step ", i + 1));
    EXPECT_EQ(dist[i].skipped, alone[i].skipped);
    EXPECT_EQ(dist[i].scale, alone[i].scale);
    EXPECT_NEAR(dist[i].loss, alone[i].loss, 2e-3 * std::max(1.0, std::fabs(alone[i].loss)));
  }
  EXPECT_LT(dist.back().loss, dist.front().loss);
}

TEST_F(DistributedAmpctlTest, BadShardingFlagsAreUsageErrors) {
  ASSERT_NO_FATAL_FAILURE(Start(0, "rank0.log"));
  ASSERT_NO_FATAL_FAILURE(Start(1, "rank1.log"));
  std::vector<std::string> args = DistributedArgs({"--steps=1"});
  args[1] = absl::StrCat("--server=127.0.0.1:", replicas_[0].port);  // one address for two ranks
  CommandResult result = RunCommand(args, kRunDeadline);
  EXPECT_EQ(result.status.code, 2) << result.err;
  EXPECT_NE(result.err.find("2 comma-separated addresses"), std::string::npos) << result.err;
  // 64 rows do not split into 2 x 3 micro-batches.
  result = RunCommand(DistributedArgs({"--steps=1", "--micro-batches=3"}), kRunDeadline);
  EXPECT_EQ(result.status.code, 2) << result.err;
  EXPECT_NE(result.err.find("do not split"), std::string::npos) << result.err;
}

}  // namespace
}  // namespace ampd
