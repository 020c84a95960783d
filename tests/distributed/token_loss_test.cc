// A GPT's token losses (weighted cross_entropy, importance_sampling, ppo,
// cispo, dro) in
// a data-parallel job through real ampd processes over Gloo on loopback: two
// ranks on their shares train as one process on every micro-batch (each
// step's loss the sum over both ranks' tokens, the same on every rank; the
// same weights), and a step one rank refuses (a bad per-token input, or a
// loss function the ranks disagree on) is refused on both without wedging
// either: the same sequence then trains.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/data_parallel.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::TempDir;

constexpr int64_t kVocab = 32;
constexpr int64_t kSeq = 16;
constexpr int64_t kRows = 4;  // per step, split in two

v1::Tensor Tensor(v1::DType dtype, const void* data, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.add_shape(kRows);
  t.add_shape(kSeq);
  t.set_data(std::string(static_cast<const char*>(data), bytes));
  return t;
}

// A deterministic draw (the same bits on every platform).
class Draw {
 public:
  explicit Draw(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t Next() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(static_cast<double>(Next() >> 11) * 0x1.0p-53);
  }

 private:
  uint64_t state_;
};

// Step `step`'s loss function: the five token losses in turn, and the
// model's own mean loss every sixth step (a job may change it per step).
v1::LossFn LossOf(int64_t step) {
  switch (step % 6) {
    case 1:
      return v1::LOSS_FN_CROSS_ENTROPY;
    case 2:
      return v1::LOSS_FN_IMPORTANCE_SAMPLING;
    case 3:
      return v1::LOSS_FN_PPO;
    case 4:
      return v1::LOSS_FN_CISPO;
    case 5:
      return v1::LOSS_FN_DRO;
    default:
      return v1::LOSS_FN_MODEL;
  }
}

// The whole step's batch, (kRows, kSeq), with the per-token inputs its loss
// reads: every fifth target ignored, weights in [0, 2), advantages in
// [-1, 1), sampling log-probs near the model's (about -ln 32) so that PPO
// clips on both sides.
v1::MicroBatch StepBatch(int64_t step) {
  Draw draw(static_cast<uint64_t>(step));
  const auto n = static_cast<size_t>(kRows * kSeq);
  std::vector<int32_t> ids(n);
  std::vector<int32_t> targets(n);
  std::vector<float> weights(n);
  std::vector<float> advantages(n);
  std::vector<float> logprobs(n);
  for (size_t i = 0; i < n; ++i) {
    ids[i] = static_cast<int32_t>(draw.Next() % kVocab);
    targets[i] = i % 5 == 3 ? -100 : static_cast<int32_t>(draw.Next() % kVocab);
    weights[i] = draw.Uniform(0, 2);
    advantages[i] = draw.Uniform(-1, 1);
    logprobs[i] = draw.Uniform(-3.9f, -3.0f);
  }
  v1::MicroBatch mb;
  *mb.mutable_inputs() = Tensor(v1::DTYPE_I32, ids.data(), n * 4);
  *mb.mutable_targets() = Tensor(v1::DTYPE_I32, targets.data(), n * 4);
  const v1::LossFn fn = LossOf(step);
  if (fn == v1::LOSS_FN_CROSS_ENTROPY) {
    *mb.mutable_weights() = Tensor(v1::DTYPE_F32, weights.data(), n * 4);
  }
  if (fn != v1::LOSS_FN_MODEL && fn != v1::LOSS_FN_CROSS_ENTROPY) {
    *mb.mutable_advantages() = Tensor(v1::DTYPE_F32, advantages.data(), n * 4);
    *mb.mutable_sampling_logprobs() = Tensor(v1::DTYPE_F32, logprobs.data(), n * 4);
  }
  return mb;
}

// What every rank is sent beside its micro-batches.
v1::StepRequest Common(int64_t step) {
  v1::StepRequest common;
  common.set_loss_fn(LossOf(step));
  // Narrow clip ranges: more tokens clipped.
  if (common.loss_fn() == v1::LOSS_FN_PPO) {
    common.set_ppo_clip_low(0.9f);
    common.set_ppo_clip_high(1.1f);
  }
  if (common.loss_fn() == v1::LOSS_FN_CISPO) {
    common.set_cispo_clip_low(0.95f);
    common.set_cispo_clip_high(1.05f);
  }
  if (common.loss_fn() == v1::LOSS_FN_DRO) common.set_dro_beta(0.5f);
  return common;
}

std::vector<v1::MicroBatch> Halves(const v1::MicroBatch& batch) {
  absl::StatusOr<std::vector<v1::MicroBatch>> halves = SplitRows(batch, 2);
  EXPECT_TRUE(halves.ok()) << halves.status();
  return halves.ok() ? *halves : std::vector<v1::MicroBatch>{};
}

codec::StateDict State(Client& client, const std::string& job_id) {
  absl::StatusOr<std::string> bytes = client.GetStateDict(job_id);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return {};
  absl::StatusOr<codec::StateDict> state = codec::DecodeSafetensors(*bytes);
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? *std::move(state) : codec::StateDict{};
}

class DistributedTokenLossTest : public ::testing::Test {
 protected:
  std::unique_ptr<AmpdProcess> Start(const std::string& name, bool peer) {
    std::vector<std::string> flags;
    if (peer) flags.push_back("--peer-address=127.0.0.1:0");
    auto process =
        std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, root_.path() / (name + ".log"));
    EXPECT_NE(process->port(), 0) << process->Describe();
    return process;
  }

  static v1::CreateJobRequest Request() {
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    v1::Gpt* gpt = config->mutable_model()->mutable_gpt();
    gpt->set_vocab_size(kVocab);
    gpt->set_context_length(kSeq);
    gpt->set_d_model(32);
    gpt->set_n_layer(2);
    gpt->set_n_head(4);
    config->set_seed(5);
    config->set_precision(v1::PRECISION_FP32);
    // Plain SGD: the weights move by lr times the gradient, so weights that
    // agree say the gradients did (Adam would turn the rounding noise of a
    // gradient that is zero in exact arithmetic, attention's key bias, into
    // lr-sized steps of either sign).
    config->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
    config->mutable_optimizer()->set_lr(0.02f);
    return request;
  }

  // Two replicas and the job across them.
  void StartGroup() {
    for (int r = 0; r < 2; ++r) {
      ranks_.push_back(Start(absl::StrCat("rank", r), /*peer=*/true));
      ASSERT_NE(ranks_.back()->peer_port(), 0) << ranks_.back()->Describe();
    }
    DataParallelOptions options;
    for (const auto& p : ranks_) options.servers.push_back(p->address());
    options.rendezvous = absl::StrCat("127.0.0.1:", ranks_[0]->peer_port());
    options.timeout = absl::Seconds(5);
    options.retry_for = absl::Seconds(90);
    options.client.deadline = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<DataParallelJob>> job =
        DataParallelJob::Create(Request(), options);
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *std::move(job);
  }

  // Sends requests[r] to rank r, all at once, once each.
  std::vector<absl::StatusOr<v1::StepResponse>> SendEach(std::vector<v1::StepRequest> requests) {
    std::vector<absl::StatusOr<v1::StepResponse>> results(2, absl::UnknownError("not sent"));
    std::vector<std::thread> threads;
    for (size_t r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        ClientOptions once;
        once.max_attempts = 1;
        once.deadline = absl::Seconds(30);
        std::unique_ptr<Client> c = Client::Connect(ranks_[r]->address(), once);
        requests[r].set_job_id(job_->jobs()[r].job_id());
        results[r] = c->Step(requests[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  void TearDown() override {
    if (!HasFailure()) return;
    for (const auto& p : ranks_) std::fprintf(stderr, "%s\n", p->Log().c_str());
  }

  TempDir root_{"ampd_distributed_token_loss_test"};
  std::vector<std::unique_ptr<AmpdProcess>> ranks_;
  std::unique_ptr<DataParallelJob> job_;
};

// fp32 through Gloo: each rank's gradient is its half's, and the sum of the
// two adds the same terms as one process accumulating both micro-batches,
// grouped differently, so the weights (and from step 2 the losses) differ
// by float rounding only: tolerated as 1e-5 of the loss and 1e-6 + 1e-5 |w|
// per weight (the engine's in-process test sees up to 1.2e-7 per weight).
// Step 1's loss, before any update, is the same two per-micro-batch sums
// added once: equal.
TEST_F(DistributedTokenLossTest, TwoRanksOnHalvesTrainAsOneProcessOnBoth) {
  constexpr int64_t kSteps = 8;
  std::vector<v1::StepResponse> alone;
  codec::StateDict alone_state;
  {
    std::unique_ptr<AmpdProcess> process = Start("alone", /*peer=*/false);
    std::unique_ptr<Client> client = Client::Connect(process->address());
    absl::StatusOr<v1::Job> job = client->CreateJob(Request());
    ASSERT_TRUE(job.ok()) << job.status();
    for (int64_t i = 1; i <= kSteps; ++i) {
      v1::StepRequest step = Common(i);
      step.set_job_id(job->job_id());
      step.set_sequence(i);
      for (const v1::MicroBatch& mb : Halves(StepBatch(i))) *step.add_micro_batches() = mb;
      absl::StatusOr<v1::StepResponse> r = client->Step(step);
      ASSERT_TRUE(r.ok()) << "step " << i << ": " << r.status();
      alone.push_back(*r);
    }
    alone_state = State(*client, job->job_id());
  }
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  std::vector<v1::StepResponse> group;
  for (int64_t i = 1; i <= kSteps; ++i) {
    const std::vector<v1::MicroBatch> halves = Halves(StepBatch(i));
    ASSERT_EQ(halves.size(), 2u);
    // DataParallelJob checks that both ranks report the same loss: the
    // sum over both ranks' tokens.
    absl::StatusOr<v1::StepResponse> r = job_->Step(i, {{halves[0]}, {halves[1]}}, Common(i));
    ASSERT_TRUE(r.ok()) << "step " << i << ": " << r.status();
    group.push_back(*r);
  }
  double worst_loss = 0;
  for (size_t i = 0; i < alone.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("step ", i + 1, " loss_fn ", v1::LossFn_Name(LossOf(i + 1))));
    EXPECT_FALSE(group[i].skipped());
    EXPECT_EQ(group[i].applied_steps(), alone[i].applied_steps());
    EXPECT_EQ(group[i].samples(), alone[i].samples() / 2);  // the rank's own rows
    const double diff = std::fabs(static_cast<double>(group[i].loss()) - alone[i].loss()) /
                        std::max(1.0, std::fabs(static_cast<double>(alone[i].loss())));
    worst_loss = std::max(worst_loss, diff);
    EXPECT_LT(diff, 1e-5) << group[i].loss() << " vs " << alone[i].loss();
  }
  EXPECT_EQ(group[0].loss(), alone[0].loss());
  RecordProperty("worst_relative_loss_difference", absl::StrCat(worst_loss));

  std::unique_ptr<Client> c0 = Client::Connect(ranks_[0]->address());
  std::unique_ptr<Client> c1 = Client::Connect(ranks_[1]->address());
  const codec::StateDict s0 = State(*c0, job_->jobs()[0].job_id());
  const codec::StateDict s1 = State(*c1, job_->jobs()[1].job_id());
  ASSERT_EQ(s0.tensors.size(), alone_state.tensors.size());
  ASSERT_EQ(s1.tensors.size(), alone_state.tensors.size());
  double worst = 0;
  std::string where;
  for (size_t t = 0; t < s0.tensors.size(); ++t) {
    const codec::NamedTensor& a = alone_state.tensors[t];
    ASSERT_EQ(s0.tensors[t].name, a.name);
    // Both ranks hold the same bytes.
    EXPECT_EQ(s0.tensors[t].tensor.data, s1.tensors[t].tensor.data) << a.name;
    if (a.tensor.dtype != codec::DType::kF32) {
      EXPECT_EQ(s0.tensors[t].tensor.data, a.tensor.data) << a.name;
      continue;
    }
    const size_t n = a.tensor.data.size() / 4;
    ASSERT_EQ(s0.tensors[t].tensor.data.size(), n * 4) << a.name;
    std::vector<float> x(n), y(n);
    std::memcpy(x.data(), s0.tensors[t].tensor.data.data(), n * 4);
    std::memcpy(y.data(), a.tensor.data.data(), n * 4);
    for (size_t k = 0; k < n; ++k) {
      const double ratio =
          std::fabs(static_cast<double>(x[k]) - y[k]) / (1e-6 + 1e-5 * std::fabs(y[k]));
      if (ratio > worst) {
        worst = ratio;
        where = absl::StrCat(a.name, "[", k, "]: ", x[k], " vs ", y[k]);
      }
    }
  }
  RecordProperty("worst_state_ratio", absl::StrCat(worst));
  EXPECT_LE(worst, 1.0) << where;
}

// Rank 1's advantages of the wrong shape, then rank 0's sampling log-probs
// with a NaN: the rank answers INVALID_ARGUMENT naming the field, the other
// REPLICAS_DIFFER; ranks sent different loss functions (or PPO clip ranges)
// or learning rates are refused on both. Nothing is applied, and the same sequence trains.
TEST_F(DistributedTokenLossTest, ARefusedTokenLossStepIsRefusedOnEveryRankAndTheGroupTrainsOn) {
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  const std::vector<v1::MicroBatch> first = Halves(StepBatch(1));
  ASSERT_TRUE(job_->Step(1, {{first[0]}, {first[1]}}, Common(1)).ok());

  const std::vector<v1::MicroBatch> halves = Halves(StepBatch(3));  // ppo
  auto requests = [&](int64_t sequence) {
    std::vector<v1::StepRequest> out(2, Common(3));
    for (size_t r = 0; r < 2; ++r) {
      out[r].set_sequence(sequence);
      *out[r].add_micro_batches() = halves[r];
    }
    return out;
  };
  struct Bad {
    size_t rank;
    std::string field;
    std::function<void(v1::StepRequest&)> spoil;
  };
  const std::vector<Bad> bad = {
      {1, "micro_batches[0].advantages",
       [](v1::StepRequest& s) {
         v1::Tensor* a = s.mutable_micro_batches(0)->mutable_advantages();
         a->set_shape(1, kSeq / 2);  // (2, 8): not the targets' shape
         a->set_data(a->data().substr(0, a->data().size() / 2));
       }},
      {0, "micro_batches[0].sampling_logprobs",
       [](v1::StepRequest& s) {
         std::string* d = s.mutable_micro_batches(0)->mutable_sampling_logprobs()->mutable_data();
         const float nan = std::numeric_limits<float>::quiet_NaN();
         std::memcpy(d->data() + 12, &nan, sizeof(nan));
       }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.field);
    std::vector<v1::StepRequest> sent = requests(2);
    b.spoil(sent[b.rank]);
    std::vector<absl::StatusOr<v1::StepResponse>> results = SendEach(sent);
    for (size_t r = 0; r < 2; ++r) {
      ASSERT_FALSE(results[r].ok()) << "rank " << r;
      EXPECT_EQ(results[r].status().code(), absl::StatusCode::kInvalidArgument)
          << results[r].status();
      std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(results[r].status());
      ASSERT_TRUE(info.has_value()) << results[r].status();
      if (r == b.rank) {
        EXPECT_EQ(info->reason(), "INVALID_FIELD") << results[r].status();
        EXPECT_EQ(info->metadata().at("field"), b.field) << results[r].status();
      } else {
        EXPECT_EQ(info->reason(), "REPLICAS_DIFFER") << results[r].status();
      }
    }
  }
  // Both valid, but not the same loss (neither a sum nor a mean), or not
  // the same learning rate (the ranks' weights would part).
  struct Differ {
    std::string what;
    std::string field;
    std::function<void(v1::StepRequest&)> change;
  };
  const std::vector<Differ> differ = {
      {"loss functions differ", "loss_fn",
       [](v1::StepRequest& s) {
         // Without PPO's clip range, which importance sampling refuses.
         s.set_loss_fn(v1::LOSS_FN_IMPORTANCE_SAMPLING);
         s.clear_ppo_clip_low();
         s.clear_ppo_clip_high();
       }},
      {"a dro step beside a ppo one", "loss_fn",
       [](v1::StepRequest& s) {
         s.set_loss_fn(v1::LOSS_FN_DRO);
         s.clear_ppo_clip_low();
         s.clear_ppo_clip_high();
         s.set_dro_beta(0.5f);
       }},
      {"ppo clip ranges differ", "loss_fn", [](v1::StepRequest& s) { s.set_ppo_clip_high(1.2f); }},
      {"one rank overrides the learning rate", "learning_rate",
       [](v1::StepRequest& s) { s.set_learning_rate(0.5f); }},
  };
  for (const Differ& d : differ) {
    SCOPED_TRACE(d.what);
    std::vector<v1::StepRequest> sent = requests(2);
    d.change(sent[1]);
    std::vector<absl::StatusOr<v1::StepResponse>> results = SendEach(sent);
    for (size_t r = 0; r < 2; ++r) {
      ASSERT_FALSE(results[r].ok()) << "rank " << r;
      EXPECT_EQ(results[r].status().code(), absl::StatusCode::kFailedPrecondition)
          << results[r].status();
      std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(results[r].status());
      ASSERT_TRUE(info.has_value()) << results[r].status();
      EXPECT_EQ(info->reason(), "REPLICAS_DIFFER");
      EXPECT_EQ(info->metadata().at("field"), d.field);
    }
  }
  // Nothing was applied: the same sequence trains on both.
  std::vector<absl::StatusOr<v1::StepResponse>> results = SendEach(requests(2));
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_EQ(results[r]->global_step(), 2);
    EXPECT_EQ(results[r]->applied_steps(), 2);
    EXPECT_TRUE(std::isfinite(results[r]->loss()));
  }
  EXPECT_EQ(results[0]->loss(), results[1]->loss());
}

}  // namespace
}  // namespace ampd
