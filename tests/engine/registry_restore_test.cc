// JobRegistry::RestoreAll with the engine alone (this test links no rpc
// code): jobs come back from the ampd.config their checkpoints carry, with
// no decoder given; a checkpoint of the earlier ampd.create_request format
// is left on disk when no decoder is given and restores through one that
// is.
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "server/engine/config/job_config_codec.h"
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
    // The default when the request was written (pytorch's is false now).
    config.scaler.raise_at_min_scale = true;
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

// The bytes of a job's checkpoints and state dicts, pinned by files that
// the code wrote before the step count and the optimizer's count had one
// owner each (tests/data/README.md). No step runs here: its timings and
// the CPU's arithmetic would vary, while restoring, exporting, importing
// and checkpointing move every tensor and every ampd.* key as it is.
class CheckpointBytes : public LegacyCheckpoint {
 protected:
  static std::string Golden(const std::string& name) {
    return test_support::ReadFile(std::filesystem::path(AMPD_TEST_DATA_DIR) / name);
  }

  // On a mismatch the actual bytes are left in the test's temporary
  // directory, to compare with a safetensors reader.
  static void ExpectGolden(const std::string& actual, const std::string& name) {
    const std::string golden = Golden(name);
    if (actual == golden) return;
    const std::filesystem::path out = std::filesystem::path(::testing::TempDir()) / name;
    std::ofstream(out, std::ios::binary) << actual;
    ADD_FAILURE() << name << ": " << actual.size() << " bytes differ from the " << golden.size()
                  << " recorded; written to " << out;
  }

  static absl::StatusOr<JobConfigRecord> Decode(absl::string_view) {
    return JobConfigRecord{LegacyConfig(), "req-legacy"};
  }

  static std::string Bytes(const checkpoint::EncodedSafetensors& file) {
    std::string bytes;
    file.CopyOut(0, file.size(), &bytes);
    return bytes;
  }

  static absl::StatusOr<checkpoint::EncodedSafetensors> Export(JobRegistry& registry,
                                                               const std::string& job_id) {
    std::promise<absl::StatusOr<checkpoint::EncodedSafetensors>> exported;
    registry.Submit("", job_id, ExportStateRequest{StateView::kFull},
                    [&](absl::StatusOr<checkpoint::EncodedSafetensors> file) {
                      exported.set_value(std::move(file));
                    });
    return exported.get_future().get();
  }
};

TEST_F(CheckpointBytes, RestoredJobExportsAndCheckpointsTheRecordedBytes) {
  auto registry = Open(root_.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  ASSERT_TRUE((*registry)->RestoreAll(&Decode).ok());
  absl::StatusOr<checkpoint::EncodedSafetensors> exported = Export(**registry, "job-02aa4f8e7b3a");
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectGolden(Bytes(*exported), "golden-restored-export.safetensors");
  ASSERT_TRUE((*registry)->CheckpointAll().ok());
  ExpectGolden(test_support::ReadFile(file_), "golden-restored-checkpoint.safetensors");
}

TEST_F(CheckpointBytes, ImportKeepsTheJobsSequenceAndCheckpointsTheRecordedBytes) {
  const std::filesystem::path dir = root_.path() / "import";
  std::filesystem::create_directories(dir);
  auto registry = Open(dir);
  ASSERT_TRUE(registry.ok()) << registry.status();
  absl::StatusOr<JobSnapshot> job = Create(**registry, LegacyConfig(), "req-import");
  ASSERT_TRUE(job.ok()) << job.status();
  absl::StatusOr<checkpoint::StateDict> file =
      checkpoint::DecodeSafetensors(test_support::ReadFile(file_));
  ASSERT_TRUE(file.ok()) << file.status();
  std::promise<absl::StatusOr<int64_t>> imported;
  (*registry)->Submit("", job->job_id, ImportStateRequest{*std::move(file), /*partial=*/false},
                      [&](absl::StatusOr<int64_t> n) { imported.set_value(std::move(n)); });
  absl::StatusOr<int64_t> tensors = imported.get_future().get();
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(*tensors, 12);  // 2 Linear layers x (weight, bias) x (master, exp_avg, exp_avg_sq)
  // The weights, moments, optimizer count and scaler came from the file;
  // the step sequence is the job's own.
  absl::StatusOr<JobSnapshot> after = (*registry)->GetJob("", job->job_id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->step, 0);
  EXPECT_EQ(after->applied_steps, 4);
  EXPECT_EQ(after->scaler.scale, 256.0f);
  // GetStateDict says the same: one count of Step calls, the job's.
  absl::StatusOr<checkpoint::EncodedSafetensors> exported = Export(**registry, job->job_id);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->state.metadata.at("ampd.step"), "0");
  EXPECT_EQ(exported->state.metadata.at("optimizer.step"), "4");
  ASSERT_TRUE((*registry)->CheckpointAll().ok());
  ExpectGolden(test_support::ReadFile(dir / (job->job_id + ".safetensors")),
               "golden-imported-checkpoint.safetensors");
}

}  // namespace
}  // namespace ampd::engine
