// ServerMetrics end to end within one process: steps are fed through the
// engine's JobObserver interface exactly as the job workers will feed them,
// and every assertion reads the exposition over a real loopback socket, the
// way Prometheus reads it. promtool (AMPD_PROMTOOL) lints the scraped text.
#include "server/metrics/server_metrics.h"

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/gauge.h"
#include "server/engine/api.h"
#include "server/engine/jobs/job_observer.h"
#include "tests/support/exposition.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"

namespace ampd::metrics {
namespace {

using engine::JobConfig;
using engine::JobObserver;
using engine::StepReport;
using test_support::CommandResult;
using test_support::HttpGetBody;
using test_support::ParseSamples;
using test_support::RunCommand;

class ServerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started = ServerMetrics::Start("127.0.0.1:0");
    ASSERT_TRUE(started.ok()) << started.status();
    metrics_ = *std::move(started);
    ASSERT_GT(metrics_->port(), 0);
  }

  std::string Scrape() {
    absl::StatusOr<std::string> body = HttpGetBody(metrics_->port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return body.ok() ? *body : "";
  }

  // The value of one series in a fresh scrape; fails the test when absent.
  double Value(const std::string& series) {
    const std::string text = Scrape();
    const auto samples = ParseSamples(text);
    auto it = samples.find(series);
    EXPECT_NE(it, samples.end()) << series << " missing from:\n" << text;
    return it == samples.end() ? std::nan("") : it->second;
  }

  JobObserver& observer() { return *metrics_; }

  std::unique_ptr<ServerMetrics> metrics_;
};

JobConfig Fp16Config() {
  JobConfig config;  // pytorch policy: init_scale 65536, backoff 0.5
  config.precision = engine::model::Precision::kFp16;
  return config;
}

// A step that applied its update at an unchanged scale.
StepReport NormalStep(int64_t step, float scale) {
  StepReport report;
  report.step = step;
  report.applied_steps = step;
  report.loss = 0.5f;
  report.scaler = {.scale_before = scale, .scale_after = scale, .counters = {}};
  report.grad_norm = 1.25f;
  report.seconds = {
      .forward = 0.002, .backward = 0.003, .unscale = 0.0005, .optimizer = 0.001, .total = 0.0065};
  report.samples = 32;
  return report;
}

// The overflow the scaler answers by skipping and halving S.
StepReport OverflowStep(int64_t step, int64_t applied, float scale_before) {
  StepReport report = NormalStep(step, scale_before);
  report.applied_steps = applied;
  report.scaler = {.scale_before = scale_before,
                   .scale_after = scale_before / 2,
                   .found_inf = true,
                   .skipped = true,
                   .backed_off = true,
                   .counters = {}};
  report.grad_norm.reset();  // the norm is not computed once found_inf is set
  return report;
}

// Engine bin of the octave [2^k, 2^(k+1)) (common/grad_histogram.h: bin 2 starts
// at 2^-30).
constexpr int OctaveBin(int k) { return k - engine::kGradHistogramMinLog2 + 2; }

TEST_F(ServerMetricsTest, ServesServerWideFamiliesBeforeAnyJob) {
  const std::string text = Scrape();
  EXPECT_NE(text.find("# TYPE ampd_jobs gauge"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE ampd_device_memory_total_bytes gauge"), std::string::npos) << text;
  // prometheus-cpp writes no HELP/TYPE for a family without series.
  EXPECT_EQ(text.find("ampd_loss_scale"), std::string::npos) << text;
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at("ampd_jobs"), 0);
  EXPECT_EQ(s.at("ampd_device_memory_used_bytes"), 0);
}

TEST(ServerMetricsStartTest, RejectsEmptyAddress) {
  auto started = ServerMetrics::Start("");
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServerMetricsStartTest, RejectsAddressesWithoutAValidPort) {
  for (const char* address : {"127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000"}) {
    auto started = ServerMetrics::Start(address);
    EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument)
        << address << ": " << started.status();
  }
}

// Only /metrics is served; a query string is ignored, as Prometheus's own
// scrape parameters would be.
TEST_F(ServerMetricsTest, AnswersOtherPathsWithNotFound) {
  absl::StatusOr<test_support::HttpResponse> other =
      test_support::HttpGet(metrics_->port(), "/status");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->status, 404) << other->headers;
  absl::StatusOr<test_support::HttpResponse> with_query =
      test_support::HttpGet(metrics_->port(), "/metrics?format=text");
  ASSERT_TRUE(with_query.ok()) << with_query.status();
  EXPECT_EQ(with_query->status, 200) << with_query->headers;
  EXPECT_NE(with_query->body.find("# TYPE ampd_jobs gauge"), std::string::npos);
  EXPECT_NE(with_query->headers.find("text/plain; version=0.0.4"), std::string::npos)
      << with_query->headers;
}

TEST(ServerMetricsStartTest, ReportsAPortAlreadyInUseAsUnavailable) {
  auto first = ServerMetrics::Start("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ServerMetrics::Start("127.0.0.1:" + std::to_string((*first)->port()));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
}

TEST_F(ServerMetricsTest, CreatedJobStartsAtItsInitialScale) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  EXPECT_EQ(Value(R"(ampd_loss_scale{job="job-a"})"), 65536);
  EXPECT_EQ(Value(R"(ampd_steps_total{job="job-a"})"), 0);
  EXPECT_EQ(Value(R"(ampd_skipped_steps_total{job="job-a",reason="nonfinite"})"), 0);
  EXPECT_EQ(Value("ampd_jobs"), 1);

  JobConfig disabled = Fp16Config();
  disabled.scaler.enabled = false;
  observer().OnJobCreated("job-off", "", disabled);
  EXPECT_EQ(Value(R"(ampd_loss_scale{job="job-off"})"), 1);
  EXPECT_EQ(Value("ampd_jobs"), 2);
}

TEST_F(ServerMetricsTest, OverflowSkipsTheStepAndBacksTheScaleOff) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  observer().OnStep("job-a", NormalStep(1, 65536));
  EXPECT_EQ(Value(R"(ampd_loss_scale{job="job-a"})"), 65536);
  EXPECT_EQ(Value(R"(ampd_loss_scale_backoffs_total{job="job-a"})"), 0);

  observer().OnStep("job-a", OverflowStep(2, 1, 65536));
  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_loss_scale{job="job-a"})"), 32768) << text;
  EXPECT_EQ(s.at(R"(ampd_steps_total{job="job-a"})"), 2);
  EXPECT_EQ(s.at(R"(ampd_skipped_steps_total{job="job-a",reason="nonfinite"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_loss_scale_backoffs_total{job="job-a"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_loss_scale_growths_total{job="job-a"})"), 0);
  EXPECT_EQ(s.at(R"(ampd_samples_total{job="job-a"})"), 64);
  EXPECT_EQ(s.at(R"(ampd_loss{job="job-a"})"), 0.5);
  // The overflow step carried no norm: the gauge keeps the last one seen.
  EXPECT_EQ(s.at(R"(ampd_grad_norm{job="job-a"})"), 1.25);
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="job-a",phase="total"})"), 2);
  EXPECT_DOUBLE_EQ(s.at(R"(ampd_step_duration_seconds_sum{job="job-a",phase="forward"})"), 0.004);
  // 0.0065 s lands in the 10 ms bucket, not the 5 ms one.
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_bucket{job="job-a",phase="total",le="0.005"})"), 0);
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_bucket{job="job-a",phase="total",le="0.01"})"), 2);
}

TEST_F(ServerMetricsTest, GrowthIsCounted) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  StepReport grew = NormalStep(2000, 32768);
  grew.scaler.scale_after = 65536;
  grew.scaler.grew = true;
  observer().OnStep("job-a", grew);
  EXPECT_EQ(Value(R"(ampd_loss_scale_growths_total{job="job-a"})"), 1);
  EXPECT_EQ(Value(R"(ampd_loss_scale{job="job-a"})"), 65536);
}

TEST_F(ServerMetricsTest, DeferredGrowthsAndUnderflowFractionAreExported) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  EXPECT_EQ(Value(R"(ampd_loss_scale_growths_deferred_total{job="job-a"})"), 0);
  EXPECT_EQ(Scrape().find("ampd_grad_underflow_fraction{"), std::string::npos);
  StepReport deferred = NormalStep(2000, 4096);
  deferred.scaler.growth_deferred = true;
  deferred.grad_underflow_fraction = 0.25;
  observer().OnStep("job-a", deferred);
  observer().OnStep("job-a", NormalStep(2001, 4096));  // unsampled: the gauge keeps 0.25
  EXPECT_EQ(Value(R"(ampd_loss_scale_growths_deferred_total{job="job-a"})"), 1);
  EXPECT_EQ(Value(R"(ampd_grad_underflow_fraction{job="job-a"})"), 0.25);
  EXPECT_EQ(Value(R"(ampd_loss_scale_growths_total{job="job-a"})"), 0);
  observer().OnJobDeleted("job-a");
  EXPECT_EQ(Scrape().find("ampd_grad_underflow_fraction{"), std::string::npos);
  EXPECT_EQ(Scrape().find("ampd_loss_scale_growths_deferred_total{"), std::string::npos);
}

// One gauge per layer group, labelled layer="g", from the first step that
// reports group scales; at most 32 per job whatever a report carries; gone
// with the job.
TEST_F(ServerMetricsTest, PerLayerScalesAreOneGaugePerGroup) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  observer().OnStep("job-a", NormalStep(1, 4096));
  EXPECT_EQ(Scrape().find("ampd_loss_scale_layer{"), std::string::npos);
  StepReport layered = NormalStep(2, 2048);
  layered.scaler.layer_scales_after = {16777216.0f, 65536.0f, 2048.0f};
  observer().OnStep("job-a", layered);
  EXPECT_EQ(Value(R"(ampd_loss_scale_layer{job="job-a",layer="0"})"), 16777216);
  EXPECT_EQ(Value(R"(ampd_loss_scale_layer{job="job-a",layer="1"})"), 65536);
  EXPECT_EQ(Value(R"(ampd_loss_scale_layer{job="job-a",layer="2"})"), 2048);
  layered.scaler.layer_scales_after = {8388608.0f, 65536.0f, 4096.0f};
  observer().OnStep("job-a", layered);
  EXPECT_EQ(Value(R"(ampd_loss_scale_layer{job="job-a",layer="0"})"), 8388608);
  EXPECT_EQ(Value(R"(ampd_loss_scale_layer{job="job-a",layer="2"})"), 4096);

  StepReport many = NormalStep(1, 1);
  many.scaler.layer_scales_after.assign(40, 2.0f);
  observer().OnStep("job-b", many);
  const auto s = ParseSamples(Scrape());
  int layers_of_b = 0;
  for (const auto& [name, value] : s) {
    if (name.rfind(R"(ampd_loss_scale_layer{job="job-b")", 0) == 0) ++layers_of_b;
  }
  EXPECT_EQ(layers_of_b, 32);
  EXPECT_EQ(s.count(R"(ampd_loss_scale_layer{job="job-b",layer="31"})"), 1u);
  EXPECT_EQ(s.count(R"(ampd_loss_scale_layer{job="job-b",layer="32"})"), 0u);

  observer().OnJobDeleted("job-a");
  observer().OnJobDeleted("job-b");
  EXPECT_EQ(Scrape().find("ampd_loss_scale_layer{"), std::string::npos);
}

TEST_F(ServerMetricsTest, GradNormSeriesAppearsOnlyOnceReported) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  StepReport no_norm = NormalStep(1, 65536);
  no_norm.grad_norm.reset();
  observer().OnStep("job-a", no_norm);
  EXPECT_EQ(ParseSamples(Scrape()).count(R"(ampd_grad_norm{job="job-a"})"), 0u);
  observer().OnStep("job-a", NormalStep(2, 65536));
  EXPECT_EQ(Value(R"(ampd_grad_norm{job="job-a"})"), 1.25);
}

TEST_F(ServerMetricsTest, LogprobMismatchSeriesAppearsWithATokenLossAndGoesWithTheJob) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  observer().OnStep("job-a", NormalStep(1, 65536));
  EXPECT_EQ(ParseSamples(Scrape()).count(R"(ampd_logprob_mismatch{job="job-a"})"), 0u);
  StepReport rl = NormalStep(2, 65536);
  rl.logprob_mismatch = 0.0f;
  observer().OnStep("job-a", rl);
  EXPECT_EQ(Value(R"(ampd_logprob_mismatch{job="job-a"})"), 0.0);
  rl.logprob_mismatch = 0.125f;
  observer().OnStep("job-a", rl);
  EXPECT_EQ(Value(R"(ampd_logprob_mismatch{job="job-a"})"), 0.125);
  // A plain step in between keeps the last token loss's value.
  observer().OnStep("job-a", NormalStep(4, 65536));
  EXPECT_EQ(Value(R"(ampd_logprob_mismatch{job="job-a"})"), 0.125);
  observer().OnJobDeleted("job-a");
  EXPECT_EQ(Scrape().find("ampd_logprob_mismatch{"), std::string::npos);
}

TEST_F(ServerMetricsTest, GradHistogramBinsBecomeCumulativeLog2Buckets) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  StepReport report = NormalStep(1, 65536);
  report.grad_histogram.assign(engine::kGradHistogramBins, 0);
  report.grad_histogram[0] = 7;               // exact zeros
  report.grad_histogram[1] = 3;               // below 2^-30
  report.grad_histogram[OctaveBin(-25)] = 5;  // [2^-25, 2^-24): fp16 rounds these to 0 or 2^-24
  report.grad_histogram[OctaveBin(15)] = 11;  // [2^15, 2^16): just under fp16's 65504
  report.grad_histogram[engine::kGradHistogramBins - 1] = 2;  // >= 2^20, inf, NaN
  observer().OnStep("job-a", report);

  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  auto bucket = [&](const std::string& le) {
    const std::string key = R"(ampd_grad_magnitude_log2_bucket{job="job-a",le=")" + le + "\"}";
    auto it = s.find(key);
    EXPECT_NE(it, s.end()) << key << " missing from:\n" << text;
    return it == s.end() ? -1.0 : it->second;
  };
  EXPECT_EQ(bucket("-30"), 3);
  EXPECT_EQ(bucket("-29"), 3);
  EXPECT_EQ(bucket("-25"), 3);  // the octave [2^-25, 2^-24) is below le=-24, not le=-25
  EXPECT_EQ(bucket("-24"), 8);
  EXPECT_EQ(bucket("15"), 8);
  EXPECT_EQ(bucket("16"), 19);
  EXPECT_EQ(bucket("20"), 19);
  EXPECT_EQ(bucket("+Inf"), 21);
  EXPECT_EQ(s.at(R"(ampd_grad_magnitude_log2_count{job="job-a"})"), 21);
  EXPECT_DOUBLE_EQ(s.at(R"(ampd_grad_magnitude_log2_sum{job="job-a"})"),
                   3 * -30.5 + 5 * -24.5 + 11 * 15.5 + 2 * 20.5);
  EXPECT_EQ(s.at(R"(ampd_grad_zero_elements_total{job="job-a"})"), 7);

  // Every bound -30..20 is exposed, so Grafana's heatmap has a fixed y axis.
  for (int k = engine::kGradHistogramMinLog2; k <= engine::kGradHistogramMaxLog2; ++k) {
    EXPECT_GE(bucket(std::to_string(k)), 0) << k;
  }

  // A second sampled step accumulates; a malformed histogram is ignored.
  observer().OnStep("job-a", report);
  StepReport malformed = NormalStep(3, 65536);
  malformed.grad_histogram.assign(5, 100);
  observer().OnStep("job-a", malformed);
  EXPECT_EQ(Value(R"(ampd_grad_magnitude_log2_count{job="job-a"})"), 42);
  EXPECT_EQ(Value(R"(ampd_grad_zero_elements_total{job="job-a"})"), 14);
}

TEST_F(ServerMetricsTest, DeletedJobsSeriesDisappear) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  observer().OnJobCreated("job-b", "", Fp16Config());
  StepReport report = NormalStep(1, 65536);
  report.grad_histogram.assign(engine::kGradHistogramBins, 1);
  observer().OnStep("job-a", report);
  observer().OnStep("job-b", report);
  ASSERT_NE(Scrape().find(R"(job="job-a")"), std::string::npos);

  observer().OnJobDeleted("job-a");
  const std::string text = Scrape();
  EXPECT_EQ(text.find(R"(job="job-a")"), std::string::npos) << text;
  EXPECT_EQ(ParseSamples(text).at(R"(ampd_steps_total{job="job-b"})"), 1);
  EXPECT_EQ(ParseSamples(text).at("ampd_jobs"), 1);

  // Deleting twice, or an unknown job, changes nothing.
  observer().OnJobDeleted("job-a");
  observer().OnJobDeleted("never-created");
  EXPECT_EQ(Value("ampd_jobs"), 1);
}

// A tenant's job carries its tenant on every series, so a dashboard can
// filter per tenant; a job of the open server's anonymous tenant does not.
TEST_F(ServerMetricsTest, JobsOfATenantAreLabelledWithIt) {
  observer().OnJobCreated("job-t", "team-a", Fp16Config());
  observer().OnJobCreated("job-open", "", Fp16Config());
  StepReport report = NormalStep(1, 65536);
  report.grad_histogram.assign(engine::kGradHistogramBins, 1);
  observer().OnStep("job-t", report);
  observer().OnStep("job-t", OverflowStep(2, 1, 65536));
  observer().OnStep("job-open", report);
  observer().OnEvaluate("job-t", {.loss = 0.75f, .samples = 8, .seconds = 0.001});
  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_steps_total{job="job-t",tenant="team-a"})"), 2) << text;
  EXPECT_EQ(s.at(R"(ampd_evaluations_total{job="job-t",tenant="team-a"})"), 1) << text;
  EXPECT_EQ(s.at(R"(ampd_evaluate_duration_seconds_count{job="job-t",tenant="team-a"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_eval_loss{job="job-t",tenant="team-a"})"), 0.75);
  EXPECT_EQ(s.at(R"(ampd_skipped_steps_total{job="job-t",reason="nonfinite",tenant="team-a"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_grad_norm{job="job-t",tenant="team-a"})"), 1.25) << text;
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="job-t",phase="total",tenant="team-a"})"),
            2);
  EXPECT_EQ(s.at(R"(ampd_steps_total{job="job-open"})"), 1);
  // Every series of the tenant's job names the tenant; none is left bare.
  for (const auto& [series, value] : s) {
    if (series.find(R"(job="job-t")") != std::string::npos) {
      EXPECT_NE(series.find(R"(tenant="team-a")"), std::string::npos) << series;
    }
  }
  observer().OnJobDeleted("job-t");
  EXPECT_EQ(Scrape().find("team-a"), std::string::npos);
}

// The learning rate of the last step, and the evaluations beside the steps:
// counted, timed, their last loss; all removed with the job.
TEST_F(ServerMetricsTest, LearningRateAndEvaluations) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  // No lr and no eval loss before a step and an evaluation.
  std::string text = Scrape();
  EXPECT_EQ(text.find("ampd_learning_rate{"), std::string::npos) << text;
  EXPECT_EQ(text.find("ampd_eval_loss{"), std::string::npos) << text;
  EXPECT_EQ(Value(R"(ampd_evaluations_total{job="job-a"})"), 0);

  StepReport first = NormalStep(1, 65536);
  first.learning_rate = 2.5e-4f;
  observer().OnStep("job-a", first);
  EXPECT_EQ(Value(R"(ampd_learning_rate{job="job-a"})"), 2.5e-4f);
  StepReport second = OverflowStep(2, 1, 65536);
  second.learning_rate = 0.125f;
  observer().OnStep("job-a", second);
  EXPECT_EQ(Value(R"(ampd_learning_rate{job="job-a"})"), 0.125);

  observer().OnEvaluate("job-a", {.loss = 1.5f, .samples = 16, .seconds = 0.003});
  observer().OnEvaluate("job-a", {.loss = 0.25f, .samples = 16, .seconds = 0.2});
  text = Scrape();
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_evaluations_total{job="job-a"})"), 2) << text;
  EXPECT_EQ(s.at(R"(ampd_evaluate_duration_seconds_count{job="job-a"})"), 2);
  EXPECT_DOUBLE_EQ(s.at(R"(ampd_evaluate_duration_seconds_sum{job="job-a"})"), 0.203);
  EXPECT_EQ(s.at(R"(ampd_evaluate_duration_seconds_bucket{job="job-a",le="0.005"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_eval_loss{job="job-a"})"), 0.25);
  // Evaluations are not steps.
  EXPECT_EQ(s.at(R"(ampd_steps_total{job="job-a"})"), 2);
  EXPECT_EQ(s.at(R"(ampd_samples_total{job="job-a"})"), 64);

  observer().OnJobDeleted("job-a");
  text = Scrape();
  EXPECT_EQ(text.find("job-a"), std::string::npos) << text;
}

TEST_F(ServerMetricsTest, AccumulatedCallsPendingFollowTheJobAndGoWithIt) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  // Absent until the job's first ForwardBackward call.
  EXPECT_EQ(Scrape().find("ampd_accumulated_calls_pending{"), std::string::npos);
  observer().OnAccumulated("job-a", 1);
  observer().OnAccumulated("job-a", 3);
  EXPECT_EQ(Value(R"(ampd_accumulated_calls_pending{job="job-a"})"), 3);
  observer().OnAccumulated("job-a", 0);  // the OptimStep that applied them
  EXPECT_EQ(Value(R"(ampd_accumulated_calls_pending{job="job-a"})"), 0);
  observer().OnJobDeleted("job-a");
  EXPECT_EQ(Scrape().find("ampd_accumulated_calls_pending{"), std::string::npos);
}

TEST_F(ServerMetricsTest, SamplerSnapshotsFollowTheJobAndGoWithIt) {
  observer().OnJobCreated("job-a", "", Fp16Config());
  // Absent until the job's first snapshot.
  EXPECT_EQ(Scrape().find("ampd_sampler_snapshot"), std::string::npos);
  observer().OnSamplerSnapshots("job-a", 1, 3584);
  observer().OnSamplerSnapshots("job-a", 2, 7168);
  EXPECT_EQ(Value(R"(ampd_sampler_snapshots{job="job-a"})"), 2);
  EXPECT_EQ(Value(R"(ampd_sampler_snapshot_bytes{job="job-a"})"), 7168);
  observer().OnSamplerSnapshots("job-a", 0, 0);  // deleted
  EXPECT_EQ(Value(R"(ampd_sampler_snapshots{job="job-a"})"), 0);
  EXPECT_EQ(Value(R"(ampd_sampler_snapshot_bytes{job="job-a"})"), 0);
  // A restored job's snapshots come before it is announced.
  observer().OnSamplerSnapshots("restored", 1, 64);
  EXPECT_EQ(Value(R"(ampd_sampler_snapshots{job="restored"})"), 1);
  observer().OnJobDeleted("job-a");
  observer().OnJobDeleted("restored");
  EXPECT_EQ(Scrape().find("ampd_sampler_snapshot"), std::string::npos);
}

TEST_F(ServerMetricsTest, SharedBasesAreServerWide) {
  EXPECT_EQ(Value("ampd_shared_bases"), 0);
  EXPECT_EQ(Value("ampd_shared_base_bytes"), 0);
  observer().OnSharedBases(2, 96 << 20);
  EXPECT_EQ(Value("ampd_shared_bases"), 2);
  EXPECT_EQ(Value("ampd_shared_base_bytes"), 96 << 20);
  observer().OnSharedBases(0, 0);  // the last job on each went
  EXPECT_EQ(Value("ampd_shared_bases"), 0);
  EXPECT_EQ(Value("ampd_shared_base_bytes"), 0);
}

TEST_F(ServerMetricsTest, StepOfAnUnannouncedJobCreatesItsSeries) {
  observer().OnStep("restored", OverflowStep(7, 6, 1024));
  EXPECT_EQ(Value(R"(ampd_loss_scale{job="restored"})"), 512);
  EXPECT_EQ(Value(R"(ampd_skipped_steps_total{job="restored",reason="nonfinite"})"), 1);
  EXPECT_EQ(Value("ampd_jobs"), 1);
}

// Rank `rank` of a distributed job of `world_size` ranks.
JobConfig DistributedConfig(int32_t rank, int32_t world_size) {
  JobConfig config = Fp16Config();
  config.distributed.world_size = world_size;
  config.distributed.rank = rank;
  config.distributed.group = "group-a";
  config.distributed.rendezvous = "ampd-0.ampd-peers:50052";
  return config;
}

// A distributed rank's step: the all-reduce and the wait at its start.
StepReport DistributedStep(int64_t step, double allreduce, double wait) {
  StepReport report = NormalStep(step, 65536);
  report.seconds.allreduce = allreduce;
  report.seconds.wait = wait;
  return report;
}

// A distributed job's rank exports its rank, world size, formations and the
// allreduce and wait phases; a single job beside it keeps exactly the five
// phases it always had.
TEST_F(ServerMetricsTest, DistributedJobsExportTheirRankPhasesAndFormations) {
  observer().OnJobCreated("job-d", "team-a", DistributedConfig(1, 4));
  observer().OnJobCreated("job-s", "", Fp16Config());
  const auto formations = [](const std::string& copied) {
    return R"(ampd_distributed_group_formations_total{copied_state=")" + copied +
           R"(",job="job-d",tenant="team-a"})";
  };
  const auto allreduce_bucket = [](const std::string& le) {
    return R"(ampd_step_duration_seconds_bucket{job="job-d",phase="allreduce",)"
           R"(tenant="team-a",le=")" +
           le + "\"}";
  };
  std::string text = Scrape();
  auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_distributed_rank{job="job-d",tenant="team-a"})"), 1) << text;
  EXPECT_EQ(s.at(R"(ampd_distributed_world_size{job="job-d",tenant="team-a"})"), 4);
  // Both formation series exist at zero before the first formation.
  EXPECT_EQ(s.at(formations("false")), 0);
  EXPECT_EQ(s.at(formations("true")), 0);

  observer().OnGroupFormed("job-d", {.round = 0, .copied_state = false, .source_rank = 0});
  observer().OnStep("job-d", DistributedStep(1, 0.004, 0.002));
  // The group broke and formed again; this rank had restarted behind.
  observer().OnGroupFormed("job-d", {.round = 1, .copied_state = true, .source_rank = 0});
  observer().OnStep("job-d", DistributedStep(2, 0.03, 0.0));
  observer().OnStep("job-s", NormalStep(1, 65536));
  text = Scrape();
  s = ParseSamples(text);
  EXPECT_EQ(s.at(formations("false")), 1) << text;
  EXPECT_EQ(s.at(formations("true")), 1);
  EXPECT_EQ(
      s.at(R"(ampd_step_duration_seconds_count{job="job-d",phase="allreduce",tenant="team-a"})"),
      2);
  EXPECT_DOUBLE_EQ(
      s.at(R"(ampd_step_duration_seconds_sum{job="job-d",phase="allreduce",tenant="team-a"})"),
      0.034);
  // 4 ms lands in the 5 ms bucket, 30 ms only from the 50 ms one.
  EXPECT_EQ(s.at(allreduce_bucket("0.005")), 1);
  EXPECT_EQ(s.at(allreduce_bucket("0.05")), 2);
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="job-d",phase="wait",tenant="team-a"})"),
            2);
  EXPECT_DOUBLE_EQ(
      s.at(R"(ampd_step_duration_seconds_sum{job="job-d",phase="wait",tenant="team-a"})"), 0.002);
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="job-d",phase="total",tenant="team-a"})"),
            2);

  // The single job: no distributed series at all.
  for (const auto& [series, value] : s) {
    if (series.find(R"(job="job-s")") == std::string::npos) continue;
    EXPECT_EQ(series.find("ampd_distributed_"), std::string::npos) << series;
    EXPECT_EQ(series.find(R"(phase="allreduce")"), std::string::npos) << series;
    EXPECT_EQ(series.find(R"(phase="wait")"), std::string::npos) << series;
  }
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="job-s",phase="total"})"), 1);

  observer().OnJobDeleted("job-d");
  text = Scrape();
  EXPECT_EQ(text.find(R"(job="job-d")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"(job="job-s")"), std::string::npos) << text;
}

// A world of one is not distributed: none of the distributed series.
TEST_F(ServerMetricsTest, WorldSizeOneIsASingleJob) {
  observer().OnJobCreated("job-1", "", DistributedConfig(0, 1));
  observer().OnStep("job-1", NormalStep(1, 65536));
  const std::string text = Scrape();
  EXPECT_EQ(text.find("ampd_distributed_"), std::string::npos) << text;
  EXPECT_EQ(text.find(R"(phase="allreduce")"), std::string::npos) << text;
}

// A distributed job not announced (restored without OnJobCreated) is
// recognised by its first formation or its distributed phases; its rank and
// world size, which only the config carries, stay absent.
TEST_F(ServerMetricsTest, UnannouncedDistributedJobGetsItsPhasesAndFormations) {
  observer().OnGroupFormed("restored", {.round = 3, .copied_state = true, .source_rank = 2});
  observer().OnStep("restored", DistributedStep(9, 0.001, 0.0005));
  observer().OnStep("stepped-first", DistributedStep(1, 0.002, 0.001));
  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_distributed_group_formations_total{copied_state="true",job="restored"})"),
            1)
      << text;
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="restored",phase="allreduce"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_step_duration_seconds_count{job="stepped-first",phase="wait"})"), 1);
  EXPECT_EQ(
      s.at(R"(ampd_distributed_group_formations_total{copied_state="false",job="stepped-first"})"),
      0);
  EXPECT_EQ(text.find("ampd_distributed_rank{"), std::string::npos) << text;
  EXPECT_EQ(text.find("ampd_distributed_world_size{"), std::string::npos) << text;
}

TEST_F(ServerMetricsTest, RpcsAndDeviceMemory) {
  metrics_->RecordRpc("Step", "OK", 0.004);
  metrics_->RecordRpc("Step", "OK", 0.002);
  metrics_->RecordRpc("Step", "INVALID_ARGUMENT", 0.0001);
  metrics_->RecordRpc("CreateJob", "OK", 0.3);
  metrics_->SetDeviceMemory(int64_t{3} << 30, int64_t{80} << 30);
  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  EXPECT_EQ(s.at(R"(ampd_rpc_requests_total{code="OK",method="Step"})"), 2) << text;
  EXPECT_EQ(s.at(R"(ampd_rpc_requests_total{code="INVALID_ARGUMENT",method="Step"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_rpc_requests_total{code="OK",method="CreateJob"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_rpc_duration_seconds_count{method="Step"})"), 3);
  EXPECT_EQ(s.at(R"(ampd_rpc_duration_seconds_bucket{method="Step",le="0.0025"})"), 2);
  EXPECT_EQ(s.at(R"(ampd_rpc_duration_seconds_bucket{method="CreateJob",le="0.25"})"), 0);
  EXPECT_EQ(s.at("ampd_device_memory_used_bytes"), 3.0 * (1 << 30));
  EXPECT_EQ(s.at("ampd_device_memory_total_bytes"), 80.0 * (1 << 30));
}

TEST_F(ServerMetricsTest, RpcsInFlightByMethodWithBoundedLabels) {
  prometheus::Gauge& sample = metrics_->RpcInFlight("Sample");
  sample.Increment();
  sample.Increment();
  metrics_->RpcInFlight("Join").Increment();
  EXPECT_EQ(&metrics_->RpcInFlight("Sample"), &sample);  // one series a method
  sample.Decrement();
  auto s = ParseSamples(Scrape());
  EXPECT_EQ(s.at(R"(ampd_rpc_in_flight{method="Sample"})"), 1);
  EXPECT_EQ(s.at(R"(ampd_rpc_in_flight{method="Join"})"), 1);

  // Method names past the bound share one series.
  for (size_t i = 0; i < ServerMetrics::kMaxInFlightMethods + 10; ++i) {
    metrics_->RpcInFlight(absl::StrCat("M", i)).Increment();
  }
  s = ParseSamples(Scrape());
  size_t series = 0;
  for (const auto& [name, value] : s) {
    series += absl::StartsWith(name, "ampd_rpc_in_flight{") ? 1 : 0;
  }
  EXPECT_EQ(series, ServerMetrics::kMaxInFlightMethods + 1);
  // The two above, then M0..M61 alone; M62 onwards (12 of them) are "other".
  EXPECT_EQ(s.at(R"(ampd_rpc_in_flight{method="other"})"), 12);
  EXPECT_EQ(s.at(R"(ampd_rpc_in_flight{method="M61"})"), 1);
}

TEST_F(ServerMetricsTest, ConcurrentJobsCountExactly) {
  constexpr int kJobs = 4;
  constexpr int kSteps = 500;
  std::vector<std::thread> workers;
  for (int j = 0; j < kJobs; ++j) {
    workers.emplace_back([this, j] {
      const std::string id = "job-" + std::to_string(j);
      observer().OnJobCreated(id, "", Fp16Config());
      for (int i = 1; i <= kSteps; ++i) {
        StepReport report =
            (i % 10 == 0) ? OverflowStep(i, i - i / 10, 65536) : NormalStep(i, 65536);
        observer().OnStep(id, report);
      }
    });
  }
  // A transient job created and deleted while the others step.
  workers.emplace_back([this] {
    for (int i = 0; i < 100; ++i) {
      observer().OnJobCreated("transient", "", Fp16Config());
      observer().OnStep("transient", NormalStep(1, 65536));
      observer().OnJobDeleted("transient");
    }
  });
  for (std::thread& t : workers) t.join();

  const std::string text = Scrape();
  const auto s = ParseSamples(text);
  for (int j = 0; j < kJobs; ++j) {
    const std::string job = "{job=\"job-" + std::to_string(j) + "\"}";
    EXPECT_EQ(s.at("ampd_steps_total" + job), kSteps);
    EXPECT_EQ(s.at("ampd_loss_scale_backoffs_total" + job), kSteps / 10);
    EXPECT_EQ(s.at("ampd_samples_total" + job), 32 * kSteps);
  }
  EXPECT_EQ(text.find("transient"), std::string::npos);
  EXPECT_EQ(s.at("ampd_jobs"), kJobs);
}

TEST_F(ServerMetricsTest, PromtoolAcceptsTheExposition) {
  // Every family populated, so the lint sees every name, type and HELP.
  observer().OnJobCreated("job-a", "", Fp16Config());
  StepReport report = NormalStep(1, 65536);
  report.grad_histogram.assign(engine::kGradHistogramBins, 2);
  observer().OnStep("job-a", report);
  observer().OnStep("job-a", OverflowStep(2, 1, 65536));
  observer().OnSamplerSnapshots("job-a", 2, 7168);
  observer().OnSharedBases(1, 1 << 26);
  observer().OnJobCreated("job-d", "team-a", DistributedConfig(0, 2));
  observer().OnGroupFormed("job-d", {.round = 0, .copied_state = false, .source_rank = 0});
  observer().OnStep("job-d", DistributedStep(1, 0.002, 0.001));
  metrics_->RecordRpc("Step", "OK", 0.004);
  metrics_->RpcInFlight("Sample").Increment();
  metrics_->SetDeviceMemory(1 << 20, 1 << 30);
  const std::string text = Scrape();
  ASSERT_FALSE(text.empty());

  // promtool must exist in CI (scripts/install-deps.sh installs it): a
  // missing binary fails here, it cannot be started.
  const CommandResult lint =
      RunCommand({AMPD_PROMTOOL, "check", "metrics"}, std::chrono::seconds(30), text);
  ASSERT_TRUE(lint.status.exited || lint.status.signaled()) << lint.err;
  EXPECT_TRUE(lint.status.exited && lint.status.code == 0)
      << "promtool (" << AMPD_PROMTOOL << ") rejected the exposition (" << lint.status.ToString()
      << "):\n"
      << lint.out << lint.err << "\n---\n"
      << text;
}

TEST(ServerMetricsPrivacyTest, WithoutTenantLabelsJobsArePseudonymsStableAndDistinct) {
  MetricsOptions options;
  options.tenant_labels = false;
  auto started = ServerMetrics::Start("127.0.0.1:0", options);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerMetrics& metrics = **started;
  metrics.OnJobCreated("job-alpha-7", "tenant-alice", Fp16Config());
  metrics.OnJobCreated("job-beta-9", "tenant-alice", Fp16Config());
  metrics.OnStep("job-alpha-7", NormalStep(1, 65536));
  metrics.OnStep("job-beta-9", NormalStep(1, 65536));
  absl::StatusOr<std::string> first = HttpGetBody(metrics.port(), "/metrics");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->find("job-alpha-7"), std::string::npos) << *first;
  EXPECT_EQ(first->find("job-beta-9"), std::string::npos) << *first;
  EXPECT_EQ(first->find("tenant"), std::string::npos) << *first;
  std::set<std::string> labels;
  for (const auto& [series, value] : ParseSamples(*first)) {
    if (series.rfind("ampd_loss_scale{", 0) != 0) continue;
    const size_t at = series.find("job=\"");
    ASSERT_NE(at, std::string::npos) << series;
    const std::string label = series.substr(at + 5, series.find('"', at + 5) - at - 5);
    EXPECT_EQ(label.size(), 17u) << label;
    EXPECT_EQ(label[0], 'j') << label;
    labels.insert(label);
  }
  EXPECT_EQ(labels.size(), 2u) << *first;
  // A later step of the same job lands on the same series.
  metrics.OnStep("job-alpha-7", NormalStep(2, 65536));
  absl::StatusOr<std::string> second = HttpGetBody(metrics.port(), "/metrics");
  ASSERT_TRUE(second.ok()) << second.status();
  size_t loss_scales = 0;
  for (const auto& [series, value] : ParseSamples(*second)) {
    if (series.rfind("ampd_loss_scale{", 0) == 0) {
      ++loss_scales;
      EXPECT_TRUE(labels.contains(series.substr(series.find("job=\"") + 5, 17))) << series;
    }
  }
  EXPECT_EQ(loss_scales, 2u);
}

TEST(ServerMetricsPrivacyTest, AScrapeWithoutTheTokenGets401AndNoSeries) {
  MetricsOptions options;
  options.exposer.bearer_token = "scrape-token";
  auto started = ServerMetrics::Start("127.0.0.1:0", options);
  ASSERT_TRUE(started.ok()) << started.status();
  (*started)->OnJobCreated("job-a", "", Fp16Config());
  absl::StatusOr<test_support::HttpResponse> refused =
      test_support::HttpGet((*started)->port(), "/metrics");
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->status, 401);
  EXPECT_NE(refused->headers.find("WWW-Authenticate: Bearer"), std::string::npos)
      << refused->headers;
  EXPECT_EQ(refused->body.find("ampd_"), std::string::npos) << refused->body;
}

TEST(ServerMetricsPrivacyTest, TlsFilesThatCannotBeLoadedAreNamed) {
  MetricsOptions half_options;
  half_options.exposer.tls_cert_file = "/nonexistent";
  auto half = ServerMetrics::Start("127.0.0.1:0", half_options);
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  MetricsOptions missing_options;
  missing_options.exposer.tls_cert_file = "/nonexistent.crt";
  missing_options.exposer.tls_key_file = "/nonexistent.key";
  auto missing = ServerMetrics::Start("127.0.0.1:0", missing_options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("/nonexistent.crt"), std::string::npos)
      << missing.status();
}

}  // namespace
}  // namespace ampd::metrics
