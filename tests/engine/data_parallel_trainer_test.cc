// Trainer::Step as a rank of a distributed job (DataParallelStep), with the
// ranks as threads of this process and an in-process gradient sum in place
// of Gloo: the engine's side of a data-parallel step without sockets. A
// GPT's token losses (weighted cross_entropy, importance_sampling, ppo,
// cispo, dro) trained by two ranks on their shares equal one Trainer on every
// micro-batch, in each step's loss (the sum over every rank's tokens, the
// same on every rank) and in the weights; the adaptive scaler's calibration
// starts every rank at the one Trainer's scale. tests/distributed/ runs the
// same through real servers over Gloo.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "engine_test_util.h"
#include "kernels/float16.h"
#include "server/engine/dist/gradient_all_reduce.h"

namespace ampd::engine {
namespace {

using kernels::DType;
using kernels::Tensor;
using namespace ampd::engine::testing;

constexpr int64_t kVocab = 32;
constexpr int64_t kSeq = 16;

// The ranks' element-wise sums: each rank hands its values in and gets the
// sum over every rank, added in rank order, once every rank has come.
class LocalGroup {
 public:
  explicit LocalGroup(int ranks) : shares_(static_cast<size_t>(ranks)) {}

  // The sum, or nothing once a rank gave up (Abandon).
  std::vector<float> Sum(int rank, std::vector<float> mine) {
    absl::MutexLock lock(&mu_);
    if (abandoned_) return {};
    const int64_t round = round_;
    shares_[static_cast<size_t>(rank)] = std::move(mine);
    if (++arrived_ == static_cast<int>(shares_.size())) {
      // The last to come adds up. result_ is overwritten only when the
      // next round completes, which needs every rank back here first, so
      // each rank reads this round's result below.
      result_.assign(shares_[0].size(), 0.0f);
      for (const std::vector<float>& share : shares_) {
        EXPECT_EQ(share.size(), result_.size()) << "the ranks summed different sizes";
        for (size_t i = 0; i < std::min(share.size(), result_.size()); ++i) result_[i] += share[i];
      }
      arrived_ = 0;
      ++round_;
      done_.SignalAll();
    }
    while (round_ == round && !abandoned_) done_.Wait(&mu_);
    if (round_ == round) return {};
    return result_;
  }

  // A rank whose step failed: the others' sums fail instead of waiting
  // for it forever.
  void Abandon() {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
    done_.SignalAll();
  }

 private:
  absl::Mutex mu_;
  absl::CondVar done_;
  std::vector<std::vector<float>> shares_;
  std::vector<float> result_;
  int arrived_ = 0;
  int64_t round_ = 0;
  bool abandoned_ = false;
};

// One rank's GradientAllReduce over a LocalGroup: the tensors started are
// copied to the host at Finish, summed, copied back. F32, or F16 summed in
// float and rounded once (what Gloo's per-addition rounding gives for two
// ranks).
class LocalAllReduce : public dist::GradientAllReduce {
 public:
  LocalAllReduce(LocalGroup& group, int rank, kernels::Backend& backend)
      : group_(group), rank_(rank), backend_(backend) {}

  absl::Status Start(absl::Span<Tensor* const> tensors) override {
    pending_.insert(pending_.end(), tensors.begin(), tensors.end());
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    std::vector<float> values;
    for (Tensor* t : pending_) {
      const auto n = static_cast<size_t>(t->numel());
      const size_t at = values.size();
      values.resize(at + n);
      if (t->dtype() == DType::kF32) {
        AMPD_RETURN_IF_ERROR(backend_.CopyToHost(*t, values.data() + at, t->nbytes()));
      } else if (t->dtype() == DType::kF16) {
        std::vector<uint16_t> bits(n);
        AMPD_RETURN_IF_ERROR(backend_.CopyToHost(*t, bits.data(), t->nbytes()));
        for (size_t i = 0; i < n; ++i) values[at + i] = kernels::HalfBitsToFloat(bits[i]);
      } else {
        return absl::UnimplementedError("LocalAllReduce sums F32 and F16 tensors");
      }
    }
    const size_t count = values.size();
    const std::vector<float> sums = group_.Sum(rank_, std::move(values));
    if (sums.size() != count) return absl::UnavailableError("another rank gave up");
    size_t at = 0;
    for (Tensor* t : pending_) {
      const auto n = static_cast<size_t>(t->numel());
      if (t->dtype() == DType::kF32) {
        AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(sums.data() + at, t->nbytes(), *t));
      } else {
        std::vector<uint16_t> bits(n);
        for (size_t i = 0; i < n; ++i) bits[i] = kernels::FloatToHalfBits(sums[at + i]);
        AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(bits.data(), t->nbytes(), *t));
      }
      at += n;
    }
    pending_.clear();
    return absl::OkStatus();
  }

 private:
  LocalGroup& group_;
  const int rank_;
  kernels::Backend& backend_;
  std::vector<Tensor*> pending_;
};

// Plain SGD: the weights move by lr times the gradient, so weights that
// agree say the gradients did. (Adam would turn the rounding noise of a
// gradient that is zero in exact arithmetic, such as attention's key bias,
// into lr-sized steps of either sign.)
JobConfig GptConfig(model::Precision precision = model::Precision::kFp32,
                    amp::ScalerPolicy policy = amp::ScalerPolicy::kPyTorch) {
  JobConfig config = DefaultJobConfig(precision, policy, optim::OptimizerKind::kSgd);
  model::GptSpec g;
  g.vocab_size = kVocab;
  g.context_length = kSeq;
  g.d_model = 32;
  g.n_layer = 2;
  g.n_head = 4;
  config.model.loss = model::LossKind::kCrossEntropy;
  config.model.kind = g;
  config.optimizer.sgd.lr = 0.02f;
  config.seed = 5;
  return config;
}

// A (rows, kSeq) micro-batch with the per-token inputs `fn` reads: random
// ids and targets (every fifth target ignored), weights in [0, 2),
// advantages in [-1, 1), and sampling log-probs near the model's (about
// -ln 32) so that PPO's ratios land on both sides of its clip range.
MicroBatch TokenBatch(LossFnKind fn, int64_t rows, DataRng& rng) {
  const auto n = static_cast<size_t>(rows * kSeq);
  std::vector<int32_t> ids(n);
  std::vector<int32_t> targets(n);
  for (size_t i = 0; i < n; ++i) {
    ids[i] = rng.Index(kVocab);
    targets[i] = i % 5 == 3 ? -100 : rng.Index(kVocab);
  }
  MicroBatch mb{I32({rows, kSeq}, ids), I32({rows, kSeq}, targets)};
  if (fn == LossFnKind::kCrossEntropy) mb.weights = F32({rows, kSeq}, rng.UniformVector(n, 0, 2));
  if (ReadsSamplingLogprobs(fn)) {
    mb.advantages = F32({rows, kSeq}, rng.UniformVector(n, -1, 1));
    mb.sampling_logprobs = F32({rows, kSeq}, rng.UniformVector(n, -3.9f, -3.0f));
  }
  return mb;
}

// Step i's micro-batches: `ranks` shares of `per_rank` micro-batches each,
// rank r's at [r * per_rank, (r + 1) * per_rank).
std::vector<MicroBatch> StepBatches(LossFnKind fn, int64_t step, int ranks, int per_rank) {
  DataRng rng(1000 + static_cast<uint64_t>(step));
  std::vector<MicroBatch> mbs;
  for (int i = 0; i < ranks * per_rank; ++i) mbs.push_back(TokenBatch(fn, 2 + i % 2, rng));
  return mbs;
}

StepInput Input(LossFnKind fn, std::vector<MicroBatch> mbs) {
  StepInput input;
  input.micro_batches = std::move(mbs);
  input.loss_fn.kind = fn;
  // Each loss its own parameters (another's is refused): narrow clip
  // ranges, so that more tokens are clipped, and a beta far from 0.
  if (fn == LossFnKind::kPpo) {
    input.loss_fn.ppo_clip_low = 0.9f;
    input.loss_fn.ppo_clip_high = 1.1f;
  }
  if (fn == LossFnKind::kCispo) {
    input.loss_fn.cispo_clip_low = 0.95f;
    input.loss_fn.cispo_clip_high = 1.05f;
  }
  if (fn == LossFnKind::kDro) input.loss_fn.dro_beta = 0.5f;
  return input;
}

struct Trajectory {
  std::vector<StepReport> reports;
  checkpoint::StateDict state;
};

Trajectory Alone(const JobConfig& config, LossFnKind fn, int steps, int ranks, int per_rank) {
  Trajectory run;
  std::unique_ptr<Trainer> t = MakeTrainer(config);
  if (t == nullptr) return run;
  for (int s = 1; s <= steps; ++s) {
    absl::StatusOr<StepReport> r = t->Step(Input(fn, StepBatches(fn, s, ranks, per_rank)));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    run.reports.push_back(*r);
  }
  absl::StatusOr<checkpoint::StateDict> state = t->ExportState();
  EXPECT_TRUE(state.ok()) << state.status();
  if (state.ok()) run.state = *std::move(state);
  return run;
}

// Every rank's run, the ranks as threads stepping together.
std::vector<Trajectory> Group(const JobConfig& config, LossFnKind fn, int steps, int ranks,
                              int per_rank) {
  std::vector<Trajectory> runs(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (int r = 0; r < ranks; ++r) trainers.push_back(MakeTrainer(config));
  for (const auto& t : trainers) {
    if (t == nullptr) return runs;
  }
  LocalGroup group(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Trainer& t = *trainers[static_cast<size_t>(r)];
      LocalAllReduce all_reduce(group, r, t.backend());
      DataParallelStep dp;
      dp.global_micro_batches = ranks * per_rank;
      dp.all_reduce = &all_reduce;
      Trajectory& run = runs[static_cast<size_t>(r)];
      for (int s = 1; s <= steps; ++s) {
        std::vector<MicroBatch> all = StepBatches(fn, s, ranks, per_rank);
        std::vector<MicroBatch> mine(all.begin() + r * per_rank, all.begin() + (r + 1) * per_rank);
        absl::StatusOr<StepReport> rep = t.Step(Input(fn, std::move(mine)), nullptr, &dp);
        if (!rep.ok()) {
          ADD_FAILURE() << "rank " << r << " step " << s << ": " << rep.status();
          group.Abandon();  // or the others would wait at the next sum
          return;
        }
        run.reports.push_back(*rep);
      }
      absl::StatusOr<checkpoint::StateDict> state = t.ExportState();
      ASSERT_TRUE(state.ok()) << state.status();
      run.state = *std::move(state);
    });
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

// The largest |a - b| / (atol + |b|) over every F32 tensor of the two
// states (weights and optimizer moments): <= 1 within tolerance.
double WorstRatio(const checkpoint::StateDict& a, const checkpoint::StateDict& b, double atol,
                  double rtol, std::string* where) {
  EXPECT_EQ(a.tensors.size(), b.tensors.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.tensors.size(), b.tensors.size()); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    EXPECT_EQ(x.name, y.name);
    if (x.tensor.dtype != DType::kF32) {
      EXPECT_EQ(x.tensor.data, y.tensor.data) << x.name;
      continue;
    }
    const std::vector<float> u = ToFloats(x.tensor);
    const std::vector<float> v = ToFloats(y.tensor);
    EXPECT_EQ(u.size(), v.size()) << x.name;
    for (size_t k = 0; k < std::min(u.size(), v.size()); ++k) {
      const double ratio = std::fabs(static_cast<double>(u[k]) - v[k]) /
                           (atol + rtol * std::fabs(static_cast<double>(v[k])));
      if (ratio > worst) {
        worst = ratio;
        *where = absl::StrCat(x.name, "[", k, "]: ", u[k], " vs ", v[k]);
      }
    }
  }
  return worst;
}

struct Case {
  LossFnKind fn;
  int per_rank;
};

class DataParallelTokenLoss : public ::testing::TestWithParam<Case> {};

// fp32: a rank's gradient is its micro-batches' sum, and the ranks' sum of
// those adds the same terms as the one Trainer's accumulation but grouped
// differently (per rank, then across ranks; a GEMM that accumulates into
// the gradient adds inside its own sum), so the gradients and the weights
// differ by float rounding: here up to 1.2e-7 per weight after 6 steps
// (the embedding's, which sums the most terms), tolerated as 1e-6 + 1e-5
// |w|, and 5e-7 of the loss, tolerated as 1e-5. Step 1's loss (before any
// update) adds the same two micro-batch sums either way: equal.
TEST_P(DataParallelTokenLoss, TwoRanksOnSharesEqualOneTrainerOnEveryMicroBatch) {
  const Case c = GetParam();
  constexpr int kSteps = 6;
  constexpr int kRanks = 2;
  const JobConfig config = GptConfig();
  const Trajectory alone = Alone(config, c.fn, kSteps, kRanks, c.per_rank);
  const std::vector<Trajectory> ranks = Group(config, c.fn, kSteps, kRanks, c.per_rank);
  ASSERT_EQ(alone.reports.size(), static_cast<size_t>(kSteps));
  for (const Trajectory& run : ranks) ASSERT_EQ(run.reports.size(), static_cast<size_t>(kSteps));
  double worst_loss = 0;
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s + 1));
    const StepReport& a = alone.reports[static_cast<size_t>(s)];
    ASSERT_TRUE(std::isfinite(a.loss));
    for (const Trajectory& run : ranks) {
      const StepReport& g = run.reports[static_cast<size_t>(s)];
      // Every rank reports the same whole-batch loss, bit for bit.
      EXPECT_EQ(g.loss, ranks[0].reports[static_cast<size_t>(s)].loss);
      EXPECT_EQ(g.scaler.skipped, a.scaler.skipped);
      EXPECT_EQ(g.applied_steps, a.applied_steps);
      worst_loss = std::max(worst_loss, std::fabs(static_cast<double>(g.loss) - a.loss) /
                                            std::max(1.0, std::fabs(static_cast<double>(a.loss))));
    }
    if (s == 0 && c.per_rank == 1) {
      // Two micro-batches' losses added once either way.
      EXPECT_EQ(ranks[0].reports[0].loss, a.loss);
    }
    // samples are the rank's own rows; the loss is over both ranks'.
    int64_t samples = 0;
    for (const Trajectory& run : ranks) samples += run.reports[static_cast<size_t>(s)].samples;
    EXPECT_EQ(samples, a.samples);
  }
  RecordProperty("worst_relative_loss_difference", absl::StrCat(worst_loss));
  EXPECT_LT(worst_loss, 1e-5);
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::string where;
    // Every rank holds the same state bit for bit.
    EXPECT_EQ(WorstRatio(ranks[r].state, ranks[0].state, 0, 1, &where), 0.0)
        << "rank " << r << ": " << where;
    const double ratio = WorstRatio(ranks[r].state, alone.state, 1e-6, 1e-5, &where);
    RecordProperty(absl::StrCat("rank", r, "_state_ratio"), absl::StrCat(ratio));
    EXPECT_LE(ratio, 1.0) << "rank " << r << " against one Trainer: " << where;
  }
}

INSTANTIATE_TEST_SUITE_P(Losses, DataParallelTokenLoss,
                         ::testing::Values(Case{LossFnKind::kCrossEntropy, 1},
                                           Case{LossFnKind::kImportanceSampling, 1},
                                           Case{LossFnKind::kPpo, 1}, Case{LossFnKind::kPpo, 2},
                                           Case{LossFnKind::kCispo, 1}, Case{LossFnKind::kDro, 2}),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           return absl::StrCat(LossFnName(param.param.fn), "_",
                                               param.param.per_rank, "_per_rank");
                         });

// The adaptive scaler's first step calibrates on the whole batch's token
// loss gradient (summed across the ranks, at grad scale 1, not 1 / K): every
// rank starts where the one Trainer does.
TEST(DataParallelTokenLossCalibration, EveryRankStartsAtTheOneTrainersScale) {
  const JobConfig config = GptConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive);
  const Trajectory alone = Alone(config, LossFnKind::kPpo, 3, 2, 1);
  const std::vector<Trajectory> ranks = Group(config, LossFnKind::kPpo, 3, 2, 1);
  ASSERT_EQ(alone.reports.size(), 3u);
  for (const Trajectory& run : ranks) {
    ASSERT_EQ(run.reports.size(), 3u);
    for (size_t s = 0; s < 3; ++s) {
      SCOPED_TRACE(absl::StrCat("step ", s + 1));
      EXPECT_EQ(run.reports[s].scaler.scale_before, alone.reports[s].scaler.scale_before);
      EXPECT_EQ(run.reports[s].scaler.scale_after, alone.reports[s].scaler.scale_after);
      EXPECT_EQ(run.reports[s].scaler.skipped, alone.reports[s].scaler.skipped);
      EXPECT_EQ(run.reports[s].loss, ranks[0].reports[s].loss);
      // fp16 gradients are rounded per rank before the sum: the loss of
      // the later steps agrees to fp16's rounding.
      EXPECT_NEAR(run.reports[s].loss, alone.reports[s].loss,
                  2e-2 * std::max(1.0f, std::fabs(alone.reports[s].loss)));
    }
    EXPECT_FALSE(run.reports[0].scaler.skipped);  // calibrated, not backing off
  }
}

}  // namespace
}  // namespace ampd::engine
