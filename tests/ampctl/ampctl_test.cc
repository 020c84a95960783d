// `ampctl train --batches=FILE`: batch files written with EncodeSafetensors
// into a temporary directory, the real `ampd` (tests/support's AmpdProcess:
// --device=cpu on 127.0.0.1:0, its port read from the "listening on" line)
// and the real `ampctl` binary. The losses ampctl prints must be the ones a
// Trainer run in this process on the same batches, config and seed
// produces: the same CPU backend, so they agree to the bit. Malformed files
// and flags must fail with exit status 2, naming the tensor or layer, before
// any job exists. Every wait on a child is bounded (a poll on its pipes
// under a deadline, a future with a deadline).
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/batch_file.h"
#include "client/client.h"
#include "client/synthetic_task.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kernels/float16.h"
#include "server/engine/model/batch_check.h"
#include "server/engine/trainer/trainer.h"
#include "server/rpc/translate.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using codec::DType;
using codec::EncodeSafetensors;
using codec::HostTensor;
using codec::StateDict;

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

constexpr auto kExitDeadline = std::chrono::seconds(120);

// ---- tensors and batch files ----------------------------------------------------

HostTensor F32(codec::Shape shape, const std::vector<float>& v) {
  HostTensor t{DType::kF32, std::move(shape), std::string(v.size() * 4, '\0')};
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}
HostTensor Bf16(codec::Shape shape, const std::vector<float>& v) {
  HostTensor t{DType::kBF16, std::move(shape), std::string(v.size() * 2, '\0')};
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t bits = kernels::FloatToBf16Bits(v[i]);
    std::memcpy(t.data.data() + 2 * i, &bits, 2);
  }
  return t;
}
HostTensor I32(codec::Shape shape, const std::vector<int32_t>& v) {
  HostTensor t{DType::kI32, std::move(shape), std::string(v.size() * 4, '\0')};
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}
HostTensor I64(codec::Shape shape, const std::vector<int64_t>& v) {
  HostTensor t{DType::kI64, std::move(shape), std::string(v.size() * 8, '\0')};
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

// Deterministic values that differ per batch and element; the magnitude
// makes fp16 at PyTorch's init_scale overflow, so the scaler has work to do.
std::vector<float> Values(size_t n, int batch, float magnitude) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = magnitude * std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(batch));
  }
  return v;
}

// The regression file the happy-path test trains on: 3 batches of 8 rows,
// 16 -> 8, with batch 1's inputs in BF16 (any float dtype is accepted).
StateDict RegressionBatches() {
  StateDict state;
  for (int b = 0; b < 3; ++b) {
    const std::vector<float> x = Values(8 * 16, b, 1.0f);
    state.tensors.push_back(
        {absl::StrCat("inputs.", b), b == 1 ? Bf16({8, 16}, x) : F32({8, 16}, x)});
    state.tensors.push_back(
        {absl::StrCat("targets.", b), F32({8, 8}, Values(8 * 8, b + 5, 48.0f))});
  }
  return state;
}
constexpr char kRegressionLayers[] = "linear:16:32,gelu,linear:32:8";

HostTensor* Find(StateDict& state, const std::string& name) {
  for (auto& t : state.tensors) {
    if (t.name == name) return &t.tensor;
  }
  return nullptr;
}

// ---- the reference: the engine in this process ---------------------------------

struct StepLine {
  int64_t step = 0;
  double loss = 0;
  double loss_scale = 0;
  bool skipped = false;
  std::string job_id;
};

// One JSON object per line of ampctl's --json output, parsed with
// protobuf's JSON parser into a Struct.
std::vector<StepLine> ParseLines(const std::string& out) {
  std::vector<StepLine> lines;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct s;
    const auto status = google::protobuf::util::JsonStringToMessage(std::string(line), &s);
    EXPECT_TRUE(status.ok()) << "not JSON: " << line;
    if (!status.ok()) continue;
    const auto& f = s.fields();
    for (const char* key : {"step", "loss", "loss_scale", "skipped", "job_id"}) {
      EXPECT_TRUE(f.contains(key)) << key << " missing in " << line;
    }
    if (!f.contains("step") || !f.contains("loss") || !f.contains("loss_scale") ||
        !f.contains("skipped") || !f.contains("job_id")) {
      continue;
    }
    StepLine l;
    l.step = static_cast<int64_t>(f.at("step").number_value());
    l.loss = f.at("loss").kind_case() == google::protobuf::Value::kNullValue
                 ? NAN
                 : f.at("loss").number_value();
    l.loss_scale = f.at("loss_scale").number_value();
    l.skipped = f.at("skipped").bool_value();
    l.job_id = f.at("job_id").string_value();
    lines.push_back(l);
  }
  return lines;
}

// What ampctl sends for these flags with the other options at their
// defaults: adamw, the pytorch scaler policy, the given precision and seed.
v1::JobConfig ExpectedConfig(const v1::ModelSpec& model, v1::Precision precision, uint64_t seed) {
  v1::JobConfig config;
  *config.mutable_model() = model;
  config.set_precision(precision);
  config.set_seed(seed);
  config.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  config.mutable_scaler()->set_policy(v1::SCALER_POLICY_PYTORCH);
  return config;
}

// The reports of `steps` Trainer steps on the batches, cycled.
std::vector<engine::StepReport> ReferenceRun(const v1::JobConfig& proto, const StateDict& batches,
                                             int steps) {
  std::vector<engine::StepReport> reports;
  absl::StatusOr<engine::JobConfig> config = rpc::JobConfigFromProto(proto);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return reports;
  auto backend = kernels::CreateBackend("cpu");
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return reports;
  auto trainer = engine::Trainer::Create(*config, *std::move(backend));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return reports;
  const size_t count = batches.tensors.size() / 2;
  for (int s = 0; s < steps; ++s) {
    const size_t b = static_cast<size_t>(s) % count;
    engine::StepInput input;
    engine::MicroBatch mb;
    mb.inputs = *batches.Find(absl::StrCat("inputs.", b));
    mb.targets = *batches.Find(absl::StrCat("targets.", b));
    input.micro_batches.push_back(std::move(mb));
    absl::StatusOr<engine::StepReport> report = (*trainer)->Step(input);
    EXPECT_TRUE(report.ok()) << report.status();
    if (!report.ok()) return reports;
    reports.push_back(*report);
  }
  return reports;
}

class AmpctlTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
    }
    client_.reset();
    server_.reset();
  }

  void StartServer() {
    server_ = std::make_unique<AmpdProcess>(
        AMPD_SERVER_BINARY,
        std::vector<std::string>{"--state-dir=" + (root_.path() / "state").string()},
        root_.path() / "ampd.log");
    ASSERT_NE(server_->port(), 0) << "ampd did not report its port; " << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }

  std::string WriteBatches(const StateDict& state, const std::string& name = "batches") {
    const std::string path = (root_.path() / (name + ".safetensors")).string();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const std::string bytes = EncodeSafetensors(state);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(f.good()) << path;
    return path;
  }

  // Runs ampctl with `args` (and --server= the running ampd, or a closed
  // port when none runs), its stdout and stderr captured.
  CommandResult Ampctl(std::vector<std::string> args) {
    const std::string server = server_ != nullptr ? server_->address() : std::string("127.0.0.1:1");
    args.insert(args.begin(), {AMPCTL_BINARY, "--server=" + server});
    CommandResult run = RunCommand(args, kExitDeadline);
    // A child that could not be started reports neither an exit nor a signal.
    EXPECT_TRUE(run.status.exited || run.status.signaled()) << run.err;
    return run;
  }

  // A malformed file or flag: exit status 2, the message naming `culprit`,
  // and no job left on the server.
  void ExpectUsageError(const std::vector<std::string>& args, const std::string& culprit) {
    const CommandResult run = Ampctl(args);
    EXPECT_EQ(run.status.code, 2) << "stdout:\n" << run.out << "stderr:\n" << run.err;
    EXPECT_TRUE(absl::StrContains(run.err, culprit)) << "stderr does not name " << culprit << ":\n"
                                                     << run.err;
    EXPECT_TRUE(run.out.empty()) << run.out;
    if (client_ != nullptr) {
      absl::StatusOr<std::vector<v1::Job>> jobs = client_->ListAllJobs();
      ASSERT_TRUE(jobs.ok()) << jobs.status();
      EXPECT_TRUE(jobs->empty()) << "a job was created for a rejected file";
    }
  }

  // Trains through ampctl and checks every line against the reference, and
  // the job's effective config against the expected one.
  // Returns ampctl's lines (empty when a check failed early).
  std::vector<StepLine> ExpectSameAsEngine(const StateDict& batches, const v1::JobConfig& expected,
                                           std::vector<std::string> flags, int steps) {
    const std::string path = WriteBatches(batches);
    flags.insert(flags.begin(), {"train", "--batches=" + path, absl::StrCat("--steps=", steps),
                                 absl::StrCat("--seed=", expected.seed()), "--json"});
    const CommandResult run = Ampctl(flags);
    EXPECT_EQ(run.status.code, 0) << "stdout:\n" << run.out << "stderr:\n" << run.err;
    const std::vector<StepLine> lines = ParseLines(run.out);
    const std::vector<engine::StepReport> reports = ReferenceRun(expected, batches, steps);
    EXPECT_EQ(lines.size(), static_cast<size_t>(steps)) << run.out;
    EXPECT_EQ(reports.size(), static_cast<size_t>(steps));
    if (lines.size() != static_cast<size_t>(steps) || reports.size() != lines.size()) return {};
    for (size_t i = 0; i < lines.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("step ", i + 1));
      EXPECT_EQ(lines[i].step, static_cast<int64_t>(i + 1));
      // %.9g round-trips a float, so the printed loss is the float itself.
      EXPECT_EQ(static_cast<float>(lines[i].loss), reports[i].loss);
      EXPECT_EQ(static_cast<float>(lines[i].loss_scale), reports[i].scaler.scale_after);
      EXPECT_EQ(lines[i].skipped, reports[i].scaler.skipped);
      EXPECT_EQ(lines[i].job_id, lines[0].job_id);
    }
    // The job ampctl created has the model the flags describe, with the
    // server's defaults filled in exactly as the reference's.
    absl::StatusOr<v1::Job> job = client_->GetJob(lines[0].job_id);
    EXPECT_TRUE(job.ok()) << job.status();
    absl::StatusOr<engine::JobConfig> effective = rpc::JobConfigFromProto(expected);
    EXPECT_TRUE(effective.ok()) << effective.status();
    if (!job.ok() || !effective.ok()) return {};
    v1::JobConfig want = rpc::JobConfigToProto(*effective);
    v1::JobConfig got = job->config();
    got.clear_display_name();
    want.clear_display_name();
    std::string diff;
    google::protobuf::util::MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&diff);
    EXPECT_TRUE(differencer.Compare(want, got)) << diff;
    EXPECT_EQ(job->step(), steps);
    return lines;
  }

  TempDir root_{"ampd_ampctl_test"};
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(AmpctlTest, TrainsOnRegressionBatchesLikeTheEngine) {
  StartServer();
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(kRegressionLayers, "mse");
  ASSERT_TRUE(spec.ok()) << spec.status();
  // 5 steps over 3 batches: steps 4 and 5 reuse batches 0 and 1.
  const std::vector<StepLine> lines =
      ExpectSameAsEngine(RegressionBatches(), ExpectedConfig(*spec, v1::PRECISION_FP16, 3),
                         {absl::StrCat("--layers=", kRegressionLayers)}, 5);
  // The targets' magnitude overflows fp16 at the first scale and later
  // steps apply, so both the skip path and real AdamW updates are compared.
  std::string pattern;
  for (const StepLine& l : lines) pattern += l.skipped ? 'S' : 'A';
  EXPECT_TRUE(absl::StrContains(pattern, "S") && absl::StrContains(pattern, "A")) << pattern;
}

TEST_F(AmpctlTest, TrainsAnEmbeddingClassifierFromIdsAndLabels) {
  StartServer();
  StateDict batches;
  for (int b = 0; b < 2; ++b) {
    std::vector<int64_t> ids(12);
    std::vector<int32_t> labels(12);
    for (int i = 0; i < 12; ++i) {
      ids[static_cast<size_t>(i)] = (i * 7 + b * 3) % 10;
      labels[static_cast<size_t>(i)] = (i + b) % 5;
    }
    batches.tensors.push_back({absl::StrCat("inputs.", b), I64({12}, ids)});
    batches.tensors.push_back({absl::StrCat("targets.", b), I32({12}, labels)});
  }
  v1::ModelSpec model;
  model.add_layers()->mutable_embedding()->set_num_embeddings(10);
  model.mutable_layers(0)->mutable_embedding()->set_embedding_dim(8);
  model.add_layers()->mutable_tanh();
  model.add_layers()->mutable_linear()->set_in_features(8);
  model.mutable_layers(2)->mutable_linear()->set_out_features(5);
  model.set_loss(v1::LOSS_CROSS_ENTROPY);
  ExpectSameAsEngine(
      batches, ExpectedConfig(model, v1::PRECISION_BF16, 11),
      {"--layers=embedding:10:8,tanh,linear:8:5", "--loss=cross_entropy", "--precision=bf16"}, 4);
}

TEST_F(AmpctlTest, MissingTargetsIsNamed) {
  StartServer();
  StateDict state = RegressionBatches();
  std::erase_if(state.tensors, [](const auto& t) { return t.name == "targets.1"; });
  ExpectUsageError({"train", "--batches=" + WriteBatches(state),
                    absl::StrCat("--layers=", kRegressionLayers), "--steps=4", "--json"},
                   "targets.1 is missing");
}

TEST_F(AmpctlTest, WrongDtypesAreNamed) {
  StartServer();
  {
    StateDict state = RegressionBatches();
    *Find(state, "targets.2") = I32({8}, std::vector<int32_t>(8, 1));  // labels, but mse
    ExpectUsageError({"train", "--batches=" + WriteBatches(state, "labels"),
                      absl::StrCat("--layers=", kRegressionLayers), "--steps=4"},
                     "targets.2: expected F32 (N, 8) with N = 8");
  }
  {
    StateDict state = RegressionBatches();
    *Find(state, "inputs.0") = I64({8}, std::vector<int64_t>(8, 1));  // ids, but no embedding
    ExpectUsageError({"train", "--batches=" + WriteBatches(state, "ids"),
                      absl::StrCat("--layers=", kRegressionLayers), "--steps=4"},
                     "inputs.0: expected F32, F16 or BF16 (N, 16)");
  }
  {
    StateDict state = RegressionBatches();
    *Find(state, "inputs.1") = F32({8, 12}, Values(8 * 12, 1, 1.0f));  // wrong width
    ExpectUsageError({"train", "--batches=" + WriteBatches(state, "width"),
                      absl::StrCat("--layers=", kRegressionLayers), "--steps=4"},
                     "inputs.1: expected F32, F16 or BF16 (N, 16)");
  }
}

TEST_F(AmpctlTest, BadFilesAndFlagsAreUsageErrors) {
  StartServer();
  const std::string good = WriteBatches(RegressionBatches());
  const std::string layers = absl::StrCat("--layers=", kRegressionLayers);
  {
    StateDict state = RegressionBatches();
    state.tensors.push_back({"labels.0", F32({1}, {1.0f})});
    ExpectUsageError({"train", "--batches=" + WriteBatches(state, "stray"), layers},
                     "unexpected tensor \"labels.0\"");
  }
  {
    StateDict state;
    state.tensors.push_back({"inputs.0", F32({2, 16}, Values(32, 0, 1.0f))});
    state.tensors.push_back({"targets.0", F32({3, 8}, Values(24, 0, 1.0f))});  // 3 rows, not 2
    ExpectUsageError({"train", "--batches=" + WriteBatches(state, "rows"), layers},
                     "targets.0: expected F32 (N, 8) with N = 2");
  }
  {
    StateDict state = RegressionBatches();
    *Find(state, "targets.0") = I32({8}, std::vector<int32_t>(8, 9));  // class 9 of 8
    ExpectUsageError(
        {"train", "--batches=" + WriteBatches(state, "range"), layers, "--loss=cross_entropy"},
        "targets.0[0]: 9 is outside [0, 8)");
  }
  {
    const std::string path = (root_.path() / "garbage.safetensors").string();
    std::ofstream(path) << "not a safetensors file";
    ExpectUsageError({"train", "--batches=" + path, layers}, "garbage.safetensors");
  }
  ExpectUsageError({"train", "--batches=" + (root_.path() / "absent").string(), layers}, "absent");
  ExpectUsageError({"train", "--batches=" + good}, "--layers");
  ExpectUsageError({"train", "--batches=" + good, "--layers=linear:16"}, "\"linear:16\"");
  ExpectUsageError({"train", "--batches=" + good, "--layers=linear:16:32,swish"}, "swish");
  // Sizes that do not chain are the server's to refuse: CreateJob answers
  // INVALID_ARGUMENT naming the field, before any job exists.
  ExpectUsageError({"train", "--batches=" + good, "--layers=linear:16:32,linear:64:8"},
                   "layers[1].in_features: the previous layer produces 32 features");
  ExpectUsageError({"train", "--batches=" + good, layers, "--loss=hinge"}, "hinge");
  // With the synthetic task, --layers must take its 16 inputs.
  ExpectUsageError({"train", "--layers=linear:12:4", "--steps=1"}, "synthetic task's inputs");
}

TEST_F(AmpctlTest, SyntheticTaskAcceptsLayers) {
  StartServer();
  const CommandResult run = Ampctl(
      {"train", "--layers=linear:16:8,relu,linear:8:4", "--steps=2", "--precision=fp32", "--json"});
  ASSERT_EQ(run.status.code, 0) << run.err;
  const std::vector<StepLine> lines = ParseLines(run.out);
  ASSERT_EQ(lines.size(), 2u) << run.out;
  absl::StatusOr<v1::Job> job = client_->GetJob(lines[0].job_id);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->config().model().layers_size(), 3);
  EXPECT_EQ(job->config().model().layers(0).linear().out_features(), 8);
  EXPECT_TRUE(job->config().model().layers(1).has_relu());
  EXPECT_TRUE(std::isfinite(lines[1].loss));
}

// One JSON object of ampd's output as a Struct's fields (empty when the
// line is not JSON).
google::protobuf::Struct ParseObject(const std::string& line) {
  google::protobuf::Struct s;
  const auto status = google::protobuf::util::JsonStringToMessage(line, &s);
  EXPECT_TRUE(status.ok()) << "not JSON: " << line;
  return s;
}

// `ampctl eval` prints the loss the job's next Step on the same batches
// reports (all of the file's batches, as one Evaluate's micro-batches),
// and leaves the job where it was.
TEST_F(AmpctlTest, EvalPrintsTheLossOfTheNextStepAndChangesNothing) {
  StartServer();
  const std::string path = WriteBatches(RegressionBatches());
  const std::string layers = absl::StrCat("--layers=", kRegressionLayers);
  const CommandResult trained =
      Ampctl({"train", "--batches=" + path, layers, "--steps=4", "--precision=fp32", "--json"});
  ASSERT_EQ(trained.status.code, 0) << trained.err;
  const std::vector<StepLine> lines = ParseLines(trained.out);
  ASSERT_EQ(lines.size(), 4u) << trained.out;
  const std::string id = lines[0].job_id;

  const CommandResult evaluated = Ampctl({"eval", "--job=" + id, "--batches=" + path, "--json"});
  ASSERT_EQ(evaluated.status.code, 0) << evaluated.err;
  const google::protobuf::Struct line = ParseObject(evaluated.out);
  ASSERT_TRUE(line.fields().contains("loss")) << evaluated.out;
  EXPECT_EQ(line.fields().at("job_id").string_value(), id);
  EXPECT_EQ(line.fields().at("step").number_value(), 4);
  EXPECT_EQ(line.fields().at("samples").number_value(), 24);
  // The text form names the loss too, with 9 significant digits.
  const CommandResult text = Ampctl({"eval", id, "--batches=" + path});
  ASSERT_EQ(text.status.code, 0) << text.err;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrFormat("eval loss %.9g over 24 samples",
                                                          line.fields().at("loss").number_value())))
      << text.out;

  // Nothing moved: the job is at step 4, and step 5 on the file's batches
  // reports the loss eval printed.
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->step(), 4);
  absl::StatusOr<std::string> bytes = ReadBatchFile(path);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(kRegressionLayers, "mse");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<v1::MicroBatch>> batches =
      BatchesFromSafetensors(*bytes, BatchLayoutOf(*spec));
  ASSERT_TRUE(batches.ok()) << batches.status();
  v1::StepRequest step;
  step.set_job_id(id);
  step.set_sequence(5);
  for (const v1::MicroBatch& mb : *batches) *step.add_micro_batches() = mb;
  absl::StatusOr<v1::StepResponse> stepped = client_->Step(step);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->loss(), static_cast<float>(line.fields().at("loss").number_value()));

  // The synthetic task's batch does not fit this model: a usage error.
  const CommandResult synthetic = Ampctl({"eval", "--job=" + id});
  EXPECT_EQ(synthetic.status.code, 2) << synthetic.err;
  EXPECT_TRUE(absl::StrContains(synthetic.err, "--batches=FILE")) << synthetic.err;
  // An unknown job is the server's NOT_FOUND.
  const CommandResult unknown = Ampctl({"eval", "--job=job-nope", "--batches=" + path});
  EXPECT_EQ(unknown.status.code, 1) << unknown.err;
  EXPECT_TRUE(absl::StrContains(unknown.err, "NOT_FOUND [JOB_NOT_FOUND")) << unknown.err;
}

// Without --batches, eval takes the synthetic task's first batch for
// --seed: the batch `train` with that seed steps on first.
TEST_F(AmpctlTest, EvalOnTheSyntheticTaskIsTheFirstTrainingBatchsLoss) {
  StartServer();
  absl::StatusOr<v1::Job> job = client_->CreateJob([] {
    v1::CreateJobRequest request;
    *request.mutable_config()->mutable_model() = SyntheticTask(SyntheticTaskOptions{}).Model();
    request.mutable_config()->set_precision(v1::PRECISION_FP32);
    return request;
  }());
  ASSERT_TRUE(job.ok()) << job.status();
  const CommandResult evaluated =
      Ampctl({"eval", "--job=" + job->job_id(), "--seed=9", "--batch-size=12", "--json"});
  ASSERT_EQ(evaluated.status.code, 0) << evaluated.err;
  const google::protobuf::Struct line = ParseObject(evaluated.out);
  ASSERT_TRUE(line.fields().contains("loss")) << evaluated.out;
  EXPECT_EQ(line.fields().at("samples").number_value(), 12);
  SyntheticTaskOptions options;  // ampctl's defaults, but --seed and --batch-size
  options.batch_size = 12;
  options.seed = 9;
  options.target_scale = 32.0f;
  v1::StepRequest step;
  step.set_job_id(job->job_id());
  step.set_sequence(1);
  *step.add_micro_batches() = SyntheticTask(options).NextBatch();
  absl::StatusOr<v1::StepResponse> stepped = client_->Step(step);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->loss(), static_cast<float>(line.fields().at("loss").number_value()));
}

// --lr-schedule and its flags reach the job's config, and every step line
// carries the lr the schedule gave it.
TEST_F(AmpctlTest, ScheduleFlagsConfigureTheJobAndStepsReportTheirLr) {
  StartServer();
  const CommandResult run =
      Ampctl({"train", "--steps=5", "--precision=fp32", "--lr=0.01", "--lr-schedule=warmup_cosine",
              "--warmup-steps=1", "--decay-steps=3", "--min-lr=0.001", "--json"});
  ASSERT_EQ(run.status.code, 0) << run.err;
  std::vector<double> lrs;
  std::string id;
  for (absl::string_view l : absl::StrSplit(run.out, '\n', absl::SkipEmpty())) {
    const google::protobuf::Struct line = ParseObject(std::string(l));
    ASSERT_TRUE(line.fields().contains("learning_rate")) << l;
    lrs.push_back(line.fields().at("learning_rate").number_value());
    id = line.fields().at("job_id").string_value();
  }
  ASSERT_EQ(lrs.size(), 5u) << run.out;
  // fp32 steps all apply: nanoGPT's get_lr(0..4) for lr 0.01, warmup 1,
  // decay 3, min 0.001.
  const double lr = 0.01f, min_lr = 0.001f;
  const double want[5] = {lr / 2, lr,
                          min_lr + 0.5 * (1 + std::cos(std::numbers::pi / 2)) * (lr - min_lr),
                          min_lr, min_lr};
  for (size_t i = 0; i < 5; ++i)
    EXPECT_EQ(static_cast<float>(lrs[i]), static_cast<float>(want[i])) << i;
  absl::StatusOr<v1::Job> job = client_->GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->config().optimizer().lr_schedule(), v1::LR_SCHEDULE_WARMUP_COSINE);
  EXPECT_EQ(job->config().optimizer().warmup_steps(), 1);
  EXPECT_EQ(job->config().optimizer().decay_steps(), 3);
  EXPECT_EQ(job->config().optimizer().min_lr(), 0.001f);

  ASSERT_TRUE(client_->DeleteJob(id).ok());
  ExpectUsageError({"train", "--steps=1", "--lr-schedule=step"}, "--lr_schedule");
  // The server names the field of a schedule it refuses; no job is left.
  ExpectUsageError(
      {"train", "--steps=1", "--lr-schedule=warmup_cosine", "--warmup-steps=4", "--decay-steps=4"},
      "config.optimizer.decay_steps");
}

// Server errors are printed with their ErrorInfo reason, so scripts can
// match the reason instead of the wording.
TEST_F(AmpctlTest, ServerErrorsShowTheirReason) {
  StartServer();
  const CommandResult run = Ampctl({"jobs", "get", "job-nope"});
  EXPECT_EQ(run.status.code, 1) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "ampctl: NOT_FOUND [JOB_NOT_FOUND job_id=job-nope]: "))
      << run.err;
}

TEST_F(AmpctlTest, HelpDocumentsBatchFiles) {
  const CommandResult run = Ampctl({"--help"});
  const std::string text = run.out + run.err;
  EXPECT_TRUE(absl::StrContains(text, "--batches=FILE")) << text;
  EXPECT_TRUE(absl::StrContains(text, "inputs.<i>")) << text;
  EXPECT_TRUE(absl::StrContains(text, "linear:IN:OUT")) << text;
  EXPECT_TRUE(absl::StrContains(text, "cross_entropy")) << text;
}

// ---- the flag and file parsing, in process -----------------------------------------

TEST(ParseModelFlagsTest, BuildsTheLayersInOrder) {
  absl::StatusOr<v1::ModelSpec> spec =
      ParseModelFlags("layer_norm:16, linear:16:32:nobias ,tanh,linear:32:3", "cross_entropy");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::ModelSpec& proto = *spec;
  ASSERT_EQ(proto.layers_size(), 4);
  EXPECT_EQ(proto.layers(0).layer_norm().normalized_shape(), 16);
  EXPECT_EQ(proto.layers(1).linear().in_features(), 16);
  EXPECT_EQ(proto.layers(1).linear().out_features(), 32);
  EXPECT_FALSE(proto.layers(1).linear().bias());
  EXPECT_TRUE(proto.layers(2).has_tanh());
  EXPECT_EQ(proto.layers(3).linear().out_features(), 3);
  EXPECT_TRUE(proto.layers(3).linear().bias());
  EXPECT_EQ(proto.loss(), v1::LOSS_CROSS_ENTROPY);
}

TEST(ParseModelFlagsTest, RejectsMalformedItems) {
  for (const char* bad :
       {"", "linear", "linear:16", "linear:16:0", "linear:16:x", "linear:16:8:bias", "relu:3",
        "gelu,,linear:1:1", "conv:3:3", "linear:4:4,embedding:10:4", "relu,tanh"}) {
    absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(bad, "mse");
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StartsWith(spec.status().message(), "--layers")) << spec.status();
  }
}

// ampctl reads a model's batch layout off the wire spec; the engine derives
// it from its own ModelSpec. For every model the server accepts they agree.
TEST(BatchLayoutOfTest, AgreesWithTheEngine) {
  for (const auto& [layers, loss] : std::vector<std::pair<const char*, const char*>>{
           {kRegressionLayers, "mse"},
           {"linear:16:32,gelu,linear:32:8", "cross_entropy"},
           {"layer_norm:12,linear:12:4", "mse"},
           {"relu,linear:6:3,tanh", "mse"},
           {"linear:5:7,layer_norm:7", "mse"},
           {"embedding:10:8,tanh,linear:8:5", "cross_entropy"},
           {"embedding:10:8", "mse"},
           {"embedding:10:8,layer_norm:8,linear:8:3,gelu", "mse"}}) {
    SCOPED_TRACE(absl::StrCat(layers, " ", loss));
    absl::StatusOr<v1::ModelSpec> proto = ParseModelFlags(layers, loss);
    ASSERT_TRUE(proto.ok()) << proto.status();
    engine::model::ModelSpec spec;
    ASSERT_TRUE(rpc::ModelSpecFromProto(*proto, "model", &spec).ok());
    ASSERT_TRUE(engine::model::ValidateModelSpec(spec).ok());
    const codec::BatchLayout client = BatchLayoutOf(*proto);
    const codec::BatchLayout engine = engine::model::LayoutOf(spec);
    EXPECT_EQ(client.input_ids, engine.input_ids);
    EXPECT_EQ(client.num_embeddings, engine.num_embeddings);
    EXPECT_EQ(client.input_features, engine.input_features);
    EXPECT_EQ(client.target_labels, engine.target_labels);
    EXPECT_EQ(client.outputs, engine.outputs);
  }
}

TEST(BatchesFromSafetensorsTest, KeepsIndexOrderAndBytes) {
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(kRegressionLayers, "mse");
  ASSERT_TRUE(spec.ok());
  StateDict state = RegressionBatches();
  // Header order is not batch order: the file may list batch 2 first.
  std::reverse(state.tensors.begin(), state.tensors.end());
  absl::StatusOr<std::vector<v1::MicroBatch>> batches =
      BatchesFromSafetensors(EncodeSafetensors(state), BatchLayoutOf(*spec));
  ASSERT_TRUE(batches.ok()) << batches.status();
  ASSERT_EQ(batches->size(), 3u);
  for (int b = 0; b < 3; ++b) {
    const v1::MicroBatch& mb = (*batches)[static_cast<size_t>(b)];
    EXPECT_EQ(mb.inputs().dtype(), b == 1 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
    EXPECT_EQ(mb.inputs().data(), state.Find(absl::StrCat("inputs.", b))->data);
    EXPECT_EQ(mb.targets().data(), state.Find(absl::StrCat("targets.", b))->data);
  }
}

TEST(BatchesFromSafetensorsTest, NamesGapsAndLeadingZeros) {
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(kRegressionLayers, "mse");
  ASSERT_TRUE(spec.ok());
  StateDict state = RegressionBatches();
  std::erase_if(state.tensors, [](const auto& t) { return absl::EndsWith(t.name, ".1"); });
  absl::StatusOr<std::vector<v1::MicroBatch>> gap =
      BatchesFromSafetensors(EncodeSafetensors(state), BatchLayoutOf(*spec));
  EXPECT_TRUE(absl::StrContains(gap.status().message(), "inputs.1 and targets.1 are missing"))
      << gap.status();
  state.tensors.push_back({"inputs.01", F32({8, 16}, Values(128, 1, 1.0f))});
  absl::StatusOr<std::vector<v1::MicroBatch>> zero =
      BatchesFromSafetensors(EncodeSafetensors(state), BatchLayoutOf(*spec));
  EXPECT_TRUE(absl::StrContains(zero.status().message(), "unexpected tensor \"inputs.01\""))
      << zero.status();
  absl::StatusOr<std::vector<v1::MicroBatch>> empty =
      BatchesFromSafetensors(EncodeSafetensors(StateDict{}), BatchLayoutOf(*spec));
  EXPECT_TRUE(absl::StrContains(empty.status().message(), "no batches")) << empty.status();
}

}  // namespace
}  // namespace ampd
