// Sampler snapshots through the real ampd process (--device=cpu, a state
// directory) over the generated stub: a GPT job's snapshot samples the
// same bits after the job trained on and after a SIGKILL (the job itself
// back at its last checkpoint), its log-probs are the next step's training
// forward's; ListSamplerSnapshots and DeleteSamplerSnapshot; the errors'
// ErrorInfo (reason and field) for an unknown name, a name held for other
// weights and a snapshot the memory limit refuses.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::TempDir;

constexpr int64_t kVocab = 32;

google::rpc::ErrorInfo InfoOf(const grpc::Status& status) {
  google::rpc::Status details;
  google::rpc::ErrorInfo info;
  EXPECT_TRUE(details.ParseFromString(status.error_details())) << status.error_message();
  if (details.details_size() == 1) {
    EXPECT_TRUE(details.details(0).UnpackTo(&info));
  }
  return info;
}

std::string Meta(const google::rpc::ErrorInfo& info, const std::string& key) {
  auto it = info.metadata().find(key);
  return it == info.metadata().end() ? "<absent>" : it->second;
}

class SamplerSnapshotServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { state_dir_ = (root_.path() / "state").string(); }
  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), "--state-dir=" + state_dir_);
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, state_dir_ + ".log");
    ASSERT_NE(server_->port(), 0) << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }
  void Kill() {
    server_->Signal(SIGKILL);
    server_->Wait(std::chrono::seconds(60));
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
  }

  std::string CreateGpt() {
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    v1::Gpt* gpt = config->mutable_model()->mutable_gpt();
    gpt->set_vocab_size(kVocab);
    gpt->set_context_length(16);
    gpt->set_d_model(32);
    gpt->set_n_layer(2);
    gpt->set_n_head(4);
    config->set_seed(5);
    config->set_precision(v1::PRECISION_FP16);
    config->set_batch_invariant(true);
    config->mutable_optimizer()->set_lr(1e-2f);
    absl::StatusOr<v1::Job> job = client_->CreateJob(request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->job_id() : "";
  }

  static v1::Tensor Ids(const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_I32);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
    return t;
  }
  static v1::Tensor F32(const std::vector<int64_t>& shape, const std::vector<float>& values) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_F32);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
    return t;
  }

  grpc::Status RuleStep(const std::string& job, int64_t sequence) {
    std::vector<int32_t> ids, targets;
    for (int b = 0; b < 2; ++b) {
      auto t = static_cast<int32_t>((sequence * 7 + b * 5) % kVocab);
      for (int s = 0; s < 8; ++s) {
        ids.push_back(t);
        t = (3 * t + 1) % kVocab;
        targets.push_back(t);
      }
    }
    v1::StepRequest request;
    request.set_job_id(job);
    request.set_sequence(sequence);
    v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_inputs() = Ids({2, 8}, ids);
    *mb->mutable_targets() = Ids({2, 8}, targets);
    return Call([&](grpc::ClientContext* c) {
      v1::StepResponse response;
      return client_->stub().Step(c, request, &response);
    });
  }

  template <typename F>
  grpc::Status Call(F f) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return f(&context);
  }

  grpc::Status Save(const std::string& job, const std::string& name,
                    v1::SaveSamplerSnapshotResponse* out = nullptr) {
    v1::SaveSamplerSnapshotRequest request;
    request.set_job_id(job);
    request.set_snapshot(name);
    v1::SaveSamplerSnapshotResponse response;
    return Call([&](grpc::ClientContext* c) {
      return client_->stub().SaveSamplerSnapshot(c, request, out != nullptr ? out : &response);
    });
  }
  grpc::Status Delete(const std::string& job, const std::string& name) {
    v1::DeleteSamplerSnapshotRequest request;
    request.set_job_id(job);
    request.set_snapshot(name);
    v1::DeleteSamplerSnapshotResponse response;
    return Call([&](grpc::ClientContext* c) {
      return client_->stub().DeleteSamplerSnapshot(c, request, &response);
    });
  }
  std::vector<std::string> List(const std::string& job) {
    v1::ListSamplerSnapshotsRequest request;
    request.set_job_id(job);
    v1::ListSamplerSnapshotsResponse response;
    const grpc::Status s = Call([&](grpc::ClientContext* c) {
      return client_->stub().ListSamplerSnapshots(c, request, &response);
    });
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> names;
    for (const v1::SamplerSnapshot& snap : response.snapshots()) {
      names.push_back(absl::StrCat(snap.name(), "@", snap.step()));
    }
    return names;
  }
  grpc::Status Sample(const std::string& job, const std::string& snapshot,
                      v1::SampleResponse* response) {
    v1::SampleRequest request;
    request.set_job_id(job);
    for (const std::vector<int64_t>& prompt : Prompts()) {
      v1::TokenSequence* p = request.add_prompts();
      for (int64_t t : prompt) p->add_tokens(t);
    }
    request.set_num_samples(2);
    request.set_max_tokens(5);
    request.set_seed(13);
    request.set_snapshot(snapshot);
    return Call(
        [&](grpc::ClientContext* c) { return client_->stub().Sample(c, request, response); });
  }
  static std::vector<std::vector<int64_t>> Prompts() { return {{3, 1, 4}, {7}, {2, 7, 1, 8}}; }

  TempDir root_{"ampd_sampler_snapshot_service_test"};
  std::string state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

// Tokens and log-prob bits of every completion, in order.
std::vector<std::vector<int64_t>> Flatten(const v1::SampleResponse& r) {
  std::vector<std::vector<int64_t>> out;
  for (const v1::PromptCompletions& p : r.prompts()) {
    for (const v1::Completion& c : p.completions()) {
      std::vector<int64_t> row(c.tokens().begin(), c.tokens().end());
      for (float lp : c.logprobs()) {
        uint32_t b = 0;
        std::memcpy(&b, &lp, 4);
        row.push_back(b);
      }
      out.push_back(row);
    }
  }
  return out;
}

TEST_F(SamplerSnapshotServiceTest, ASnapshotSamplesItsStepWhileTrainingGoesOnAndAfterSigkill) {
  Start();
  const std::string job = CreateGpt();
  for (int64_t s = 1; s <= 2; ++s) ASSERT_TRUE(RuleStep(job, s).ok());
  v1::SaveSamplerSnapshotResponse saved;
  ASSERT_TRUE(Save(job, "", &saved).ok());
  EXPECT_EQ(saved.snapshot().name(), "step-2");
  EXPECT_EQ(saved.snapshot().step(), 2);
  EXPECT_GT(saved.snapshot().bytes(), 0);
  v1::SampleResponse taken;
  ASSERT_TRUE(Sample(job, "step-2", &taken).ok());

  // The training forward at the snapshot's step: step 3's forward (the
  // weights before its update), an importance-sampling loss on the
  // samples, reports their log-probs with no mismatch at all.
  v1::StepRequest rl;
  rl.set_job_id(job);
  rl.set_sequence(3);
  rl.set_loss_fn(v1::LOSS_FN_IMPORTANCE_SAMPLING);
  rl.set_return_logprobs(true);
  const std::vector<std::vector<int64_t>> prompts = Prompts();
  for (int p = 0; p < taken.prompts_size(); ++p) {
    for (const v1::Completion& c : taken.prompts(p).completions()) {
      std::vector<int32_t> seq(prompts[static_cast<size_t>(p)].begin(),
                               prompts[static_cast<size_t>(p)].end());
      seq.insert(seq.end(), c.tokens().begin(), c.tokens().end());
      const auto t = static_cast<int64_t>(seq.size() - 1);
      const auto prompt_len = static_cast<int64_t>(prompts[static_cast<size_t>(p)].size());
      std::vector<int32_t> targets(seq.begin() + 1, seq.end());
      std::vector<float> q(static_cast<size_t>(t), 0.0f);
      for (int64_t i = 0; i < t; ++i) {
        if (i < prompt_len - 1) {
          targets[static_cast<size_t>(i)] = -100;
        } else {
          q[static_cast<size_t>(i)] = c.logprobs(static_cast<int>(i - (prompt_len - 1)));
        }
      }
      v1::MicroBatch* mb = rl.add_micro_batches();
      *mb->mutable_inputs() = Ids({1, t}, std::vector<int32_t>(seq.begin(), seq.end() - 1));
      *mb->mutable_targets() = Ids({1, t}, targets);
      *mb->mutable_advantages() = F32({1, t}, std::vector<float>(static_cast<size_t>(t), 1.0f));
      *mb->mutable_sampling_logprobs() = F32({1, t}, q);
    }
  }
  v1::StepResponse rl_response;
  const grpc::Status rl_status =
      Call([&](grpc::ClientContext* c) { return client_->stub().Step(c, rl, &rl_response); });
  ASSERT_TRUE(rl_status.ok()) << rl_status.error_message();
  ASSERT_TRUE(rl_response.has_logprob_mismatch());
  EXPECT_EQ(rl_response.logprob_mismatch(), 0.0f);

  // The job trains on; the snapshot samples the same bits.
  for (int64_t s = 4; s <= 5; ++s) ASSERT_TRUE(RuleStep(job, s).ok());
  v1::SampleResponse later;
  ASSERT_TRUE(Sample(job, "step-2", &later).ok());
  EXPECT_EQ(Flatten(later), Flatten(taken));
  v1::SampleResponse live;
  ASSERT_TRUE(Sample(job, "", &live).ok());
  EXPECT_NE(Flatten(live), Flatten(taken));

  // SIGKILL: no final checkpoint. The job is back at its last checkpoint
  // (its creation's, step 0); the snapshot at its step, with its bits.
  Kill();
  Start();
  absl::StatusOr<v1::Job> restored = client_->GetJob(job);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 0);
  EXPECT_EQ(List(job), std::vector<std::string>{"step-2@2"});
  v1::SampleResponse after;
  ASSERT_TRUE(Sample(job, "step-2", &after).ok());
  EXPECT_EQ(Flatten(after), Flatten(taken));

  // Deleted, it stays deleted across a restart.
  ASSERT_TRUE(Delete(job, "step-2").ok());
  EXPECT_TRUE(List(job).empty());
  Kill();
  Start();
  EXPECT_TRUE(List(job).empty());
}

TEST_F(SamplerSnapshotServiceTest, RefusalsCarryTheReasonAndTheField) {
  Start();
  const std::string job = CreateGpt();
  ASSERT_TRUE(RuleStep(job, 1).ok());
  // An unknown name: NOT_FOUND, for Sample and Delete alike.
  v1::SampleResponse response;
  for (const grpc::Status& s : {Sample(job, "nope", &response), Delete(job, "nope")}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    const google::rpc::ErrorInfo info = InfoOf(s);
    EXPECT_EQ(info.reason(), "SNAPSHOT_NOT_FOUND");
    EXPECT_EQ(Meta(info, "field"), "snapshot");
    EXPECT_EQ(Meta(info, "snapshot"), "nope");
  }
  // A name held for other weights.
  ASSERT_TRUE(Save(job, "v1").ok());
  ASSERT_TRUE(Save(job, "v1").ok());  // a resend
  ASSERT_TRUE(RuleStep(job, 2).ok());
  const grpc::Status exists = Save(job, "v1");
  EXPECT_EQ(exists.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(InfoOf(exists).reason(), "SNAPSHOT_EXISTS");
  // A malformed name.
  const grpc::Status bad = Save(job, "a/b");
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Meta(InfoOf(bad), "field"), "snapshot");
  // Another job id: the job's NOT_FOUND.
  EXPECT_EQ(InfoOf(Save("job-000000000000", "x")).reason(), "JOB_NOT_FOUND");
}

TEST_F(SamplerSnapshotServiceTest, TheMemoryLimitRefusesASnapshotThatDoesNotFit) {
  Start();
  const std::string job = CreateGpt();
  v1::SaveSamplerSnapshotResponse saved;
  ASSERT_TRUE(Save(job, "a", &saved).ok());
  absl::StatusOr<v1::Job> created = client_->GetJob(job);
  ASSERT_TRUE(created.ok());
  const int64_t bytes = saved.snapshot().bytes();
  server_->Signal(SIGTERM);
  server_->Wait(std::chrono::seconds(60));
  // Room for the job, its restored snapshot and half of another.
  Start({absl::StrCat("--max-memory-bytes=", created->estimated_bytes() + bytes + bytes / 2)});
  EXPECT_EQ(List(job), std::vector<std::string>{"a@0"});
  const grpc::Status refused = Save(job, "b");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  const google::rpc::ErrorInfo info = InfoOf(refused);
  EXPECT_EQ(info.reason(), "MEMORY_LIMIT");
  EXPECT_EQ(Meta(info, "field"), "snapshot");
  EXPECT_EQ(Meta(info, "requested_bytes"), absl::StrCat(bytes));
  ASSERT_TRUE(Delete(job, "a").ok());
  EXPECT_TRUE(Save(job, "b").ok());
}

}  // namespace
}  // namespace ampd
