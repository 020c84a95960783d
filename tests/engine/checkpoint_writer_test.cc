// CheckpointWriter against a real StateDirectory: the newest snapshot of a
// job is the one left on disk, Cancel keeps a queued snapshot from ever being
// written, and Shutdown writes what is still queued.
#include "server/engine/jobs/checkpoint_writer.h"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/engine/checkpoint/state_directory.h"
#include "tests/support/temp_dir.h"

namespace ampd::engine {
namespace {

using checkpoint::StateDict;
using checkpoint::StateDirectory;

// A state of ~8 MB whose bytes and metadata name the step it was taken at.
StateDict StateAt(int64_t step) {
  StateDict state;
  HostTensor t;
  t.dtype = codec::DType::kF32;
  t.shape = {1 << 21};
  t.data.assign(size_t{4} << 21, static_cast<char>(step));
  state.tensors.push_back({"model.0.weight", std::move(t)});
  state.metadata["ampd.step"] = absl::StrCat(step);
  return state;
}

class CheckpointWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<StateDirectory> dir = StateDirectory::Open((root_.path() / "state").string());
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_.emplace(*std::move(dir));
  }
  std::string StepOnDisk(const std::string& job_id) {
    absl::StatusOr<StateDict> state = dir_->Read(job_id);
    if (!state.ok()) return state.status().ToString();
    return state->metadata.at("ampd.step");
  }

  test_support::TempDir root_{"ampd_checkpoint_writer_test"};
  std::optional<StateDirectory> dir_;
};

TEST_F(CheckpointWriterTest, TheNewestSnapshotOfEachJobEndsOnDisk) {
  CheckpointWriter writer(&*dir_, 1);
  for (int64_t step = 1; step <= 20; ++step) {
    writer.Enqueue("job-a", step, StateAt(step));
    writer.Enqueue("job-b", 100 + step, StateAt(100 + step));
  }
  writer.Flush();
  EXPECT_EQ(StepOnDisk("job-a"), "20");
  EXPECT_EQ(StepOnDisk("job-b"), "120");
  absl::StatusOr<StateDict> a = dir_->Read("job-a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->tensors[0].tensor.data, StateAt(20).tensors[0].tensor.data);
}

TEST_F(CheckpointWriterTest, CancelThenRemoveLeavesNoFileBehind) {
  CheckpointWriter writer(&*dir_, 2);
  for (int round = 0; round < 10; ++round) {
    const std::string id = absl::StrCat("job-", round);
    writer.Enqueue(id, 1, StateAt(1));
    writer.Enqueue(id, 2, StateAt(2));
    writer.Cancel(id);
    ASSERT_TRUE(dir_->Remove(id).ok());
  }
  writer.Shutdown();  // drains whatever is queued: nothing of these jobs
  absl::StatusOr<std::vector<std::string>> left = dir_->ListJobs();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty()) << (*left)[0];
}

TEST_F(CheckpointWriterTest, ShutdownWritesWhatIsQueuedAndRefusesMore) {
  CheckpointWriter writer(&*dir_, 1);
  for (int i = 0; i < 4; ++i) writer.Enqueue(absl::StrCat("job-", i), 7, StateAt(7));
  writer.Shutdown();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(StepOnDisk(absl::StrCat("job-", i)), "7");
  writer.Enqueue("job-late", 1, StateAt(1));
  writer.Flush();
  EXPECT_FALSE(std::filesystem::exists(root_.path() / "state" / "job-late.safetensors"));
}

}  // namespace
}  // namespace ampd::engine
