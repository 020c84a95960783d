// ampd end to end: each test starts the real `ampd` binary on 127.0.0.1:0
// with --device=cpu and a temporary --state-dir (tests/support's
// AmpdProcess reads the bound port from its "listening on" line), and talks
// to it over loopback TCP with the generated stubs and ampd::Client. Every
// wait is on a condition with a bounded deadline (a pipe read, a health
// answer, a child's exit).
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "codec/safetensors.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"
#include "reflection_subset.grpc.pb.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using codec::DecodeSafetensors;
using codec::StateDict;

using test_support::AmpdProcess;
using test_support::ExitStatus;
using test_support::ReadFile;
using test_support::TempDir;

constexpr auto kExitDeadline = std::chrono::seconds(60);

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { state_dir_ = (root_.path() / "state").string(); }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr)
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    server_.reset();
    client_.reset();
  }

  // Starts (or, after a kill, restarts) ampd on the test's state directory;
  // a restart appends to the same log.
  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), "--state-dir=" + state_dir_);
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, state_dir_ + ".log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }

  static v1::CreateJobRequest JobRequest(uint64_t seed, const std::string& precision = "fp16") {
    SyntheticTaskOptions task_options;
    task_options.batch_size = 16;
    SyntheticTask task(task_options);
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    *config->mutable_model() = task.Model();
    config->set_seed(seed);
    config->set_display_name(absl::StrCat("test-", seed));
    config->set_precision(precision == "bf16"   ? v1::PRECISION_BF16
                          : precision == "fp32" ? v1::PRECISION_FP32
                                                : v1::PRECISION_FP16);
    config->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    config->mutable_optimizer()->set_lr(1e-2f);
    config->mutable_scaler()->set_init_scale(1024);
    config->mutable_scaler()->set_growth_interval(3);
    return request;
  }

  // A batch of the synthetic task (batch 16, seed-determined).
  static v1::MicroBatch Batch(uint64_t seed, int index) {
    SyntheticTaskOptions task_options;
    task_options.batch_size = 16;
    task_options.seed = seed;
    SyntheticTask task(task_options);
    v1::MicroBatch batch;
    for (int i = 0; i <= index; ++i) batch = task.NextBatch();
    return batch;
  }

  static v1::StepRequest StepRequest(const std::string& job_id, int64_t sequence, int batch = 0) {
    v1::StepRequest request;
    request.set_job_id(job_id);
    request.set_sequence(sequence);
    *request.add_micro_batches() = Batch(7, batch);
    return request;
  }

  std::string CreateJob(uint64_t seed, const std::string& precision = "fp16") {
    absl::StatusOr<v1::Job> job = client_->CreateJob(JobRequest(seed, precision));
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->job_id() : "";
  }

  // Raw unary call through the stub, for exact status checks (no retries).
  grpc::Status RawStep(const v1::StepRequest& request, v1::StepResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return client_->stub().Step(&context, request, response);
  }
  grpc::Status RawCreate(const v1::CreateJobRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::CreateJobResponse response;
    return client_->stub().CreateJob(&context, request, &response);
  }

  grpc::Status RawGetJob(const std::string& job_id, v1::Job* job = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobResponse response;
    grpc::Status s = client_->stub().GetJob(&context, request, &response);
    if (job != nullptr) *job = response.job();
    return s;
  }

  // One LoadStateDict stream driven by hand, so that tests can keep several
  // open at once.
  struct LoadStream {
    grpc::ClientContext context;
    v1::LoadStateDictResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::LoadStateDictRequest>> writer;
  };
  std::unique_ptr<LoadStream> OpenLoad() {
    auto stream = std::make_unique<LoadStream>();
    stream->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stream->writer = client_->stub().LoadStateDict(&stream->context, &stream->response);
    return stream;
  }

  // Polls the server's log until it contains `text` (a background
  // checkpoint's "checkpointed at step N" line) or the deadline passes.
  bool WaitForLog(const std::string& text) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!absl::StrContains(server_->Log(), text)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  bool CheckpointExists(const std::string& job_id) const {
    return std::filesystem::exists(std::filesystem::path(state_dir_) / (job_id + ".safetensors"));
  }

  StateDict ReadCheckpoint(const std::string& job_id) {
    absl::StatusOr<StateDict> state =
        DecodeSafetensors(ReadFile(std::filesystem::path(state_dir_) / (job_id + ".safetensors")));
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *std::move(state) : StateDict{};
  }

  TempDir root_{"ampd_service_test"};
  std::string state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

// The google.rpc.ErrorInfo of a failed call, read the way any gRPC client
// reads it: the google.rpc.Status in the trailer grpc-status-details-bin
// (grpc::Status::error_details()), holding exactly one ErrorInfo in domain
// "ampd" whose code and message match the status's.
google::rpc::ErrorInfo DetailsOf(const grpc::Status& status) {
  google::rpc::ErrorInfo info;
  google::rpc::Status details;
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(details.ParseFromString(status.error_details()))
      << "no google.rpc.Status in the details of: " << status.error_message();
  EXPECT_EQ(details.code(), static_cast<int>(status.error_code()));
  EXPECT_EQ(details.message(), status.error_message());
  EXPECT_EQ(details.details_size(), 1) << status.error_message();
  if (details.details_size() >= 1) {
    EXPECT_TRUE(details.details(0).UnpackTo(&info));
  }
  EXPECT_EQ(info.domain(), "ampd");
  return info;
}

// metadata[key], "<absent>" when the key is missing (Map::at would abort).
std::string Meta(const google::rpc::ErrorInfo& info, const std::string& key) {
  auto it = info.metadata().find(key);
  return it == info.metadata().end() ? "<absent>" : it->second;
}

void ExpectSameTensors(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].tensor.shape, b.tensors[i].tensor.shape) << a.tensors[i].name;
    EXPECT_TRUE(a.tensors[i].tensor.data == b.tensors[i].tensor.data) << a.tensors[i].name;
  }
  for (const auto& [key, value] : a.metadata) {
    if (!absl::StartsWith(key, "scaler.") && !absl::StartsWith(key, "optimizer.")) continue;
    auto it = b.metadata.find(key);
    ASSERT_NE(it, b.metadata.end()) << key;
    EXPECT_EQ(it->second, value) << key;
  }
}

TEST_F(ServiceTest, JobLifecycle) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(JobRequest(1));
  ASSERT_TRUE(job.ok()) << job.status();
  // The effective config has the defaults filled in.
  EXPECT_EQ(job->config().scaler().policy(), v1::SCALER_POLICY_PYTORCH);
  EXPECT_EQ(job->config().scaler().init_scale(), 1024);
  EXPECT_EQ(job->config().scaler().growth_factor(), 2.0);
  EXPECT_EQ(job->config().scaler().backoff_factor(), 0.5);
  EXPECT_EQ(job->config().optimizer().beta2(), 0.999f);
  EXPECT_EQ(job->step(), 0);
  EXPECT_GT(job->parameter_count(), 0);

  std::vector<std::string> ids = {job->job_id(), CreateJob(2), CreateJob(3)};
  // Paging: two pages of two and one, together every job once.
  absl::StatusOr<v1::ListJobsResponse> page1 = client_->ListJobs(2, "");
  ASSERT_TRUE(page1.ok()) << page1.status();
  ASSERT_EQ(page1->jobs_size(), 2);
  ASSERT_FALSE(page1->next_page_token().empty());
  absl::StatusOr<v1::ListJobsResponse> page2 = client_->ListJobs(2, page1->next_page_token());
  ASSERT_TRUE(page2.ok()) << page2.status();
  ASSERT_EQ(page2->jobs_size(), 1);
  EXPECT_TRUE(page2->next_page_token().empty());
  std::vector<std::string> listed;
  for (const auto& j : page1->jobs()) listed.push_back(j.job_id());
  for (const auto& j : page2->jobs()) listed.push_back(j.job_id());
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(listed, ids);

  for (int64_t s = 1; s <= 3; ++s) {
    absl::StatusOr<v1::StepResponse> r =
        client_->Step(StepRequest(job->job_id(), s, static_cast<int>(s)));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->global_step(), s);
    EXPECT_TRUE(std::isfinite(r->loss()));
    EXPECT_EQ(r->scale_before(), s == 1 ? 1024.0f : r->scale_before());
  }
  absl::StatusOr<v1::Job> got = client_->GetJob(job->job_id());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->step(), 3);
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(state_dir_) /
                                      (job->job_id() + ".safetensors")));

  ASSERT_TRUE(client_->DeleteJob(job->job_id()).ok());
  EXPECT_EQ(client_->GetJob(job->job_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteJob(job->job_id()).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(state_dir_) /
                                       (job->job_id() + ".safetensors")));
  absl::StatusOr<std::vector<v1::Job>> all = client_->ListAllJobs();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 2u);
}

TEST_F(ServiceTest, CreateWithSameRequestIdReturnsSameJob) {
  Start();
  v1::CreateJobRequest request = JobRequest(1);
  request.set_request_id("create-once");
  absl::StatusOr<v1::Job> a = client_->CreateJob(request);
  absl::StatusOr<v1::Job> b = client_->CreateJob(request);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->job_id(), b->job_id());
  absl::StatusOr<std::vector<v1::Job>> all = client_->ListAllJobs();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

TEST_F(ServiceTest, Bf16DefaultsToStaticScaleOne) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob([] {
    v1::CreateJobRequest r = JobRequest(1, "bf16");
    r.mutable_config()->clear_scaler();
    return r;
  }());
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->config().scaler().init_scale(), 1.0);
  EXPECT_FALSE(job->config().scaler().dynamic());
  EXPECT_TRUE(job->config().scaler().enabled());
}

TEST_F(ServiceTest, StepIsExactlyOnce) {
  Start();
  const std::string id = CreateJob(1);
  v1::StepResponse first, again;
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &first).ok());
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &again).ok());
  EXPECT_EQ(first.SerializeAsString(), again.SerializeAsString());
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->step(), 1);
  EXPECT_EQ(job->applied_steps(), first.applied_steps());

  v1::StepResponse response;
  grpc::Status skip = RawStep(StepRequest(id, 3), &response);
  EXPECT_EQ(skip.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(skip.error_message(), "sequence")) << skip.error_message();
  EXPECT_TRUE(absl::StrContains(skip.error_message(), "expected 2")) << skip.error_message();
  grpc::Status zero = RawStep(StepRequest(id, 0), &response);
  EXPECT_EQ(zero.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(RawStep(StepRequest(id, 2), &response).ok());
  EXPECT_EQ(response.global_step(), 2);
}

TEST_F(ServiceTest, BadInputIsAnsweredWithTheField) {
  Start({"--max-receive-message-bytes=200000", "--max-jobs=3"});
  const std::string id = CreateJob(1);
  v1::StepResponse response;

  grpc::Status s = RawStep(StepRequest("job-nope", 1), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "job_id")) << s.error_message();

  v1::StepRequest bytes = StepRequest(id, 1);
  bytes.mutable_micro_batches(0)->mutable_inputs()->mutable_data()->resize(10);
  s = RawStep(bytes, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "micro_batches[0].inputs")) << s.error_message();

  v1::StepRequest shape = StepRequest(id, 1);
  {  // Consistent bytes, wrong feature count for the model: the Trainer's check.
    v1::Tensor* t = shape.mutable_micro_batches(0)->mutable_inputs();
    t->set_shape(1, 8);
    t->set_shape(0, 32);
  }
  s = RawStep(shape, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "micro_batches[0]")) << s.error_message();

  v1::StepRequest dtype = StepRequest(id, 1);
  dtype.mutable_micro_batches(0)->mutable_targets()->set_dtype(v1::DTYPE_UNSPECIFIED);
  s = RawStep(dtype, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "micro_batches[0].targets.dtype"));

  v1::StepRequest empty = StepRequest(id, 1);
  empty.clear_micro_batches();
  s = RawStep(empty, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "micro_batches"));

  v1::StepRequest lr = StepRequest(id, 1);
  lr.set_learning_rate(std::numeric_limits<float>::quiet_NaN());
  s = RawStep(lr, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "learning_rate"));

  // Oversize: gRPC itself refuses it.
  v1::StepRequest big = StepRequest(id, 1);
  {
    v1::Tensor* t = big.mutable_micro_batches(0)->mutable_inputs();
    t->set_shape(0, 4096);
    t->mutable_data()->assign(4096 * 16 * 4, '\0');
  }
  s = RawStep(big, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();

  // Config errors name the request field.
  v1::CreateJobRequest nan_lr = JobRequest(2);
  nan_lr.mutable_config()->mutable_optimizer()->set_lr(std::numeric_limits<float>::quiet_NaN());
  s = RawCreate(nan_lr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "config.optimizer.lr")) << s.error_message();

  v1::CreateJobRequest growth = JobRequest(2);
  growth.mutable_config()->mutable_scaler()->set_growth_factor(0.5);
  s = RawCreate(growth);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "scaler.growth_factor")) << s.error_message();

  v1::CreateJobRequest beta = JobRequest(2);
  beta.mutable_config()->mutable_optimizer()->set_beta1(1.5f);
  s = RawCreate(beta);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "beta1")) << s.error_message();

  v1::CreateJobRequest chain = JobRequest(2);
  chain.mutable_config()->mutable_model()->mutable_layers(2)->mutable_linear()->set_in_features(7);
  s = RawCreate(chain);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "config.model.layers[2]")) << s.error_message();

  // Non-finite values inside a batch are not an error: the step is skipped.
  v1::StepRequest inf = StepRequest(id, 1);
  {
    std::string* data = inf.mutable_micro_batches(0)->mutable_targets()->mutable_data();
    const float big_value = std::numeric_limits<float>::infinity();
    std::memcpy(data->data(), &big_value, sizeof(float));
  }
  ASSERT_TRUE(RawStep(inf, &response).ok());
  EXPECT_TRUE(response.found_inf());
  EXPECT_TRUE(response.skipped());
  EXPECT_EQ(response.applied_steps(), 0);

  // Too many jobs.
  CreateJob(3);
  CreateJob(4);
  s = RawCreate(JobRequest(5));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "max-jobs")) << s.error_message();

  // The job that saw all of this still trains.
  ASSERT_TRUE(RawStep(StepRequest(id, 2), &response).ok());
}

TEST_F(ServiceTest, MemoryLimitRefusesLargeJobs) {
  Start({"--max-memory-bytes=100000"});
  v1::CreateJobRequest request = JobRequest(1);
  v1::Linear* l = request.mutable_config()->mutable_model()->mutable_layers(0)->mutable_linear();
  l->set_out_features(4096);
  request.mutable_config()->mutable_model()->mutable_layers(2)->mutable_linear()->set_in_features(
      4096);
  grpc::Status s = RawCreate(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "config.model")) << s.error_message();
  EXPECT_TRUE(RawCreate(JobRequest(2)).ok());
}

TEST_F(ServiceTest, RacingRetriesTrainOnceAndJobsRunInParallel) {
  Start();
  const std::string a = CreateJob(1);
  const std::string b = CreateJob(2);
  constexpr int kThreads = 6;
  std::vector<v1::StepResponse> responses(kThreads);
  std::vector<grpc::Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { statuses[i] = RawStep(StepRequest(a, 1), &responses[i]); });
  }
  // Meanwhile job b runs its own sequence.
  std::thread other([&] {
    for (int64_t s = 1; s <= 4; ++s) {
      v1::StepResponse r;
      EXPECT_TRUE(RawStep(StepRequest(b, s, static_cast<int>(s)), &r).ok());
    }
  });
  for (std::thread& t : threads) t.join();
  other.join();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(responses[i].SerializeAsString(), responses[0].SerializeAsString());
  }
  absl::StatusOr<v1::Job> ja = client_->GetJob(a);
  absl::StatusOr<v1::Job> jb = client_->GetJob(b);
  ASSERT_TRUE(ja.ok() && jb.ok());
  EXPECT_EQ(ja->step(), 1);
  EXPECT_EQ(jb->step(), 4);
}

TEST_F(ServiceTest, StateDictRoundTrip) {
  Start();
  const std::string a = CreateJob(1);
  for (int64_t s = 1; s <= 3; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(a, s, static_cast<int>(s))).ok());
  absl::StatusOr<std::string> bytes = client_->GetStateDict(a);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<StateDict> decoded = DecodeSafetensors(*bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_NE(decoded->Find("model.0.weight"), nullptr);

  const std::string b = CreateJob(99);  // different initial weights
  absl::StatusOr<v1::LoadStateDictResponse> loaded = client_->LoadStateDict(b, *bytes);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->bytes(), static_cast<int64_t>(bytes->size()));
  absl::StatusOr<std::string> b_bytes = client_->GetStateDict(b);
  ASSERT_TRUE(b_bytes.ok());
  absl::StatusOr<StateDict> b_decoded = DecodeSafetensors(*b_bytes);
  ASSERT_TRUE(b_decoded.ok());
  ExpectSameTensors(*decoded, *b_decoded);

  absl::StatusOr<v1::StepResponse> next_a = client_->Step(StepRequest(a, 4, 9));
  absl::StatusOr<v1::StepResponse> next_b = client_->Step(StepRequest(b, 1, 9));
  ASSERT_TRUE(next_a.ok() && next_b.ok());
  EXPECT_EQ(next_a->loss(), next_b->loss());
  EXPECT_EQ(next_a->scale_before(), next_b->scale_before());

  // A corrupt file is refused and the job is untouched.
  absl::StatusOr<v1::LoadStateDictResponse> bad = client_->LoadStateDict(b, "not safetensors");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->LoadStateDict("job-nope", *bytes).status().code(),
            absl::StatusCode::kNotFound);
}

// With --checkpoint-sync a periodic checkpoint is on disk before its step
// is answered: a SIGKILL right after the response loses nothing checkpointed.
TEST_F(ServiceTest, RestartAfterSigkillRestoresTheCheckpoint) {
  Start({"--checkpoint-every=2", "--checkpoint-sync"});
  const std::string id = CreateJob(1);
  for (int64_t s = 1; s <= 5; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(id, s, static_cast<int>(s))).ok());
  server_->Signal(SIGKILL);
  const ExitStatus killed = server_->Wait(kExitDeadline);
  EXPECT_EQ(killed.code, -1);
  EXPECT_TRUE(killed.signaled());

  const StateDict saved = ReadCheckpoint(id);
  ASSERT_EQ(saved.metadata.at("ampd.step"), "4");
  EXPECT_TRUE(saved.metadata.contains("ampd.config"));
  EXPECT_FALSE(saved.metadata.contains("ampd.create_request"));

  Start({"--checkpoint-every=2", "--checkpoint-sync"});
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 4);
  EXPECT_EQ(job->config().scaler().growth_interval(), 3);
  absl::StatusOr<std::string> bytes = client_->GetStateDict(id);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<StateDict> restored = DecodeSafetensors(*bytes);
  ASSERT_TRUE(restored.ok());
  ExpectSameTensors(saved, *restored);

  // The sequence continues from the checkpoint; the last checkpointed step's
  // response was recorded with it.
  v1::StepResponse response;
  grpc::Status wrong = RawStep(StepRequest(id, 6, 6), &response);
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(wrong.error_message(), "expected 5")) << wrong.error_message();
  ASSERT_TRUE(RawStep(StepRequest(id, 4, 4), &response).ok());
  EXPECT_EQ(response.global_step(), 4);
  ASSERT_TRUE(RawStep(StepRequest(id, 5, 5), &response).ok());
  EXPECT_EQ(response.global_step(), 5);
  EXPECT_TRUE(absl::StrContains(server_->Log(), "restored at step 4"));
}

// ForwardBackward calls then OptimStep over the wire train as one Step (the
// model's mean loss, divided by micro_batches_in_update); a SIGKILL between
// calls loses only the accumulated gradients, and the next call and the
// OptimStep say how many calls to resend.
TEST_F(ServiceTest, AccumulatedCallsEqualAStepAndASigkillNamesTheCallsToResend) {
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  const std::string fused = CreateJob(3);
  const std::string split = CreateJob(3);
  v1::StepRequest step = StepRequest(fused, 1, 0);
  *step.add_micro_batches() = Batch(7, 1);
  absl::StatusOr<v1::StepResponse> a = client_->Step(step);
  ASSERT_TRUE(a.ok()) << a.status();
  auto call = [&](int64_t sequence, int64_t index, int batch) {
    v1::ForwardBackwardRequest request;
    request.set_job_id(split);
    request.set_sequence(sequence);
    request.set_index(index);
    request.set_micro_batches_in_update(2);
    *request.add_micro_batches() = Batch(7, batch);
    return request;
  };
  auto raw = [&](const auto& request, auto* response, auto method) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return (client_->stub().*method)(&context, request, response);
  };
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::ForwardBackwardResponse> r = client_->ForwardBackward(call(1, i + 1, i));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->pending(), i + 1);
    EXPECT_EQ(r->loss_scale(), a->scale_before());
  }
  v1::OptimStepRequest optim;
  optim.set_job_id(split);
  optim.set_sequence(1);
  optim.set_forward_backward_calls(2);
  absl::StatusOr<v1::StepResponse> b = client_->OptimStep(optim);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->loss(), a->loss());
  EXPECT_EQ(b->scale_after(), a->scale_after());
  absl::StatusOr<std::string> fused_bytes = client_->GetStateDict(fused);
  absl::StatusOr<std::string> split_bytes = client_->GetStateDict(split);
  ASSERT_TRUE(fused_bytes.ok() && split_bytes.ok());
  absl::StatusOr<StateDict> applied = DecodeSafetensors(*split_bytes);
  ASSERT_TRUE(applied.ok());
  ExpectSameTensors(*DecodeSafetensors(*fused_bytes), *applied);

  ASSERT_TRUE(client_->ForwardBackward(call(2, 1, 2)).ok());
  server_->Signal(SIGKILL);
  (void)server_->Wait(kExitDeadline);
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  v1::ForwardBackwardResponse fb_response;
  grpc::Status lost = raw(call(2, 2, 3), &fb_response, &v1::Trainer::Stub::ForwardBackward);
  EXPECT_EQ(lost.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << lost.error_message();
  google::rpc::ErrorInfo info = DetailsOf(lost);
  EXPECT_EQ(info.reason(), "ACCUMULATION_LOST");
  EXPECT_EQ(Meta(info, "pending_lost"), "1");
  EXPECT_EQ(Meta(info, "expected_index"), "1");
  optim.set_sequence(2);
  v1::StepResponse optim_response;
  lost = raw(optim, &optim_response, &v1::Trainer::Stub::OptimStep);
  info = DetailsOf(lost);
  EXPECT_EQ(info.reason(), "ACCUMULATION_LOST");
  EXPECT_EQ(Meta(info, "pending_lost"), "2");
  // The applied update survived; nothing of the lost calls was applied.
  absl::StatusOr<std::string> restored = client_->GetStateDict(split);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectSameTensors(*applied, *DecodeSafetensors(*restored));
  absl::StatusOr<v1::Job> job = client_->GetJob(split);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->step(), 1);
  EXPECT_EQ(job->applied_steps(), 1);
}

TEST_F(ServiceTest, EveryErrorCarriesAnErrorInfoWithAStableReason) {
  Start({"--max-jobs=1"});
  const std::string id = CreateJob(1);
  v1::StepResponse response;
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &response).ok());

  grpc::Status s = RawStep(StepRequest(id, 5), &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  google::rpc::ErrorInfo info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "SEQUENCE_MISMATCH");
  EXPECT_EQ(Meta(info, "expected_sequence"), "2");

  s = RawStep(StepRequest("job-nope", 1), &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "JOB_NOT_FOUND");
  EXPECT_EQ(Meta(info, "job_id"), "job-nope");
  EXPECT_EQ(DetailsOf(RawGetJob("job-nope")).reason(), "JOB_NOT_FOUND");

  v1::CreateJobRequest nan_lr = JobRequest(2);
  nan_lr.mutable_config()->mutable_optimizer()->set_lr(std::numeric_limits<float>::quiet_NaN());
  s = RawCreate(nan_lr);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_EQ(Meta(info, "field"), "config.optimizer.lr");

  // An engine validation error names its field too.
  v1::CreateJobRequest beta = JobRequest(2);
  beta.mutable_config()->mutable_optimizer()->set_beta1(1.5f);
  info = DetailsOf(RawCreate(beta));
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_TRUE(absl::StrContains(Meta(info, "field"), "beta1")) << info.DebugString();

  v1::StepRequest bytes = StepRequest(id, 2);
  bytes.mutable_micro_batches(0)->mutable_inputs()->mutable_data()->resize(10);
  info = DetailsOf(RawStep(bytes, &response));
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_EQ(Meta(info, "field"), "micro_batches[0].inputs.data");

  // A step's own checks answer before its job and its sequence are looked
  // at: the sequence 9 and the unknown job go unmentioned.
  v1::StepRequest empty = StepRequest(id, 9);
  empty.clear_micro_batches();
  s = RawStep(empty, &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "micro_batches: at least one micro-batch is required");
  info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_EQ(Meta(info, "field"), "micro_batches");
  v1::StepRequest lr = StepRequest("job-nope", 1);
  lr.set_learning_rate(-1.0f);
  s = RawStep(lr, &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "learning_rate: must be finite and >= 0, got -1");
  info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_EQ(Meta(info, "field"), "learning_rate");

  s = RawCreate(JobRequest(3));
  ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "JOB_LIMIT");
  EXPECT_EQ(Meta(info, "max_jobs"), "1");

  absl::StatusOr<v1::LoadStateDictResponse> bad = client_->LoadStateDict(id, "not safetensors");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(ErrorInfoOf(bad.status()).has_value());
  EXPECT_EQ(ErrorInfoOf(bad.status())->reason(), "INVALID_STATE_DICT");

  // ampd::Client keeps the ErrorInfo on the absl::Status and prints it.
  absl::StatusOr<v1::StepResponse> wrong = client_->Step(StepRequest(id, 7));
  ASSERT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  std::optional<google::rpc::ErrorInfo> kept = ErrorInfoOf(wrong.status());
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->reason(), "SEQUENCE_MISMATCH");
  EXPECT_EQ(Meta(*kept, "expected_sequence"), "2");
  EXPECT_TRUE(absl::StartsWith(DescribeError(wrong.status()),
                               "FAILED_PRECONDITION [SEQUENCE_MISMATCH expected_sequence=2]: "))
      << DescribeError(wrong.status());
}

TEST_F(ServiceTest, GetJobReportsTheLastAppliedGradNorm) {
  Start();
  v1::CreateJobRequest request = JobRequest(1, "fp32");  // no overflow: the step applies
  request.mutable_config()->mutable_optimizer()->set_max_grad_norm(1e6f);  // computed, no clip
  absl::StatusOr<v1::Job> created = client_->CreateJob(request);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_FALSE(created->has_grad_norm());
  v1::StepResponse response;
  ASSERT_TRUE(RawStep(StepRequest(created->job_id(), 1), &response).ok());
  ASSERT_FALSE(response.skipped());
  ASSERT_TRUE(response.has_grad_norm());
  v1::Job job;
  ASSERT_TRUE(RawGetJob(created->job_id(), &job).ok());
  ASSERT_TRUE(job.has_grad_norm());
  EXPECT_EQ(job.grad_norm(), response.grad_norm());
}

// The scaler's counters travel with every step and GetJob: a deepspeed job
// with hysteresis 2 absorbs one overflow (2 -> 1 until backoff) without
// backing off, and counts clean steps toward its window.
TEST_F(ServiceTest, StepsAndGetJobReportTheScalerCounters) {
  Start();
  v1::CreateJobRequest request = JobRequest(1);
  v1::ScalerConfig* scaler = request.mutable_config()->mutable_scaler();
  scaler->set_policy(v1::SCALER_POLICY_DEEPSPEED);
  scaler->set_init_scale(1);
  scaler->set_min_scale(1.0 / 1024);
  scaler->set_hysteresis(2);
  absl::StatusOr<v1::Job> created = client_->CreateJob(request);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->job_id();
  EXPECT_EQ(created->scaler_counters().growth_tracker(), 0);
  EXPECT_EQ(created->scaler_counters().overflows_until_backoff(), 2);
  v1::StepResponse response;
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &response).ok());
  ASSERT_FALSE(response.skipped());
  EXPECT_EQ(response.scaler_counters().growth_tracker(), 1);
  EXPECT_EQ(response.scaler_counters().overflows_until_backoff(), 2);
  v1::StepRequest overflow = StepRequest(id, 2);
  {
    std::string* data = overflow.mutable_micro_batches(0)->mutable_targets()->mutable_data();
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(data->data(), &inf, sizeof(float));
  }
  ASSERT_TRUE(RawStep(overflow, &response).ok());
  ASSERT_TRUE(response.skipped());
  EXPECT_FALSE(response.scale_backed_off());
  EXPECT_EQ(response.scaler_counters().growth_tracker(), 0);
  EXPECT_EQ(response.scaler_counters().overflows_until_backoff(), 1);
  v1::Job job;
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.scaler_counters().growth_tracker(), 0);
  EXPECT_EQ(job.scaler_counters().overflows_until_backoff(), 1);
}

// A deepspeed scaler that overflows at its minimum scale stops the job: the
// step says SCALER_AT_MIN_SCALE, GetJob shows FAILED (across a restart), a
// finite step with the same sequence is refused with JOB_FAILED, and loading
// a good state dict makes the job train again.
// By default a periodic checkpoint is written in the background: once its
// "checkpointed" line is logged it is on disk, and a SIGKILL then restores
// exactly the state of that step.
TEST_F(ServiceTest, BackgroundCheckpointSurvivesSigkillOnceWritten) {
  Start({"--checkpoint-every=2"});
  const std::string id = CreateJob(1);
  for (int64_t s = 1; s <= 4; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(id, s, static_cast<int>(s))).ok());
  absl::StatusOr<std::string> at_four = client_->GetStateDict(id);
  ASSERT_TRUE(at_four.ok()) << at_four.status();
  ASSERT_TRUE(client_->Step(StepRequest(id, 5, 5)).ok());
  ASSERT_TRUE(WaitForLog(absl::StrCat("job ", id, " checkpointed at step 4"))) << server_->Log();
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);

  EXPECT_EQ(ReadCheckpoint(id).metadata.at("ampd.step"), "4");
  Start({"--checkpoint-every=2"});
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 4);
  absl::StatusOr<std::string> restored = client_->GetStateDict(id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(*restored == *at_four) << "the restored state differs from step 4's";
}

// SIGTERM right after a burst of steps, each queuing a background write:
// the final checkpoint is the last step's, whatever the writer still held.
TEST_F(ServiceTest, SigtermAfterBackgroundWritesCheckpointsTheLastStep) {
  Start({"--checkpoint-every=1"});
  const std::string id = CreateJob(1);
  for (int64_t s = 1; s <= 6; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(id, s, static_cast<int>(s))).ok());
  absl::StatusOr<std::string> last = client_->GetStateDict(id);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  EXPECT_EQ(ReadCheckpoint(id).metadata.at("ampd.step"), "6");

  Start({"--checkpoint-every=1"});
  absl::StatusOr<std::string> restored = client_->GetStateDict(id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(*restored == *last);
}

// A job deleted while its background write is queued or running leaves no
// file behind, even after the server has drained its writer and exited.
TEST_F(ServiceTest, DeleteWhileACheckpointIsPendingLeavesNoFile) {
  Start({"--checkpoint-every=1"});
  std::vector<std::string> deleted;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const std::string id = CreateJob(seed);
    ASSERT_TRUE(client_->Step(StepRequest(id, 1)).ok());
    ASSERT_TRUE(client_->Step(StepRequest(id, 2)).ok());
    ASSERT_TRUE(client_->DeleteJob(id).ok());
    EXPECT_FALSE(CheckpointExists(id)) << id;
    deleted.push_back(id);
  }
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  for (const std::string& id : deleted) EXPECT_FALSE(CheckpointExists(id)) << id;
  Start({"--checkpoint-every=1"});
  absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_TRUE(jobs->empty());
}

// A restart restores several jobs at once (in parallel on the workers):
// every one comes back bitwise, at its own step.
TEST_F(ServiceTest, ParallelRestoreRestoresEveryJobBitwise) {
  Start({"--checkpoint-every=0", "--worker-threads=4"});
  std::vector<std::string> ids;
  std::vector<std::string> states;
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const std::string id = CreateJob(seed);
    for (int64_t s = 1; s <= static_cast<int64_t>(seed); ++s)
      ASSERT_TRUE(client_->Step(StepRequest(id, s, static_cast<int>(s))).ok());
    absl::StatusOr<std::string> state = client_->GetStateDict(id);
    ASSERT_TRUE(state.ok()) << state.status();
    ids.push_back(id);
    states.push_back(*std::move(state));
  }
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();

  Start({"--checkpoint-every=0", "--worker-threads=4"});
  for (size_t i = 0; i < ids.size(); ++i) {
    absl::StatusOr<v1::Job> job = client_->GetJob(ids[i]);
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->step(), static_cast<int64_t>(i + 1));
    absl::StatusOr<std::string> restored = client_->GetStateDict(ids[i]);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_TRUE(*restored == states[i]) << ids[i];
  }
}

TEST_F(ServiceTest, ScalerAtItsMinimumFailsTheJobUntilAStateIsLoaded) {
  Start();
  v1::CreateJobRequest request = JobRequest(1);
  v1::ScalerConfig* scaler = request.mutable_config()->mutable_scaler();
  scaler->set_policy(v1::SCALER_POLICY_DEEPSPEED);
  scaler->set_init_scale(1);
  scaler->set_min_scale(1);
  scaler->set_hysteresis(1);
  scaler->set_raise_at_min_scale(true);
  absl::StatusOr<v1::Job> created = client_->CreateJob(request);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->job_id();
  v1::StepResponse response;
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &response).ok());
  absl::StatusOr<std::string> good = client_->GetStateDict(id);
  ASSERT_TRUE(good.ok()) << good.status();
  v1::Job job;
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_ACTIVE);

  v1::StepRequest overflow = StepRequest(id, 2);
  {
    std::string* data = overflow.mutable_micro_batches(0)->mutable_targets()->mutable_data();
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(data->data(), &inf, sizeof(float));
  }
  grpc::Status s = RawStep(overflow, &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_EQ(DetailsOf(s).reason(), "SCALER_AT_MIN_SCALE");
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.failure(), "minimum loss scale")) << job.failure();
  EXPECT_EQ(job.step(), 1);

  s = RawStep(StepRequest(id, 2), &response);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(DetailsOf(s).reason(), "JOB_FAILED");

  // The failure is in the checkpoint: a crash does not bring the job back.
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);
  Start();
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  s = RawStep(StepRequest(id, 2), &response);
  EXPECT_EQ(DetailsOf(s).reason(), "JOB_FAILED");

  absl::StatusOr<v1::LoadStateDictResponse> loaded = client_->LoadStateDict(id, *good);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_ACTIVE);
  EXPECT_TRUE(job.failure().empty());
  ASSERT_TRUE(RawStep(StepRequest(id, 2), &response).ok());
  EXPECT_EQ(response.global_step(), 2);
}

// Infinite inputs until the loss scale can go no lower (the issue's
// reproduction: pytorch from its init scale, adaptive from its calibrated
// one, and a state loaded with a scale of 1e-45): each job fails visibly
// with SCALER_AT_MIN_SCALE instead of skipping forever, and after a SIGTERM
// and a restart it is still listed, failed, and refuses steps with
// JOB_FAILED; a good state brings it back.
TEST_F(ServiceTest, ScaleUnderflowFailsTheJobAndARestartKeepsItListed) {
  Start();
  const float inf = std::numeric_limits<float>::infinity();
  auto overflowing = [&](const std::string& id, int64_t sequence) {
    v1::StepRequest request = StepRequest(id, sequence);
    std::string* data = request.mutable_micro_batches(0)->mutable_targets()->mutable_data();
    std::memcpy(data->data(), &inf, sizeof(float));
    return request;
  };
  // Steps until the scaler gives up; the last sequence applied.
  auto overflow_until_failed = [&](const std::string& id, int64_t first) -> int64_t {
    v1::StepResponse response;
    for (int64_t seq = first; seq < first + 400; ++seq) {
      grpc::Status s = RawStep(overflowing(id, seq), &response);
      if (s.ok()) {
        EXPECT_TRUE(response.skipped());
        EXPECT_GT(response.scale_after(), 0.0f);
        continue;
      }
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
      EXPECT_EQ(DetailsOf(s).reason(), "SCALER_AT_MIN_SCALE") << s.error_message();
      return seq - 1;
    }
    ADD_FAILURE() << "job " << id << " never failed";
    return 0;
  };
  v1::CreateJobRequest pytorch = JobRequest(1);
  pytorch.mutable_config()->mutable_scaler()->set_policy(v1::SCALER_POLICY_PYTORCH);
  v1::CreateJobRequest adaptive = JobRequest(2);
  adaptive.mutable_config()->mutable_scaler()->set_policy(v1::SCALER_POLICY_ADAPTIVE);
  adaptive.mutable_config()->mutable_scaler()->clear_init_scale();
  std::vector<std::string> ids;
  std::vector<int64_t> steps;
  for (const v1::CreateJobRequest& request : {pytorch, adaptive}) {
    absl::StatusOr<v1::Job> created = client_->CreateJob(request);
    ASSERT_TRUE(created.ok()) << created.status();
    ids.push_back(created->job_id());
    steps.push_back(overflow_until_failed(ids.back(), 1));
  }
  EXPECT_GT(steps[0], 100);  // 1024 down to 2^-127, one halving a step

  // A state whose scale is already the smallest float32 fails at once.
  const std::string loaded_id = CreateJob(3);
  ASSERT_TRUE(client_->Step(StepRequest(loaded_id, 1)).ok());
  absl::StatusOr<std::string> exported = client_->GetStateDict(loaded_id);
  ASSERT_TRUE(exported.ok()) << exported.status();
  absl::StatusOr<StateDict> tiny = DecodeSafetensors(*exported);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  tiny->metadata["scaler.scale"] = "1e-45";
  ASSERT_TRUE(client_->LoadStateDict(loaded_id, codec::EncodeSafetensors(*tiny)).ok());
  ids.push_back(loaded_id);
  steps.push_back(overflow_until_failed(loaded_id, 2));
  EXPECT_EQ(steps.back(), 1);

  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  Start();
  for (size_t i = 0; i < ids.size(); ++i) {
    v1::Job job;
    ASSERT_TRUE(RawGetJob(ids[i], &job).ok()) << ids[i] << "\n" << server_->Log();
    EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(job.failure(), "minimum loss scale")) << job.failure();
    EXPECT_EQ(job.step(), steps[i]);
    EXPECT_GT(job.loss_scale(), 0.0f);
    v1::StepResponse response;
    grpc::Status s = RawStep(StepRequest(ids[i], steps[i] + 1), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(DetailsOf(s).reason(), "JOB_FAILED");
  }
  EXPECT_FALSE(absl::StrContains(server_->Log(), "failed to restore")) << server_->Log();
  ASSERT_TRUE(client_->LoadStateDict(loaded_id, *exported).ok());
  v1::StepResponse response;
  EXPECT_TRUE(RawStep(StepRequest(loaded_id, 2), &response).ok());
}

// A checkpoint an earlier ampd wrote with a scale of 0 (which no state may
// carry) is not dropped at restart: the job is listed as failed with the
// reason, steps are refused with JOB_FAILED, the file is kept byte for
// byte, and a good state brings the job back.
TEST_F(ServiceTest, AnUnusableCheckpointKeepsItsJobListedAsFailed) {
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  const std::string id = CreateJob(1);
  ASSERT_TRUE(client_->Step(StepRequest(id, 1)).ok());
  absl::StatusOr<std::string> good = client_->GetStateDict(id);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  StateDict saved = ReadCheckpoint(id);
  saved.metadata["scaler.scale"] = "0";
  const std::filesystem::path file = std::filesystem::path(state_dir_) / (id + ".safetensors");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << codec::EncodeSafetensors(saved);
  const std::string unusable = ReadFile(file);

  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  v1::Job job;
  ASSERT_TRUE(RawGetJob(id, &job).ok()) << server_->Log();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.failure(), "failed to restore")) << job.failure();
  EXPECT_TRUE(absl::StrContains(job.failure(), "'scale'")) << job.failure();
  absl::StatusOr<std::vector<v1::Job>> listed = client_->ListAllJobs();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].state(), v1::JOB_STATE_FAILED);
  v1::StepResponse response;
  grpc::Status s = RawStep(StepRequest(id, 2), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(DetailsOf(s).reason(), "JOB_FAILED");
  EXPECT_EQ(client_->GetStateDict(id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  EXPECT_EQ(ReadFile(file), unusable);

  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  ASSERT_TRUE(client_->LoadStateDict(id, *good).ok());
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_ACTIVE);
  EXPECT_EQ(job.step(), 0);  // the job's own count was in the file it could not read
  EXPECT_TRUE(RawStep(StepRequest(id, 1), &response).ok());
}

// --checkpoint-every=1 without --checkpoint-sync: a SIGKILL at any moment
// loses at most one acknowledged step (docs/OPERATIONS.md's bound, 2N - 1 for N =
// 1): each restart's job is at least at the last acknowledged step - 1.
TEST_F(ServiceTest, SigkillLosesNoMoreAcknowledgedStepsThanTheBound) {
  Start({"--checkpoint-every=1"});
  const std::string id = CreateJob(1);
  int64_t acknowledged = 0;
  int64_t lost = 0;
  for (int kill = 0; kill < 5; ++kill) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(150);
    v1::StepResponse response;
    while (std::chrono::steady_clock::now() < until) {
      ASSERT_TRUE(RawStep(StepRequest(id, acknowledged + 1, 0), &response).ok());
      acknowledged = response.global_step();
    }
    server_->Signal(SIGKILL);
    server_->Wait(kExitDeadline);
    Start({"--checkpoint-every=1"});
    v1::Job job;
    ASSERT_TRUE(RawGetJob(id, &job).ok()) << server_->Log();
    EXPECT_GE(job.step(), acknowledged - 1) << "kill " << kill;
    EXPECT_LE(job.step(), acknowledged);
    lost += acknowledged - job.step();
    acknowledged = job.step();
  }
  EXPECT_LE(lost, 5);
}

// A LoadStateDict stream whose first 8 bytes declare a header longer than
// any allowed is refused at that chunk, before the rest is sent and held.
TEST_F(ServiceTest, LoadStateDictRefusesAnOversizedHeaderFromItsFirstBytes) {
  Start();
  const std::string id = CreateJob(1);
  std::unique_ptr<LoadStream> stream = OpenLoad();
  v1::LoadStateDictRequest first;
  first.set_job_id(id);
  const uint64_t declared = uint64_t{1} << 40;  // 1 TiB of header
  first.mutable_data()->assign(reinterpret_cast<const char*>(&declared), 8);
  ASSERT_TRUE(stream->writer->Write(first));
  v1::LoadStateDictRequest chunk;
  chunk.mutable_data()->assign(size_t{1} << 20, ' ');
  int written = 0;
  for (; written < 2000 && stream->writer->Write(chunk); ++written) {
  }
  EXPECT_LT(written, 2000);  // the server ended the call long before 2 GB
  stream->writer->WritesDone();
  grpc::Status s = stream->writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(DetailsOf(s).reason(), "INVALID_STATE_DICT");
  EXPECT_TRUE(absl::StrContains(s.error_message(), "header length")) << s.error_message();
}

// An acknowledged LoadStateDict is on disk: a SIGKILL right after the
// response restores the imported weights, not the ones before the import.
TEST_F(ServiceTest, LoadStateDictIsDurableOnceAcknowledged) {
  Start({"--checkpoint-every=1"});
  const std::string a = CreateJob(1);
  const std::string b = CreateJob(99);
  for (int64_t s = 1; s <= 3; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(a, s, static_cast<int>(s))).ok());
  ASSERT_TRUE(client_->Step(StepRequest(b, 1, 5)).ok());
  absl::StatusOr<std::string> imported = client_->GetStateDict(b);
  ASSERT_TRUE(imported.ok()) << imported.status();
  absl::StatusOr<v1::LoadStateDictResponse> loaded = client_->LoadStateDict(a, *imported);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);

  Start({"--checkpoint-every=1"});
  absl::StatusOr<v1::Job> job = client_->GetJob(a);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 3);
  absl::StatusOr<std::string> restored = client_->GetStateDict(a);
  ASSERT_TRUE(restored.ok()) << restored.status();
  absl::StatusOr<StateDict> want = DecodeSafetensors(*imported);
  absl::StatusOr<StateDict> got = DecodeSafetensors(*restored);
  ASSERT_TRUE(want.ok() && got.ok());
  ExpectSameTensors(*want, *got);
}

// When the checkpoint of an import cannot be written, the import fails and
// the job keeps the state it had: memory never runs ahead of the disk.
TEST_F(ServiceTest, LoadStateDictThatCannotBeSavedIsNotLoaded) {
  // Synchronous checkpoints: no background write is still creating files
  // when the test removes the directory below.
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  const std::string a = CreateJob(1);
  const std::string b = CreateJob(99);
  ASSERT_TRUE(client_->Step(StepRequest(a, 1)).ok());
  absl::StatusOr<std::string> before = client_->GetStateDict(a);
  absl::StatusOr<std::string> other = client_->GetStateDict(b);
  ASSERT_TRUE(before.ok() && other.ok());
  // Without its directory no checkpoint can be written (root included).
  std::filesystem::remove_all(state_dir_);
  absl::StatusOr<v1::LoadStateDictResponse> loaded = client_->LoadStateDict(a, *other);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInternal) << loaded.status();
  EXPECT_TRUE(absl::StrContains(loaded.status().message(), "could not be checkpointed"))
      << loaded.status();
  absl::StatusOr<std::string> after = client_->GetStateDict(a);
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<StateDict> want = DecodeSafetensors(*before);
  absl::StatusOr<StateDict> got = DecodeSafetensors(*after);
  ASSERT_TRUE(want.ok() && got.ok());
  ExpectSameTensors(*want, *got);
}

// More checkpoints than --max-jobs: the most recently written are restored,
// the others logged and left on disk for a start with room for them.
TEST_F(ServiceTest, RestoreHonoursMaxJobs) {
  // Synchronous writes: the files' order is the steps' order.
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  std::vector<std::string> ids;
  for (uint64_t seed = 1; seed <= 4; ++seed) ids.push_back(CreateJob(seed));
  // Each step rewrites that job's checkpoint, so ids[3]'s is the newest.
  for (const std::string& id : ids) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(client_->Step(StepRequest(id, 1)).ok());
  }
  server_->Signal(SIGKILL);  // no shutdown checkpoint to reorder the files
  server_->Wait(kExitDeadline);

  Start({"--checkpoint-every=1", "--max-jobs=2"});
  absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> restored;
  for (const v1::Job& job : *jobs) restored.push_back(job.job_id());
  std::vector<std::string> newest = {ids[2], ids[3]};
  std::sort(newest.begin(), newest.end());
  EXPECT_EQ(restored, newest);
  for (const std::string& id : ids) {
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(state_dir_) / (id + ".safetensors")))
        << id;
  }
  EXPECT_TRUE(absl::StrContains(server_->Log(), absl::StrCat("job ", ids[0], " not restored")))
      << server_->Log();
  EXPECT_EQ(RawCreate(JobRequest(5)).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  // With room again, the jobs left behind come back.
  server_->Terminate(kExitDeadline);
  Start({"--checkpoint-every=1"});
  absl::StatusOr<std::vector<v1::Job>> all = client_->ListAllJobs();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 4u);
}

// A checkpoint whose header admits it but whose tensors do not restore is
// never dropped: its job keeps its place under --max-jobs, listed as failed
// with the reason, and its file stays as it was.
TEST_F(ServiceTest, ACheckpointThatFailsToRestoreKeepsItsJobListedAsFailed) {
  Start({"--checkpoint-every=1", "--checkpoint-sync"});
  std::vector<std::string> ids;
  for (uint64_t seed = 1; seed <= 3; ++seed) ids.push_back(CreateJob(seed));
  for (const std::string& id : ids) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(client_->Step(StepRequest(id, 1)).ok());
  }
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);
  // The newest file loses its last bytes: the header still reads, the
  // tensors no longer do.
  const std::filesystem::path newest =
      std::filesystem::path(state_dir_) / (ids[2] + ".safetensors");
  std::filesystem::resize_file(newest, std::filesystem::file_size(newest) - 4);
  const std::string damaged = ReadFile(newest);

  Start({"--checkpoint-every=1", "--max-jobs=2"});
  absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> restored;
  for (const v1::Job& job : *jobs) restored.push_back(job.job_id());
  std::vector<std::string> want = {ids[1], ids[2]};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(restored, want) << server_->Log();
  EXPECT_TRUE(absl::StrContains(server_->Log(), absl::StrCat("job ", ids[2], " failed to restore")))
      << server_->Log();
  EXPECT_TRUE(absl::StrContains(server_->Log(), absl::StrCat("job ", ids[0], " not restored")))
      << server_->Log();
  v1::Job job;
  ASSERT_TRUE(RawGetJob(ids[2], &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.failure(), "failed to restore")) << job.failure();
  v1::StepResponse response;
  grpc::Status s = RawStep(StepRequest(ids[2], 2), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(DetailsOf(s).reason(), "JOB_FAILED");
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  EXPECT_EQ(ReadFile(newest), damaged);
}

// Names the server stores and sends back are bounded, and input echoed in an
// error is cut: a huge id never turns into a huge response.
TEST_F(ServiceTest, NamesAreBoundedAndErrorsDoNotEchoHugeInput) {
  Start();
  v1::CreateJobRequest named = JobRequest(1);
  named.mutable_config()->set_display_name(std::string(4 << 20, 'n'));
  grpc::Status s = RawCreate(named);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  google::rpc::ErrorInfo info = DetailsOf(s);
  EXPECT_EQ(info.reason(), "INVALID_FIELD");
  EXPECT_EQ(Meta(info, "field"), "config.display_name");
  EXPECT_LT(s.error_message().size() + s.error_details().size(), 4096u);
  named.mutable_config()->set_display_name(std::string(256, 'n'));
  EXPECT_TRUE(RawCreate(named).ok());

  v1::CreateJobRequest retried = JobRequest(2);
  retried.set_request_id(std::string(257, 'r'));
  info = DetailsOf(RawCreate(retried));
  EXPECT_EQ(Meta(info, "field"), "request_id");

  const std::string huge_id(1 << 20, 'j');
  v1::StepResponse response;
  for (const grpc::Status& status :
       {RawGetJob(huge_id), RawStep(StepRequest(huge_id, 1), &response)}) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_EQ(Meta(DetailsOf(status), "field"), "job_id");
    EXPECT_LT(status.error_message().size() + status.error_details().size(), 4096u);
  }
  std::unique_ptr<LoadStream> load = OpenLoad();
  v1::LoadStateDictRequest first;
  first.set_job_id(huge_id);
  load->writer->Write(first);
  load->writer->WritesDone();
  s = load->writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size() + s.error_details().size(), 4096u);

  // Within the bound, an unknown id is echoed cut short.
  const std::string long_id(200, 'x');
  s = RawGetJob(long_id);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "(200 bytes)")) << s.error_message();
  EXPECT_LT(s.error_message().size(), 200u);
  absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->size(), 1u);
}

// LoadStateDict streams share one budget of held bytes: a stream holds a
// tensor's bytes from when its first byte arrives (the file is decoded as
// it comes), so two streams of a 600 KB tensor against a 1 MB budget cannot
// both be held, whichever comes first; once they are done the budget is
// free again. The server may also take the second stream's chunk, finish
// that stream and free its bytes before the first stream's chunk is read
// (the two are not ordered on the wire): both then go through in turn,
// which is right but does not test sharing, so the pair is sent again, a
// bounded number of times, until they overlap.
TEST_F(ServiceTest, ConcurrentLoadStateDictStreamsShareOneBudget) {
  Start({"--max-state-dict-buffer-bytes=1000000"});
  const std::string id = CreateJob(1);
  // The header of a file with one F32 tensor of 600000 bytes, and its
  // first bytes: the stream then holds the whole tensor's buffer.
  StateDict big;
  big.tensors.push_back(
      {"model.0.weight", {codec::DType::kF32, {150000}, std::string(600000, 'x')}});
  const std::string file = codec::EncodeSafetensors(big);
  v1::LoadStateDictRequest chunk;
  chunk.set_job_id(id);
  chunk.set_data(file.substr(0, file.size() - 100000));

  grpc::Status first_status;
  grpc::Status second_status;
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::unique_ptr<LoadStream> first = OpenLoad();
    std::unique_ptr<LoadStream> second = OpenLoad();
    first->writer->Write(chunk);
    second->writer->Write(chunk);
    // Both streams stay open, holding their bytes, so whichever chunk
    // reaches the server second is refused, in either order. The server
    // ends that call at once; a further one-byte write on it then fails,
    // which tells the test that the refusal has happened.
    v1::LoadStateDictRequest byte;
    byte.set_data("x");
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    bool first_open = true;
    bool second_open = true;
    while (first_open && second_open && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      first_open = first->writer->Write(byte);
      second_open = second->writer->Write(byte);
    }
    second->writer->WritesDone();
    second_status = second->writer->Finish();
    first->writer->WritesDone();
    first_status = first->writer->Finish();
    if (first_status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
        second_status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      break;
    }
  }
  std::vector<grpc::StatusCode> codes = {first_status.error_code(), second_status.error_code()};
  std::sort(codes.begin(), codes.end());
  // INVALID_ARGUMENT (3) for the one whose bytes were taken (the file stops
  // short), RESOURCE_EXHAUSTED (8) for the one refused.
  ASSERT_EQ(codes, (std::vector<grpc::StatusCode>{grpc::StatusCode::INVALID_ARGUMENT,
                                                  grpc::StatusCode::RESOURCE_EXHAUSTED}))
      << first_status.error_message() << " / " << second_status.error_message();
  const grpc::Status& refused = first_status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED
                                    ? first_status
                                    : second_status;
  EXPECT_EQ(DetailsOf(refused).reason(), "MEMORY_LIMIT");
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "max-state-dict-buffer-bytes"))
      << refused.error_message();

  std::unique_ptr<LoadStream> third = OpenLoad();
  third->writer->Write(chunk);
  third->writer->WritesDone();
  const grpc::Status third_status = third->writer->Finish();
  EXPECT_EQ(third_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << third_status.error_message();
  EXPECT_EQ(DetailsOf(third_status).reason(), "INVALID_STATE_DICT");
  EXPECT_TRUE(absl::StrContains(third_status.error_message(), "the file ends after"))
      << third_status.error_message();
}

// The file is decoded as it arrives: one that is not a safetensors file, or
// that is larger than the server takes, ends the stream at the chunk that
// shows it, and a stream for a job the caller does not have ends at its
// first message, before any file bytes are held.
TEST_F(ServiceTest, LoadStateDictStopsAtTheFirstChunkThatShowsAProblem) {
  Start({"--max-memory-bytes=100000000"});  // also bounds a state dict to 100 MB
  const std::string id = CreateJob(1);
  v1::LoadStateDictRequest request;
  request.set_job_id(id);
  request.set_data("not a safetensors file at all");
  std::unique_ptr<LoadStream> garbage = OpenLoad();
  garbage->writer->Write(request);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  v1::LoadStateDictRequest more;
  more.set_data(std::string(1000, 'x'));
  while (garbage->writer->Write(more) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_LT(absl::Now(), deadline) << "the server kept reading after a bad header";
  grpc::Status s = garbage->writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(DetailsOf(s).reason(), "INVALID_STATE_DICT");

  // A header that declares 200 MB of tensors: refused from the header.
  const std::string json =
      R"({"model.0.weight":{"dtype":"F32","shape":[50000000],"data_offsets":[0,200000000]}})";
  std::string header;
  for (int i = 0; i < 8; ++i) header.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xFF));
  header += json;
  request.set_data(header);
  std::unique_ptr<LoadStream> over = OpenLoad();
  over->writer->Write(request);
  over->writer->WritesDone();
  s = over->writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(DetailsOf(s).reason(), "MEMORY_LIMIT");
  EXPECT_TRUE(absl::StrContains(s.error_message(), "exceeds the server's limit of 100000000 bytes"))
      << s.error_message();

  request.set_job_id("job-nope");
  request.set_data(header);
  std::unique_ptr<LoadStream> nobody = OpenLoad();
  nobody->writer->Write(request);
  nobody->writer->WritesDone();
  s = nobody->writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(DetailsOf(s).reason(), "JOB_NOT_FOUND");
}

// A job's creation checkpoint is its config and seed alone (no weights are
// written, however large the model): a server killed before the job's
// first step restores it bit for bit, and it trains on as a job created
// afresh with the same seed does.
TEST_F(ServiceTest, JobKilledAtStepZeroComesBackBitIdentical) {
  Start();
  const std::string id = CreateJob(1);
  absl::StatusOr<std::string> created = client_->GetStateDict(id);
  ASSERT_TRUE(created.ok()) << created.status();
  const StateDict saved = ReadCheckpoint(id);
  EXPECT_TRUE(saved.tensors.empty());
  EXPECT_EQ(saved.metadata.at("ampd.step"), "0");
  EXPECT_TRUE(saved.metadata.contains("ampd.initial_state"));
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);

  Start();
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 0);
  absl::StatusOr<std::string> restored = client_->GetStateDict(id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(*restored == *created) << "the restored state differs from the created one";
  const std::string twin = CreateJob(1);
  v1::StepResponse a;
  v1::StepResponse b;
  ASSERT_TRUE(RawStep(StepRequest(id, 1), &a).ok());
  ASSERT_TRUE(RawStep(StepRequest(twin, 1), &b).ok());
  EXPECT_EQ(a.loss(), b.loss());
  EXPECT_EQ(a.scale_after(), b.scale_after());
  EXPECT_TRUE(absl::StrContains(server_->Log(), absl::StrCat("job ", id, " restored at step 0")));
}

// A seed-only checkpoint whose config was altered (here its seed, which
// still reads as a valid config) is refused with an error that names the
// defect: the job is listed as failed with it, and the file left as it was.
TEST_F(ServiceTest, DamagedSeedOnlyCheckpointIsRefusedWithAClearError) {
  Start();
  const std::string id = CreateJob(1);
  server_->Signal(SIGKILL);
  server_->Wait(kExitDeadline);
  StateDict saved = ReadCheckpoint(id);
  std::string& config = saved.metadata.at("ampd.config");
  const size_t seed = config.find("\"seed\":1");
  ASSERT_NE(seed, std::string::npos) << config;
  config.replace(seed, 8, "\"seed\":2");
  const std::filesystem::path file = std::filesystem::path(state_dir_) / (id + ".safetensors");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << codec::EncodeSafetensors(saved);

  const std::string damaged = ReadFile(file);

  Start();
  v1::Job job;
  ASSERT_TRUE(RawGetJob(id, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.failure(), "ampd.config_digest: does not match"))
      << job.failure();
  const std::string log = server_->Log();
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("job ", id,
                                                  " failed to restore: DATA_LOSS: "
                                                  "ampd.config_digest: does not match")))
      << log;
  EXPECT_EQ(server_->Terminate(kExitDeadline).code, 0) << server_->Log();
  EXPECT_EQ(ReadFile(file), damaged);
}

TEST_F(ServiceTest, SigtermDrainsCheckpointsAndExitsZero) {
  Start({"--checkpoint-every=100", "--drain-grace-ms=1500"});
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);

  const std::string id = CreateJob(1);
  for (int64_t s = 1; s <= 3; ++s)
    ASSERT_TRUE(client_->Step(StepRequest(id, s, static_cast<int>(s))).ok());
  server_->Signal(SIGTERM);
  // During the drain grace the server still answers, with NOT_SERVING.
  bool saw_not_serving = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!saw_not_serving && std::chrono::steady_clock::now() < deadline) {
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auto stub = grpc::health::v1::Health::NewStub(client_->channel());
    if (!stub->Check(&context, request, &response).ok()) break;
    saw_not_serving = response.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }
  EXPECT_TRUE(saw_not_serving);
  EXPECT_EQ(server_->Wait(kExitDeadline).code, 0) << server_->Log();
  const StateDict saved = ReadCheckpoint(id);
  EXPECT_EQ(saved.metadata.at("ampd.step"), "3");
}

TEST_F(ServiceTest, ReflectionListsTheTrainerService) {
  Start();
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(client_->channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  EXPECT_NE(std::find(names.begin(), names.end(), "ampd.v1.Trainer"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"), names.end());
  EXPECT_TRUE(stream->Finish().ok());
}

// --device names a backend that must exist: ampd refuses to start, exit 1,
// naming the device, instead of failing every job later. (cuda:64: no
// machine has that many GPUs, so this holds with or without one.)
TEST(AmpdStartup, AnAbsentOrUnknownDeviceFailsClearlyAtStart) {
  for (const auto& [device, expected] : std::vector<std::pair<std::string, std::string>>{
           {"cuda:64", "device \"cuda:64\" requested but"},
           {"tpu", "device \"tpu\": expected auto, cpu, cuda or cuda:N"}}) {
    const test_support::CommandResult run =
        test_support::RunCommand({AMPD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                  "--metrics-listen=", absl::StrCat("--device=", device)},
                                 std::chrono::seconds(30));
    EXPECT_TRUE(run.status.exited && run.status.code == 1)
        << device << ": " << run.status.ToString() << "\n"
        << run.err;
    EXPECT_TRUE(absl::StrContains(run.err, expected)) << device << ": " << run.err;
    EXPECT_FALSE(absl::StrContains(run.out, "listening on")) << device << ": " << run.out;
  }
}

}  // namespace
}  // namespace ampd
