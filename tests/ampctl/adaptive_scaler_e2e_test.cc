// The adaptive loss scaler end to end: the real ampd (--device=cpu, so
// every run is deterministic) and the real ampctl on the built-in synthetic
// task, `ampctl train --precision=fp16 --steps=300 --seed=7`. The default
// pytorch policy skips its opening steps while it backs off from 65536 (and
// one more later); adaptive calibrates its start and skips none. Its final
// loss (mean of the last 20 steps) is checked against the same job in fp32,
// which never skips: on this task the loss is still falling steeply at step
// 300, so every update pytorch skips leaves it visibly behind (about 2%),
// while adaptive must land on fp32's loss. With the loss multiplied by 100,
// pytorch skips more steps still and adaptive, with no init_scale tuning,
// again none; with frequent growth, pytorch's overflowing growths cost steps
// that adaptive defers. docs/DESIGN.md's comparison table comes from these
// commands.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

constexpr auto kRunDeadline = std::chrono::seconds(300);
constexpr int kSteps = 300;
constexpr int kLastSteps = 20;

struct TrainRun {
  int steps = 0;
  int skipped = 0;
  int growths_deferred = 0;
  double final_loss = 0;                  // mean over the last kLastSteps steps
  float first_scale = 0;                  // the scale step 1 ran at
  int layer_groups = 0;                   // per-layer scales: the last step's group count
  std::vector<double> last_layer_scales;  // per-layer scales after the last step
  std::string job_id;
  std::vector<double> losses;         // per step
  std::vector<int64_t> applied_steps;  // per step: optimizer updates applied by then
};

// Mean loss of `run`'s steps whose applied-update count is one of `other`'s
// last kLastSteps steps': the two runs compared at the same number of
// updates rather than of steps (0 when none matches).
double MeanLossAtUpdatesOf(const TrainRun& run, const TrainRun& other) {
  double sum = 0;
  int n = 0;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    for (size_t j = other.applied_steps.size() - kLastSteps; j < other.applied_steps.size(); ++j) {
      if (run.applied_steps[i] != other.applied_steps[j]) continue;
      sum += run.losses[i];
      ++n;
      break;
    }
  }
  return n > 0 ? sum / n : 0.0;
}

class AdaptiveScalerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<AmpdProcess>(
        AMPD_SERVER_BINARY,
        std::vector<std::string>{"--state-dir=" + (root_.path() / "state").string()},
        root_.path() / "ampd.log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
    server_.reset();
  }

  // `ampctl train --steps=300 --seed=7 --json` plus `flags`,
  // summarised from its per-step JSON lines.
  TrainRun Train(const std::vector<std::string>& flags, int steps = kSteps) {
    std::vector<std::string> args = {AMPCTL_BINARY, "--server=" + server_->address(),
                                     "train",       absl::StrCat("--steps=", steps),
                                     "--seed=7",    "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    const CommandResult result = RunCommand(args, kRunDeadline);
    EXPECT_EQ(result.status.code, 0) << "stdout:\n" << result.out << "stderr:\n" << result.err;
    TrainRun run;
    std::vector<double> losses;
    for (absl::string_view line : absl::StrSplit(result.out, '\n', absl::SkipEmpty())) {
      google::protobuf::Struct s;
      const auto status = google::protobuf::util::JsonStringToMessage(std::string(line), &s);
      EXPECT_TRUE(status.ok()) << "not JSON: " << line;
      if (!status.ok()) continue;
      const auto& f = s.fields();
      ++run.steps;
      run.job_id = f.at("job_id").string_value();
      if (run.steps == 1) run.first_scale = static_cast<float>(f.at("scale_before").number_value());
      run.skipped += f.at("skipped").bool_value() ? 1 : 0;
      run.growths_deferred += f.at("growth_deferred").bool_value() ? 1 : 0;
      losses.push_back(f.at("loss").number_value());
      run.applied_steps.push_back(static_cast<int64_t>(f.at("applied_steps").number_value()));
      if (f.contains("layer_scales")) {
        run.last_layer_scales.clear();
        for (const auto& v : f.at("layer_scales").list_value().values()) {
          run.last_layer_scales.push_back(v.number_value());
        }
        run.layer_groups = static_cast<int>(run.last_layer_scales.size());
      }
    }
    EXPECT_EQ(run.steps, steps) << result.out;
    if (losses.size() >= kLastSteps) {
      double sum = 0;
      for (size_t i = losses.size() - kLastSteps; i < losses.size(); ++i) sum += losses[i];
      run.final_loss = sum / kLastSteps;
    }
    run.losses = losses;
    return run;
  }

  TempDir root_{"ampd_adaptive_e2e"};
  std::unique_ptr<AmpdProcess> server_;
};

TEST_F(AdaptiveScalerE2eTest, SkipsNoStepWherePyTorchSkipsAndEndsAtTheSameLoss) {
  const TrainRun pytorch = Train({"--precision=fp16", "--scaler=pytorch"});
  const TrainRun adaptive = Train({"--precision=fp16", "--scaler=adaptive"});
  const TrainRun fp32 = Train({"--precision=fp32"});
  EXPECT_GE(pytorch.skipped, 2);
  EXPECT_EQ(pytorch.first_scale, 65536.0f);
  EXPECT_EQ(adaptive.skipped, 0);
  EXPECT_LT(adaptive.first_scale, 65536.0f);  // calibrated, not the default start
  EXPECT_EQ(fp32.skipped, 0);
  ASSERT_GT(fp32.final_loss, 0.0);
  EXPECT_LE(std::fabs(adaptive.final_loss - fp32.final_loss) / fp32.final_loss, 1e-3)
      << "adaptive " << adaptive.final_loss << " fp32 " << fp32.final_loss;
  EXPECT_LE(adaptive.final_loss, pytorch.final_loss);
  // The gap is pytorch's skipped updates, not numerics: at the same number
  // of applied updates the two agree within 0.5%.
  const double at_updates = MeanLossAtUpdatesOf(adaptive, pytorch);
  EXPECT_LE(std::fabs(at_updates - pytorch.final_loss) / pytorch.final_loss, 5e-3)
      << "adaptive at pytorch's update counts " << at_updates << ", pytorch "
      << pytorch.final_loss;
}

TEST_F(AdaptiveScalerE2eTest, LossMultipliedByAHundredSkipsNoStepWithoutTuning) {
  const TrainRun pytorch = Train({"--precision=fp16", "--scaler=pytorch", "--loss-multiplier=100"});
  const TrainRun adaptive =
      Train({"--precision=fp16", "--scaler=adaptive", "--loss-multiplier=100"});
  const TrainRun fp32 = Train({"--precision=fp32", "--loss-multiplier=100"});
  EXPECT_GT(pytorch.skipped, 2);
  EXPECT_EQ(adaptive.skipped, 0);
  EXPECT_LT(adaptive.first_scale, pytorch.first_scale);
  ASSERT_GT(fp32.final_loss, 0.0);
  EXPECT_LE(std::fabs(adaptive.final_loss - fp32.final_loss) / fp32.final_loss, 1e-3)
      << "adaptive " << adaptive.final_loss << " fp32 " << fp32.final_loss;
}

// Per-layer scales (--per-layer-scales) on the synthetic task's two
// Linear layers: two group scales on every step, no step skipped, and the
// loss of one adaptive scale; refused for a framework policy.
TEST_F(AdaptiveScalerE2eTest, PerLayerScalesTrainAsOneScaleOnTheSyntheticTask) {
  const TrainRun layered = Train({"--precision=fp16", "--scaler=adaptive", "--per-layer-scales"});
  const TrainRun adaptive = Train({"--precision=fp16", "--scaler=adaptive"});
  EXPECT_EQ(layered.layer_groups, 2);
  EXPECT_EQ(adaptive.layer_groups, 0);
  EXPECT_EQ(layered.skipped, 0);
  ASSERT_GT(adaptive.final_loss, 0.0);
  EXPECT_LE(std::fabs(layered.final_loss - adaptive.final_loss) / adaptive.final_loss, 1e-3)
      << "per-layer " << layered.final_loss << " adaptive " << adaptive.final_loss;

  const CommandResult refused =
      RunCommand({AMPCTL_BINARY, "--server=" + server_->address(), "train", "--steps=1",
                  "--scaler=pytorch", "--per-layer-scales"},
                 kRunDeadline);
  EXPECT_NE(refused.status.code, 0);
  EXPECT_NE(refused.err.find("config.scaler.per_layer_scales: applies to adaptive only"),
            std::string::npos)
      << refused.err;
}

// Per-layer scales on a GPT, one per block: three scales on every step, no
// step skipped, adaptive's loss; GetJob (`ampctl jobs get`) reports the
// scales the next step will use, the last step's.
TEST_F(AdaptiveScalerE2eTest, PerLayerScalesOnAGptOnePerBlockReportedByGetJob) {
  const std::vector<std::string> gpt = {"--layers=gpt:64:32:64:3:4", "--precision=fp16",
                                        "--scaler=adaptive"};
  std::vector<std::string> per_layer = gpt;
  per_layer.push_back("--per-layer-scales");
  constexpr int kGptSteps = 60;
  const TrainRun layered = Train(per_layer, kGptSteps);
  const TrainRun adaptive = Train(gpt, kGptSteps);
  EXPECT_EQ(layered.layer_groups, 3);
  EXPECT_EQ(layered.skipped, 0);
  ASSERT_GT(adaptive.final_loss, 0.0);
  EXPECT_LE(std::fabs(layered.final_loss - adaptive.final_loss) / adaptive.final_loss, 1e-3)
      << "per-layer " << layered.final_loss << " adaptive " << adaptive.final_loss;

  const CommandResult got = RunCommand(
      {AMPCTL_BINARY, "--server=" + server_->address(), "jobs", "get", "--job=" + layered.job_id},
      kRunDeadline);
  ASSERT_EQ(got.status.code, 0) << got.err;
  google::protobuf::Struct job;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(got.out, &job).ok()) << got.out;
  std::vector<double> reported;
  for (const auto& v : job.fields().at("layer_scales").list_value().values()) {
    reported.push_back(v.number_value());
  }
  EXPECT_EQ(reported, layered.last_layer_scales) << got.out;
  EXPECT_EQ(job.fields().at("loss_scale").number_value(), layered.last_layer_scales.back());
}

// Frequent scheduled growth: pytorch's growths overflow and each costs a
// step; adaptive reads from max|g| that the doubled scale would leave its
// margin and defers them.
TEST_F(AdaptiveScalerE2eTest, GrowthsThatWouldOverflowAreDeferredNotSkipped) {
  const TrainRun pytorch = Train({"--precision=fp16", "--scaler=pytorch", "--growth-interval=50"});
  const TrainRun adaptive =
      Train({"--precision=fp16", "--scaler=adaptive", "--growth-interval=50"});
  const TrainRun slow = Train({"--precision=fp16", "--scaler=pytorch"});
  EXPECT_GT(pytorch.skipped, slow.skipped);  // growths that overflowed
  EXPECT_EQ(adaptive.skipped, 0);
  EXPECT_GE(adaptive.growths_deferred, 1);
  EXPECT_EQ(pytorch.growths_deferred, 0);
}

}  // namespace
}  // namespace ampd
