// JobRegistry::RestoreAll with the engine alone (this test links no rpc
// code): jobs come back from the ampd.config their checkpoints carry, with
// no decoder given; a checkpoint of the earlier ampd.create_request format
// is left on disk when no decoder is given and restores through one that
// is.
#include <filesystem>
#include <future>
#include <memory>
#include <string>

#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "server/engine/jobs/job_config_codec.h"
#include "server/engine/jobs/job_registry.h"
#include "tests/support/temp_dir.h"

namespace ampd::engine {
namespace {

using model::LayerKind;
using model::Precision;
using namespace ampd::engine::testing;

absl::StatusOr<std::unique_ptr<JobRegistry>> Open(const std::filesystem::path& dir) {
  RegistryOptions options;
  options.state_dir = dir.string();
  options.worker_threads = 1;
  return JobRegistry::Create(options);
}

absl::StatusOr<JobSnapshot> Create(JobRegistry& registry, const JobConfig& config,
                                   const std::string& request_id) {
  std::promise<absl::StatusOr<JobSnapshot>> created;
  registry.CreateJob("", config, request_id,
                     [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
  return created.get_future().get();
}

TEST(RegistryRestore, RestoresItsOwnCheckpointsWithoutAnyDecoder) {
  test_support::TempDir root("ampd_registry_restore_test");
  JobConfig config =
      DefaultJobConfig(Precision::kBf16, amp::ScalerPolicy::kDeepSpeed, optim::OptimizerKind::kSgd);
  config.model.layers = {Linear(3, 5), Act(LayerKind::kTanh), LayerNorm(5), Linear(5, 2)};
  config.optimizer.sgd.momentum = 0.5f;
  config.display_name = "own";
  config.seed = 99;
  std::string job_id;
  {
    auto registry = Open(root.path());
    ASSERT_TRUE(registry.ok()) << registry.status();
    absl::StatusOr<JobSnapshot> job = Create(**registry, config, "req-own");
    ASSERT_TRUE(job.ok()) << job.status();
    job_id = job->job_id;
    ASSERT_TRUE((*registry)->CheckpointAll().ok());
  }
  auto registry = Open(root.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  ASSERT_TRUE((*registry)->RestoreAll().ok());
  absl::StatusOr<JobSnapshot> restored = (*registry)->GetJob("", job_id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->request_id, "req-own");
  EXPECT_EQ(EncodeJobConfig(restored->config, ""), EncodeJobConfig(config, ""));
  // The request_id still names the job.
  absl::StatusOr<JobSnapshot> again = Create(**registry, config, "req-own");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job_id, job_id);
}

class LegacyCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::copy_file(std::filesystem::path(AMPD_TEST_DATA_DIR) /
                                   "legacy-create-request-job-02aa4f8e7b3a.safetensors",
                               file_);
  }

  // The config the checkpoint's CreateJobRequest describes (see
  // tests/data/README.md), as the rpc layer would translate it.
  static JobConfig LegacyConfig() {
    JobConfig config = DefaultJobConfig(Precision::kFp16, amp::ScalerPolicy::kPyTorch,
                                        optim::OptimizerKind::kAdam);
    config.display_name = "legacy-adam";
    config.seed = 7;
    config.model.layers = {Linear(16, 64), Act(LayerKind::kGELU), Linear(64, 4)};
    config.optimizer.adam.weight_decay = 0.01f;
    config.optimizer.max_grad_norm = 5.0f;
    config.scaler.init_scale = 128.0;
    config.scaler.growth_interval = 3;
    return config;
  }

  test_support::TempDir root_{"ampd_registry_legacy_test"};
  std::filesystem::path file_ = root_.path() / "job-02aa4f8e7b3a.safetensors";
};

TEST_F(LegacyCheckpoint, IsLeftOnDiskWithoutADecoder) {
  auto registry = Open(root_.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  ASSERT_TRUE((*registry)->RestoreAll().ok());
  EXPECT_EQ((*registry)->job_count(), 0);
  EXPECT_TRUE(std::filesystem::exists(file_));
}

TEST_F(LegacyCheckpoint, RestoresThroughTheDecoderGiven) {
  auto registry = Open(root_.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  std::string seen;
  ASSERT_TRUE((*registry)
                  ->RestoreAll([&](absl::string_view bytes) -> absl::StatusOr<JobConfigRecord> {
                    seen = std::string(bytes);
                    return JobConfigRecord{LegacyConfig(), "req-legacy"};
                  })
                  .ok());
  // The decoder got the base64-decoded CreateJobRequest, which names the job.
  EXPECT_NE(seen.find("legacy-adam"), std::string::npos);
  absl::StatusOr<JobSnapshot> job = (*registry)->GetJob("", "job-02aa4f8e7b3a");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step, 4);
  EXPECT_EQ(job->scaler.scale, 256.0f);
  EXPECT_EQ(job->request_id, "req-legacy");

  // A decoded config the engine refuses is not restored.
  auto other = Open(root_.path() / "other");
  ASSERT_TRUE(other.ok());
  std::filesystem::copy_file(file_, root_.path() / "other" / "job-02aa4f8e7b3a.safetensors");
  ASSERT_TRUE((*other)
                  ->RestoreAll([&](absl::string_view) -> absl::StatusOr<JobConfigRecord> {
                    JobConfigRecord record{LegacyConfig(), ""};
                    record.config.optimizer.adam.beta1 = 1.0f;
                    return record;
                  })
                  .ok());
  EXPECT_EQ((*other)->job_count(), 0);
}

}  // namespace
}  // namespace ampd::engine
