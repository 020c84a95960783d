// Stopping long calls inside the engine (CPU backend): the CallToken's own
// rules, a Trainer's Step, Evaluate and Sample stopped by it with the job's
// state unchanged, and the WorkerPool's long lane, which never takes every
// thread. The same through the real server: tests/service/deadline_test.cc.
#include "server/engine/call_token.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/error_reason.h"
#include "gtest/gtest.h"
#include "server/common/worker_pool.h"
#include "tests/engine/engine_test_util.h"

namespace ampd::engine {
namespace {

using testing::DataRng;
using testing::F32;
using testing::Linear;

TEST(CallToken, StopsOnlyWhenCancelledOrPastItsDeadline) {
  const CallToken open;
  EXPECT_TRUE(open.Check("x").ok());

  const CallToken late(absl::Now() - absl::Seconds(1));
  const absl::Status past = late.Check("sampling stopped after 3 of 9 decode steps");
  EXPECT_EQ(past.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(past.message(),
            "sampling stopped after 3 of 9 decode steps: the call's deadline passed");

  const CallToken call(absl::Now() + absl::Hours(1));
  const CallToken copy = call;  // the reactor's and the task's: one state
  EXPECT_TRUE(copy.Check().ok());
  call.Cancel(absl::OkStatus());  // not a reason: ignored
  EXPECT_TRUE(copy.Check().ok());
  call.Cancel(
      WithReason(absl::UnavailableError("the server is shutting down"), reason::kServerDraining));
  call.Cancel(absl::CancelledError("second"));  // the first reason wins
  const absl::Status stopped = copy.Check("the step stopped");
  EXPECT_EQ(stopped.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(stopped.message(), "the step stopped: the server is shutting down");
  const std::optional<ErrorReason> why = GetErrorReason(stopped);
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(why->reason, reason::kServerDraining);
}

JobConfig MlpConfig(amp::ScalerPolicy policy) {
  JobConfig c = DefaultJobConfig(model::Precision::kFp16, policy);
  c.model.layers = {Linear(16, 32), testing::Act(model::LayerKind::kReLU), Linear(32, 8)};
  c.model.loss = model::LossKind::kMse;
  c.seed = 5;
  return c;
}

StepInput Batches(int k, uint64_t seed) {
  DataRng rng(seed);
  StepInput input;
  for (int i = 0; i < k; ++i) {
    MicroBatch mb;
    mb.inputs = F32({8, 16}, rng.UniformVector(8 * 16, -1, 1));
    mb.targets = F32({8, 8}, rng.UniformVector(8 * 8, -4, 4));
    input.micro_batches.push_back(std::move(mb));
  }
  return input;
}

// Stopped once its workspaces are admitted, before its first micro-batch
// (the admit callback cancels the call): nothing of the Trainer changes,
// the adaptive scaler's calibration included, and the next step is the
// one a Trainer that never saw the stopped one takes.
TEST(CallToken, AStoppedStepChangesNothing) {
  for (const amp::ScalerPolicy policy :
       {amp::ScalerPolicy::kPyTorch, amp::ScalerPolicy::kAdaptive}) {
    SCOPED_TRACE(static_cast<int>(policy));
    std::unique_ptr<Trainer> t = testing::MakeTrainer(MlpConfig(policy));
    std::unique_ptr<Trainer> fresh = testing::MakeTrainer(MlpConfig(policy));
    ASSERT_NE(t, nullptr);
    ASSERT_NE(fresh, nullptr);
    const absl::StatusOr<checkpoint::StateDict> before = t->ExportState();
    ASSERT_TRUE(before.ok()) << before.status();

    const CallToken call;
    const auto cancel_once_admitted = [&call](int64_t) {
      call.Cancel(absl::CancelledError("the client went away"));
      return absl::OkStatus();
    };
    const absl::StatusOr<StepReport> stopped = t->Step(Batches(3, 1), cancel_once_admitted,
                                                       /*data_parallel=*/nullptr, call);
    EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
    EXPECT_NE(stopped.status().message().find("nothing was applied"), std::string::npos);
    EXPECT_EQ(t->steps_run(), 0);
    EXPECT_EQ(t->applied_steps(), 0);
    const absl::StatusOr<checkpoint::StateDict> after = t->ExportState();
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(testing::StateDiff(*before, *after), "");

    const absl::StatusOr<StepReport> a = t->Step(Batches(2, 2));
    const absl::StatusOr<StepReport> b = fresh->Step(Batches(2, 2));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->step, 1);
    EXPECT_EQ(a->loss, b->loss);
    EXPECT_EQ(a->scaler.scale_before, b->scaler.scale_before);
    const absl::StatusOr<checkpoint::StateDict> sa = t->ExportState();
    const absl::StatusOr<checkpoint::StateDict> sb = fresh->ExportState();
    ASSERT_TRUE(sa.ok() && sb.ok());
    EXPECT_EQ(testing::StateDiff(*sa, *sb), "");
  }
}

TEST(CallToken, EvaluateAndSampleStopAtTheirFirstUnit) {
  std::unique_ptr<Trainer> mlp = testing::MakeTrainer(MlpConfig(amp::ScalerPolicy::kPyTorch));
  ASSERT_NE(mlp, nullptr);
  const CallToken gone(absl::Now() - absl::Seconds(1));
  EvaluateInput evaluate;
  evaluate.micro_batches = Batches(2, 3).micro_batches;
  const absl::StatusOr<EvaluateReport> e = mlp->Evaluate(evaluate, nullptr, gone);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kDeadlineExceeded) << e.status();

  JobConfig gpt = DefaultJobConfig(model::Precision::kFp32);
  model::GptSpec g;
  g.vocab_size = 17;
  g.context_length = 16;
  g.d_model = 16;
  g.n_layer = 1;
  g.n_head = 2;
  gpt.model.kind = g;
  gpt.model.loss = model::LossKind::kCrossEntropy;
  std::unique_ptr<Trainer> lm = testing::MakeTrainer(gpt);
  ASSERT_NE(lm, nullptr);
  SampleInput sample;
  sample.prompts = {{1, 2, 3}};
  sample.max_tokens = 8;
  const absl::StatusOr<SampleReport> s = lm->Sample(sample, nullptr, gone);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  // Cancelled while admitted: stopped before the prompts' forward.
  const CallToken call;
  const absl::StatusOr<SampleReport> c = lm->Sample(
      sample,
      [&call](int64_t) {
        call.Cancel(absl::CancelledError("cancelled"));
        return absl::OkStatus();
      },
      call);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  EXPECT_TRUE(lm->Sample(sample).ok());
}

// Two threads, long tasks on at most one: while a long task runs, a second
// long one waits and a short one posted after it runs.
TEST(WorkerPoolLanes, LongTasksLeaveAThreadForShortOnes) {
  WorkerPool pool(2, /*max_long=*/1);
  absl::Notification release_first;
  absl::Notification first_started;
  std::atomic<bool> second_ran{false};
  absl::Notification short_ran;
  pool.Post(
      [&] {
        first_started.Notify();
        release_first.WaitForNotification();
      },
      WorkerPool::Lane::kLong);
  first_started.WaitForNotification();
  pool.Post([&] { second_ran = true; }, WorkerPool::Lane::kLong);
  pool.Post([&] { short_ran.Notify(); });
  EXPECT_TRUE(short_ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The free thread took the short task and did not take the long one.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(second_ran.load());
  release_first.Notify();
  pool.WaitIdle();
  EXPECT_TRUE(second_ran.load());
}

// Without a limit (a pool's default), long tasks take every thread.
TEST(WorkerPoolLanes, NoLimitByDefault) {
  WorkerPool pool(2);
  absl::Notification release;
  absl::Notification both_running;
  std::atomic<int> running{0};
  for (int i = 0; i < 2; ++i) {
    pool.Post(
        [&] {
          if (++running == 2) both_running.Notify();
          release.WaitForNotification();
        },
        WorkerPool::Lane::kLong);
  }
  EXPECT_TRUE(both_running.WaitForNotificationWithTimeout(absl::Seconds(30)));
  release.Notify();
  pool.Shutdown();
}

}  // namespace
}  // namespace ampd::engine
