// ampctl's decoder front: the --layers=llama:... / qwen2:... / qwen3:... /
// gemma3:... flag and its
// wire form through the server's translation (defaults filled in, effective
// config read back), checked without a server; and end to end, the real
// ampctl against the real ampd (--device=cpu): a small Qwen2-style decoder
// (grouped K/V heads, q/k/v biases) trained on the sequence task in fp16
// with dynamic loss scaling halves its loss over 300 steps, and so does a
// LoRA fine-tune of that trained model on another task.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/batch_file.h"
#include "client/sequence_task.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "server/rpc/wire.h"
#include "tests/support/ampd_process.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using test_support::AmpdProcess;
using test_support::CommandResult;
using test_support::RunCommand;
using test_support::TempDir;

TEST(DecoderFlagTest, ParsesTheSizesAndTheFamilysBiases) {
  absl::StatusOr<v1::ModelSpec> qwen2 = ParseModelFlags("qwen2:256:64:128:2:4:2:64", "");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  ASSERT_TRUE(qwen2->has_decoder());
  const v1::Decoder& d = qwen2->decoder();
  EXPECT_EQ(d.vocab_size(), 256);
  EXPECT_EQ(d.hidden_size(), 64);
  EXPECT_EQ(d.intermediate_size(), 128);
  EXPECT_EQ(d.num_hidden_layers(), 2);
  EXPECT_EQ(d.num_attention_heads(), 4);
  EXPECT_EQ(d.num_key_value_heads(), 2);
  EXPECT_EQ(d.max_position_embeddings(), 64);
  EXPECT_TRUE(d.qkv_bias());
  EXPECT_FALSE(d.has_o_bias());
  EXPECT_FALSE(d.has_rope_theta());
  absl::StatusOr<v1::ModelSpec> llama = ParseModelFlags("llama:32:16:48:1:4:1", "ce");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_FALSE(llama->decoder().qkv_bias());
  EXPECT_EQ(llama->decoder().max_position_embeddings(), 2048);
  EXPECT_TRUE(BatchLayoutOf(*llama).sequences);
  EXPECT_EQ(BatchLayoutOf(*llama).context_length, 2048);
  EXPECT_EQ(BatchLayoutOf(*llama).num_embeddings, 32);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"llama:256:64:128:2:4", "expected llama:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS"},
      {"qwen2:256:64:128:2:4:2:64:1", "expected qwen2:VOCAB"},
      {"llama:256:64:0:2:4:2", "INTER must be a positive integer"},
      {"llama:256:64:128:2:4:x", "KV_HEADS must be a positive integer"},
  };
  for (const auto& [flag, message] : bad) {
    absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags(flag, "");
    ASSERT_FALSE(spec.ok()) << flag;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(spec.status().message(), message)) << spec.status();
  }
  EXPECT_FALSE(ParseModelFlags("llama:256:64:128:2:4:2", "mse").ok());
}

// qwen3:... and gemma3:... give their families' parts (the per-head q/k
// norm; Gemma 3's norms, GeGLU, embedding scale and tied head), which the
// server takes as a valid decoder.
TEST(DecoderFlagTest, Qwen3AndGemma3PresetsGiveTheirFamilysParts) {
  absl::StatusOr<v1::ModelSpec> qwen3 = ParseModelFlags("qwen3:256:64:128:2:4:2:64", "");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_TRUE(qwen3->decoder().qk_norm());
  EXPECT_FALSE(qwen3->decoder().qkv_bias());
  EXPECT_FALSE(qwen3->decoder().norm_unit_offset());
  absl::StatusOr<v1::ModelSpec> gemma3 = ParseModelFlags("gemma3:256:64:128:2:4:1:64", "");
  ASSERT_TRUE(gemma3.ok()) << gemma3.status();
  const v1::Decoder& g = gemma3->decoder();
  EXPECT_TRUE(g.qk_norm() && g.norm_unit_offset() && g.sandwich_norms() && g.scale_embeddings() &&
              g.tie_word_embeddings());
  EXPECT_EQ(g.mlp_activation(), v1::MLP_ACTIVATION_GELU_TANH);
  EXPECT_EQ(g.sliding_layers_size(), 0);
  for (const v1::ModelSpec* spec : {&*qwen3, &*gemma3}) {
    engine::model::ModelSpec engine_spec;
    ASSERT_TRUE(rpc::ModelSpecFromProto(*spec, "config.model", &engine_spec).ok());
    EXPECT_TRUE(engine::model::ValidateModelSpec(engine_spec).ok())
        << engine::model::ValidateModelSpec(engine_spec);
  }
  EXPECT_TRUE(absl::StrContains(ParseModelFlags("qwen3:256:64", "").status().message(),
                                "expected qwen3:VOCAB"));
}

// The wire form the server receives becomes the engine's spec with Hugging
// Face's defaults, and the effective config it answers with says every field.
TEST(DecoderWireTest, DefaultsFillInAndTheEffectiveSpecRoundTrips) {
  absl::StatusOr<v1::ModelSpec> proto = ParseModelFlags("qwen2:256:64:128:2:4:2:64", "");
  ASSERT_TRUE(proto.ok());
  engine::model::ModelSpec spec;
  ASSERT_TRUE(rpc::ModelSpecFromProto(*proto, "model", &spec).ok());
  ASSERT_TRUE(spec.decoder() != nullptr);
  EXPECT_EQ(spec.loss, engine::model::LossKind::kCrossEntropy);
  EXPECT_EQ(spec.decoder()->head_dim, 0);
  EXPECT_EQ(spec.decoder()->rms_norm_eps, 1e-6f);
  EXPECT_EQ(spec.decoder()->rope_theta, 10000.0f);
  EXPECT_EQ(spec.decoder()->initializer_range, 0.02f);
  EXPECT_FALSE(spec.decoder()->tie_word_embeddings);
  EXPECT_TRUE(spec.decoder()->qkv_bias);
  EXPECT_FALSE(spec.decoder()->o_bias);
  const v1::ModelSpec effective = rpc::ModelSpecToProto(spec);
  EXPECT_EQ(effective.decoder().head_dim(), 16);
  EXPECT_TRUE(effective.decoder().has_rope_theta());
  engine::model::ModelSpec again;
  ASSERT_TRUE(rpc::ModelSpecFromProto(effective, "model", &again).ok());
  EXPECT_EQ(rpc::ModelSpecToProto(again).SerializeAsString(), effective.SerializeAsString());

  // No key/value heads given: as many as the query heads (Hugging Face's).
  v1::ModelSpec mha = *proto;
  mha.mutable_decoder()->clear_num_key_value_heads();
  ASSERT_TRUE(rpc::ModelSpecFromProto(mha, "model", &spec).ok());
  EXPECT_EQ(spec.decoder()->num_key_value_heads, 4);
  // A layer stack beside it, another loss, a non-finite eps: named.
  v1::ModelSpec both = *proto;
  both.add_layers()->mutable_relu();
  EXPECT_TRUE(
      absl::StrContains(rpc::ModelSpecFromProto(both, "model", &spec).message(), "model.layers"));
  v1::ModelSpec mse = *proto;
  mse.set_loss(v1::LOSS_MSE);
  EXPECT_TRUE(
      absl::StrContains(rpc::ModelSpecFromProto(mse, "model", &spec).message(), "model.loss"));
  v1::ModelSpec nan = *proto;
  nan.mutable_decoder()->set_rope_theta(std::nanf(""));
  EXPECT_TRUE(absl::StrContains(rpc::ModelSpecFromProto(nan, "model", &spec).message(),
                                "model.decoder.rope_theta"));
}

TEST(DecoderFlagTest, LoraFlagsSetTheDecodersAdapters) {
  absl::StatusOr<v1::ModelSpec> spec = ParseModelFlags("qwen2:256:64:128:2:4:2:64", "");
  ASSERT_TRUE(spec.ok());
  ASSERT_TRUE(ApplyLoraFlags(8, std::nullopt, "", *spec).ok());
  EXPECT_EQ(spec->decoder().lora().rank(), 8);
  EXPECT_EQ(spec->decoder().lora().alpha(), 8.0f);  // PEFT's default scale, 1
  EXPECT_EQ(spec->decoder().lora().target_modules_size(), 0);
  ASSERT_TRUE(ApplyLoraFlags(4, 16.0, " q_proj, gate_proj ", *spec).ok());
  EXPECT_EQ(spec->decoder().lora().alpha(), 16.0f);
  ASSERT_EQ(spec->decoder().lora().target_modules_size(), 2);
  EXPECT_EQ(spec->decoder().lora().target_modules(1), "gate_proj");
  const absl::Status empty = ApplyLoraFlags(4, 16.0, "q_proj,,v_proj", *spec);
  EXPECT_TRUE(absl::StartsWith(empty.message(), "--lora-targets: empty item")) << empty;
  absl::StatusOr<v1::ModelSpec> gpt = ParseModelFlags("gpt:64:16:32:2:4", "");
  ASSERT_TRUE(gpt.ok());
  const absl::Status refused = ApplyLoraFlags(4, std::nullopt, "", *gpt);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "--lora-rank: LoRA adapts a decoder")) << refused;
}

TEST(DecoderWireTest, LoraRoundTripsWithTheDefaultTargets) {
  absl::StatusOr<v1::ModelSpec> proto = ParseModelFlags("llama:256:64:128:2:4:2:64", "");
  ASSERT_TRUE(proto.ok());
  engine::model::ModelSpec spec;
  ASSERT_TRUE(rpc::ModelSpecFromProto(*proto, "model", &spec).ok());
  EXPECT_FALSE(spec.decoder()->lora.has_value());
  EXPECT_FALSE(rpc::ModelSpecToProto(spec).decoder().has_lora());

  v1::LoRA* lora = proto->mutable_decoder()->mutable_lora();
  lora->set_rank(8);
  lora->set_alpha(16.0f);
  ASSERT_TRUE(rpc::ModelSpecFromProto(*proto, "model", &spec).ok());
  ASSERT_TRUE(spec.decoder()->lora.has_value());
  EXPECT_EQ(spec.decoder()->lora->rank, 8);
  EXPECT_EQ(spec.decoder()->lora->alpha, 16.0f);
  // None named: PEFT's Llama default, the attention's four.
  EXPECT_EQ(spec.decoder()->lora->target_modules,
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  const v1::ModelSpec effective = rpc::ModelSpecToProto(spec);
  EXPECT_EQ(effective.decoder().lora().target_modules_size(), 4);
  engine::model::ModelSpec again;
  ASSERT_TRUE(rpc::ModelSpecFromProto(effective, "model", &again).ok());
  EXPECT_EQ(rpc::ModelSpecToProto(again).SerializeAsString(), effective.SerializeAsString());

  lora->add_target_modules("gate_proj");
  lora->add_target_modules("down_proj");
  ASSERT_TRUE(rpc::ModelSpecFromProto(*proto, "model", &spec).ok());
  EXPECT_EQ(spec.decoder()->lora->target_modules,
            (std::vector<std::string>{"gate_proj", "down_proj"}));
  lora->set_alpha(std::nanf(""));
  EXPECT_TRUE(absl::StrContains(rpc::ModelSpecFromProto(*proto, "model", &spec).message(),
                                "model.decoder.lora.alpha"));
}

// ---- end to end ----------------------------------------------------------------

constexpr int kSteps = 300;
constexpr int kWindow = 10;

struct TrainRun {
  std::string job_id;
  std::vector<double> losses;
  int skipped = 0;
  // The mean loss of the first and of the last kWindow steps.
  double first = 0, last = 0;
};

// `ampctl train --json` of kSteps on the decoder below with `extra` flags,
// fp16 with the pytorch policy, its scale growing every 25 clean steps
// (over 300 steps it climbs until gradients overflow and backs off).
TrainRun Train(const AmpdProcess& server, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {AMPCTL_BINARY,
                                   "--server=" + server.address(),
                                   "train",
                                   "--layers=qwen2:256:64:128:2:4:2:64",
                                   absl::StrCat("--steps=", kSteps),
                                   "--batch-size=8",
                                   "--seq-len=32",
                                   "--precision=fp16",
                                   "--scaler=pytorch",
                                   "--growth-interval=25",
                                   "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  const CommandResult result = RunCommand(args, std::chrono::seconds(300));
  TrainRun run;
  EXPECT_EQ(result.status.code, 0) << "stdout:\n" << result.out << "stderr:\n" << result.err;
  for (absl::string_view line : absl::StrSplit(result.out, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct s;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(std::string(line), &s).ok()) << line;
    if (!s.fields().contains("loss")) continue;
    run.job_id = s.fields().at("job_id").string_value();
    run.losses.push_back(s.fields().at("loss").number_value());
    run.skipped += s.fields().at("skipped").bool_value() ? 1 : 0;
  }
  EXPECT_EQ(run.losses.size(), static_cast<size_t>(kSteps));
  if (run.losses.size() < static_cast<size_t>(kWindow)) return run;
  for (int i = 0; i < kWindow; ++i) {
    run.first += run.losses[static_cast<size_t>(i)] / kWindow;
    run.last += run.losses[run.losses.size() - 1 - static_cast<size_t>(i)] / kWindow;
  }
  return run;
}

TEST(DecoderAmpctlE2eTest, Fp16WithDynamicScalingHalvesTheLoss) {
  TempDir root("ampd_decoder_ampctl");
  AmpdProcess server(AMPD_SERVER_BINARY, {}, root.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  const TrainRun run = Train(server, {"--seed=3"});
  ASSERT_EQ(run.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_NEAR(run.losses[0], std::log(256.0), 0.1);
  EXPECT_LE(run.last, 0.5 * run.first) << run.first << " -> " << run.last;
  EXPECT_GE(run.skipped, 1) << "the scale never overflowed";
  if (HasFailure()) std::fprintf(stderr, "%s\n", server.Describe().c_str());
}

// A LoRA fine-tune as users run one: the base is a trained model (the full
// run above, exported as its merged view: its weights alone, F32) loaded
// with --init-from, and rank-16 adapters on every projection learn another
// sequence task (another seed's) in fp16 with dynamic loss scaling, the base
// frozen. The loss halves, well below the uniform ln(256); the job holds 2
// bytes per base parameter and 16 per adapter parameter.
TEST(DecoderAmpctlE2eTest, Fp16LoraOnATrainedBaseHalvesTheLoss) {
  TempDir root("ampd_decoder_lora_e2e");
  AmpdProcess server(AMPD_SERVER_BINARY, {}, root.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  const TrainRun full = Train(server, {"--seed=3"});
  ASSERT_FALSE(full.job_id.empty());
  const std::string base = (root.path() / "base.safetensors").string();
  CommandResult exported =
      RunCommand({AMPCTL_BINARY, "--server=" + server.address(), "state", "export",
                  "--job=" + full.job_id, "--view=merged", "--out=" + base},
                 std::chrono::seconds(60));
  ASSERT_EQ(exported.status.code, 0) << exported.out << exported.err;
  const TrainRun lora =
      Train(server, {"--seed=4", "--lora-rank=16", "--lora-alpha=32", "--lr=3e-3",
                     "--lora-targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                     "--init-from=" + base});
  ASSERT_EQ(lora.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_LE(lora.last, 0.5 * lora.first) << lora.first << " -> " << lora.last;
  EXPECT_LT(lora.last, 0.6 * std::log(256.0)) << lora.first << " -> " << lora.last;
  EXPECT_GE(lora.skipped, 1) << "the scale never overflowed";

  const CommandResult got = RunCommand(
      {AMPCTL_BINARY, "--server=" + server.address(), "jobs", "get", lora.job_id, "--json"},
      std::chrono::seconds(60));
  ASSERT_EQ(got.status.code, 0) << got.out << got.err;
  google::protobuf::Struct job;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(got.out, &job).ok()) << got.out;
  // 64-bit counts are JSON strings.
  const double parameters = std::stod(job.fields().at("parameter_count").string_value());
  const double admitted = std::stod(job.fields().at("estimated_bytes").string_value());
  // Base: embeddings and head 2 V C, per layer two norms, q/k/v with biases,
  // o, gate/up/down; the final norm. Adapters: per layer and target r (in + out).
  const double c = 64, v = 256, i = 128, q = 64, kv = 32, r = 16;
  const double base_params =
      2 * v * c + 2 * (2 * c + (q + 2 * kv) * (c + 1) + c * q + 3 * i * c) + c;
  const double adapters = 2 * r * ((c + q) + 2 * (c + kv) + (q + c) + 2 * (c + i) + (i + c));
  EXPECT_EQ(parameters, base_params + adapters);
  EXPECT_NEAR(admitted, 2 * base_params + 16 * adapters, 0.1 * (2 * base_params + 16 * adapters));
  if (HasFailure()) std::fprintf(stderr, "%s\n", server.Describe().c_str());
}

// `ampctl train --lora-rank` reaches the server as the decoder's LoRA spec:
// a rank no target can hold is refused naming the field, alpha alone is
// refused by ampctl, and --init-from a file the job cannot take names it.
TEST(DecoderAmpctlE2eTest, LoraFlagsReachTheServer) {
  TempDir root("ampd_decoder_lora");
  AmpdProcess server(AMPD_SERVER_BINARY, {}, root.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  auto train = [&](std::vector<std::string> lora) {
    std::vector<std::string> args = {AMPCTL_BINARY, "--server=" + server.address(),
                                     "train",       "--layers=llama:256:64:128:2:4:2:64",
                                     "--steps=1",   "--batch-size=2",
                                     "--seq-len=8", "--precision=fp16"};
    args.insert(args.end(), lora.begin(), lora.end());
    return RunCommand(args, std::chrono::seconds(60));
  };
  CommandResult result = train({"--lora-rank=33", "--lora-targets=k_proj"});
  EXPECT_NE(result.status.code, 0);
  EXPECT_TRUE(absl::StrContains(result.err, "decoder.lora.rank")) << result.err;
  result = train({"--lora-alpha=16"});
  EXPECT_NE(result.status.code, 0);
  EXPECT_TRUE(absl::StrContains(result.err, "give --lora-rank too")) << result.err;
  result = train({"--lora-rank=8", "--init-from=" + (root.path() / "absent").string()});
  EXPECT_NE(result.status.code, 0);
  EXPECT_TRUE(absl::StrContains(result.err, "--init-from: cannot read")) << result.err;
  result = train({"--lora-rank=8", "--lora-alpha=16"});
  EXPECT_EQ(result.status.code, 0) << result.out << result.err;
  if (HasFailure()) std::fprintf(stderr, "%s\n", server.Describe().c_str());
}

// `ampctl train --init-from` with a file the job cannot take fails, and
// leaves no job behind (none counted against --max-jobs or a quota): an
// all-NaN base (refused by the server, naming the tensor), a file of
// another model's tensors, and a file that cannot be read (refused before
// any job is created).
TEST(DecoderAmpctlE2eTest, AFailedInitFromLeavesNoJob) {
  TempDir root("ampd_decoder_init_from");
  AmpdProcess server(AMPD_SERVER_BINARY, {"--max-jobs=1"}, root.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  auto ampctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {AMPCTL_BINARY, "--server=" + server.address()});
    return RunCommand(args, std::chrono::seconds(60));
  };
  auto write = [&](const std::string& name, const std::string& tensor, float value) {
    codec::StateDict state;
    codec::HostTensor t;
    t.dtype = codec::DType::kF32;
    t.shape = {256, 64};  // the embedding of llama:256:64:...
    const std::vector<float> values(256 * 64, value);
    t.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    state.tensors.push_back({tensor, std::move(t)});
    const std::string path = (root.path() / name).string();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const std::string bytes = codec::EncodeSafetensors(state);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  };
  const std::string nan_base = write("nan.safetensors", "model.embed_tokens.weight", NAN);
  const std::string other = write("other.safetensors", "transformer.wte.weight", 0.5f);
  const std::string good = write("good.safetensors", "model.embed_tokens.weight", 0.01f);
  const std::vector<std::pair<std::string, std::string>> failing = {
      {nan_base, "model.embed_tokens.weight: element 0 is inf or NaN"},
      {other, "--init-from " + other + ": "},
      {(root.path() / "absent").string(), "--init-from: cannot read"},
      {good + "," + nan_base, "inf or NaN"},
  };
  for (const auto& [files, message] : failing) {
    const CommandResult result =
        ampctl({"train", "--layers=llama:256:64:128:2:4:2:64", "--steps=1", "--batch-size=2",
                "--seq-len=8", "--precision=fp16", "--lora-rank=8", "--init-from=" + files});
    EXPECT_NE(result.status.code, 0) << files << ": " << result.out << result.err;
    EXPECT_TRUE(absl::StrContains(result.err, message)) << result.err;
    const CommandResult jobs = ampctl({"jobs", "list"});
    EXPECT_EQ(jobs.status.code, 0) << jobs.err;
    EXPECT_EQ(jobs.out, "") << "a job left behind by --init-from=" << files;
  }
  // The one job --max-jobs allows is still free: a good base trains.
  const CommandResult trained =
      ampctl({"train", "--layers=llama:256:64:128:2:4:2:64", "--steps=1", "--batch-size=2",
              "--seq-len=8", "--precision=fp16", "--lora-rank=8", "--init-from=" + good});
  EXPECT_EQ(trained.status.code, 0) << trained.out << trained.err;
  if (HasFailure()) std::fprintf(stderr, "%s\n", server.Describe().c_str());
}

// `ampctl state import --partial` loads the files of a sharded checkpoint one
// by one: one job's weights, split in two files, replace another's, whose
// optimizer state stays its own; a single file without --partial is refused.
TEST(DecoderAmpctlE2eTest, ShardedImportReplacesTheWeights) {
  TempDir root("ampd_decoder_shards");
  AmpdProcess server(AMPD_SERVER_BINARY, {}, root.path() / "ampd.log");
  ASSERT_NE(server.port(), 0) << server.Describe();
  auto ampctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {AMPCTL_BINARY, "--server=" + server.address()});
    return RunCommand(args, std::chrono::seconds(120));
  };
  auto train = [&](const std::string& seed) {
    const CommandResult r =
        ampctl({"train", "--layers=llama:64:32:64:1:4:2:16", "--steps=1", "--batch-size=2",
                "--seq-len=8", "--precision=fp32", "--seed=" + seed, "--json"});
    EXPECT_EQ(r.status.code, 0) << r.out << r.err;
    google::protobuf::Struct s;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &s).ok()) << r.out;
    return s.fields().contains("job_id") ? s.fields().at("job_id").string_value() : "";
  };
  auto state = [&](const std::string& job) -> codec::StateDict {
    const std::string path = (root.path() / (job + ".safetensors")).string();
    const CommandResult r = ampctl({"state", "export", "--job=" + job, "--out=" + path});
    EXPECT_EQ(r.status.code, 0) << r.out << r.err;
    std::ifstream f(path, std::ios::binary);
    std::stringstream bytes;
    bytes << f.rdbuf();
    absl::StatusOr<codec::StateDict> decoded = codec::DecodeSafetensors(bytes.str());
    EXPECT_TRUE(decoded.ok()) << decoded.status();
    return decoded.ok() ? *std::move(decoded) : codec::StateDict{};
  };
  const std::string source = train("1");
  const std::string target = train("2");
  const codec::StateDict weights = state(source);
  const codec::StateDict before = state(target);
  ASSERT_FALSE(weights.tensors.empty());
  codec::StateDict shards[2];
  size_t count = 0;
  for (const codec::NamedTensor& t : weights.tensors) {
    if (!absl::StartsWith(t.name, "optimizer.")) shards[count++ % 2].tensors.push_back(t);
  }
  std::vector<std::string> files;
  for (int i = 0; i < 2; ++i) {
    files.push_back((root.path() / absl::StrCat("shard", i, ".safetensors")).string());
    std::ofstream f(files.back(), std::ios::binary | std::ios::trunc);
    const std::string bytes = codec::EncodeSafetensors(shards[i]);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const CommandResult whole = ampctl({"state", "import", "--job=" + target, files[0]});
  EXPECT_NE(whole.status.code, 0) << whole.out;
  EXPECT_TRUE(absl::StrContains(whole.err, "missing")) << whole.err;
  const CommandResult both =
      ampctl({"state", "import", "--job=" + target, "--partial", files[0], files[1]});
  ASSERT_EQ(both.status.code, 0) << both.out << both.err;
  const codec::StateDict after = state(target);
  ASSERT_EQ(after.tensors.size(), before.tensors.size());
  for (size_t i = 0; i < after.tensors.size(); ++i) {
    const codec::NamedTensor& t = after.tensors[i];
    const codec::NamedTensor& want =
        absl::StartsWith(t.name, "optimizer.") ? before.tensors[i] : weights.tensors[i];
    EXPECT_EQ(t.name, want.name);
    EXPECT_TRUE(t.tensor.data == want.tensor.data) << t.name;
  }
}

}  // namespace
}  // namespace ampd
