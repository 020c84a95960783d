// What a job's config looks like to a client across CreateJob and restarts:
// the effective config CreateJob returns for each optimizer and precision
// (compared with a recorded golden file, so moving defaults between layers
// cannot change a response), a checkpoint written by an earlier ampd (config
// as a serialized CreateJobRequest) restoring and training on, and a job
// restored from a checkpoint reporting the config it had before the restart.
// Each test starts the real `ampd` binary (tests/support's AmpdProcess).
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "codec/safetensors.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using codec::DecodeSafetensors;
using codec::StateDict;
using google::protobuf::util::MessageDifferencer;
using test_support::AmpdProcess;
using test_support::ReadFile;
using test_support::TempDir;

constexpr auto kExitDeadline = std::chrono::seconds(60);

// The checkpoint an ampd that stored configs as ampd.create_request wrote:
// `ampctl train --steps=4 --batch_size=4 --optimizer=adam --weight_decay=0.01
// --max_grad_norm=5 --init_scale=128 --growth_interval=3 --name=legacy-adam
// --seed=7` against `ampd --device=cpu --state-dir=...`, stopped with SIGTERM.
constexpr char kLegacyJobId[] = "job-02aa4f8e7b3a";
constexpr char kLegacyFile[] = "legacy-create-request-job-02aa4f8e7b3a.safetensors";

std::filesystem::path DataPath(const std::string& name) {
  return std::filesystem::path(AMPD_TEST_DATA_DIR) / name;
}

class CheckpointConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = root_.path() / "state";
    std::filesystem::create_directories(state_dir_);
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr)
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    server_.reset();
    client_.reset();
  }

  void Start() {
    server_ = std::make_unique<AmpdProcess>(
        AMPD_SERVER_BINARY, std::vector<std::string>{"--state-dir=" + state_dir_.string()},
        state_dir_.string() + ".log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }

  void Stop() {
    const test_support::ExitStatus exit = server_->Terminate(kExitDeadline);
    EXPECT_EQ(exit.code, 0) << server_->Describe();
    server_.reset();
    client_.reset();
  }

  StateDict ReadCheckpoint(const std::string& job_id) {
    absl::StatusOr<StateDict> state =
        DecodeSafetensors(ReadFile(state_dir_ / (job_id + ".safetensors")));
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *std::move(state) : StateDict{};
  }

  TempDir root_{"ampd_checkpoint_config_test"};
  std::filesystem::path state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

// ampctl train's batches for --seed=7 --batch_size=4 (target_scale 32).
std::vector<v1::MicroBatch> LegacyBatches(int count) {
  SyntheticTaskOptions options;
  options.batch_size = 4;
  options.target_scale = 32.0f;
  options.seed = 7;
  SyntheticTask task(options);
  std::vector<v1::MicroBatch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(task.NextBatch());
  return batches;
}

v1::StepRequest Step(const std::string& job_id, int64_t sequence, const v1::MicroBatch& batch) {
  v1::StepRequest request;
  request.set_job_id(job_id);
  request.set_sequence(sequence);
  *request.add_micro_batches() = batch;
  return request;
}

// The requests whose effective configs golden file records: each optimizer
// kind (and none) with nothing else set, each with its fields set, and each
// precision under each scaler policy.
std::vector<v1::CreateJobRequest> EffectiveConfigRequests() {
  SyntheticTaskOptions task_options;
  const v1::ModelSpec model = SyntheticTask(task_options).Model();
  std::vector<v1::CreateJobRequest> requests;
  auto add = [&](const std::string& name) -> v1::JobConfig* {
    v1::CreateJobRequest& request = requests.emplace_back();
    v1::JobConfig* config = request.mutable_config();
    config->set_display_name(name);
    *config->mutable_model() = model;
    return config;
  };
  add("defaults");
  for (const auto& [name, kind] :
       {std::pair{"adam", v1::OPTIMIZER_ADAM}, std::pair{"adamw", v1::OPTIMIZER_ADAMW},
        std::pair{"sgd", v1::OPTIMIZER_SGD}}) {
    add(name)->mutable_optimizer()->set_kind(kind);
  }
  for (const auto& [name, kind] :
       {std::pair{"adam-set", v1::OPTIMIZER_ADAM}, std::pair{"adamw-set", v1::OPTIMIZER_ADAMW}}) {
    v1::OptimizerConfig* o = add(name)->mutable_optimizer();
    o->set_kind(kind);
    o->set_lr(3e-4f);
    o->set_beta1(0.8f);
    o->set_beta2(0.95f);
    o->set_eps(1e-6f);
    o->set_weight_decay(0.05f);
    o->set_max_grad_norm(1.5f);
  }
  {
    v1::OptimizerConfig* o = add("sgd-set")->mutable_optimizer();
    o->set_kind(v1::OPTIMIZER_SGD);
    o->set_lr(0.1f);
    o->set_momentum(0.9f);
    o->set_nesterov(true);
    o->set_weight_decay(1e-4f);
  }
  for (const auto& [pname, precision] :
       {std::pair{"fp16", v1::PRECISION_FP16}, std::pair{"bf16", v1::PRECISION_BF16},
        std::pair{"fp32", v1::PRECISION_FP32}}) {
    for (const auto& [sname, policy] : {std::pair{"pytorch", v1::SCALER_POLICY_PYTORCH},
                                        std::pair{"paddle", v1::SCALER_POLICY_PADDLE},
                                        std::pair{"deepspeed", v1::SCALER_POLICY_DEEPSPEED},
                                        std::pair{"megatron", v1::SCALER_POLICY_MEGATRON}}) {
      v1::JobConfig* config = add(absl::StrCat(pname, "-", sname));
      config->set_precision(precision);
      config->mutable_scaler()->set_policy(policy);
    }
  }
  {
    v1::JobConfig* config = add("scaler-set");
    config->set_seed(42);
    v1::ScalerConfig* s = config->mutable_scaler();
    s->set_policy(v1::SCALER_POLICY_DEEPSPEED);
    s->set_init_scale(4096);
    s->set_growth_factor(4);
    s->set_growth_interval(7);
    s->set_hysteresis(3);
    s->set_consecutive_hysteresis(true);
    s->set_raise_at_min_scale(false);
    s->set_min_scale(2);
    s->set_max_scale(1 << 20);
  }
  {
    v1::JobConfig* config = add("scaling-off");
    config->mutable_scaler()->set_enabled(false);
  }
  return requests;
}

// The configs CreateJob returned for EffectiveConfigRequests(), recorded
// with the ampd whose optimizer defaults lived in the rpc layer: the jobs of
// a ListJobsResponse, in request order, holding only their configs.
TEST_F(CheckpointConfigTest, CreateJobReturnsTheRecordedEffectiveConfigs) {
  Start();
  v1::ListJobsResponse golden;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      ReadFile(DataPath("effective_configs.txtpb")), &golden));
  const std::vector<v1::CreateJobRequest> requests = EffectiveConfigRequests();
  v1::ListJobsResponse got;
  for (const v1::CreateJobRequest& request : requests) {
    absl::StatusOr<v1::Job> job = client_->CreateJob(request);
    ASSERT_TRUE(job.ok()) << request.config().display_name() << ": " << job.status();
    *got.add_jobs()->mutable_config() = job->config();
  }
  std::string got_text;
  google::protobuf::TextFormat::PrintToString(got, &got_text);
  ASSERT_EQ(got.jobs_size(), golden.jobs_size()) << "CreateJob returned:\n" << got_text;
  for (int i = 0; i < got.jobs_size(); ++i) {
    std::string diff;
    MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differencer.Compare(golden.jobs(i).config(), got.jobs(i).config()))
        << requests[static_cast<size_t>(i)].config().display_name() << ":\n"
        << diff;
    // Byte for byte on the wire, too.
    EXPECT_EQ(golden.jobs(i).config().SerializeAsString(), got.jobs(i).config().SerializeAsString())
        << requests[static_cast<size_t>(i)].config().display_name();
  }
}

// A checkpoint from an ampd that stored configs as ampd.create_request
// restores with its config, request_id, step sequence and recorded report,
// and its next step is the one an uninterrupted job of the same config and
// batches takes.
TEST_F(CheckpointConfigTest, CreateRequestCheckpointRestoresAndTrainsOn) {
  std::filesystem::copy_file(DataPath(kLegacyFile),
                             state_dir_ / (std::string(kLegacyJobId) + ".safetensors"));
  Start();
  absl::StatusOr<v1::Job> job = client_->GetJob(kLegacyJobId);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 4);
  EXPECT_EQ(job->applied_steps(), 4);
  EXPECT_EQ(job->loss_scale(), 256.0f);
  EXPECT_EQ(job->request_id(), "req-5fc8bde855b9bded29d51768dad613f5");
  const v1::JobConfig& config = job->config();
  EXPECT_EQ(config.display_name(), "legacy-adam");
  EXPECT_EQ(config.seed(), 7u);
  EXPECT_EQ(config.precision(), v1::PRECISION_FP16);
  EXPECT_EQ(config.optimizer().kind(), v1::OPTIMIZER_ADAM);
  EXPECT_EQ(config.optimizer().lr(), 1e-3f);
  EXPECT_EQ(config.optimizer().weight_decay(), 0.01f);
  EXPECT_EQ(config.optimizer().max_grad_norm(), 5.0f);
  EXPECT_EQ(config.scaler().policy(), v1::SCALER_POLICY_PYTORCH);
  EXPECT_EQ(config.scaler().init_scale(), 128.0);
  EXPECT_EQ(config.scaler().growth_interval(), 3);
  ASSERT_EQ(config.model().layers_size(), 3);

  // A fresh job of the same config trained on the same batches. Since the
  // file was written, an fp16 Linear's bias joins the GEMM's fp32 sums
  // before their one rounding (it used to be added to the rounded product),
  // so the fresh job's first four steps agree with the recorded ones to
  // rounding, not to the bit.
  v1::CreateJobRequest fresh_request;
  *fresh_request.mutable_config() = config;
  absl::StatusOr<v1::Job> fresh = client_->CreateJob(fresh_request);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const std::vector<v1::MicroBatch> batches = LegacyBatches(6);
  std::vector<v1::StepResponse> expected;
  for (int64_t s = 1; s <= 4; ++s) {
    absl::StatusOr<v1::StepResponse> r =
        client_->Step(Step(fresh->job_id(), s, batches[static_cast<size_t>(s - 1)]));
    ASSERT_TRUE(r.ok()) << r.status();
    expected.push_back(*r);
  }

  // Step 4 again: the response recorded in the checkpoint, replayed the
  // same every time, and the fresh job's step 4 to rounding.
  absl::StatusOr<v1::StepResponse> again = client_->Step(Step(kLegacyJobId, 4, batches[3]));
  ASSERT_TRUE(again.ok()) << again.status();
  absl::StatusOr<v1::StepResponse> replayed = client_->Step(Step(kLegacyJobId, 4, batches[3]));
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*again, *replayed));
  EXPECT_EQ(again->global_step(), 4);
  EXPECT_NEAR(again->loss(), expected[3].loss(), 1e-3 * std::fabs(expected[3].loss()));
  EXPECT_EQ(again->scale_after(), expected[3].scale_after());

  // Steps 5 and 6 bit for bit as a job that loads the restored job's state
  // takes them: the checkpoint restored every weight, moment, count and
  // scaler field.
  absl::StatusOr<v1::Job> twin = client_->CreateJob(fresh_request);
  ASSERT_TRUE(twin.ok()) << twin.status();
  absl::StatusOr<std::string> state = client_->GetStateDict(kLegacyJobId);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_TRUE(client_->LoadStateDict(twin->job_id(), *state).ok());
  for (int64_t s = 5; s <= 6; ++s) {
    absl::StatusOr<v1::StepResponse> r =
        client_->Step(Step(kLegacyJobId, s, batches[static_cast<size_t>(s - 1)]));
    ASSERT_TRUE(r.ok()) << r.status();
    // The twin keeps its own step count (LoadStateDict does not move it).
    absl::StatusOr<v1::StepResponse> want =
        client_->Step(Step(twin->job_id(), s - 4, batches[static_cast<size_t>(s - 1)]));
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(r->global_step(), s);
    EXPECT_EQ(r->loss(), want->loss()) << "step " << s;
    EXPECT_EQ(r->scale_before(), want->scale_before()) << "step " << s;
    EXPECT_EQ(r->scale_after(), want->scale_after()) << "step " << s;
    EXPECT_EQ(r->skipped(), want->skipped()) << "step " << s;
    EXPECT_EQ(r->grad_norm(), want->grad_norm()) << "step " << s;
  }

  // Its next checkpoint is in the engine's own format, and restores to the
  // same job.
  absl::StatusOr<v1::Job> before = client_->GetJob(kLegacyJobId);
  ASSERT_TRUE(before.ok()) << before.status();
  // The last gradient norm is what this process computed; a restart does
  // not restore it.
  before->clear_grad_norm();
  Stop();
  const StateDict saved = ReadCheckpoint(kLegacyJobId);
  EXPECT_FALSE(saved.metadata.contains("ampd.create_request"));
  ASSERT_TRUE(saved.metadata.contains("ampd.config"));
  Start();
  absl::StatusOr<v1::Job> after = client_->GetJob(kLegacyJobId);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*before, *after)) << before->DebugString() << "\nvs\n"
                                                           << after->DebugString();
}

// Models of every layer kind and both losses, beside the synthetic task's.
std::vector<v1::CreateJobRequest> LayerKindRequests() {
  std::vector<v1::CreateJobRequest> requests;
  {
    v1::JobConfig* config = requests.emplace_back().mutable_config();
    config->set_display_name("every-float-layer \"quoted\" \xc3\xa9\n");
    v1::ModelSpec* m = config->mutable_model();
    v1::Linear* in = m->add_layers()->mutable_linear();
    in->set_in_features(8);
    in->set_out_features(6);
    in->set_bias(false);
    m->add_layers()->mutable_relu();
    v1::LayerNorm* norm = m->add_layers()->mutable_layer_norm();
    norm->set_normalized_shape(6);
    norm->set_eps(1e-6f);
    norm->set_elementwise_affine(false);
    m->add_layers()->mutable_tanh();
    v1::Linear* out = m->add_layers()->mutable_linear();
    out->set_in_features(6);
    out->set_out_features(3);
    out->set_bias(true);
    m->set_loss(v1::LOSS_CROSS_ENTROPY);
    m->set_loss_multiplier(0.1f);
  }
  {
    v1::CreateJobRequest& request = requests.emplace_back();
    request.set_request_id("embedding-request");
    v1::JobConfig* config = request.mutable_config();
    config->set_display_name("embedding");
    config->set_precision(v1::PRECISION_BF16);
    config->set_seed(18446744073709551615ull);
    v1::ModelSpec* m = config->mutable_model();
    v1::Embedding* e = m->add_layers()->mutable_embedding();
    e->set_num_embeddings(11);
    e->set_embedding_dim(5);
    m->add_layers()->mutable_gelu();
    v1::Linear* out = m->add_layers()->mutable_linear();
    out->set_in_features(5);
    out->set_out_features(11);
    m->set_loss(v1::LOSS_CROSS_ENTROPY);
  }
  return requests;
}

// Jobs restored from the checkpoints this ampd writes report what they
// reported before the restart, every config field included; the checkpoint
// holds the engine's ampd.config, not the wire request.
TEST_F(CheckpointConfigTest, RestoredJobsReportTheConfigTheyHadBefore) {
  Start();
  std::vector<v1::CreateJobRequest> requests = EffectiveConfigRequests();
  for (v1::CreateJobRequest& r : LayerKindRequests()) requests.push_back(std::move(r));
  requests[1].set_request_id("adam-request");
  std::vector<v1::Job> before;
  for (const v1::CreateJobRequest& request : requests) {
    absl::StatusOr<v1::Job> job = client_->CreateJob(request);
    ASSERT_TRUE(job.ok()) << request.config().display_name() << ": " << job.status();
    before.push_back(*job);
  }
  SyntheticTaskOptions options;
  options.seed = 3;
  SyntheticTask task(options);
  for (int64_t s = 1; s <= 2; ++s) {
    ASSERT_TRUE(client_->Step(Step(before[1].job_id(), s, task.NextBatch())).ok());
  }
  for (v1::Job& job : before) {
    absl::StatusOr<v1::Job> now = client_->GetJob(job.job_id());
    ASSERT_TRUE(now.ok()) << now.status();
    job = *now;
    // The last gradient norm is what this process computed; a restart does
    // not restore it.
    job.clear_grad_norm();
  }
  Stop();

  const StateDict saved = ReadCheckpoint(before[1].job_id());
  EXPECT_FALSE(saved.metadata.contains("ampd.create_request"));
  ASSERT_TRUE(saved.metadata.contains("ampd.config"));
  EXPECT_NE(saved.metadata.at("ampd.config").find("\"format_version\":1,"), std::string::npos)
      << saved.metadata.at("ampd.config");

  Start();
  for (const v1::Job& job : before) {
    absl::StatusOr<v1::Job> after = client_->GetJob(job.job_id());
    ASSERT_TRUE(after.ok()) << job.config().display_name() << ": " << after.status();
    std::string diff;
    MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differencer.Compare(job, *after)) << job.config().display_name() << ":\n" << diff;
  }
  // request_id deduplication survives the restart too.
  absl::StatusOr<v1::Job> again = client_->CreateJob(requests[1]);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job_id(), before[1].job_id());
}

// A checkpoint whose ampd.config cannot be read is logged with the key at
// fault and left on disk; the other jobs restore.
TEST_F(CheckpointConfigTest, AnUnreadableConfigIsLoggedAndTheCheckpointKept) {
  Start();
  absl::StatusOr<v1::Job> good = client_->CreateJob(EffectiveConfigRequests()[0]);
  ASSERT_TRUE(good.ok()) << good.status();
  Stop();
  StateDict state = ReadCheckpoint(good->job_id());
  std::string& config = state.metadata.at("ampd.config");
  const size_t at = config.find("\"dynamic\":true");
  ASSERT_NE(at, std::string::npos) << config;
  config.insert(at, "\"dynamo\":true,");
  const std::filesystem::path bad = state_dir_ / "job-badconfig.safetensors";
  {
    std::ofstream out(bad, std::ios::binary);
    out << codec::EncodeSafetensors(state);
  }

  Start();
  EXPECT_TRUE(client_->GetJob(good->job_id()).ok());
  EXPECT_EQ(client_->GetJob("job-badconfig").status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(server_->Log().find("job job-badconfig failed to restore: DATA_LOSS: ampd.config: "
                                "scaler.dynamo: unknown key"),
            std::string::npos)
      << server_->Log();
  EXPECT_TRUE(std::filesystem::exists(bad));
}

}  // namespace
}  // namespace ampd
