// Every state a job can reach, it can restore: jobs of every scaler policy
// (per-layer scales included) are driven into edge states (the scale at the
// top of float32 or of its cap, at the smallest usable scale and at the
// smallest float32, counters at the ends of their ranges, the job failed by
// its scaler), and after each action the checkpoint on disk is restored by
// a second registry, which must hold the same job (state, failure, step,
// scaler) and write the same checkpoint, byte for byte.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/jobs/job_registry.h"
#include "tests/support/temp_dir.h"

namespace ampd::engine {
namespace {

using model::LayerKind;
using model::Precision;
using namespace ampd::engine::testing;

constexpr int64_t kRows = 4;

absl::StatusOr<std::unique_ptr<JobRegistry>> Open(const std::filesystem::path& dir) {
  RegistryOptions options;
  options.state_dir = dir.string();
  options.worker_threads = 1;
  // Every step's checkpoint is on disk before it is answered.
  options.checkpoint_every = 1;
  options.checkpoint_sync = true;
  return JobRegistry::Create(options);
}

// The registry's asynchronous calls, waited for.
template <typename T, typename Call>
T Wait(Call&& call) {
  std::promise<T> promise;
  call([&](T value) { promise.set_value(std::move(value)); });
  return promise.get_future().get();
}

StepInput Batch(uint64_t seed, bool overflow) {
  DataRng rng(seed);
  StepInput input;
  MicroBatch mb;
  mb.inputs = F32({kRows, 4}, rng.UniformVector(kRows * 4, -1, 1));
  std::vector<float> targets = rng.UniformVector(kRows * 2, -1, 1);
  if (overflow) targets[0] = std::numeric_limits<float>::infinity();
  mb.targets = F32({kRows, 2}, targets);
  input.micro_batches.push_back(std::move(mb));
  return input;
}

struct Case {
  std::string name;
  JobConfig config;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const amp::ScalerPolicy policy :
       {amp::ScalerPolicy::kPyTorch, amp::ScalerPolicy::kPaddle, amp::ScalerPolicy::kDeepSpeed,
        amp::ScalerPolicy::kMegatron, amp::ScalerPolicy::kAdaptive}) {
    for (const bool per_layer : {false, true}) {
      if (per_layer && policy != amp::ScalerPolicy::kAdaptive) continue;
      JobConfig c = DefaultJobConfig(Precision::kFp16, policy);
      c.model.layers = {Linear(4, 8), Act(LayerKind::kReLU), Linear(8, 2)};
      c.scaler.growth_interval = 3;
      c.scaler.per_layer_scales = per_layer;
      // deepspeed's floor below every usable scale, so that the scale
      // itself reaches the smallest usable one.
      if (policy == amp::ScalerPolicy::kDeepSpeed) c.scaler.min_scale = std::ldexp(1.0, -149);
      if (policy == amp::ScalerPolicy::kMegatron) c.scaler.min_scale.reset();
      c.seed = 5;
      cases.push_back({absl::StrCat(amp::PolicyName(policy), per_layer ? "_per_layer" : ""), c});
    }
  }
  return cases;
}

class RestoreProperty : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto registry = Open(root_.path() / "live");
    ASSERT_TRUE(registry.ok()) << registry.status();
    live_ = *std::move(registry);
    absl::StatusOr<JobSnapshot> job = Wait<absl::StatusOr<JobSnapshot>>(
        [&](auto done) { live_->CreateJob("", GetParam().config, "", std::move(done)); });
    ASSERT_TRUE(job.ok()) << job.status();
    id_ = job->job_id;
  }

  // One Step with the next sequence; the answer (a refusal included).
  absl::StatusOr<StepReport> Step(bool overflow) {
    const int64_t sequence = live_->GetJob("", id_)->step + 1;
    return Wait<absl::StatusOr<StepReport>>([&](auto done) {
      live_->Submit("", id_,
                    StepRequest{sequence, Batch(static_cast<uint64_t>(sequence), overflow)},
                    std::move(done));
    });
  }

  // Overflowing steps until the scaler gives up (the job fails), at most n.
  void OverflowUntilFailed(int n) {
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<StepReport> r = Step(true);
      if (r.ok()) continue;
      const std::optional<ErrorReason> why = GetErrorReason(r.status());
      ASSERT_TRUE(why.has_value()) << r.status();
      EXPECT_EQ(why->reason, reason::kScalerAtMinScale) << r.status();
      EXPECT_EQ(live_->GetJob("", id_)->state, JobState::kFailed);
      return;
    }
    ADD_FAILURE() << "the job did not fail in " << n << " overflowing steps";
  }

  // Loads the job's own state with these scaler.* values replaced (with
  // per-layer scales, every group's scale and tracker set to the job-wide
  // one's).
  void LoadScalerState(const std::map<std::string, std::string>& values) {
    absl::StatusOr<checkpoint::EncodedSafetensors> exported =
        Wait<absl::StatusOr<checkpoint::EncodedSafetensors>>([&](auto done) {
          live_->Submit("", id_, ExportStateRequest{StateView::kFull}, std::move(done));
        });
    ASSERT_TRUE(exported.ok()) << exported.status();
    checkpoint::StateDict state = std::move(exported->state);
    for (const auto& [key, value] : values) {
      ASSERT_TRUE(state.metadata.contains("scaler." + key)) << key;
      state.metadata["scaler." + key] = value;
      if ((key == "scale" || key == "_growth_tracker") &&
          state.metadata.contains("scaler.layer_groups")) {
        for (int g = 0; state.metadata.contains(absl::StrCat("scaler.layer.", g, ".", key)); ++g) {
          state.metadata[absl::StrCat("scaler.layer.", g, ".", key)] = value;
        }
      }
    }
    absl::StatusOr<int64_t> loaded = Wait<absl::StatusOr<int64_t>>([&](auto done) {
      live_->Submit("", id_, ImportStateRequest{std::move(state), /*partial=*/false},
                    std::move(done));
    });
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }

  std::filesystem::path File(const std::filesystem::path& dir) const {
    return dir / (id_ + ".safetensors");
  }

  // The checkpoint on disk now, restored by another registry: the same job,
  // and the same checkpoint written again, byte for byte.
  void ExpectRestoresBitForBit(const std::string& after) {
    SCOPED_TRACE(after);
    const std::filesystem::path copy = root_.path() / absl::StrCat("restore-", restores_++);
    std::filesystem::create_directories(copy);
    std::filesystem::copy_file(File(root_.path() / "live"), File(copy));
    const std::string written = test_support::ReadFile(File(copy));
    auto other = Open(copy);
    ASSERT_TRUE(other.ok()) << other.status();
    ASSERT_TRUE((*other)->RestoreAll().ok());
    absl::StatusOr<JobSnapshot> restored = (*other)->GetJob("", id_);
    ASSERT_TRUE(restored.ok()) << restored.status();
    const JobSnapshot live = *live_->GetJob("", id_);
    EXPECT_EQ(restored->state, live.state);
    EXPECT_EQ(restored->failure, live.failure);
    EXPECT_EQ(restored->step, live.step);
    EXPECT_EQ(restored->applied_steps, live.applied_steps);
    EXPECT_EQ(restored->scaler.scale, live.scaler.scale);
    EXPECT_EQ(restored->scaler.layer_scales, live.scaler.layer_scales);
    EXPECT_EQ(restored->scaler.counters.growth_tracker, live.scaler.counters.growth_tracker);
    EXPECT_EQ(restored->scaler.counters.overflows_until_backoff,
              live.scaler.counters.overflows_until_backoff);
    EXPECT_EQ(restored->failure.find("failed to restore"), std::string::npos) << restored->failure;
    ASSERT_TRUE((*other)->CheckpointAll().ok());
    const std::string rewritten = test_support::ReadFile(File(copy));
    if (rewritten != written) {
      absl::StatusOr<checkpoint::StateDict> a = checkpoint::DecodeSafetensors(written);
      absl::StatusOr<checkpoint::StateDict> b = checkpoint::DecodeSafetensors(rewritten);
      ASSERT_TRUE(a.ok() && b.ok());
      std::string keys;
      for (const auto& [key, value] : a->metadata) {
        auto it = b->metadata.find(key);
        if (it == b->metadata.end() || it->second != value) {
          absl::StrAppend(&keys, "\n  ", key, ": ", value, " -> ",
                          it == b->metadata.end() ? "(missing)" : it->second);
        }
      }
      ADD_FAILURE() << "the restored job's checkpoint differs from the one it was restored from: "
                    << StateDiff(*a, *b) << keys;
    }
  }

  bool per_layer() const { return GetParam().config.scaler.per_layer_scales; }
  amp::ScalerPolicy policy() const { return GetParam().config.scaler.policy; }
  std::string ScaleKey() const {
    return policy() == amp::ScalerPolicy::kDeepSpeed ? "cur_scale" : "scale";
  }

  test_support::TempDir root_{"ampd_restore_property_test"};
  std::unique_ptr<JobRegistry> live_;
  std::string id_;
  int restores_ = 0;
};

TEST_P(RestoreProperty, EveryEdgeStateRestoresBitForBit) {
  ExpectRestoresBitForBit("created (seed-only)");
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Step(i == 1).ok());
  ExpectRestoresBitForBit("a few steps, one overflowing");

  // The top of the scale's range (the cap, where the policy has one), with
  // the growth tracker one step short of a growth: the growth is refused or
  // capped.
  const std::string top = per_layer() || policy() == amp::ScalerPolicy::kAdaptive
                              ? amp::FormatStateNumber(16777216.0)  // adaptive's cap, 2^24
                              : amp::FormatStateNumber(FLT_MAX);
  std::map<std::string, std::string> at_top = {{ScaleKey(), top}};
  if (policy() == amp::ScalerPolicy::kPyTorch || policy() == amp::ScalerPolicy::kAdaptive) {
    at_top["_growth_tracker"] = "2";
  } else if (policy() == amp::ScalerPolicy::kPaddle) {
    at_top["incr_count"] = "2";
  } else if (policy() == amp::ScalerPolicy::kMegatron) {
    at_top["growth_tracker"] = "2";
  }
  LoadScalerState(at_top);
  ExpectRestoresBitForBit("loaded at the top of the scale's range");
  ASSERT_TRUE(Step(false).ok());
  ExpectRestoresBitForBit("a growth from the top");

  // Counters at the ends of their ranges. The ones that only count up or
  // down (deepspeed's iteration, megatron's spent hysteresis, adaptive's
  // deferrals) start a few dozen steps short of 2^53, the most a state
  // holds exactly, which no job reaches (2^53 steps); the others at their
  // bound.
  if (policy() == amp::ScalerPolicy::kDeepSpeed) {
    LoadScalerState({{"cur_iter", "9007199254740900"}, {"last_overflow_iter", "9007199254740899"}});
  } else if (policy() == amp::ScalerPolicy::kMegatron) {
    LoadScalerState({{"hysteresis_tracker", "-9007199254740900"}});
  } else if (policy() == amp::ScalerPolicy::kPaddle) {
    LoadScalerState({{"decr_count", "1"}});
  } else if (policy() == amp::ScalerPolicy::kAdaptive) {
    LoadScalerState({{"growths_deferred", "9007199254740900"}});
  }
  ExpectRestoresBitForBit("counters at their bounds");
  ASSERT_TRUE(Step(true).ok());
  ExpectRestoresBitForBit("an overflow from there");

  // Down from the smallest normal float32 until the scaler gives up: the
  // failed job's checkpoint holds the last usable scale.
  LoadScalerState({{ScaleKey(), amp::FormatStateNumber(std::ldexp(1.0, -125))}});
  ExpectRestoresBitForBit("loaded at 2^-125");
  OverflowUntilFailed(10);
  EXPECT_GT(live_->GetJob("", id_)->scaler.scale, 0.0f);
  ExpectRestoresBitForBit("failed below the smallest usable scale");

  // A failed job refuses steps, and a good state brings it back: at the
  // smallest float32 (unusable), which the first overflow fails again.
  const std::string smallest =
      amp::FormatStateNumber(static_cast<double>(std::numeric_limits<float>::denorm_min()));
  LoadScalerState({{ScaleKey(), smallest}});
  EXPECT_EQ(live_->GetJob("", id_)->state, JobState::kActive);
  ExpectRestoresBitForBit("loaded at the smallest float32");
  OverflowUntilFailed(1);
  ExpectRestoresBitForBit("failed at the smallest float32");
}

INSTANTIATE_TEST_SUITE_P(EveryPolicy, RestoreProperty, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.name;
                         });

}  // namespace
}  // namespace ampd::engine
