// Seed-only checkpoints (job.h's kMetaInitialState): a job that is still
// what its config and seed made checkpoints its config alone, however large
// its model, and a restore rebuilds the same weights and optimizer state bit
// for bit. Once the job has stepped or loaded a state its checkpoints are
// full again. A seed-only file that is damaged, names another
// initialisation, holds tensors or is past step 0 is refused and left on
// disk. The seeded initialisation such files rely on is pinned here.
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/engine/checkpoint/state_dict.h"
#include "server/engine/jobs/job.h"
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
  options.worker_threads = 2;
  return JobRegistry::Create(options);
}

absl::StatusOr<JobSnapshot> Create(JobRegistry& registry, const JobConfig& config) {
  std::promise<absl::StatusOr<JobSnapshot>> created;
  registry.CreateJob("", config, "",
                     [&](absl::StatusOr<JobSnapshot> s) { created.set_value(std::move(s)); });
  return created.get_future().get();
}

// The job's state as GetStateDict sends it: every byte of the file.
std::string Export(JobRegistry& registry, const std::string& job_id) {
  std::promise<absl::StatusOr<checkpoint::EncodedSafetensors>> exported;
  registry.Submit("", job_id, ExportStateRequest{StateView::kFull},
                  [&](absl::StatusOr<checkpoint::EncodedSafetensors> file) {
                    exported.set_value(std::move(file));
                  });
  absl::StatusOr<checkpoint::EncodedSafetensors> file = exported.get_future().get();
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return "";
  std::string bytes;
  file->CopyOut(0, file->size(), &bytes);
  return bytes;
}

absl::StatusOr<StepReport> Step(JobRegistry& registry, const std::string& job_id, int64_t sequence,
                                StepInput input) {
  std::promise<absl::StatusOr<StepReport>> stepped;
  registry.Submit("", job_id, StepRequest{sequence, std::move(input)},
                  [&](absl::StatusOr<StepReport> r) { stepped.set_value(std::move(r)); });
  return stepped.get_future().get();
}

// Every layer kind with parameters, AdamW moments, fp16 working copies.
JobConfig LayersConfig(uint64_t seed) {
  JobConfig config = DefaultJobConfig(Precision::kFp16);
  config.model.layers = {Embedding(50, 12), Linear(12, 24), Act(LayerKind::kGELU), LayerNorm(24),
                         Linear(24, 5, false)};
  config.model.loss = model::LossKind::kCrossEntropy;
  config.seed = seed;
  return config;
}

JobConfig GptConfig(uint64_t seed) {
  JobConfig config = DefaultJobConfig(Precision::kBf16);
  model::GptSpec g;
  g.vocab_size = 40;
  g.context_length = 8;
  g.d_model = 16;
  g.n_layer = 2;
  g.n_head = 2;
  config.model.kind = g;
  config.model.loss = model::LossKind::kCrossEntropy;
  config.seed = seed;
  return config;
}

StepInput LayersBatch() {
  StepInput input;
  input.micro_batches.push_back({I32({4}, {1, 7, 49, 3}), I32({4}, {0, 4, 2, 1})});
  return input;
}

class SeedCheckpoint : public ::testing::Test {
 protected:
  std::filesystem::path File(const std::string& job_id) const {
    return root_.path() / (job_id + ".safetensors");
  }
  checkpoint::StateDict ReadCheckpoint(const std::string& job_id) const {
    absl::StatusOr<checkpoint::StateDict> state =
        checkpoint::DecodeSafetensors(test_support::ReadFile(File(job_id)));
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *std::move(state) : checkpoint::StateDict{};
  }
  void WriteCheckpoint(const std::string& job_id, const checkpoint::StateDict& state) const {
    std::ofstream(File(job_id), std::ios::binary | std::ios::trunc)
        << checkpoint::EncodeSafetensors(state);
  }

  // Creates a job of `config` on a registry that is then dropped without a
  // final checkpoint, as a killed server leaves it; returns its id and
  // state as exported before.
  std::string CreateAndDrop(const JobConfig& config, std::string* exported) {
    auto registry = Open(root_.path());
    EXPECT_TRUE(registry.ok()) << registry.status();
    if (!registry.ok()) return "";
    absl::StatusOr<JobSnapshot> job = Create(**registry, config);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return "";
    if (exported != nullptr) *exported = Export(**registry, job->job_id);
    return job->job_id;
  }

  test_support::TempDir root_{"ampd_seed_checkpoint_test"};
};

TEST_F(SeedCheckpoint, CreationWritesTheConfigAndSeedAlone) {
  const std::string id = CreateAndDrop(LayersConfig(5), nullptr);
  const checkpoint::StateDict saved = ReadCheckpoint(id);
  EXPECT_TRUE(saved.tensors.empty());
  EXPECT_EQ(saved.metadata.at(kMetaInitialState), kSeededInitialisation);
  EXPECT_EQ(saved.metadata.at(kMetaStep), "0");
  EXPECT_TRUE(saved.metadata.contains(kMetaConfig));
  EXPECT_TRUE(saved.metadata.contains(kMetaConfigDigest));
  EXPECT_LT(std::filesystem::file_size(File(id)), 8192u);
}

// The restore after a crash at step 0 is the job as created, bit for bit:
// weights, moments, scaler state and counts, for a layer stack and a GPT.
TEST_F(SeedCheckpoint, RestoresTheCreatedStateBitForBit) {
  for (const JobConfig& config : {LayersConfig(5), GptConfig(11)}) {
    SCOPED_TRACE(config.model.gpt() != nullptr ? "gpt" : "layers");
    std::string created;
    const std::string id = CreateAndDrop(config, &created);
    ASSERT_FALSE(created.empty());
    auto registry = Open(root_.path());
    ASSERT_TRUE(registry.ok()) << registry.status();
    ASSERT_TRUE((*registry)->RestoreAll().ok());
    absl::StatusOr<JobSnapshot> job = (*registry)->GetJob("", id);
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->step, 0);
    EXPECT_TRUE(Export(**registry, id) == created) << "the restored state differs";
    // Still untouched: its shutdown checkpoint stays seed-only.
    ASSERT_TRUE((*registry)->CheckpointAll().ok());
    EXPECT_TRUE(ReadCheckpoint(id).tensors.empty());
  }
}

// A step or an import changes the state: from then on every checkpoint
// holds it in full, and restores it.
TEST_F(SeedCheckpoint, CheckpointsAreFullOnceTheJobHasChanged) {
  auto registry = Open(root_.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  absl::StatusOr<JobSnapshot> stepped = Create(**registry, LayersConfig(5));
  absl::StatusOr<JobSnapshot> imported = Create(**registry, LayersConfig(6));
  ASSERT_TRUE(stepped.ok() && imported.ok());
  ASSERT_TRUE(Step(**registry, stepped->job_id, 1, LayersBatch()).ok());
  absl::StatusOr<checkpoint::StateDict> other =
      checkpoint::DecodeSafetensors(Export(**registry, stepped->job_id));
  ASSERT_TRUE(other.ok()) << other.status();
  std::promise<absl::StatusOr<int64_t>> loaded;
  (*registry)->Submit("", imported->job_id,
                      ImportStateRequest{*std::move(other), /*partial=*/false},
                      [&](absl::StatusOr<int64_t> n) { loaded.set_value(std::move(n)); });
  ASSERT_TRUE(loaded.get_future().get().ok());
  // The import is checkpointed before it is acknowledged.
  const checkpoint::StateDict after_import = ReadCheckpoint(imported->job_id);
  EXPECT_FALSE(after_import.tensors.empty());
  EXPECT_FALSE(after_import.metadata.contains(kMetaInitialState));
  ASSERT_TRUE((*registry)->CheckpointAll().ok());
  const checkpoint::StateDict after_step = ReadCheckpoint(stepped->job_id);
  EXPECT_FALSE(after_step.tensors.empty());
  EXPECT_FALSE(after_step.metadata.contains(kMetaInitialState));
  EXPECT_EQ(after_step.metadata.at(kMetaStep), "1");
  const std::string state = Export(**registry, stepped->job_id);
  registry->reset();

  auto restarted = Open(root_.path());
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ASSERT_TRUE((*restarted)->RestoreAll().ok());
  EXPECT_TRUE(Export(**restarted, stepped->job_id) == state);
}

// Each kind of damage to a seed-only file: the job is not restored but
// listed as failed, with the damage named, and the file is left as it was
// (a registry's shutdown does not overwrite it), for an operator to
// inspect.
TEST_F(SeedCheckpoint, DamagedOrForeignSeedOnlyFilesAreRefusedAndKept) {
  const std::string id = CreateAndDrop(LayersConfig(5), nullptr);
  const checkpoint::StateDict good = ReadCheckpoint(id);
  const std::string& config = good.metadata.at(kMetaConfig);
  ASSERT_NE(config.find("\"seed\":5"), std::string::npos) << config;

  struct Damage {
    const char* label;
    checkpoint::StateDict state;
  };
  std::vector<Damage> damages;
  damages.push_back({"another seed", good});
  damages.back().state.metadata[kMetaConfig] =
      absl::StrReplaceAll(config, {{"\"seed\":5", "\"seed\":6"}});
  damages.push_back({"no digest", good});
  damages.back().state.metadata.erase(kMetaConfigDigest);
  damages.push_back({"another initialisation", good});
  damages.back().state.metadata[kMetaInitialState] = "seed:some-other-init:v9";
  damages.push_back({"past step 0", good});
  damages.back().state.metadata[kMetaStep] = "3";
  damages.push_back({"holds a tensor", good});
  damages.back().state.tensors.push_back({"model.1.weight", F32({1}, {0.5f})});

  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.label);
    WriteCheckpoint(id, damage.state);
    const std::string bytes = test_support::ReadFile(File(id));
    auto registry = Open(root_.path());
    ASSERT_TRUE(registry.ok()) << registry.status();
    ASSERT_TRUE((*registry)->RestoreAll().ok());
    absl::StatusOr<JobSnapshot> job = (*registry)->GetJob("", id);
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->state, JobState::kFailed);
    EXPECT_NE(job->failure.find("failed to restore: DATA_LOSS"), std::string::npos) << job->failure;
    ASSERT_TRUE((*registry)->CheckpointAll().ok());
    registry->reset();
    EXPECT_EQ(test_support::ReadFile(File(id)), bytes);
  }
  // The undamaged file still restores.
  WriteCheckpoint(id, good);
  auto registry = Open(root_.path());
  ASSERT_TRUE(registry.ok()) << registry.status();
  ASSERT_TRUE((*registry)->RestoreAll().ok());
  EXPECT_EQ((*registry)->job_count(), 1);
  EXPECT_EQ((*registry)->GetJob("", id)->state, JobState::kActive);
}

// FNV-1a 64 of the master weights' bytes, in the export's order.
std::string WeightsDigest(const JobConfig& config, int threads) {
  auto trainer = Trainer::Create(config, kernels::CreateCpuBackend(threads));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return "";
  absl::StatusOr<checkpoint::StateDict> state = (*trainer)->ExportState();
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return "";
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const checkpoint::NamedTensor& t : state->tensors) {
    for (const char c : t.name + t.tensor.data) {
      h ^= static_cast<unsigned char>(c);
      h *= 0x100000001b3ULL;
    }
  }
  return absl::StrFormat("%016x", h);
}

// The pin of kSeededInitialisation: what a config and seed make, on any
// thread count. Seed-only checkpoints written by earlier builds rely on it.
// If a change to the initialisation (model/init.cc, a model's parameter
// order or stream numbering) moves these digests, it must rename
// kSeededInitialisation (job.h), so that those files are refused with a
// clear error instead of restored with other weights; then record the new
// digests here.
TEST(SeededInitialisation, IsPinned) {
  EXPECT_STREQ(kSeededInitialisation, "seed:philox4x32-10:v1");
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    EXPECT_EQ(WeightsDigest(LayersConfig(5), threads), "7c1f05052f600c61");
    EXPECT_EQ(WeightsDigest(GptConfig(11), threads), "161e4a7f0da995af");
  }
}

}  // namespace
}  // namespace ampd::engine
