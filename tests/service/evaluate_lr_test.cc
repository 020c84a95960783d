// Evaluate and learning-rate schedules through the real `ampd` (--device=cpu
// on 127.0.0.1:0, a temporary --state-dir), over loopback TCP.
//
// Evaluate must report the loss the next Step on the same micro-batches
// reports (Step reports the loss before its update), and leave everything
// else exactly as it was: the exported state dict byte for byte, the step
// and applied counts, the loss scale and the scaler's counters. A schedule
// must give, step by step, what nanoGPT's get_lr gives for the count of
// updates applied before the step (transcribed below), with skipped steps
// not advancing it and a request's learning_rate overriding it for that step
// only, across a restart too.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/http_get.h"
#include "tests/support/nanogpt_lr.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::TempDir;

using test_support::NanoGptGetLr;

// The value of the sample `series` (name{labels}) in a Prometheus text
// exposition; nullopt when absent.
std::optional<double> Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      return std::strtod(std::string(line.substr(series.size() + 1)).c_str(), nullptr);
    }
  }
  return std::nullopt;
}

// A job on the synthetic task's model.
v1::CreateJobRequest JobRequest(v1::Precision precision, uint64_t seed = 3) {
  v1::CreateJobRequest request;
  v1::JobConfig* config = request.mutable_config();
  *config->mutable_model() = SyntheticTask(SyntheticTaskOptions{}).Model();
  config->set_seed(seed);
  config->set_precision(precision);
  config->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  config->mutable_optimizer()->set_lr(1e-2f);
  // A scale that overflows on the synthetic task's first fp16 steps, so
  // skipped steps and a moving scale are part of every fp16 run.
  if (precision == v1::PRECISION_FP16) config->mutable_scaler()->set_init_scale(65536);
  config->mutable_scaler()->set_growth_interval(2);
  return request;
}

class EvaluateLrTest : public ::testing::Test {
 protected:
  void SetUp() override { state_dir_ = (root_.path() / "state").string(); }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr)
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
  }

  void Start() {
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY,
                                            std::vector<std::string>{"--state-dir=" + state_dir_},
                                            state_dir_ + ".log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }

  // Batch `index` (0-based) of the synthetic task with `rows` rows.
  static v1::MicroBatch Batch(int index, int64_t rows = 16) {
    SyntheticTaskOptions options;
    options.batch_size = rows;
    options.seed = 11;
    SyntheticTask task(options);
    v1::MicroBatch batch;
    for (int i = 0; i <= index; ++i) batch = task.NextBatch();
    return batch;
  }

  absl::StatusOr<v1::StepResponse> Step(const std::string& job, int64_t sequence,
                                        const std::vector<v1::MicroBatch>& batches,
                                        std::optional<float> lr = std::nullopt) {
    v1::StepRequest request;
    request.set_job_id(job);
    request.set_sequence(sequence);
    for (const v1::MicroBatch& b : batches) *request.add_micro_batches() = b;
    if (lr.has_value()) request.set_learning_rate(*lr);
    return client_->Step(request);
  }

  absl::StatusOr<v1::EvaluateResponse> Evaluate(const std::string& job,
                                                const std::vector<v1::MicroBatch>& batches) {
    v1::EvaluateRequest request;
    request.set_job_id(job);
    for (const v1::MicroBatch& b : batches) *request.add_micro_batches() = b;
    return client_->Evaluate(request);
  }

  // Exactly the code and a message naming `field`, no retries.
  void ExpectRawEvaluateError(const v1::EvaluateRequest& request, grpc::StatusCode code,
                              const std::string& field) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::EvaluateResponse response;
    const grpc::Status s = client_->stub().Evaluate(&context, request, &response);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), field)) << s.error_message();
  }

  void ExpectCreateError(const v1::CreateJobRequest& request, const std::string& field) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::CreateJobResponse response;
    const grpc::Status s = client_->stub().CreateJob(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_TRUE(absl::StrContains(s.error_message(), field))
        << "does not name " << field << ": " << s.error_message();
  }

  TempDir root_{"ampd_evaluate_lr_test"};
  std::string state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

// Everything Evaluate must leave alone, as the outside sees it.
struct Observed {
  std::string state_dict;
  int64_t step = 0;
  int64_t applied_steps = 0;
  float loss_scale = 0;
  int64_t growth_tracker = 0;
  int64_t overflows_until_backoff = 0;
};

class EvaluatePrecisionTest : public EvaluateLrTest,
                              public ::testing::WithParamInterface<v1::Precision> {
 protected:
  Observed Observe(const std::string& job) {
    Observed o;
    absl::StatusOr<std::string> bytes = client_->GetStateDict(job);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    if (bytes.ok()) o.state_dict = *bytes;
    absl::StatusOr<v1::Job> got = client_->GetJob(job);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return o;
    o.step = got->step();
    o.applied_steps = got->applied_steps();
    o.loss_scale = got->loss_scale();
    o.growth_tracker = got->scaler_counters().growth_tracker();
    o.overflows_until_backoff = got->scaler_counters().overflows_until_backoff();
    return o;
  }

  static void ExpectUnchanged(const Observed& before, const Observed& after) {
    EXPECT_FALSE(before.state_dict.empty());
    EXPECT_TRUE(before.state_dict == after.state_dict) << "the exported state dict changed";
    EXPECT_EQ(before.step, after.step);
    EXPECT_EQ(before.applied_steps, after.applied_steps);
    EXPECT_EQ(before.loss_scale, after.loss_scale);
    EXPECT_EQ(before.growth_tracker, after.growth_tracker);
    EXPECT_EQ(before.overflows_until_backoff, after.overflows_until_backoff);
  }
};

TEST_P(EvaluatePrecisionTest, ReportsTheNextStepsLossAndChangesNothing) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(JobRequest(GetParam()));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();

  int64_t sequence = 0;
  bool saw_skip = false;
  for (int round = 0; round < 4; ++round) {
    // Two steps between evaluations, so that weights, optimizer moments and
    // (fp16) the scale have moved.
    for (int i = 0; i < 2; ++i) {
      ++sequence;
      absl::StatusOr<v1::StepResponse> r = Step(id, sequence, {Batch(static_cast<int>(sequence))});
      ASSERT_TRUE(r.ok()) << r.status();
      saw_skip = saw_skip || r->skipped();
    }
    SCOPED_TRACE(absl::StrCat("after step ", sequence));
    const Observed before = Observe(id);

    // One micro-batch, the same one again, a different row count, and two
    // micro-batches of different sizes: the workspaces Evaluate uses come
    // and go like a step's.
    const v1::MicroBatch next = Batch(100 + round);
    const std::vector<v1::MicroBatch> pair = {Batch(200 + round, 5), Batch(300 + round)};
    absl::StatusOr<v1::EvaluateResponse> single = Evaluate(id, {next});
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_EQ(single->samples(), 16);
    EXPECT_TRUE(std::isfinite(single->loss()));
    EXPECT_GE(single->seconds(), 0.0);
    absl::StatusOr<v1::EvaluateResponse> again = Evaluate(id, {next});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->loss(), single->loss());
    absl::StatusOr<v1::EvaluateResponse> small = Evaluate(id, {Batch(400 + round, 3)});
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_EQ(small->samples(), 3);
    absl::StatusOr<v1::EvaluateResponse> two = Evaluate(id, pair);
    ASSERT_TRUE(two.ok()) << two.status();
    EXPECT_EQ(two->samples(), 21);
    ExpectUnchanged(before, Observe(id));

    // The next Step on the same batch reports the same loss, to the bit.
    ++sequence;
    absl::StatusOr<v1::StepResponse> stepped = Step(id, sequence, {next});
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(stepped->loss(), single->loss());
    EXPECT_EQ(stepped->global_step(), sequence);
    saw_skip = saw_skip || stepped->skipped();

    // And with two micro-batches: their mean, as a step over both.
    const Observed mid = Observe(id);
    absl::StatusOr<v1::EvaluateResponse> both = Evaluate(id, pair);
    ASSERT_TRUE(both.ok()) << both.status();
    ExpectUnchanged(mid, Observe(id));
    ++sequence;
    stepped = Step(id, sequence, pair);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(stepped->loss(), both->loss());
  }
  if (GetParam() == v1::PRECISION_FP16) {
    EXPECT_TRUE(saw_skip) << "no fp16 step was skipped";
  }
  absl::StatusOr<v1::Job> last = client_->GetJob(id);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->step(), sequence);

  // The metrics count the evaluations per job.
  absl::StatusOr<std::string> text = test_support::HttpGetBody(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string job_label = absl::StrCat("{job=\"", id, "\"}");
  EXPECT_EQ(Sample(*text, "ampd_evaluations_total" + job_label), 20) << *text;
  EXPECT_EQ(Sample(*text, "ampd_evaluate_duration_seconds_count" + job_label), 20) << *text;
  EXPECT_EQ(Sample(*text, "ampd_steps_total" + job_label), sequence) << *text;
  EXPECT_EQ(Sample(*text, R"(ampd_rpc_requests_total{code="OK",method="Evaluate"})"), 20) << *text;
  const std::optional<double> eval_loss = Sample(*text, "ampd_eval_loss" + job_label);
  ASSERT_TRUE(eval_loss.has_value()) << *text;
}

INSTANTIATE_TEST_SUITE_P(Precisions, EvaluatePrecisionTest,
                         ::testing::Values(v1::PRECISION_FP16, v1::PRECISION_FP32,
                                           v1::PRECISION_BF16),
                         [](const ::testing::TestParamInfo<v1::Precision>& p) {
                           return v1::Precision_Name(p.param);
                         });

TEST_F(EvaluateLrTest, EvaluateRefusesBadInputAsStepDoes) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(JobRequest(v1::PRECISION_FP16));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();

  v1::EvaluateRequest none;
  none.set_job_id(id);
  ExpectRawEvaluateError(none, grpc::StatusCode::INVALID_ARGUMENT, "micro_batches");

  v1::EvaluateRequest unknown;
  unknown.set_job_id("job-nope");
  *unknown.add_micro_batches() = Batch(0);
  ExpectRawEvaluateError(unknown, grpc::StatusCode::NOT_FOUND, "job_id");

  v1::EvaluateRequest bytes;
  bytes.set_job_id(id);
  *bytes.add_micro_batches() = Batch(0);
  *bytes.add_micro_batches() = Batch(1);
  bytes.mutable_micro_batches(1)->mutable_targets()->mutable_data()->resize(10);
  ExpectRawEvaluateError(bytes, grpc::StatusCode::INVALID_ARGUMENT, "micro_batches[1].targets");

  v1::EvaluateRequest shape;
  shape.set_job_id(id);
  *shape.add_micro_batches() = Batch(0);
  {  // Consistent bytes, the wrong feature count for the model.
    v1::Tensor* t = shape.mutable_micro_batches(0)->mutable_inputs();
    t->set_shape(1, 8);
    t->set_shape(0, 32);
  }
  ExpectRawEvaluateError(shape, grpc::StatusCode::INVALID_ARGUMENT, "micro_batches[0].inputs");

  v1::EvaluateRequest rows;
  rows.set_job_id(id);
  *rows.add_micro_batches() = Batch(0, 16);
  *rows.mutable_micro_batches(0)->mutable_targets() = Batch(0, 8).targets();
  ExpectRawEvaluateError(rows, grpc::StatusCode::INVALID_ARGUMENT, "micro_batches[0].targets");

  // None of it touched the job; a deleted job is not found.
  absl::StatusOr<v1::Job> after = client_->GetJob(id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->step(), 0);
  ASSERT_TRUE(client_->DeleteJob(id).ok());
  v1::EvaluateRequest deleted;
  deleted.set_job_id(id);
  *deleted.add_micro_batches() = Batch(0);
  ExpectRawEvaluateError(deleted, grpc::StatusCode::NOT_FOUND, "job_id");
}

// ---- learning-rate schedules ----------------------------------------------------

constexpr float kLr = 1e-2f;
constexpr int64_t kWarmup = 3;
constexpr int64_t kDecay = 8;
constexpr float kMinLr = 5e-4f;

v1::CreateJobRequest CosineJob(v1::Precision precision) {
  v1::CreateJobRequest request = JobRequest(precision);
  v1::OptimizerConfig* o = request.mutable_config()->mutable_optimizer();
  o->set_lr(kLr);
  o->set_lr_schedule(v1::LR_SCHEDULE_WARMUP_COSINE);
  o->set_warmup_steps(kWarmup);
  o->set_decay_steps(kDecay);
  o->set_min_lr(kMinLr);
  // Past the first backoffs no further overflow: every boundary of the
  // schedule is reached within the test's steps.
  request.mutable_config()->mutable_scaler()->set_growth_interval(1000);
  return request;
}

float ExpectedLr(int64_t applied_before) {
  return static_cast<float>(NanoGptGetLr(applied_before, kLr, kWarmup, kDecay, kMinLr));
}

TEST_F(EvaluateLrTest, WarmupCosineFollowsNanoGptOverAppliedStepsAndSurvivesARestart) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(CosineJob(v1::PRECISION_FP16));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  EXPECT_EQ(job->config().optimizer().lr_schedule(), v1::LR_SCHEDULE_WARMUP_COSINE);
  EXPECT_EQ(job->config().optimizer().warmup_steps(), kWarmup);
  EXPECT_EQ(job->config().optimizer().decay_steps(), kDecay);
  EXPECT_EQ(job->config().optimizer().min_lr(), kMinLr);

  // The applied counts at which each boundary of get_lr was seen.
  std::vector<int64_t> seen;
  int64_t sequence = 0;
  int64_t skipped = 0;
  const auto run = [&](int64_t steps) {
    for (int64_t i = 0; i < steps; ++i) {
      ++sequence;
      absl::StatusOr<v1::StepResponse> r = Step(id, sequence, {Batch(static_cast<int>(sequence))});
      ASSERT_TRUE(r.ok()) << r.status();
      // The count of updates applied before this step.
      const int64_t before = r->applied_steps() - (r->skipped() ? 0 : 1);
      SCOPED_TRACE(absl::StrCat("step ", sequence, ", ", before, " applied before"));
      EXPECT_EQ(r->learning_rate(), ExpectedLr(before));
      skipped += r->skipped() ? 1 : 0;
      seen.push_back(before);
    }
  };
  run(6);
  // The fp16 scale overflows at first: those steps are skipped and the
  // schedule waits for them (step 2 still sees 0 applied updates).
  ASSERT_GT(skipped, 0);
  ASSERT_EQ(seen.size(), 6u);
  EXPECT_EQ(seen[0], 0);
  EXPECT_EQ(seen[1], 0) << "the first step was not skipped";

  // A step's own learning_rate overrides the schedule for that step only.
  ++sequence;
  absl::StatusOr<v1::StepResponse> overridden = Step(id, sequence, {Batch(500)}, 2e-3f);
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ(overridden->learning_rate(), 2e-3f);
  EXPECT_NE(ExpectedLr(overridden->applied_steps() - (overridden->skipped() ? 0 : 1)), 2e-3f);

  // A restart restores the schedule and where it stands.
  ASSERT_EQ(server_->Terminate(std::chrono::seconds(60)).code, 0) << server_->Describe();
  Start();
  absl::StatusOr<v1::Job> restored = client_->GetJob(id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), sequence);
  EXPECT_EQ(restored->config().optimizer().lr_schedule(), v1::LR_SCHEDULE_WARMUP_COSINE);
  EXPECT_EQ(restored->config().optimizer().decay_steps(), kDecay);
  EXPECT_EQ(restored->config().optimizer().min_lr(), kMinLr);
  run(kDecay + 6);
  // Every boundary of get_lr was crossed: 0, warmup - 1, warmup, the end of
  // the decay, and past it.
  for (int64_t a : {int64_t{0}, kWarmup - 1, kWarmup, kDecay, kDecay + 1, kDecay + 3}) {
    EXPECT_NE(std::find(seen.begin(), seen.end(), a), seen.end()) << "applied count " << a;
  }
  // The values at the boundaries, against get_lr itself.
  EXPECT_FLOAT_EQ(ExpectedLr(0), kLr / (kWarmup + 1));
  EXPECT_FLOAT_EQ(ExpectedLr(kWarmup), kLr);
  EXPECT_FLOAT_EQ(ExpectedLr(kDecay), kMinLr);
  EXPECT_FLOAT_EQ(ExpectedLr(kDecay + 1), kMinLr);

  // The per-job gauge shows the last step's lr (past the decay: min_lr).
  absl::StatusOr<std::string> text = test_support::HttpGetBody(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::optional<double> gauge =
      Sample(*text, absl::StrCat("ampd_learning_rate{job=\"", id, "\"}"));
  ASSERT_TRUE(gauge.has_value()) << *text;
  EXPECT_EQ(static_cast<float>(*gauge), kMinLr);
}

TEST_F(EvaluateLrTest, ConstantAndDefaultsFillTheEffectiveConfig) {
  Start();
  // Constant (the default): every step uses lr, the config is as before
  // schedules existed (no schedule fields set).
  absl::StatusOr<v1::Job> constant = client_->CreateJob(JobRequest(v1::PRECISION_FP32));
  ASSERT_TRUE(constant.ok()) << constant.status();
  EXPECT_EQ(constant->config().optimizer().lr_schedule(), v1::LR_SCHEDULE_UNSPECIFIED);
  EXPECT_FALSE(constant->config().optimizer().has_min_lr());
  for (int64_t s = 1; s <= 3; ++s) {
    absl::StatusOr<v1::StepResponse> r = Step(constant->job_id(), s, {Batch(static_cast<int>(s))});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->learning_rate(), 1e-2f);
  }
  // Warmup-cosine with only decay_steps: warmup 0 and min_lr lr / 10.
  v1::CreateJobRequest request = JobRequest(v1::PRECISION_FP32);
  request.mutable_config()->mutable_optimizer()->set_lr_schedule(v1::LR_SCHEDULE_WARMUP_COSINE);
  request.mutable_config()->mutable_optimizer()->set_decay_steps(10);
  absl::StatusOr<v1::Job> cosine = client_->CreateJob(request);
  ASSERT_TRUE(cosine.ok()) << cosine.status();
  EXPECT_EQ(cosine->config().optimizer().warmup_steps(), 0);
  EXPECT_EQ(cosine->config().optimizer().min_lr(), 1e-2f / 10.0f);
  absl::StatusOr<v1::StepResponse> first = Step(cosine->job_id(), 1, {Batch(1)});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->learning_rate(), 1e-2f);  // cos(0): the full lr, no warmup
  absl::StatusOr<v1::StepResponse> second = Step(cosine->job_id(), 2, {Batch(2)});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->learning_rate(),
            static_cast<float>(NanoGptGetLr(1, 1e-2f, 0, 10, 1e-2f / 10.0f)));
}

TEST_F(EvaluateLrTest, BadSchedulesAreRefusedNamingTheField) {
  Start();
  const auto with = [](auto edit) {
    v1::CreateJobRequest request = CosineJob(v1::PRECISION_FP32);
    edit(*request.mutable_config()->mutable_optimizer());
    return request;
  };
  using O = v1::OptimizerConfig;
  ExpectCreateError(with([](O& o) { o.set_decay_steps(kWarmup); }), "config.optimizer.decay_steps");
  ExpectCreateError(with([](O& o) { o.clear_decay_steps(); }), "config.optimizer.decay_steps");
  ExpectCreateError(with([](O& o) { o.set_warmup_steps(-1); }), "config.optimizer.warmup_steps");
  ExpectCreateError(with([](O& o) { o.set_min_lr(-1e-3f); }), "config.optimizer.min_lr");
  ExpectCreateError(with([](O& o) { o.set_min_lr(NAN); }), "config.optimizer.min_lr");
  ExpectCreateError(with([](O& o) { o.set_min_lr(INFINITY); }), "config.optimizer.min_lr");
  ExpectCreateError(with([](O& o) { o.set_lr(INFINITY); }), "config.optimizer.lr");
  ExpectCreateError(with([](O& o) { o.set_lr_schedule(static_cast<v1::LrSchedule>(7)); }),
                    "config.optimizer.lr_schedule");
  // The schedule's fields on the constant schedule, which reads none.
  ExpectCreateError(with([](O& o) { o.set_lr_schedule(v1::LR_SCHEDULE_CONSTANT); }),
                    "config.optimizer.warmup_steps");
  ExpectCreateError(with([](O& o) {
                      o.clear_lr_schedule();
                      o.clear_warmup_steps();
                      o.clear_decay_steps();
                    }),
                    "config.optimizer.min_lr");
  absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty());
}

}  // namespace
}  // namespace ampd
