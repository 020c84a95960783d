// ampd's /metrics end to end against the real server process: each test
// starts the `ampd` binary (tests/support's AmpdProcess: --device=cpu, gRPC
// and metrics on 127.0.0.1:0, here with the gradient histogram sampled on
// every step), trains through ampd::Client and its stub, and reads the
// exposition over a real loopback socket the way Prometheus does. Unlike
// tests/metrics/server_metrics_test.cc, which feeds the exporter directly,
// this covers the wiring: engine -> JobObserver, rpc layer -> RecordRpc,
// registry -> OnJobCreated/OnJobDeleted, main.cc's ports. Every wait is
// bounded (a pipe read under a deadline, socket timeouts, a child's exit).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/exposition.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::HttpGetBody;
using test_support::ParseSamples;
using test_support::RunCommand;
using test_support::TempDir;

constexpr auto kExitDeadline = std::chrono::seconds(30);
constexpr int kBatchRows = 16;
// Job A trains at a scale its gradients fit under and a growth interval it
// never reaches, so its scale stays put; job B starts at PyTorch's 65536 and
// its first batch carries an inf target, so its first step must back off.
constexpr double kGoodInitScale = 1024;
constexpr double kOverflowInitScale = 65536;
constexpr int kGoodSteps = 3;

// One scrape: the text and its samples.
struct Scrape {
  std::string text;
  std::map<std::string, double> samples;

  // The series' value; NaN (which fails any EXPECT_EQ against a number)
  // with a test failure naming the series when it is absent.
  double operator()(const std::string& series) const {
    auto it = samples.find(series);
    EXPECT_NE(it, samples.end()) << series << " missing from:\n" << text;
    return it == samples.end() ? std::nan("") : it->second;
  }
  bool Has(const std::string& series) const { return samples.count(series) > 0; }
};

std::string JobLabel(const std::string& job_id) { return absl::StrCat("{job=\"", job_id, "\"}"); }

class LiveMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY,
                                            std::vector<std::string>{"--grad-histogram-every=1"},
                                            root_.path() / "ampd.log");
    ASSERT_NE(server_->port(), 0) << "ampd reported no gRPC port; " << server_->Describe();
    ASSERT_NE(server_->metrics_port(), 0)
        << "ampd reported no metrics port; " << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
    client_.reset();
    server_.reset();
  }

  Scrape ScrapeNow() {
    absl::StatusOr<std::string> body = HttpGetBody(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    Scrape scrape;
    scrape.text = body.ok() ? *body : "";
    scrape.samples = ParseSamples(scrape.text);
    return scrape;
  }

  // An fp16 AdamW job on the synthetic task (batches of kBatchRows rows).
  absl::StatusOr<v1::Job> CreateJob(uint64_t seed, double init_scale) {
    SyntheticTaskOptions task_options;
    task_options.batch_size = kBatchRows;
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    *config->mutable_model() = SyntheticTask(task_options).Model();
    config->set_seed(seed);
    config->set_display_name(absl::StrCat("live-metrics-", seed));
    config->set_precision(v1::PRECISION_FP16);
    config->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    config->mutable_optimizer()->set_lr(1e-3f);
    config->mutable_scaler()->set_init_scale(init_scale);
    config->mutable_scaler()->set_growth_interval(1000);
    return client_->CreateJob(request);
  }

  // Step `sequence` of job_id with the task's batch of that index; with
  // poison, the batch's first target is +inf, so the scaled gradients
  // overflow whatever the scale.
  absl::StatusOr<v1::StepResponse> Step(const std::string& job_id, int64_t sequence,
                                        bool poison = false) {
    SyntheticTaskOptions task_options;
    task_options.batch_size = kBatchRows;
    task_options.seed = 7;
    SyntheticTask task(task_options);
    v1::StepRequest request;
    request.set_job_id(job_id);
    request.set_sequence(sequence);
    v1::MicroBatch* batch = request.add_micro_batches();
    for (int64_t i = 0; i < sequence; ++i) *batch = task.NextBatch();
    if (poison) {
      const float inf = std::numeric_limits<float>::infinity();
      std::memcpy(batch->mutable_targets()->mutable_data()->data(), &inf, sizeof(float));
    }
    return client_->Step(request);
  }

  // Creates job A (kGoodSteps applied steps) and job B (one overflowing
  // step), checking the step responses so that the metric assertions below
  // rest on a known history. Also returns B's scrape from before its step.
  void TrainBothJobs(v1::Job* a, v1::Job* b, v1::StepResponse* last_a, Scrape* before_b) {
    absl::StatusOr<v1::Job> job_a = CreateJob(1, kGoodInitScale);
    ASSERT_TRUE(job_a.ok()) << job_a.status();
    absl::StatusOr<v1::Job> job_b = CreateJob(2, kOverflowInitScale);
    ASSERT_TRUE(job_b.ok()) << job_b.status();
    *a = *job_a;
    *b = *job_b;
    for (int64_t s = 1; s <= kGoodSteps; ++s) {
      absl::StatusOr<v1::StepResponse> r = Step(a->job_id(), s);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_FALSE(r->skipped()) << "job A's step " << s << " overflowed at scale "
                                 << r->scale_before();
      ASSERT_EQ(r->scale_after(), kGoodInitScale);
      *last_a = *r;
    }
    *before_b = ScrapeNow();
    absl::StatusOr<v1::StepResponse> r = Step(b->job_id(), 1, /*poison=*/true);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->found_inf());
    ASSERT_TRUE(r->skipped());
    ASSERT_EQ(r->scale_before(), kOverflowInitScale);
    ASSERT_EQ(r->scale_after(), kOverflowInitScale / 2);
  }

  TempDir root_{"ampd_live_metrics"};
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(LiveMetricsTest, OverflowBackoffAndJobSeriesFollowTheServer) {
  v1::Job a, b;
  v1::StepResponse last_a;
  Scrape before;
  ASSERT_NO_FATAL_FAILURE(TrainBothJobs(&a, &b, &last_a, &before));
  const std::string la = JobLabel(a.job_id());
  const std::string lb = JobLabel(b.job_id());
  const std::string skipped_a =
      absl::StrCat("ampd_skipped_steps_total{job=\"", a.job_id(), "\",reason=\"nonfinite\"}");
  const std::string skipped_b =
      absl::StrCat("ampd_skipped_steps_total{job=\"", b.job_id(), "\",reason=\"nonfinite\"}");

  // Job B as announced at creation, before its step.
  EXPECT_EQ(before("ampd_loss_scale" + lb), kOverflowInitScale);
  EXPECT_EQ(before(skipped_b), 0);
  EXPECT_EQ(before("ampd_loss_scale_backoffs_total" + lb), 0);
  EXPECT_EQ(before("ampd_steps_total" + lb), 0);

  const Scrape after = ScrapeNow();
  // Job B: one step, skipped for inf, scale halved once.
  EXPECT_EQ(after(skipped_b), 1);
  EXPECT_EQ(after("ampd_loss_scale_backoffs_total" + lb), 1);
  EXPECT_EQ(after("ampd_loss_scale_growths_total" + lb), 0);
  EXPECT_EQ(after("ampd_loss_scale" + lb), kOverflowInitScale / 2);
  EXPECT_EQ(after("ampd_steps_total" + lb), 1);
  EXPECT_EQ(after("ampd_samples_total" + lb), kBatchRows);
  // Its sampled histogram saw the non-finite elements: only the +Inf bucket
  // (which the engine shares between >= 2^20, inf and NaN) grows past le=20.
  EXPECT_GT(
      after(absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", b.job_id(), "\",le=\"+Inf\"}")),
      after(absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", b.job_id(), "\",le=\"20\"}")));

  // Job A: every step applied, nothing of B's leaked into its series.
  EXPECT_EQ(after(skipped_a), 0);
  EXPECT_EQ(after("ampd_loss_scale_backoffs_total" + la), 0);
  EXPECT_EQ(after("ampd_loss_scale" + la), kGoodInitScale);
  EXPECT_EQ(after("ampd_steps_total" + la), kGoodSteps);
  EXPECT_EQ(after("ampd_samples_total" + la), kGoodSteps * kBatchRows);
  EXPECT_FLOAT_EQ(static_cast<float>(after("ampd_loss" + la)), last_a.loss());
  // Sampled on every step (--grad-histogram-every=1): each step sees every
  // parameter's gradient once, as a bucket observation or as an exact zero.
  const double observed = after("ampd_grad_magnitude_log2_count" + la);
  EXPECT_GT(observed, 0);
  EXPECT_EQ(observed + after("ampd_grad_zero_elements_total" + la),
            static_cast<double>(kGoodSteps * a.parameter_count()));
  double finite_buckets = 0;
  for (const auto& [series, value] : after.samples) {
    if (absl::StartsWith(series, absl::StrCat("ampd_grad_magnitude_log2_bucket{job=\"", a.job_id(),
                                              "\",le=\"")) &&
        !absl::StrContains(series, "+Inf")) {
      finite_buckets = std::max(finite_buckets, value);
    }
  }
  EXPECT_GT(finite_buckets, 0) << "no finite ampd_grad_magnitude_log2 bucket of job A counted";

  // Server-wide: both jobs held, every RPC recorded with its code.
  EXPECT_EQ(after("ampd_jobs"), 2);
  EXPECT_EQ(after(R"(ampd_rpc_requests_total{code="OK",method="Step"})"), kGoodSteps + 1);
  EXPECT_EQ(after(R"(ampd_rpc_requests_total{code="OK",method="CreateJob"})"), 2);
  // Each call counted in flight while it ran (the gauge exists) and no
  // more once answered (the scrape itself is HTTP, not a call).
  EXPECT_EQ(after(R"(ampd_rpc_in_flight{method="Step"})"), 0);
  EXPECT_EQ(after(R"(ampd_rpc_in_flight{method="CreateJob"})"), 0);

  // A refused step (out of sequence) is an RPC error, not a training step.
  absl::StatusOr<v1::StepResponse> refused = Step(a.job_id(), kGoodSteps + 5);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const Scrape refused_scrape = ScrapeNow();
  EXPECT_EQ(refused_scrape(R"(ampd_rpc_requests_total{code="FAILED_PRECONDITION",method="Step"})"),
            1);
  EXPECT_EQ(refused_scrape(R"(ampd_rpc_requests_total{code="OK",method="Step"})"), kGoodSteps + 1);
  EXPECT_EQ(refused_scrape("ampd_steps_total" + la), kGoodSteps);

  // DeleteJob takes every series of B with it, and only B's.
  ASSERT_TRUE(client_->DeleteJob(b.job_id()).ok());
  const Scrape deleted = ScrapeNow();
  EXPECT_FALSE(absl::StrContains(deleted.text, absl::StrCat("job=\"", b.job_id(), "\"")))
      << deleted.text;
  EXPECT_EQ(deleted("ampd_jobs"), 1);
  EXPECT_EQ(deleted(R"(ampd_rpc_requests_total{code="OK",method="DeleteJob"})"), 1);
  EXPECT_EQ(deleted("ampd_steps_total" + la), kGoodSteps);
  EXPECT_EQ(deleted("ampd_loss_scale" + la), kGoodInitScale);

  // A clean SIGTERM shutdown with the metrics server up. The idle channel
  // goes first: nothing polls it between calls, so the server's graceful
  // GOAWAY ping would go unanswered and the drain would wait out gRPC's
  // ping timeout (about 5 s) instead of exiting at once.
  client_.reset();
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0);
}

TEST_F(LiveMetricsTest, LiveExpositionPassesPromtool) {
  v1::Job a, b;
  v1::StepResponse last_a;
  Scrape before;
  ASSERT_NO_FATAL_FAILURE(TrainBothJobs(&a, &b, &last_a, &before));
  const Scrape scrape = ScrapeNow();
  ASSERT_TRUE(scrape.Has("ampd_grad_magnitude_log2_count" + JobLabel(a.job_id())))
      << "the lint would not see the histogram:\n"
      << scrape.text;

  // promtool is found at configure time; a missing one fails here (it
  // cannot be started) rather than skipping the lint.
  const CommandResult lint =
      RunCommand({AMPD_PROMTOOL, "check", "metrics"}, kExitDeadline, scrape.text);
  ASSERT_TRUE(lint.status.exited || lint.status.signaled()) << lint.err;
  EXPECT_TRUE(lint.status.exited && lint.status.code == 0)
      << "promtool (" << AMPD_PROMTOOL << ") rejected the live exposition ("
      << lint.status.ToString() << "):\n"
      << lint.out << lint.err << "\n---\n"
      << scrape.text;
}

}  // namespace
}  // namespace ampd
