// ampctl's GPT front: the --layers=gpt:... flag, the synthetic Markov-chain
// sequence task and (B, T) batch files, checked here without a server; and
// end to end, the real ampctl against the real ampd (--device=cpu), a GPT
// trained on the sequence task in bf16 and in fp16 with dynamic loss
// scaling: the loss must fall to at most half its opening value, fp16 must
// end within 1% of bf16, and the fp16 job's skipped steps and loss scale
// must read the same in the metrics scrape as in ampctl's step lines.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/batch_file.h"
#include "client/sequence_task.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/exposition.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using codec::DType;
using codec::HostTensor;
using codec::StateDict;
using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

// The task of the end-to-end runs: gpt:256:64:128:2:4, 300 steps.
constexpr char kGptLayers[] = "--layers=gpt:256:64:128:2:4";
constexpr int kSteps = 300;
constexpr int kWindow = 10;  // the first and last steps compared
// Sized so that one run takes about 10 to 20 s on two shared CPU cores.
constexpr char kBatchSize[] = "--batch-size=8";
constexpr char kSeqLen[] = "--seq-len=32";
constexpr auto kRunDeadline = std::chrono::seconds(300);

std::vector<int32_t> Ids(const v1::Tensor& t) {
  std::vector<int32_t> v(t.data().size() / 4);
  std::memcpy(v.data(), t.data().data(), v.size() * 4);
  return v;
}

HostTensor Int32(codec::Shape shape, const std::vector<int32_t>& v) {
  HostTensor t{DType::kI32, std::move(shape), std::string(v.size() * 4, '\0')};
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

// ---- --layers=gpt:... ---------------------------------------------------------

TEST(GptFlagTest, ParsesTheFiveSizes) {
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags("gpt:256:64:128:2:4", "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_gpt());
  EXPECT_EQ(spec->layers_size(), 0);
  EXPECT_EQ(spec->gpt().vocab_size(), 256);
  EXPECT_EQ(spec->gpt().context_length(), 64);
  EXPECT_EQ(spec->gpt().d_model(), 128);
  EXPECT_EQ(spec->gpt().n_layer(), 2);
  EXPECT_EQ(spec->gpt().n_head(), 4);
  // The optional fields stay unset for the server's defaults.
  EXPECT_FALSE(spec->gpt().has_mlp_ratio());
  EXPECT_FALSE(spec->gpt().has_layer_norm_eps());
  EXPECT_FALSE(spec->gpt().has_tie_embeddings());
  EXPECT_TRUE(ParseModelFlags("gpt:8:4:4:1:1", "cross_entropy").ok());
}

TEST(GptFlagTest, RejectsMalformedSpecs) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"gpt:256:64:128:2", "expected gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD"},
      {"gpt:256:64:128:2:4:1", "expected gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD"},
      {"gpt:0:64:128:2:4", "VOCAB must be a positive integer"},
      {"gpt:256:x:128:2:4", "CONTEXT must be a positive integer"},
      {"gpt:256:64:128:2:-4", "NHEAD must be a positive integer"},
  };
  for (const auto& [flag, message] : bad) {
    absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(flag, "");
    ASSERT_FALSE(spec.ok()) << flag;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(spec.status().message(), message)) << spec.status();
  }
  absl::StatusOr<v1::ModelSpec> mse = ParseModelFlags("gpt:256:64:128:2:4", "mse");
  ASSERT_FALSE(mse.ok());
  EXPECT_TRUE(absl::StrContains(mse.status().message(), "--loss=mse")) << mse.status();
}

// ---- the sequence task -----------------------------------------------------------

TEST(SequenceTaskTest, BatchesAreNextTokenPairsAndDeterministic) {
  SequenceTaskOptions options{.vocab_size = 50, .batch_size = 3, .seq_len = 7, .seed = 5};
  absl::StatusOr<SequenceTask> a = SequenceTask::Create(options);
  absl::StatusOr<SequenceTask> b = SequenceTask::Create(options);
  options.seed = 6;
  absl::StatusOr<SequenceTask> c = SequenceTask::Create(options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  bool differs = false;
  for (int i = 0; i < 3; ++i) {
    const v1::MicroBatch x = a->NextBatch();
    const v1::MicroBatch y = b->NextBatch();
    const v1::MicroBatch z = c->NextBatch();
    EXPECT_EQ(x.SerializeAsString(), y.SerializeAsString());
    differs = differs || x.SerializeAsString() != z.SerializeAsString();
    for (const v1::Tensor* t : {&x.inputs(), &x.targets()}) {
      EXPECT_EQ(t->dtype(), v1::DTYPE_I32);
      ASSERT_EQ(t->shape_size(), 2);
      EXPECT_EQ(t->shape(0), 3);
      EXPECT_EQ(t->shape(1), 7);
    }
    const std::vector<int32_t> in = Ids(x.inputs());
    const std::vector<int32_t> out = Ids(x.targets());
    for (int r = 0; r < 3; ++r) {
      for (int t = 0; t + 1 < 7; ++t) EXPECT_EQ(out[r * 7 + t], in[r * 7 + t + 1]);
    }
    for (int32_t id : in) EXPECT_TRUE(id >= 0 && id < 50) << id;
    for (int32_t id : out) EXPECT_TRUE(id >= 0 && id < 50) << id;
  }
  EXPECT_TRUE(differs) << "the seed does not change the chain";
}

// Every token has at most kSuccessors successors, drawn with the stated
// probabilities: the empirical conditional entropy is the stated rate,
// which sits far below ln(vocab).
TEST(SequenceTaskTest, TheChainHasTheStatedEntropyRate) {
  absl::StatusOr<SequenceTask> task =
      SequenceTask::Create({.vocab_size = 64, .batch_size = 64, .seq_len = 256, .seed = 1});
  ASSERT_TRUE(task.ok());
  std::map<int32_t, std::map<int32_t, int64_t>> counts;
  int64_t total = 0;
  for (int i = 0; i < 8; ++i) {
    const v1::MicroBatch batch = task->NextBatch();
    const std::vector<int32_t> in = Ids(batch.inputs());
    const std::vector<int32_t> out = Ids(batch.targets());
    for (size_t j = 0; j < in.size(); ++j) ++counts[in[j]][out[j]];
    total += static_cast<int64_t>(in.size());
  }
  double entropy = 0;
  for (const auto& [token, next] : counts) {
    EXPECT_LE(next.size(), static_cast<size_t>(SequenceTask::kSuccessors)) << "token " << token;
    int64_t row = 0;
    for (const auto& [unused, n] : next) row += n;
    for (const auto& [unused, n] : next) {
      const double p = static_cast<double>(n) / static_cast<double>(row);
      entropy -= static_cast<double>(row) / static_cast<double>(total) * p * std::log(p);
    }
  }
  EXPECT_NEAR(SequenceTask::EntropyRate(), 1.0336, 1e-3);
  EXPECT_NEAR(entropy, SequenceTask::EntropyRate(), 0.03);
  EXPECT_LT(SequenceTask::EntropyRate(), 0.25 * std::log(64.0));
}

TEST(SequenceTaskTest, RefusesBadSizes) {
  EXPECT_FALSE(SequenceTask::Create({.vocab_size = 0, .batch_size = 1, .seq_len = 1}).ok());
  EXPECT_FALSE(SequenceTask::Create({.vocab_size = 8, .batch_size = 0, .seq_len = 1}).ok());
  EXPECT_FALSE(SequenceTask::Create({.vocab_size = 8, .batch_size = 1, .seq_len = 0}).ok());
  absl::StatusOr<SequenceTask> huge = SequenceTask::Create(
      {.vocab_size = 8, .batch_size = int64_t{1} << 40, .seq_len = int64_t{1} << 40});
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "--batch_size")) << huge.status();
}

// ---- (B, T) batch files ------------------------------------------------------------

TEST(GptBatchFileTest, AcceptsSequencesWithIgnoredTargetsAndNamesBadTensors) {
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags("gpt:16:4:8:1:2", "");
  ASSERT_TRUE(spec.ok());
  auto file = [](HostTensor inputs, HostTensor targets) {
    StateDict state;
    state.tensors.push_back({"inputs.0", Int32({2, 3}, {1, 2, 3, 4, 5, 6})});
    state.tensors.push_back({"targets.0", Int32({2, 3}, {2, 3, -100, 5, 6, 15})});
    state.tensors.push_back({"inputs.1", std::move(inputs)});
    state.tensors.push_back({"targets.1", std::move(targets)});
    return codec::EncodeSafetensors(state);
  };
  absl::StatusOr<std::vector<v1::MicroBatch>> good = BatchesFromSafetensors(
      file(Int32({1, 4}, {0, 1, 2, 3}), Int32({1, 4}, {1, 2, 3, -100})), BatchLayoutOf(*spec));
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->size(), 2u);
  EXPECT_EQ(good->at(0).inputs().shape_size(), 2);

  const std::vector<std::pair<std::string, std::string>> bad = {
      // T over the context.
      {file(Int32({1, 5}, {0, 1, 2, 3, 4}), Int32({1, 5}, {1, 2, 3, 4, 5})),
       "inputs.1: T = 5 exceeds context_length 4"},
      // An id outside the vocabulary, by position.
      {file(Int32({1, 2}, {0, 16}), Int32({1, 2}, {1, 2})), "inputs.1[0, 1]: 16 is outside"},
      // A target neither in range nor -100.
      {file(Int32({1, 2}, {0, 1}), Int32({1, 2}, {1, -1})),
       "targets.1[0, 1]: -1 is outside [0, 16) and not -100"},
      // Targets of another shape.
      {file(Int32({1, 2}, {0, 1}), Int32({2}, {1, 2})),
       "targets.1: expected I32 or I64 (1, 2) token ids"},
      // Rows of ids, as a layer stack's embedding takes them.
      {file(Int32({2}, {0, 1}), Int32({2}, {1, 2})), "inputs.1: expected I32 or I64 (B, T)"},
  };
  for (const auto& [bytes, message] : bad) {
    absl::StatusOr<std::vector<v1::MicroBatch>> batches =
        BatchesFromSafetensors(bytes, BatchLayoutOf(*spec));
    ASSERT_FALSE(batches.ok()) << message;
    EXPECT_EQ(batches.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(batches.status().message(), message)) << batches.status();
  }
}

// ---- end to end ----------------------------------------------------------------

struct TrainRun {
  std::string job_id;
  std::vector<double> losses;
  std::vector<double> scales;  // scale_after of each step
  int skipped = 0;

  double Mean(size_t from, size_t to) const {
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += losses[i];
    return sum / static_cast<double>(to - from);
  }
  double First() const { return Mean(0, kWindow); }
  double Last() const { return Mean(losses.size() - kWindow, losses.size()); }
};

class GptAmpctlE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, std::vector<std::string>{},
                                            root_.path() / "ampd.log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
    server_.reset();
  }

  CommandResult Ampctl(std::vector<std::string> args) {
    args.insert(args.begin(), {AMPCTL_BINARY, "--server=" + server_->address()});
    return RunCommand(args, kRunDeadline);
  }

  // `ampctl train` on the GPT with --json, summarised.
  TrainRun Train(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"train",    kGptLayers, absl::StrCat("--steps=", kSteps),
                                     kBatchSize, kSeqLen,    "--seed=3",
                                     "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    const CommandResult result = Ampctl(args);
    EXPECT_EQ(result.status.code, 0) << "stdout:\n" << result.out << "stderr:\n" << result.err;
    TrainRun run;
    for (absl::string_view line : absl::StrSplit(result.out, '\n', absl::SkipEmpty())) {
      google::protobuf::Struct s;
      const auto status = google::protobuf::util::JsonStringToMessage(std::string(line), &s);
      EXPECT_TRUE(status.ok()) << "not JSON: " << line;
      if (!status.ok()) continue;
      const auto& f = s.fields();
      run.job_id = f.at("job_id").string_value();
      run.losses.push_back(f.at("loss").number_value());
      run.scales.push_back(f.at("loss_scale").number_value());
      run.skipped += f.at("skipped").bool_value() ? 1 : 0;
    }
    EXPECT_EQ(run.losses.size(), static_cast<size_t>(kSteps)) << result.out;
    return run;
  }

  TempDir root_{"ampd_gpt_ampctl"};
  std::unique_ptr<AmpdProcess> server_;
};

TEST_F(GptAmpctlE2eTest, Bf16AndFp16LearnTheChainAndEndTogether) {
  const TrainRun bf16 = Train({"--precision=bf16"});
  // fp16 with the pytorch policy, its scale growing every 25 clean steps so
  // that over 300 steps it climbs until the gradients overflow, backs off
  // and skips those steps: dynamic scaling at work.
  const TrainRun fp16 = Train({"--precision=fp16", "--scaler=pytorch", "--growth-interval=25"});
  ASSERT_EQ(bf16.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(fp16.losses.size(), static_cast<size_t>(kSteps));
  const double ln_vocab = std::log(256.0);
  // An untrained GPT predicts about uniformly; the chain's floor is far lower.
  EXPECT_NEAR(bf16.losses[0], ln_vocab, 0.1);
  EXPECT_NEAR(fp16.losses[0], ln_vocab, 0.1);
  EXPECT_LT(bf16.Last(), 1.5 * SequenceTask::EntropyRate());
  EXPECT_LE(bf16.Last(), 0.5 * bf16.First()) << "bf16 " << bf16.First() << " -> " << bf16.Last();
  EXPECT_LE(fp16.Last(), 0.5 * fp16.First()) << "fp16 " << fp16.First() << " -> " << fp16.Last();
  EXPECT_LE(std::fabs(fp16.Last() - bf16.Last()) / bf16.Last(), 0.01)
      << "fp16 " << fp16.Last() << " bf16 " << bf16.Last();
  EXPECT_EQ(bf16.skipped, 0);
  EXPECT_GE(fp16.skipped, 1) << "the scale never overflowed";

  // The metrics scrape tells the same story as the step lines.
  absl::StatusOr<std::string> body = test_support::HttpGetBody(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const std::map<std::string, double> samples = test_support::ParseSamples(*body);
  const std::string fp16_skipped =
      absl::StrCat("ampd_skipped_steps_total{job=\"", fp16.job_id, "\",reason=\"nonfinite\"}");
  const std::string fp16_scale = absl::StrCat("ampd_loss_scale{job=\"", fp16.job_id, "\"}");
  const std::string bf16_skipped =
      absl::StrCat("ampd_skipped_steps_total{job=\"", bf16.job_id, "\",reason=\"nonfinite\"}");
  ASSERT_TRUE(samples.count(fp16_skipped)) << fp16_skipped << " not in\n" << *body;
  ASSERT_TRUE(samples.count(fp16_scale)) << fp16_scale << " not in\n" << *body;
  EXPECT_EQ(samples.at(fp16_skipped), fp16.skipped);
  EXPECT_EQ(samples.at(fp16_scale), fp16.scales.back());
  EXPECT_GT(fp16.scales.back(), 1.0);
  ASSERT_TRUE(samples.count(bf16_skipped)) << bf16_skipped;
  EXPECT_EQ(samples.at(bf16_skipped), 0);
}

// A (B, T) batch file with ignored targets trains a GPT through ampctl; a
// file whose ids leave the vocabulary fails before any job exists.
TEST_F(GptAmpctlE2eTest, TrainsOnASequenceBatchFile) {
  StateDict state;
  std::vector<int32_t> ids(2 * 16), targets(2 * 16);
  for (int i = 0; i < 32; ++i) {
    ids[i] = (7 * i) % 256;
    targets[i] = i % 16 == 15 ? -100 : (7 * (i + 1)) % 256;  // the last position ignored
  }
  state.tensors.push_back({"inputs.0", Int32({2, 16}, ids)});
  state.tensors.push_back({"targets.0", Int32({2, 16}, targets)});
  const std::string path = (root_.path() / "seq.safetensors").string();
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const std::string bytes = codec::EncodeSafetensors(state);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good());
  }
  const CommandResult ok = Ampctl({"train", kGptLayers, "--batches=" + path, "--steps=20",
                                   "--precision=fp32", "--lr=0.01", "--json"});
  ASSERT_EQ(ok.status.code, 0) << ok.out << ok.err;
  std::vector<double> losses;
  std::string job_id;
  for (absl::string_view line : absl::StrSplit(ok.out, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct s;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(std::string(line), &s).ok()) << line;
    losses.push_back(s.fields().at("loss").number_value());
    job_id = s.fields().at("job_id").string_value();
  }
  ASSERT_EQ(losses.size(), 20u);
  // One batch over and over: memorised.
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << ok.out;

  // eval: the file's batch, and without a file the sequence task's first
  // batch; both read the trained job without changing it.
  const auto eval_loss = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"eval", "--job=" + job_id, "--json"});
    const CommandResult r = Ampctl(flags);
    EXPECT_EQ(r.status.code, 0) << r.out << r.err;
    google::protobuf::Struct s;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &s).ok()) << r.out;
    return s.fields().contains("loss") ? s.fields().at("loss").number_value() : -1.0;
  };
  const double on_file = eval_loss({"--batches=" + path});
  EXPECT_GT(on_file, 0.0);
  EXPECT_LT(on_file, 0.5 * losses.front());
  EXPECT_EQ(eval_loss({"--batches=" + path}), on_file);
  const double on_task = eval_loss({"--batch-size=2", "--seq-len=16", "--seed=3"});
  EXPECT_TRUE(std::isfinite(on_task) && on_task > 0.0) << on_task;

  state.tensors[0].tensor = Int32({2, 16}, std::vector<int32_t>(32, 300));
  const std::string bad = (root_.path() / "bad.safetensors").string();
  {
    std::ofstream f(bad, std::ios::binary | std::ios::trunc);
    const std::string bytes = codec::EncodeSafetensors(state);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const CommandResult refused = Ampctl({"train", kGptLayers, "--batches=" + bad, "--steps=1"});
  EXPECT_EQ(refused.status.code, 2) << refused.out << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "inputs.0[0, 0]: 300 is outside [0, 256)"))
      << refused.err;
  const CommandResult jobs = Ampctl({"jobs", "list"});
  EXPECT_EQ(jobs.status.code, 0) << jobs.err;
  EXPECT_EQ(std::count(jobs.out.begin(), jobs.out.end(), '\n'), 1) << "one job, the first run's:\n"
                                                                   << jobs.out;
}

}  // namespace
}  // namespace ampd
