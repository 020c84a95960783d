// Deadlines and cancellation of long calls through the real `ampd`
// (--device=cpu --worker-threads=2 on 127.0.0.1:0), over loopback TCP.
//
// A call nobody waits for any more must stop at its next unit of work (a
// decode step, a micro-batch) and leave its job as it was; Samples must
// never hold every worker thread; SIGTERM must end a server that is in the
// middle of a long Sample within the shutdown timeout.
//
// The sampling model is sized at run time: the test measures one decode
// step and picks the number of completions so that a full Sample would run
// for kFullSampleSeconds or more, far longer than any bound asserted here,
// which are generous (a busy 2-core machine). Stopping is then shown by
// what the server does next (the job's next call is served, the server
// records the call's code), not by timing the stop itself.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/exposition.h"
#include "tests/support/http_get.h"
#include "tests/support/metric_wait.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::TempDir;
using Clock = std::chrono::steady_clock;

// The sampling GPT: a prompt of kPromptTokens, then every position of the
// context sampled.
constexpr int64_t kVocab = 65536;
constexpr int64_t kContext = 512;
constexpr int64_t kPromptTokens = 2;
constexpr int64_t kMaxTokens = kContext - kPromptTokens + 1;
// What a full Sample must cost for the test to tell a stopped Sample from
// one that ran on: many times the bounds below.
constexpr double kFullSampleSeconds = 120;
// The deadline of an abandoned call, and how long the server may take to
// be free again after it (about one decode step is expected).
constexpr auto kAbandonAfter = std::chrono::seconds(2);
constexpr auto kFreeWithin = std::chrono::seconds(20);

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::chrono::system_clock::time_point In(std::chrono::milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

// A GPT micro-batch of one row of T tokens (next = 3 t + 1 mod V).
v1::MicroBatch GptBatch(int64_t tokens, int32_t start) {
  std::vector<int32_t> ids;
  std::vector<int32_t> targets;
  int32_t t = start;
  for (int64_t i = 0; i < tokens; ++i) {
    ids.push_back(t);
    t = static_cast<int32_t>((3 * int64_t{t} + 1) % kVocab);
    targets.push_back(t);
  }
  v1::MicroBatch mb;
  for (auto [tensor, values] :
       {std::pair{mb.mutable_inputs(), &ids}, std::pair{mb.mutable_targets(), &targets}}) {
    tensor->set_dtype(v1::DTYPE_I32);
    tensor->add_shape(1);
    tensor->add_shape(tokens);
    tensor->set_data(std::string(reinterpret_cast<const char*>(values->data()),
                                 values->size() * sizeof(int32_t)));
  }
  return mb;
}

class DeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override { state_dir_ = (root_.path() / "state").string(); }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
  }

  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), "--state-dir=" + state_dir_);
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, state_dir_ + ".log");
    ASSERT_NE(server_->port(), 0) << server_->Describe();
    ClientOptions options;
    options.deadline = absl::FromChrono(kFreeWithin);
    options.max_attempts = 1;  // every call here is sent once, on purpose
    client_ = Client::Connect(server_->address(), options);
  }

  // A GPT whose decode step is mostly its LM head (a large vocabulary, two
  // narrow layers): much work per completion for a small KV cache (2 MiB a
  // completion). ~18M parameters, an SGD optimizer (no moments to hold).
  std::string CreateGpt(uint64_t seed) {
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    v1::Gpt* gpt = config->mutable_model()->mutable_gpt();
    gpt->set_vocab_size(kVocab);
    gpt->set_context_length(kContext);
    gpt->set_d_model(256);
    gpt->set_n_layer(2);
    gpt->set_n_head(4);
    config->set_seed(seed);
    config->set_precision(v1::PRECISION_FP32);
    config->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
    config->mutable_optimizer()->set_lr(1e-3f);
    absl::StatusOr<v1::Job> job = client_->CreateJob(request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->job_id() : "";
  }

  // A job on the synthetic task's small model, for the calls that must be
  // served beside the Samples.
  std::string CreateSmallJob() {
    v1::CreateJobRequest request;
    *request.mutable_config()->mutable_model() = SyntheticTask(SyntheticTaskOptions{}).Model();
    request.mutable_config()->set_seed(1);
    absl::StatusOr<v1::Job> job = client_->CreateJob(request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->job_id() : "";
  }

  static v1::SampleRequest SampleRequest(const std::string& job, int64_t num_samples,
                                         int64_t max_tokens) {
    v1::SampleRequest request;
    request.set_job_id(job);
    v1::TokenSequence* prompt = request.add_prompts();
    for (int64_t i = 0; i < kPromptTokens; ++i) prompt->add_tokens(i + 1);
    request.set_num_samples(num_samples);
    request.set_max_tokens(max_tokens);
    request.set_seed(7);
    return request;
  }

  grpc::Status Sample(const v1::SampleRequest& request, std::chrono::milliseconds deadline,
                      v1::SampleResponse* response = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(In(deadline));
    v1::SampleResponse ignored;
    return client_->stub().Sample(&context, request, response ? response : &ignored);
  }

  // The completions per prompt that make a Sample of kMaxTokens last
  // kFullSampleSeconds: one decode step measured (the difference of two
  // short Samples, so the prompts' forward cancels; the faster of two
  // tries, as the machine may be busy with other work now and not later),
  // scaled linearly.
  int64_t CompletionsForALongSample(const std::string& job) {
    constexpr int64_t kProbe = 32;
    constexpr int64_t kSteps = 16;
    auto timed = [&](int64_t max_tokens) {
      const Clock::time_point start = Clock::now();
      const grpc::Status s =
          Sample(SampleRequest(job, kProbe, max_tokens), std::chrono::seconds(120));
      EXPECT_TRUE(s.ok()) << s.error_message();
      return SecondsSince(start);
    };
    (void)timed(1);  // warms the workspaces
    double per_step = 1e9;
    for (int i = 0; i < 2; ++i) {
      per_step = std::min(per_step, std::max(1e-4, (timed(kSteps + 1) - timed(1)) / kSteps));
    }
    const double full = per_step * static_cast<double>(kMaxTokens);
    const auto needed = static_cast<int64_t>(std::ceil(kProbe * kFullSampleSeconds / full));
    const int64_t completions = std::clamp<int64_t>(needed, kProbe, 256);
    std::fprintf(stderr,
                 "decode step of %lld completions: %.1f ms; %lld completions of %lld tokens "
                 "should take about %.0f s\n",
                 static_cast<long long>(kProbe), per_step * 1e3,
                 static_cast<long long>(completions), static_cast<long long>(kMaxTokens),
                 full * static_cast<double>(completions) / kProbe);
    // What the assertions need: a full Sample well past the abandoned
    // call's deadline plus the time the server has to be free again.
    const double needed_seconds =
        1.5 * std::chrono::duration<double>(kAbandonAfter + kFreeWithin).count();
    EXPECT_GE(full * static_cast<double>(completions) / kProbe, needed_seconds)
        << "this machine samples too fast for the test to tell a stopped Sample from a "
           "finished one";
    return completions;
  }

  grpc::Status GptStep(const std::string& job, int64_t sequence, int64_t micro_batches,
                       std::chrono::milliseconds deadline, v1::StepResponse* response) {
    v1::StepRequest request;
    request.set_job_id(job);
    request.set_sequence(sequence);
    for (int64_t i = 0; i < micro_batches; ++i) {
      *request.add_micro_batches() = GptBatch(64, static_cast<int32_t>(i % kVocab));
    }
    grpc::ClientContext context;
    context.set_deadline(In(deadline));
    return client_->stub().Step(&context, request, response);
  }

  // Steps 1 and 2 of a new GPT job: the first allocates the workspaces,
  // the second measures a micro-batch. Returns how many micro-batches make
  // step 3 run for kFullSampleSeconds.
  int64_t MicroBatchesForALongStep(const std::string& job) {
    v1::StepResponse response;
    EXPECT_TRUE(GptStep(job, 1, 1, std::chrono::seconds(120), &response).ok());
    const Clock::time_point start = Clock::now();
    EXPECT_TRUE(GptStep(job, 2, 1, std::chrono::seconds(120), &response).ok());
    const double per_micro_batch = std::max(1e-3, SecondsSince(start));
    const auto micro_batches = std::clamp<int64_t>(
        static_cast<int64_t>(std::ceil(kFullSampleSeconds / per_micro_batch)), 8, 4096);
    std::fprintf(stderr, "micro-batch: %.0f ms; step 3 has %lld\n", per_micro_batch * 1e3,
                 static_cast<long long>(micro_batches));
    return micro_batches;
  }

  // The value of `series` in /metrics (0 when absent).
  double Metric(const std::string& series) {
    absl::StatusOr<std::string> body =
        test_support::HttpGetBody(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    if (!body.ok()) return -1;
    const std::map<std::string, double> samples = test_support::ParseSamples(*body);
    auto it = samples.find(series);
    return it == samples.end() ? 0 : it->second;
  }
  static std::string RpcSeries(absl::string_view method, absl::string_view code) {
    return absl::StrCat("ampd_rpc_requests_total{code=\"", code, "\",method=\"", method, "\"}");
  }

  // A one-token Sample on `job`: queued behind whatever the job's worker
  // still runs, so it is answered only once that has ended.
  grpc::Status NextCallOn(const std::string& job) {
    return Sample(SampleRequest(job, 1, 1), kFreeWithin);
  }

  TempDir root_{"ampd_deadline_test"};
  std::string state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(DeadlineTest, AnAbandonedSampleStopsAndItsJobIsServedAgain) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string job = CreateGpt(1);
  ASSERT_FALSE(job.empty());
  const int64_t completions = CompletionsForALongSample(job);

  const Clock::time_point start = Clock::now();
  const grpc::Status abandoned = Sample(SampleRequest(job, completions, kMaxTokens), kAbandonAfter);
  ASSERT_EQ(abandoned.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << abandoned.error_message();
  // The job's next call waits for its worker: served at all within the
  // bound, the abandoned Sample has stopped (it had minutes left).
  const grpc::Status next = NextCallOn(job);
  EXPECT_TRUE(next.ok()) << "the job's next call: " << next.error_message() << " after "
                         << SecondsSince(start) << " s";
  // And the server says why it stopped: the call's deadline, not a
  // completion nobody read.
  EXPECT_EQ(Metric(RpcSeries("Sample", "DEADLINE_EXCEEDED")), 1);
  EXPECT_NE(server_->Log().find("sample stopped"), std::string::npos) << server_->Log();
}

TEST_F(DeadlineTest, ACancelledSampleStopsAndItsJobIsServedAgain) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string job = CreateGpt(2);
  ASSERT_FALSE(job.empty());
  const int64_t completions = CompletionsForALongSample(job);

  grpc::ClientContext context;
  context.set_deadline(In(std::chrono::seconds(600)));
  v1::SampleResponse response;
  grpc::Status cancelled;
  std::thread call([&] {
    cancelled =
        client_->stub().Sample(&context, SampleRequest(job, completions, kMaxTokens), &response);
  });
  // Cancelled once the server runs it (it has minutes of work).
  EXPECT_TRUE(test_support::WaitForCallsInFlight(server_->metrics_port(), "Sample"));
  context.TryCancel();
  call.join();
  ASSERT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED) << cancelled.error_message();
  const grpc::Status next = NextCallOn(job);
  EXPECT_TRUE(next.ok()) << "the job's next call: " << next.error_message();
  EXPECT_EQ(Metric(RpcSeries("Sample", "CANCELLED")), 1);
}

TEST_F(DeadlineTest, LongSamplesLeaveAWorkerForAnotherJobsStep) {
  ASSERT_NO_FATAL_FAILURE(Start());  // --worker-threads=2
  const std::string a = CreateGpt(3);
  const std::string b = CreateGpt(4);
  const std::string other = CreateSmallJob();
  ASSERT_FALSE(a.empty() || b.empty() || other.empty());
  const int64_t completions = CompletionsForALongSample(a);

  // Two Samples whose clients wait (minutes), one per job, and two more
  // abandoned at once: without a limit they would take both workers.
  std::vector<std::unique_ptr<grpc::ClientContext>> waiting;
  std::vector<std::thread> calls;
  std::vector<grpc::Status> statuses(4);
  for (int i = 0; i < 4; ++i) {
    waiting.push_back(std::make_unique<grpc::ClientContext>());
    waiting.back()->set_deadline(In(i < 2 ? std::chrono::milliseconds(600'000) : kAbandonAfter));
    calls.emplace_back([&, i] {
      v1::SampleResponse response;
      statuses[static_cast<size_t>(i)] = client_->stub().Sample(
          waiting[static_cast<size_t>(i)].get(),
          SampleRequest(i % 2 == 0 ? a : b, completions, kMaxTokens), &response);
    });
  }
  // All four taken by the server (the two abandoned ones may have ended).
  const std::string in_flight = test_support::InFlightSeries("Sample");
  const std::string abandoned = RpcSeries("Sample", "DEADLINE_EXCEEDED");
  EXPECT_TRUE(test_support::WaitForMetrics(server_->metrics_port(),
                                           [&](const test_support::Samples& samples) {
                                             return test_support::ValueOf(samples, in_flight) +
                                                        test_support::ValueOf(samples, abandoned) >=
                                                    4;
                                           }));

  // The other job's Step is served while they run.
  SyntheticTask task(SyntheticTaskOptions{});
  v1::StepRequest step;
  step.set_job_id(other);
  step.set_sequence(1);
  *step.add_micro_batches() = task.NextBatch();
  grpc::ClientContext context;
  context.set_deadline(In(kFreeWithin));
  v1::StepResponse response;
  const Clock::time_point start = Clock::now();
  const grpc::Status served = client_->stub().Step(&context, step, &response);
  EXPECT_TRUE(served.ok()) << served.error_message() << " after " << SecondsSince(start) << " s";
  EXPECT_EQ(response.global_step(), 1);

  // The waiting clients give up too; the abandoned ones had by now.
  waiting[0]->TryCancel();
  waiting[1]->TryCancel();
  for (std::thread& t : calls) t.join();
  EXPECT_EQ(statuses[2].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(statuses[3].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Both jobs are free again soon after: every Sample stopped.
  EXPECT_TRUE(NextCallOn(a).ok());
  EXPECT_TRUE(NextCallOn(b).ok());
}

TEST_F(DeadlineTest, AStoppedStepAppliesNothingAndItsSequenceIsSentAgain) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string job = CreateGpt(6);
  ASSERT_FALSE(job.empty());
  const int64_t micro_batches = MicroBatchesForALongStep(job);
  const absl::StatusOr<std::string> before = client_->GetStateDict(job);
  ASSERT_TRUE(before.ok()) << before.status();

  v1::StepResponse stopped;
  const grpc::Status abandoned = GptStep(job, 3, micro_batches, kAbandonAfter, &stopped);
  ASSERT_EQ(abandoned.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << abandoned.error_message();
  // The export waits for the job's worker: the step has stopped by then,
  // with the weights, optimizer, scaler and counts as they were.
  const absl::StatusOr<std::string> after = client_->GetStateDict(job);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(*after == *before) << "the stopped step changed the job's state";
  absl::StatusOr<v1::Job> snapshot = client_->GetJob(job);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->step(), 2);
  EXPECT_EQ(Metric(RpcSeries("Step", "DEADLINE_EXCEEDED")), 1);

  // Sequence 3 was not used: sent again, it trains.
  v1::StepResponse retried;
  const grpc::Status resent = GptStep(job, 3, 1, std::chrono::seconds(120), &retried);
  ASSERT_TRUE(resent.ok()) << resent.error_message();
  EXPECT_EQ(retried.global_step(), 3);
  EXPECT_EQ(retried.applied_steps(), 3);
}

TEST_F(DeadlineTest, SigtermDuringALongSampleEndsWithinTheShutdownTimeout) {
  constexpr auto kShutdownTimeout = std::chrono::seconds(10);
  ASSERT_NO_FATAL_FAILURE(Start({absl::StrCat(
      "--shutdown-timeout-ms=",
      std::chrono::duration_cast<std::chrono::milliseconds>(kShutdownTimeout).count())}));
  const std::string job = CreateGpt(5);
  ASSERT_FALSE(job.empty());
  const int64_t completions = CompletionsForALongSample(job);

  grpc::Status sampled;
  std::thread call([&] {
    sampled = Sample(SampleRequest(job, completions, kMaxTokens), std::chrono::seconds(600));
  });
  EXPECT_TRUE(test_support::WaitForCallsInFlight(server_->metrics_port(), "Sample"));
  const Clock::time_point start = Clock::now();
  server_->Signal(SIGTERM);
  const test_support::ExitStatus exit = server_->Wait(std::chrono::seconds(120));
  const double took = SecondsSince(start);
  std::fprintf(stderr, "SIGTERM to exit: %.1f s\n", took);
  call.join();
  EXPECT_TRUE(exit.exited && exit.code == 0) << exit.ToString();
  EXPECT_LT(took, std::chrono::duration<double>(kShutdownTimeout).count())
      << "SIGTERM to exit; " << server_->Log();
  // Stopped for the drain: a client retries it on another server.
  EXPECT_EQ(sampled.error_code(), grpc::StatusCode::UNAVAILABLE) << sampled.error_message();
}

// Past the shutdown timeout the calls still running are cancelled: a Step
// stops at its next micro-batch, applying nothing, and the job restarts at
// the step before it.
TEST_F(DeadlineTest, SigtermCancelsALongStepAtTheShutdownTimeout) {
  constexpr auto kShutdownTimeout = std::chrono::seconds(3);
  const std::string timeout_flag =
      absl::StrCat("--shutdown-timeout-ms=",
                   std::chrono::duration_cast<std::chrono::milliseconds>(kShutdownTimeout).count());
  ASSERT_NO_FATAL_FAILURE(Start({timeout_flag}));
  const std::string job = CreateGpt(7);
  ASSERT_FALSE(job.empty());
  const int64_t micro_batches = MicroBatchesForALongStep(job);

  grpc::Status stepped;
  std::thread call([&] {
    v1::StepResponse response;
    stepped = GptStep(job, 3, micro_batches, std::chrono::seconds(600), &response);
  });
  EXPECT_TRUE(test_support::WaitForCallsInFlight(server_->metrics_port(), "Step"));
  const Clock::time_point start = Clock::now();
  server_->Signal(SIGTERM);
  const test_support::ExitStatus exit = server_->Wait(std::chrono::seconds(120));
  const double took = SecondsSince(start);
  std::fprintf(stderr, "SIGTERM to exit: %.1f s\n", took);
  call.join();
  EXPECT_TRUE(exit.exited && exit.code == 0) << exit.ToString();
  EXPECT_LT(took, std::chrono::duration<double>(kShutdownTimeout + kFreeWithin).count())
      << server_->Log();
  EXPECT_FALSE(stepped.ok());

  // Restarted from its final checkpoint: step 3 was not applied, and sent
  // again it trains.
  ASSERT_NO_FATAL_FAILURE(Start({timeout_flag}));
  absl::StatusOr<v1::Job> restored = client_->GetJob(job);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 2);
  v1::StepResponse resent;
  const grpc::Status again = GptStep(job, 3, 1, std::chrono::seconds(120), &resent);
  ASSERT_TRUE(again.ok()) << again.error_message();
  EXPECT_EQ(resent.global_step(), 3);
}

}  // namespace
}  // namespace ampd
