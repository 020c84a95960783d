// Data-parallel jobs through real ampd processes (docs/DISTRIBUTED.md): N
// replicas over Gloo on loopback train the same job as one process on the
// combined batch — the same losses (to float-reduction tolerance), the same
// skipped steps and scales, an overflow on one rank's share skipping the
// step on every rank — and a replica SIGKILLed mid-run and restarted from
// its older checkpoint resumes with every acknowledged step applied once.
#include "client/data_parallel.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "ampd/v1/peer.grpc.pb.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "server/engine/dist/peer_auth.h"
#include "tests/support/ampd_process.h"
#include "tests/support/metric_wait.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

// Tokens of two tenants (only their SHA-256 is written to the tenants file).
constexpr char kAliceToken[] = "alice-token-data-parallel";
constexpr char kBobToken[] = "bob-token-data-parallel";

// A replica's ports are the kernel's picks on its first start (ampd prints
// them); a restart comes back on the same gRPC port, which its clients dial,
// and any peer port (only rank 0's is the group's rendezvous).
struct Replica {
  int port = 0;
  int peer_port = 0;
  std::vector<std::string> extra;  // --state-dir etc.
  std::unique_ptr<AmpdProcess> process;

  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  std::string peer() const { return absl::StrCat("127.0.0.1:", peer_port); }
};

class DataParallelTest : public ::testing::Test {
 protected:
  // Starts (or restarts) replica r on its fixed ports.
  // Starts (or restarts, on its gRPC port and, when asked, its peer port)
  // a replica.
  void Start(Replica& replica, const std::string& name, bool same_peer_port = false) {
    std::vector<std::string> flags = {same_peer_port
                                          ? absl::StrCat("--peer-address=", replica.peer())
                                          : "--peer-address=127.0.0.1:0"};
    if (replica.port != 0) flags.push_back(absl::StrCat("--listen=", replica.address()));
    flags.insert(flags.end(), replica.extra.begin(), replica.extra.end());
    replica.process =
        std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, root_.path() / (name + ".log"));
    ASSERT_NE(replica.process->port(), 0) << replica.process->Describe();
    ASSERT_NE(replica.process->peer_port(), 0) << replica.process->Describe();
    replica.port = replica.process->port();
    replica.peer_port = replica.process->peer_port();
  }

  std::vector<Replica> StartReplicas(int n, const std::vector<std::string>& extra = {}) {
    std::vector<Replica> replicas(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      replicas[static_cast<size_t>(r)].extra = extra;
      if (!extra.empty()) {
        // Each replica its own state directory.
        replicas[static_cast<size_t>(r)].extra.push_back(
            absl::StrCat("--state-dir=", (root_.path() / absl::StrCat("state", r)).string()));
      }
      Start(replicas[static_cast<size_t>(r)], absl::StrCat("rank", r));
      if (::testing::Test::HasFatalFailure()) break;
    }
    return replicas;
  }

  static v1::CreateJobRequest Request(const SyntheticTask& task, v1::Precision precision) {
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    *config->mutable_model() = task.Model();
    config->set_precision(precision);
    config->set_seed(7);
    config->mutable_optimizer()->set_lr(1e-3f);
    return request;
  }

  static SyntheticTaskOptions TaskOptions() {
    SyntheticTaskOptions options;
    options.batch_size = 64;
    options.target_scale = 32.0f;  // the first fp16 steps overflow at 65536
    options.seed = 7;
    return options;
  }

  // Step i's batch, with every input of its last quarter (the last rank's
  // share for 2 and 4 ranks) made infinite at step `poisoned`.
  static v1::MicroBatch Batch(SyntheticTask& task, int64_t i, int64_t poisoned) {
    v1::MicroBatch batch = task.NextBatch();
    if (i == poisoned) {
      std::string* data = batch.mutable_inputs()->mutable_data();
      const float inf = std::numeric_limits<float>::infinity();
      for (size_t at = data->size() * 3 / 4; at + sizeof(float) <= data->size();
           at += sizeof(float)) {
        std::memcpy(data->data() + at, &inf, sizeof(float));
      }
    }
    return batch;
  }

  // One process training `steps` steps on each batch cut into `parts`
  // micro-batches: the reference a group of `parts` ranks must match.
  std::vector<v1::StepResponse> TrainAlone(v1::Precision precision, int64_t parts, int64_t steps,
                                           int64_t poisoned) {
    Replica alone;
    Start(alone, "alone");
    std::unique_ptr<Client> client = Client::Connect(alone.address());
    SyntheticTask task(TaskOptions());
    absl::StatusOr<v1::Job> job = client->CreateJob(Request(task, precision));
    EXPECT_TRUE(job.ok()) << job.status();
    std::vector<v1::StepResponse> responses;
    for (int64_t i = 1; i <= steps && job.ok(); ++i) {
      v1::StepRequest step;
      step.set_job_id(job->job_id());
      step.set_sequence(i);
      absl::StatusOr<std::vector<v1::MicroBatch>> mbs = SplitRows(Batch(task, i, poisoned), parts);
      EXPECT_TRUE(mbs.ok()) << mbs.status();
      for (const v1::MicroBatch& mb : *mbs) *step.add_micro_batches() = mb;
      absl::StatusOr<v1::StepResponse> r = client->Step(step);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) responses.push_back(*r);
    }
    return responses;
  }

  static DataParallelOptions Options(const std::vector<Replica>& replicas) {
    DataParallelOptions options;
    for (const Replica& r : replicas) options.servers.push_back(r.address());
    options.rendezvous = replicas[0].peer();
    options.timeout = absl::Seconds(5);
    options.retry_for = absl::Seconds(90);
    options.client.deadline = absl::Seconds(30);
    return options;
  }

  static std::vector<std::vector<v1::MicroBatch>> Shares(const v1::MicroBatch& batch, int ranks) {
    absl::StatusOr<std::vector<v1::MicroBatch>> parts = SplitRows(batch, ranks);
    EXPECT_TRUE(parts.ok()) << parts.status();
    std::vector<std::vector<v1::MicroBatch>> shares(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      shares[static_cast<size_t>(r)] = {(*parts)[static_cast<size_t>(r)]};
    return shares;
  }

  // The group's run, step by step against `alone`.
  void ExpectSameRun(const std::vector<v1::StepResponse>& alone,
                     const std::vector<v1::StepResponse>& group, double loss_tolerance) {
    ASSERT_EQ(alone.size(), group.size());
    for (size_t i = 0; i < alone.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("step ", i + 1));
      EXPECT_EQ(group[i].global_step(), alone[i].global_step());
      EXPECT_EQ(group[i].skipped(), alone[i].skipped());
      EXPECT_EQ(group[i].scale_before(), alone[i].scale_before());
      EXPECT_EQ(group[i].scale_after(), alone[i].scale_after());
      EXPECT_EQ(group[i].applied_steps(), alone[i].applied_steps());
      if (std::isnan(alone[i].loss())) {
        EXPECT_TRUE(std::isnan(group[i].loss())) << group[i].loss();
      } else {
        EXPECT_NEAR(group[i].loss(), alone[i].loss(),
                    loss_tolerance * std::max(1.0f, std::fabs(alone[i].loss())));
      }
    }
  }

  void GroupMatchesOneProcess(int ranks, v1::Precision precision, int64_t steps, int64_t poisoned,
                              double loss_tolerance) {
    const std::vector<v1::StepResponse> alone = TrainAlone(precision, ranks, steps, poisoned);
    Group g;
    ASSERT_NO_FATAL_FAILURE(StartGroup(ranks, precision, &g));
    std::vector<Replica>& replicas = g.replicas;
    SyntheticTask& task = g.task;
    DataParallelJob* job = g.job.get();
    std::vector<v1::StepResponse> group;
    for (int64_t i = 1; i <= steps; ++i) {
      absl::StatusOr<v1::StepResponse> r = job->Step(i, Shares(Batch(task, i, poisoned), ranks));
      ASSERT_TRUE(r.ok()) << r.status() << "\n" << replicas[0].process->Log();
      group.push_back(*r);
    }
    ExpectSameRun(alone, group, loss_tolerance);
    int skipped = 0;
    for (const v1::StepResponse& r : group) skipped += r.skipped() ? 1 : 0;
    if (precision == v1::PRECISION_FP16) {
      EXPECT_GE(skipped, 2);  // the opening backoffs
    }
    EXPECT_TRUE(group[static_cast<size_t>(poisoned - 1)].skipped());
    EXPECT_TRUE(group[static_cast<size_t>(poisoned - 1)].found_inf());
  }

  // `ranks` replicas (each with `extra` flags and its own state directory
  // when there are extra flags) and a job of `precision` across them on the
  // synthetic task.
  struct Group {
    std::vector<Replica> replicas;
    SyntheticTask task{TaskOptions()};
    std::unique_ptr<DataParallelJob> job;
  };
  void StartGroup(int ranks, v1::Precision precision, Group* group,
                  const std::vector<std::string>& extra = {}) {
    group->replicas = StartReplicas(ranks, extra);
    ASSERT_FALSE(HasFatalFailure());
    absl::StatusOr<std::unique_ptr<DataParallelJob>> job =
        DataParallelJob::Create(Request(group->task, precision), Options(group->replicas));
    ASSERT_TRUE(job.ok()) << job.status();
    group->job = *std::move(job);
  }

  void KillAndRestart(int killed);

  // The flag of a tenants file naming alice and bob, the same for every
  // replica (the ranks' fingerprints include the owning tenant's name).
  std::string TenantsFlag() {
    auto digest = [](const std::string& token) {
      const CommandResult sum = RunCommand({"/usr/bin/sha256sum"}, std::chrono::seconds(30), token);
      EXPECT_EQ(sum.status.code, 0) << sum.err;
      return sum.out.substr(0, 64);
    };
    const std::string path = (root_.path() / "tenants").string();
    std::ofstream(path) << "alice " << digest(kAliceToken) << "\n"
                        << "bob " << digest(kBobToken) << "\n";
    return "--auth-tokens=" + path;
  }

  // A call to a replica's Peer port as an outsider would make it, with its
  // own context so that another thread may cancel it.
  struct PeerCaller {
    explicit PeerCaller(const Replica& replica)
        : stub(v1::Peer::NewStub(
              grpc::CreateChannel(replica.peer(), grpc::InsecureChannelCredentials()))) {}
    template <typename Method, typename Request, typename Response>
    grpc::Status Call(Method method, const Request& request, Response* response,
                      grpc::ClientContext* context, int deadline_ms = 60000) {
      context->set_deadline(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(deadline_ms));
      return ((*stub).*method)(context, request, response);
    }
    std::unique_ptr<v1::Peer::Stub> stub;
  };

  // A Join or Get signed with the key of `secret` for `group`, as the
  // owner of a job of that group (or of another job under its name) can
  // sign it.
  static v1::JoinRequest SignedJoin(const std::string& secret, const std::string& group,
                                    int32_t rank, int32_t world_size,
                                    const std::string& fingerprint, int64_t timeout_ms) {
    v1::JoinRequest join;
    join.set_group(group);
    join.set_rank(rank);
    join.set_world_size(world_size);
    join.set_fingerprint(fingerprint);
    join.set_timeout_ms(timeout_ms);
    join.set_proof(engine::dist::JoinProof(engine::dist::GroupKey(secret, group), group, rank,
                                           world_size, fingerprint, timeout_ms));
    return join;
  }
  static v1::GetRequest SignedGet(const std::string& secret, const std::string& key,
                                  int64_t timeout_ms) {
    v1::GetRequest get;
    get.set_key(key);
    get.set_timeout_ms(timeout_ms);
    const std::string group(engine::dist::GroupOfKey(key));
    get.set_proof(engine::dist::GetProof(engine::dist::GroupKey(secret, group), key, timeout_ms));
    return get;
  }

  // A rank-0 job of `world_size` ranks under `group` with `secret`, created
  // on `replica` by `client`'s tenant.
  static absl::StatusOr<v1::Job> CreateRankZero(Client& client, const Replica& replica,
                                                const std::string& group, const std::string& secret,
                                                int32_t world_size) {
    SyntheticTask task(TaskOptions());
    v1::CreateJobRequest request = Request(task, v1::PRECISION_FP32);
    v1::Distributed* d = request.mutable_config()->mutable_distributed();
    d->set_world_size(world_size);
    d->set_rank(0);
    d->set_group(group);
    d->set_rendezvous(replica.peer());
    d->set_timeout_ms(5000);
    d->set_secret(secret);
    return client.CreateJob(request);
  }

  TempDir root_{"ampd_data_parallel_test"};
};

TEST_F(DataParallelTest, TwoRanksMatchOneProcessInFp32) {
  GroupMatchesOneProcess(2, v1::PRECISION_FP32, 20, /*poisoned=*/9, 1e-5);
}

TEST_F(DataParallelTest, TwoRanksMatchOneProcessInFp16WithTheSameSkips) {
  // 16-bit gradients are rounded once per rank before the sum, once in one
  // process: the losses agree to fp16's rounding, the skips exactly.
  GroupMatchesOneProcess(2, v1::PRECISION_FP16, 30, /*poisoned=*/17, 2e-2);
}

TEST_F(DataParallelTest, FourRanksMatchOneProcess) {
  GroupMatchesOneProcess(4, v1::PRECISION_FP32, 12, /*poisoned=*/6, 1e-5);
}

TEST_F(DataParallelTest, RanksSentDifferentSequencesRefuseTheStepAndStayUsable) {
  Group g;
  ASSERT_NO_FATAL_FAILURE(StartGroup(2, v1::PRECISION_FP32, &g));
  std::vector<Replica>& replicas = g.replicas;
  SyntheticTask& task = g.task;
  DataParallelJob* job = g.job.get();
  const std::vector<std::vector<v1::MicroBatch>> shares = Shares(task.NextBatch(), 2);
  ASSERT_TRUE(job->Step(1, shares).ok());
  // Rank 0 is sent step 2, rank 1 step 3: both refuse, nothing is applied.
  std::vector<absl::StatusOr<v1::StepResponse>> results(2, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Client> c = Client::Connect(replicas[static_cast<size_t>(r)].address());
      v1::StepRequest step;
      step.set_job_id(job->jobs()[static_cast<size_t>(r)].job_id());
      step.set_sequence(2 + r);
      *step.add_micro_batches() = shares[static_cast<size_t>(r)][0];
      results[static_cast<size_t>(r)] = c->Step(step);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(results[static_cast<size_t>(r)].ok());
    EXPECT_EQ(results[static_cast<size_t>(r)].status().code(),
              absl::StatusCode::kFailedPrecondition)
        << results[static_cast<size_t>(r)].status();
    std::optional<google::rpc::ErrorInfo> info =
        ErrorInfoOf(results[static_cast<size_t>(r)].status());
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->reason(), "REPLICAS_DIFFER");
  }
  absl::StatusOr<v1::StepResponse> next = job->Step(2, Shares(task.NextBatch(), 2));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->global_step(), 2);
}

// Rank `killed` is SIGKILLed after step 8 and restarted while step 9 is
// being sent. Both ranks checkpoint every 3 steps, so it comes back at step
// 6, two steps behind, and must take the other rank's state. Rank 0 is also
// the group's meeting point: it comes back on the same peer port (its
// address is in every rank's config), with an empty table the ranks meet
// at afresh.
TEST_F(DataParallelTest, AKilledRankRestartsAndEveryAcknowledgedStepIsAppliedOnce) {
  KillAndRestart(1);
}

TEST_F(DataParallelTest, KillingRankZeroTheMeetingPointLosesNothingEither) { KillAndRestart(0); }

void DataParallelTest::KillAndRestart(int killed) {
  constexpr int64_t kSteps = 16;
  constexpr int64_t kKillAfter = 8;
  const std::vector<v1::StepResponse> alone = TrainAlone(v1::PRECISION_FP32, 2, kSteps, -1);
  Group g;
  ASSERT_NO_FATAL_FAILURE(
      StartGroup(2, v1::PRECISION_FP32, &g, {"--checkpoint-every=3", "--checkpoint-sync"}));
  std::vector<Replica>& replicas = g.replicas;
  SyntheticTask& task = g.task;
  DataParallelJob* job = g.job.get();
  std::vector<v1::StepResponse> group;
  for (int64_t i = 1; i <= kSteps; ++i) {
    if (i == kKillAfter + 1) {
      Replica& victim = replicas[static_cast<size_t>(killed)];
      victim.process->Signal(SIGKILL);
      victim.process->Wait(std::chrono::seconds(10));
      std::vector<std::vector<v1::MicroBatch>> shares = Shares(task.NextBatch(), 2);
      // Sent to the survivor alone, once: it says which peer is missing.
      {
        const int survivor = 1 - killed;
        ClientOptions once;
        once.max_attempts = 1;
        std::unique_ptr<Client> c =
            Client::Connect(replicas[static_cast<size_t>(survivor)].address(), once);
        v1::StepRequest step;
        step.set_job_id(job->jobs()[static_cast<size_t>(survivor)].job_id());
        step.set_sequence(i);
        *step.add_micro_batches() = shares[static_cast<size_t>(survivor)][0];
        absl::StatusOr<v1::StepResponse> alone_step = c->Step(step);
        ASSERT_FALSE(alone_step.ok());
        EXPECT_EQ(alone_step.status().code(), absl::StatusCode::kUnavailable)
            << alone_step.status();
        std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(alone_step.status());
        ASSERT_TRUE(info.has_value()) << alone_step.status();
        EXPECT_EQ(info->reason(), "PEER_UNAVAILABLE");
        EXPECT_EQ(info->metadata().at("rank"), absl::StrCat(survivor));
      }
      // The step goes to both while the rank is down (its first attempts
      // fail while the restarted ampd is still starting) and is resent
      // until the rank is back.
      std::future<absl::StatusOr<v1::StepResponse>> pending =
          std::async(std::launch::async, [&] { return job->Step(i, shares); });
      Start(victim, absl::StrCat("rank", killed, "-restarted"), /*same_peer_port=*/killed == 0);
      ASSERT_FALSE(HasFatalFailure());
      absl::StatusOr<v1::StepResponse> r = pending.get();
      ASSERT_TRUE(r.ok()) << r.status() << "\n" << victim.process->Log();
      group.push_back(*r);
      EXPECT_NE(victim.process->Log().find(absl::StrCat("copied the state of rank ", 1 - killed)),
                std::string::npos)
          << victim.process->Log();
      continue;
    }
    absl::StatusOr<v1::StepResponse> r = job->Step(i, Shares(task.NextBatch(), 2));
    ASSERT_TRUE(r.ok()) << r.status();
    group.push_back(*r);
  }
  ExpectSameRun(alone, group, 1e-5);
  // Both replicas hold the same state, that of the uninterrupted run's count.
  std::unique_ptr<Client> c0 = Client::Connect(replicas[0].address());
  std::unique_ptr<Client> c1 = Client::Connect(replicas[1].address());
  absl::StatusOr<std::string> s0 = c0->GetStateDict(job->jobs()[0].job_id());
  absl::StatusOr<std::string> s1 = c1->GetStateDict(job->jobs()[1].job_id());
  ASSERT_TRUE(s0.ok() && s1.ok());
  absl::StatusOr<codec::StateDict> d0 = codec::DecodeSafetensors(*s0);
  absl::StatusOr<codec::StateDict> d1 = codec::DecodeSafetensors(*s1);
  ASSERT_TRUE(d0.ok() && d1.ok());
  EXPECT_EQ(d0->metadata.at("ampd.step"), absl::StrCat(kSteps));
  EXPECT_EQ(d1->metadata.at("ampd.step"), absl::StrCat(kSteps));
  ASSERT_EQ(d0->tensors.size(), d1->tensors.size());
  for (size_t t = 0; t < d0->tensors.size(); ++t) {
    EXPECT_EQ(d0->tensors[t].name, d1->tensors[t].name);
    EXPECT_EQ(d0->tensors[t].tensor.data, d1->tensors[t].tensor.data) << d0->tensors[t].name;
  }
}

TEST_F(DataParallelTest, AStateLoadedIntoOneRankIsRefusedUntilEveryRankHasIt) {
  Group g;
  ASSERT_NO_FATAL_FAILURE(StartGroup(2, v1::PRECISION_FP32, &g));
  std::vector<Replica>& replicas = g.replicas;
  SyntheticTask& task = g.task;
  DataParallelJob* job = g.job.get();
  ASSERT_TRUE(job->Step(1, Shares(task.NextBatch(), 2)).ok());
  // A state from elsewhere: rank 0's after one more step.
  std::unique_ptr<Client> c0 = Client::Connect(replicas[0].address());
  std::unique_ptr<Client> c1 = Client::Connect(replicas[1].address());
  absl::StatusOr<std::string> before = c0->GetStateDict(job->jobs()[0].job_id());
  ASSERT_TRUE(job->Step(2, Shares(task.NextBatch(), 2)).ok());
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(c0->LoadStateDict(job->jobs()[0].job_id(), *before).ok());
  absl::StatusOr<v1::StepResponse> refused = job->Step(3, Shares(task.NextBatch(), 2));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(refused.status());
  ASSERT_TRUE(info.has_value()) << refused.status();
  EXPECT_EQ(info->reason(), "REPLICAS_DIFFER");
  EXPECT_NE(refused.status().message().find("different states"), std::string::npos)
      << refused.status();
  // The same state into rank 1 too: the group forms and trains on.
  ASSERT_TRUE(c1->LoadStateDict(job->jobs()[1].job_id(), *before).ok());
  absl::StatusOr<v1::StepResponse> next = job->Step(3, Shares(task.NextBatch(), 2));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->global_step(), 3);
}

TEST_F(DataParallelTest, AServerWithoutPeerAddressRefusesDistributedJobs) {
  AmpdProcess plain(AMPD_SERVER_BINARY, {}, root_.path() / "plain.log");
  ASSERT_NE(plain.port(), 0) << plain.Describe();
  std::unique_ptr<Client> client = Client::Connect(plain.address());
  SyntheticTask task(TaskOptions());
  v1::CreateJobRequest request = Request(task, v1::PRECISION_FP32);
  v1::Distributed* d = request.mutable_config()->mutable_distributed();
  d->set_world_size(2);
  d->set_group("g");
  d->set_rendezvous("127.0.0.1:1");
  d->set_secret(std::string(32, 's'));
  absl::StatusOr<v1::Job> job = client->CreateJob(request);
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kFailedPrecondition) << job.status();
  // And a malformed spec is the field's error.
  d->set_rank(5);
  job = client->CreateJob(request);
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
  EXPECT_NE(job.status().message().find("distributed.rank"), std::string::npos) << job.status();
}

// The resident set of process `pid` in bytes (VmRSS), 0 when unreadable.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    absl::string_view value = absl::StripAsciiWhitespace(absl::string_view(line).substr(6));
    absl::ConsumeSuffix(&value, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(value), &kib)) return kib * 1024;
  }
  return 0;
}

TEST_F(DataParallelTest, ARendezvousIsHostPortAndTheSecretIsRequiredAndNeverEchoed) {
  Replica replica;
  ASSERT_NO_FATAL_FAILURE(Start(replica, "validate"));
  std::unique_ptr<Client> client = Client::Connect(replica.address());
  SyntheticTask task(TaskOptions());
  v1::CreateJobRequest request = Request(task, v1::PRECISION_FP32);
  v1::Distributed* d = request.mutable_config()->mutable_distributed();
  d->set_world_size(2);
  d->set_rank(1);
  d->set_group("validated");
  d->set_secret(std::string(32, 's'));
  // Each of these once passed CreateJob, and every step then failed as an
  // unreachable meeting point.
  for (const char* address : {"[::1", "127.0.0.1:1:2", "::1:80", "host:80x", "[::1]:0"}) {
    d->set_rendezvous(address);
    absl::StatusOr<v1::Job> job = client->CreateJob(request);
    ASSERT_FALSE(job.ok()) << address;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
    std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(job.status());
    ASSERT_TRUE(info.has_value()) << job.status();
    EXPECT_EQ(info->reason(), "INVALID_FIELD");
    EXPECT_EQ(info->metadata().at("field"), "config.distributed.rendezvous") << job.status();
  }
  d->set_rendezvous("[::1]:50052");
  d->clear_secret();
  absl::StatusOr<v1::Job> job = client->CreateJob(request);
  ASSERT_FALSE(job.ok());
  std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(job.status());
  ASSERT_TRUE(info.has_value()) << job.status();
  EXPECT_EQ(info->metadata().at("field"), "config.distributed.secret") << job.status();
  d->set_secret(std::string(32, 's'));
  job = client->CreateJob(request);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->config().distributed().rendezvous(), "[::1]:50052");
  EXPECT_TRUE(job->config().distributed().secret().empty());
  absl::StatusOr<v1::Job> got = client->GetJob(job->job_id());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->config().distributed().secret().empty());
}

TEST_F(DataParallelTest, AnUnreachableRendezvousFailsTheStepAtTimeoutMs) {
  Replica replica;
  ASSERT_NO_FATAL_FAILURE(Start(replica, "unreachable"));
  ClientOptions once;
  once.max_attempts = 1;
  once.deadline = absl::Seconds(60);
  std::unique_ptr<Client> client = Client::Connect(replica.address(), once);
  SyntheticTask task(TaskOptions());
  v1::CreateJobRequest request = Request(task, v1::PRECISION_FP32);
  v1::Distributed* d = request.mutable_config()->mutable_distributed();
  d->set_world_size(2);
  d->set_rank(1);
  d->set_group("alone");
  d->set_rendezvous("127.0.0.1:1");  // nothing listens on port 1
  d->set_timeout_ms(2000);
  d->set_secret(std::string(32, 's'));
  absl::StatusOr<v1::Job> job = client->CreateJob(request);
  ASSERT_TRUE(job.ok()) << job.status();
  for (int attempt = 0; attempt < 2; ++attempt) {
    v1::StepRequest step;
    step.set_job_id(job->job_id());
    step.set_sequence(1);
    *step.add_micro_batches() = task.NextBatch();
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<v1::StepResponse> r = client->Step(step);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(r.status());
    ASSERT_TRUE(info.has_value()) << r.status();
    EXPECT_EQ(info->reason(), "PEER_UNAVAILABLE");
    // timeout_ms, not timeout_ms + 5 s as before; a little for the step's
    // own work and the call.
    EXPECT_GE(seconds, 1.8) << r.status();
    EXPECT_LT(seconds, 3.5) << r.status();
  }
}

// The reproductions of an outsider on the peer port: 70 Get waits of 25 s
// and a flood of 64 KiB Sets once exhausted the port's threads and filled
// its key table, so every new data-parallel job failed; and anyone with a
// group's name could read its keys or squat its formation. Now every call
// the outsider makes is refused at once (it cannot sign with a group's
// key), while a tenant's new job forms and trains, and rank 0's memory
// stays where it was.
TEST_F(DataParallelTest, AnOutsiderCannotJamThePeerPortNorReadOrSquatAGroup) {
  Group g;
  ASSERT_NO_FATAL_FAILURE(StartGroup(2, v1::PRECISION_FP32, &g));
  std::vector<Replica>& replicas = g.replicas;
  ASSERT_TRUE(g.job->Step(1, Shares(g.task.NextBatch(), 2)).ok());
  const std::string group = g.job->group();

  auto channel = grpc::CreateChannel(replicas[0].peer(), grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::Peer::Stub> stub = v1::Peer::NewStub(channel);
  auto call = [&](auto method, const auto& request, auto* response, int deadline_ms) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    return ((*stub).*method)(&context, request, response);
  };
  // Knowing the group's name is not enough to join it, read its round's
  // keys (the Gloo addresses of round 0) or write one.
  v1::JoinRequest join;
  v1::JoinResponse join_response;
  join.set_group(group);
  join.set_rank(1);
  join.set_world_size(2);
  join.set_timeout_ms(20000);
  EXPECT_EQ(call(&v1::Peer::Stub::Join, join, &join_response, 30000).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  join.set_proof(std::string(32, 'p'));
  EXPECT_EQ(call(&v1::Peer::Stub::Join, join, &join_response, 30000).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::GetRequest get;
  v1::GetResponse got;
  get.set_key(absl::StrCat(group, "/0/rank_0"));
  get.set_proof(std::string(32, 'p'));
  EXPECT_EQ(call(&v1::Peer::Stub::Get, get, &got, 30000).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::SetRequest set;
  v1::SetResponse set_response;
  set.set_key(absl::StrCat(group, "/1/rank_1"));
  set.set_value("outsider");
  EXPECT_EQ(call(&v1::Peer::Stub::Set, set, &set_response, 30000).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  join.set_group("no-such-group");
  EXPECT_EQ(call(&v1::Peer::Stub::Join, join, &join_response, 30000).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Past the port's message limit.
  set.set_value(std::string(1 << 20, 'v'));
  EXPECT_EQ(call(&v1::Peer::Stub::Set, set, &set_response, 30000).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);

  const int64_t rss_before = ResidentBytes(replicas[0].process->pid());
  ASSERT_GT(rss_before, 0);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> sets{0};
  // At least as many 64 KiB Sets as once filled the table for good
  // (16,384 keys, 1 GB).
  constexpr int64_t kFloodSets = 16400;
  absl::Notification flooded;
  std::atomic<int64_t> served{0};       // calls the port answered OK: must stay 0
  std::atomic<int64_t> longest_ms{0};   // the longest any outsider call took
  std::atomic<int64_t> other_codes{0};  // neither refused as an outsider nor busy
  auto account = [&](const grpc::Status& s, std::chrono::steady_clock::time_point start) {
    ++calls;
    const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - start)
                           .count();
    int64_t seen = longest_ms.load();
    while (ms > seen && !longest_ms.compare_exchange_weak(seen, ms)) {
    }
    if (s.ok()) {
      ++served;
    } else if (s.error_code() != grpc::StatusCode::UNAUTHENTICATED &&
               s.error_code() != grpc::StatusCode::NOT_FOUND &&
               s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++other_codes;
    }
  };
  std::vector<std::thread> outsiders;
  for (int i = 0; i < 70; ++i) {
    outsiders.emplace_back([&, i] {
      while (!stop.load()) {
        v1::GetRequest wait;
        wait.set_key(i % 2 == 0 ? absl::StrCat(group, "/9/never-", i) : absl::StrCat("x/", i));
        wait.set_timeout_ms(25000);
        wait.set_proof(std::string(32, static_cast<char>(i)));
        v1::GetResponse response;
        const auto start = std::chrono::steady_clock::now();
        account(call(&v1::Peer::Stub::Get, wait, &response, 30000), start);
        // Each comes back at once; 70 callers asking again every few
        // milliseconds keep the port as busy as 70 held waits would.
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  for (int i = 0; i < 4; ++i) {
    outsiders.emplace_back([&, i] {
      for (int64_t n = 0; !stop.load(); ++n) {
        v1::SetRequest flood;
        flood.set_key(n % 2 == 0 ? absl::StrCat(group, "/9/flood-", i, "-", n)
                                 : absl::StrCat("flood-", i, "/", n));
        flood.set_value(std::string(64 << 10, 'v'));
        v1::SetResponse response;
        const auto start = std::chrono::steady_clock::now();
        account(call(&v1::Peer::Stub::Set, flood, &response, 30000), start);
        if (++sets == kFloodSets) flooded.Notify();
      }
    });
  }
  // While it runs: a new job of the tenant forms its group at the same
  // meeting point and trains, and the first one trains on.
  SyntheticTask task(TaskOptions());
  absl::StatusOr<std::unique_ptr<DataParallelJob>> second =
      DataParallelJob::Create(Request(task, v1::PRECISION_FP32), Options(replicas));
  ASSERT_TRUE(second.ok()) << second.status();
  for (int64_t i = 1; i <= 3; ++i) {
    absl::StatusOr<v1::StepResponse> r = (*second)->Step(i, Shares(task.NextBatch(), 2));
    ASSERT_TRUE(r.ok()) << "step " << i << ": " << r.status() << "\n" << replicas[0].process->Log();
    absl::StatusOr<v1::StepResponse> first = g.job->Step(i + 1, Shares(g.task.NextBatch(), 2));
    ASSERT_TRUE(first.ok()) << "step " << i + 1 << ": " << first.status();
  }
  flooded.WaitForNotificationWithTimeout(absl::Seconds(90));
  stop = true;
  for (std::thread& t : outsiders) t.join();
  const int64_t rss_after = ResidentBytes(replicas[0].process->pid());
  EXPECT_GE(sets.load(), kFloodSets);
  // After the flood, yet another job forms and trains: the table is not full.
  SyntheticTask third_task(TaskOptions());
  absl::StatusOr<std::unique_ptr<DataParallelJob>> third =
      DataParallelJob::Create(Request(third_task, v1::PRECISION_FP32), Options(replicas));
  ASSERT_TRUE(third.ok()) << third.status();
  absl::StatusOr<v1::StepResponse> after = (*third)->Step(1, Shares(third_task.NextBatch(), 2));
  ASSERT_TRUE(after.ok()) << after.status() << "\n" << replicas[0].process->Log();
  RecordProperty("outsider_calls", static_cast<int>(calls.load()));
  RecordProperty("outsider_sets", static_cast<int>(sets.load()));
  RecordProperty("longest_outsider_call_ms", static_cast<int>(longest_ms.load()));
  RecordProperty("rank0_rss_growth_kib", static_cast<int>((rss_after - rss_before) >> 10));
  EXPECT_GT(calls.load(), 1000);
  EXPECT_EQ(served.load(), 0);
  EXPECT_EQ(other_codes.load(), 0);
  // Refused at once: no outsider call waited (they asked for 25 s).
  EXPECT_LT(longest_ms.load(), 5000);
  // Once 16,371 Sets of 64 KiB grew rank 0 by over 1 GB, for good.
  EXPECT_LT(rss_after - rss_before, int64_t{150} << 20)
      << "before " << rss_before << ", after " << rss_after << " after " << calls.load()
      << " calls";
  EXPECT_TRUE(replicas[0].process->Log().find("stopped") == std::string::npos);
}

// Bob, a tenant of the same servers, creates a rank-0 job under the name of
// Alice's group with his own secret. Once that made his key a key of her
// group: he read her round's Gloo addresses, and his waiting Join (his
// fingerprint) kept her ranks from forming again. Now a group name belongs
// to the owner whose secret signs for it: his job meets apart, he reads
// nothing of hers, and her job forms again while he keeps trying.
TEST_F(DataParallelTest, AnotherTenantCannotCreateJoinOrReadAGroupUnderItsName) {
  std::vector<Replica> replicas = StartReplicas(2, {TenantsFlag()});
  ASSERT_FALSE(HasFatalFailure());
  SyntheticTask task(TaskOptions());
  DataParallelOptions options = Options(replicas);
  options.client.token = kAliceToken;
  absl::StatusOr<std::unique_ptr<DataParallelJob>> alice =
      DataParallelJob::Create(Request(task, v1::PRECISION_FP32), options);
  ASSERT_TRUE(alice.ok()) << alice.status();
  ASSERT_TRUE((*alice)->Step(1, Shares(task.NextBatch(), 2)).ok());
  const std::string group = (*alice)->group();

  // His job under her group's name is his own group: nothing of hers.
  ClientOptions bob_options;
  bob_options.token = kBobToken;
  bob_options.max_attempts = 1;
  std::unique_ptr<Client> bob = Client::Connect(replicas[0].address(), bob_options);
  const std::string bob_secret(32, 'b');
  absl::StatusOr<v1::Job> squat = CreateRankZero(*bob, replicas[0], group, bob_secret, 2);
  ASSERT_TRUE(squat.ok()) << squat.status();
  EXPECT_EQ(bob->GetJob((*alice)->jobs()[0].job_id()).status().code(), absl::StatusCode::kNotFound);

  PeerCaller peer(replicas[0]);
  // Her round 0's keys: the Gloo address of each of her ranks.
  for (int r = 0; r < 2; ++r) {
    grpc::ClientContext context;
    v1::GetResponse got;
    const grpc::Status read =
        peer.Call(&v1::Peer::Stub::Get,
                  SignedGet(bob_secret, absl::StrCat(group, "/0/rank_", r), 0), &got, &context);
    EXPECT_FALSE(read.ok()) << "rank " << r << ": Bob read " << got.value().size() << " bytes";
  }

  // Bob holds a Join as rank 0 of the name, with a fingerprint of his own,
  // again and again, while Alice's ranks leave their group (a state loaded
  // into each) and form it again at her next steps.
  std::atomic<bool> stop{false};
  std::atomic<int> bob_joined{0};
  absl::Mutex mu;
  grpc::ClientContext* current = nullptr;
  std::thread squatter([&] {
    while (!stop.load()) {
      grpc::ClientContext context;
      {
        absl::MutexLock lock(&mu);
        current = &context;
      }
      v1::JoinResponse joined;
      const grpc::Status s =
          peer.Call(&v1::Peer::Stub::Join, SignedJoin(bob_secret, group, 0, 2, "bob", 20000),
                    &joined, &context, 25000);
      {
        absl::MutexLock lock(&mu);
        current = nullptr;
      }
      if (s.ok()) ++bob_joined;
      if (!s.ok() && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
          s.error_code() != grpc::StatusCode::CANCELLED) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  });
  // His Join waits at the meeting point.
  EXPECT_TRUE(test_support::WaitForCallsInFlight(replicas[0].process->metrics_port(), "Join"));
  ClientOptions alice_options;
  alice_options.token = kAliceToken;
  std::unique_ptr<Client> c0 = Client::Connect(replicas[0].address(), alice_options);
  std::unique_ptr<Client> c1 = Client::Connect(replicas[1].address(), alice_options);
  for (int64_t step = 2; step <= 3; ++step) {
    absl::StatusOr<std::string> state = c0->GetStateDict((*alice)->jobs()[0].job_id());
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_TRUE(c0->LoadStateDict((*alice)->jobs()[0].job_id(), *state).ok());
    ASSERT_TRUE(c1->LoadStateDict((*alice)->jobs()[1].job_id(), *state).ok());
    absl::StatusOr<v1::StepResponse> r = (*alice)->Step(step, Shares(task.NextBatch(), 2));
    ASSERT_TRUE(r.ok()) << "step " << step << ": " << r.status() << "\n"
                        << replicas[0].process->Log();
    EXPECT_EQ(r->global_step(), step);
    // Nor can he read the keys of the round she just formed.
    for (int64_t round = 1; round <= 2; ++round) {
      grpc::ClientContext context;
      v1::GetResponse got;
      const grpc::Status read = peer.Call(
          &v1::Peer::Stub::Get,
          SignedGet(bob_secret, absl::StrCat(group, "/", round, "/rank_0"), 0), &got, &context);
      EXPECT_FALSE(read.ok()) << "round " << round;
    }
  }
  stop = true;
  {
    absl::MutexLock lock(&mu);
    if (current != nullptr) current->TryCancel();
  }
  squatter.join();
  EXPECT_EQ(bob_joined.load(), 0);
}

// Bob's two groups of 64 ranks once took all 192 waits of the meeting point
// (128 Gets in one, 64 in the other), and Alice's new data-parallel jobs
// failed PEER_UNAVAILABLE for as long as he held them. Now one tenant's
// groups wait at most --peer-waits-per-tenant (96) calls together: the rest
// of his are refused at once, and Alice's group forms and trains meanwhile.
TEST_F(DataParallelTest, ATenantTakesAtMostItsShareOfTheMeetingPointsWaits) {
  std::vector<Replica> replicas = StartReplicas(2, {TenantsFlag()});
  ASSERT_FALSE(HasFatalFailure());
  ClientOptions bob_options;
  bob_options.token = kBobToken;
  std::unique_ptr<Client> bob = Client::Connect(replicas[0].address(), bob_options);
  PeerCaller peer(replicas[0]);
  constexpr int kRanks = 64;
  const std::vector<std::string> groups = {"bob-a", "bob-b"};
  const std::vector<std::string> secrets = {std::string(32, 'a'), std::string(32, 'b')};
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::StatusOr<v1::Job> job = CreateRankZero(*bob, replicas[0], groups[g], secrets[g], kRanks);
    ASSERT_TRUE(job.ok()) << job.status();
    // All 64 ranks meet once, so that his group's keys may be waited for.
    std::vector<std::future<grpc::Status>> joins;
    for (int r = 0; r < kRanks; ++r) {
      joins.push_back(std::async(std::launch::async, [&, g, r] {
        grpc::ClientContext context;
        v1::JoinResponse joined;
        return peer.Call(&v1::Peer::Stub::Join,
                         SignedJoin(secrets[g], groups[g], r, kRanks, "bob", 30000), &joined,
                         &context);
      }));
    }
    for (auto& j : joins) {
      const grpc::Status s = j.get();
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
  }

  // 192 Gets of keys nobody sets, 96 for each group: as many as the whole
  // meeting point lets wait.
  constexpr int kGets = 192;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (int i = 0; i < kGets; ++i) contexts.push_back(std::make_unique<grpc::ClientContext>());
  std::atomic<int> refused{0};
  std::atomic<int> refused_for_tenant{0};
  std::vector<std::thread> waits;
  for (int i = 0; i < kGets; ++i) {
    waits.emplace_back([&, i] {
      const size_t g = static_cast<size_t>(i % 2);
      v1::GetResponse got;
      const grpc::Status s =
          peer.Call(&v1::Peer::Stub::Get,
                    SignedGet(secrets[g], absl::StrCat(groups[g], "/0/never-", i), 60000), &got,
                    contexts[static_cast<size_t>(i)].get(), 65000);
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++refused;
        if (s.error_message().find("tenant") != std::string::npos) ++refused_for_tenant;
      }
    });
  }
  // Refusals come at once; what is not refused waits: every Get has been
  // answered or is held by the server.
  const std::string waiting = test_support::InFlightSeries("Get");
  EXPECT_TRUE(test_support::WaitForMetrics(
      replicas[0].process->metrics_port(), [&](const test_support::Samples& samples) {
        return refused.load() + test_support::ValueOf(samples, waiting) == kGets;
      }));
  EXPECT_EQ(refused.load(), kGets - 96);
  EXPECT_EQ(refused_for_tenant.load(), refused.load());

  // Alice's job of two ranks forms at the same meeting point and trains.
  SyntheticTask task(TaskOptions());
  DataParallelOptions options = Options(replicas);
  options.client.token = kAliceToken;
  options.retry_for = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DataParallelJob>> alice =
      DataParallelJob::Create(Request(task, v1::PRECISION_FP32), options);
  ASSERT_TRUE(alice.ok()) << alice.status();
  for (int64_t step = 1; step <= 2; ++step) {
    absl::StatusOr<v1::StepResponse> r = (*alice)->Step(step, Shares(task.NextBatch(), 2));
    EXPECT_TRUE(r.ok()) << "step " << step << ": " << r.status();
  }
  for (auto& context : contexts) context->TryCancel();
  for (std::thread& t : waits) t.join();
}

}  // namespace
}  // namespace ampd
