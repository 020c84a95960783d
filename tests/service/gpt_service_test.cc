// GPT jobs through the real ampd process (tests/support's AmpdProcess on
// 127.0.0.1:0, --device=cpu): the effective config with its defaults, steps
// that train, an exported state dict in Hugging Face GPT-2's names and
// layout, a file written in exactly that layout (prefixed and unprefixed
// names, the attn.bias mask buffers, a tied lm_head.weight) loading into
// another job and giving the same loss, and bad requests answered with
// INVALID_ARGUMENT naming the field while the server keeps serving.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "codec/safetensors.h"
#include "gtest/gtest.h"
#include "tests/support/ampd_process.h"
#include "tests/support/temp_dir.h"

namespace ampd {
namespace {

using codec::DecodeSafetensors;
using codec::EncodeSafetensors;
using codec::HostTensor;
using codec::StateDict;
using test_support::AmpdProcess;
using test_support::TempDir;

constexpr int64_t kVocab = 32;
constexpr int64_t kContext = 16;
constexpr int64_t kLayers = 2;

class GptServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { state_dir_ = (root_.path() / "state").string(); }
  // Starts (or restarts) ampd on the test's state directory.
  void Start(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), "--state-dir=" + state_dir_);
    server_ = std::make_unique<AmpdProcess>(AMPD_SERVER_BINARY, flags, state_dir_ + ".log");
    ASSERT_NE(server_->port(), 0) << server_->Describe();
    ClientOptions options;
    options.deadline = absl::Seconds(30);
    client_ = Client::Connect(server_->address(), options);
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr)
      std::fprintf(stderr, "%s\n", server_->Describe().c_str());
  }

  static v1::CreateJobRequest GptRequest(uint64_t seed, v1::Precision precision) {
    v1::CreateJobRequest request;
    v1::JobConfig* config = request.mutable_config();
    v1::Gpt* gpt = config->mutable_model()->mutable_gpt();
    gpt->set_vocab_size(kVocab);
    gpt->set_context_length(kContext);
    gpt->set_d_model(32);
    gpt->set_n_layer(kLayers);
    gpt->set_n_head(4);
    config->set_seed(seed);
    config->set_precision(precision);
    config->mutable_optimizer()->set_lr(3e-3f);
    return request;
  }

  static v1::Tensor Ids(const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
    v1::Tensor t;
    t.set_dtype(v1::DTYPE_I32);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
    return t;
  }

  // B sequences of T tokens following next = (3 t + 1) mod V from a start
  // that depends on (seed, b); the last target of each row is ignored.
  static v1::MicroBatch RuleBatch(int64_t batch, int64_t seq, int seed) {
    std::vector<int32_t> ids, targets;
    for (int64_t b = 0; b < batch; ++b) {
      auto t = static_cast<int32_t>((seed * 7 + b * 5) % kVocab);
      for (int64_t s = 0; s < seq; ++s) {
        ids.push_back(t);
        t = static_cast<int32_t>((3 * t + 1) % kVocab);
        targets.push_back(s == seq - 1 ? -100 : t);
      }
    }
    v1::MicroBatch mb;
    *mb.mutable_inputs() = Ids({batch, seq}, ids);
    *mb.mutable_targets() = Ids({batch, seq}, targets);
    return mb;
  }

  static v1::StepRequest Step(const std::string& job, int64_t sequence, v1::MicroBatch mb) {
    v1::StepRequest request;
    request.set_job_id(job);
    request.set_sequence(sequence);
    *request.add_micro_batches() = std::move(mb);
    return request;
  }

  grpc::Status RawStep(const v1::StepRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StepResponse response;
    return client_->stub().Step(&context, request, &response);
  }
  grpc::Status RawCreate(const v1::CreateJobRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::CreateJobResponse response;
    return client_->stub().CreateJob(&context, request, &response);
  }

  TempDir root_{"ampd_gpt_service_test"};
  std::string state_dir_;
  std::unique_ptr<AmpdProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(GptServiceTest, EffectiveConfigFillsTheDefaults) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(GptRequest(1, v1::PRECISION_BF16));
  ASSERT_TRUE(job.ok()) << job.status();
  const v1::Gpt& gpt = job->config().model().gpt();
  EXPECT_EQ(gpt.vocab_size(), kVocab);
  EXPECT_EQ(gpt.n_head(), 4);
  EXPECT_TRUE(gpt.has_mlp_ratio());
  EXPECT_EQ(gpt.mlp_ratio(), 4);
  EXPECT_TRUE(gpt.has_layer_norm_eps());
  EXPECT_FLOAT_EQ(gpt.layer_norm_eps(), 1e-5f);
  EXPECT_TRUE(gpt.has_tie_embeddings());
  EXPECT_TRUE(gpt.tie_embeddings());
  EXPECT_EQ(job->config().model().layers_size(), 0);
  EXPECT_EQ(job->config().model().loss(), v1::LOSS_CROSS_ENTROPY);
  // wte + wpe + per layer 12 C^2 + 13 C + ln_f.
  const int64_t c = 32;
  EXPECT_EQ(job->parameter_count(),
            kVocab * c + kContext * c + kLayers * (12 * c * c + 13 * c) + 2 * c);
}

TEST_F(GptServiceTest, TrainsExportsInHfLayoutAndAnHfFileLoadsWithTheSameLoss) {
  Start();
  absl::StatusOr<v1::Job> a = client_->CreateJob(GptRequest(1, v1::PRECISION_FP32));
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<float> losses;
  for (int s = 1; s <= 30; ++s) {
    absl::StatusOr<v1::StepResponse> r = client_->Step(Step(a->job_id(), s, RuleBatch(4, 12, s)));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->samples(), 4);
    losses.push_back(r->loss());
  }
  EXPECT_GT(losses.front(), 0.8f * std::log(static_cast<float>(kVocab)));
  EXPECT_LT(losses.back(), 0.7f * losses.front());

  absl::StatusOr<std::string> bytes = client_->GetStateDict(a->job_id());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<StateDict> exported = DecodeSafetensors(*bytes);
  ASSERT_TRUE(exported.ok()) << exported.status();
  // transformers' from_pretrained refuses safetensors without it.
  ASSERT_TRUE(exported->metadata.contains("format"));
  EXPECT_EQ(exported->metadata.at("format"), "pt");
  // Hugging Face GPT-2's names and Conv1D (in, out) layouts; no lm_head
  // when tied, as HF's own model.safetensors.
  const HostTensor* c_attn = exported->Find("transformer.h.1.attn.c_attn.weight");
  ASSERT_NE(c_attn, nullptr);
  EXPECT_EQ(c_attn->shape, (codec::Shape{32, 96}));
  ASSERT_NE(exported->Find("transformer.h.0.mlp.c_fc.weight"), nullptr);
  EXPECT_EQ(exported->Find("transformer.h.0.mlp.c_fc.weight")->shape, (codec::Shape{32, 128}));
  EXPECT_EQ(exported->Find("transformer.h.0.mlp.c_proj.weight")->shape, (codec::Shape{128, 32}));
  EXPECT_EQ(exported->Find("transformer.wpe.weight")->shape, (codec::Shape{kContext, 32}));
  EXPECT_NE(exported->Find("transformer.ln_f.bias"), nullptr);
  EXPECT_EQ(exported->Find("lm_head.weight"), nullptr);
  EXPECT_NE(exported->Find("optimizer.transformer.wte.weight.exp_avg"), nullptr);

  // The file a pretrained GPT-2 checkpoint would be: model tensors only, no
  // metadata but the format, block tensors without the prefix (as older
  // exports write them), the mask buffers, and the tied head spelled out.
  StateDict hf;
  hf.metadata["format"] = "pt";
  for (const codec::NamedTensor& t : exported->tensors) {
    if (absl::StartsWith(t.name, "optimizer.")) continue;
    std::string name = t.name;
    if (absl::StartsWith(name, "transformer.h.")) name = name.substr(std::strlen("transformer."));
    hf.tensors.push_back({name, t.tensor});
  }
  for (int64_t l = 0; l < kLayers; ++l) {
    // Saved as U8 or BOOL by some transformers versions, F32 by others:
    // dropped whatever the dtype.
    HostTensor mask;
    const codec::DType mask_dtypes[] = {codec::DType::kU8, codec::DType::kBool, codec::DType::kF32};
    mask.dtype = mask_dtypes[l % 3];
    mask.shape = {1, 1, kContext, kContext};
    mask.data.assign(static_cast<size_t>(kContext * kContext) * codec::SizeOf(mask.dtype), '\1');
    hf.tensors.push_back({absl::StrCat("h.", l, ".attn.bias"), mask});
    HostTensor masked;
    masked.dtype = codec::DType::kF32;
    masked.shape = {};
    masked.data.assign(4, '\0');
    hf.tensors.push_back({absl::StrCat("h.", l, ".attn.masked_bias"), masked});
  }
  hf.tensors.push_back({"lm_head.weight", *exported->Find("transformer.wte.weight")});

  absl::StatusOr<v1::Job> b = client_->CreateJob(GptRequest(99, v1::PRECISION_FP32));
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<v1::LoadStateDictResponse> loaded =
      client_->LoadStateDict(b->job_id(), EncodeSafetensors(hf));
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  // The same batch at learning rate 0 on both: same weights, same loss.
  v1::StepRequest probe_a = Step(a->job_id(), 31, RuleBatch(3, 16, 77));
  probe_a.set_learning_rate(0.0f);
  v1::StepRequest probe_b = Step(b->job_id(), 1, RuleBatch(3, 16, 77));
  probe_b.set_learning_rate(0.0f);
  absl::StatusOr<v1::StepResponse> la = client_->Step(probe_a);
  absl::StatusOr<v1::StepResponse> lb = client_->Step(probe_b);
  ASSERT_TRUE(la.ok() && lb.ok()) << la.status() << lb.status();
  EXPECT_EQ(la->loss(), lb->loss());

  // A tied model refuses a head that is not its embedding, and nothing
  // changes: the next probe gives the same loss again.
  StateDict other = hf;
  HostTensor& head = other.tensors.back().tensor;
  head.data[0] = static_cast<char>(head.data[0] ^ 1);
  absl::StatusOr<v1::LoadStateDictResponse> refused =
      client_->LoadStateDict(b->job_id(), EncodeSafetensors(other));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "lm_head.weight")) << refused.status();
  v1::StepRequest again = Step(b->job_id(), 2, RuleBatch(3, 16, 77));
  again.set_learning_rate(0.0f);
  absl::StatusOr<v1::StepResponse> lb2 = client_->Step(again);
  ASSERT_TRUE(lb2.ok()) << lb2.status();
  EXPECT_EQ(lb2->loss(), la->loss());
}

TEST_F(GptServiceTest, Fp16AndBf16Train) {
  Start();
  for (v1::Precision precision : {v1::PRECISION_BF16, v1::PRECISION_FP16}) {
    absl::StatusOr<v1::Job> job = client_->CreateJob(GptRequest(5, precision));
    ASSERT_TRUE(job.ok()) << job.status();
    float first = 0, last = 0;
    for (int s = 1; s <= 40; ++s) {
      absl::StatusOr<v1::StepResponse> r =
          client_->Step(Step(job->job_id(), s, RuleBatch(4, 16, s)));
      ASSERT_TRUE(r.ok()) << r.status();
      if (s <= 3) first += r->loss() / 3;
      if (s > 37) last += r->loss() / 3;
    }
    EXPECT_LT(last, 0.7f * first) << v1::Precision_Name(precision);
  }
}

TEST_F(GptServiceTest, BadInputIsInvalidArgumentNamingTheField) {
  Start();
  absl::StatusOr<v1::Job> job = client_->CreateJob(GptRequest(1, v1::PRECISION_BF16));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  // Each message starts with the field it names, and the ErrorInfo's
  // `field` says the same.
  auto expect = [&](const v1::StepRequest& request, const std::string& message) {
    const grpc::Status s = RawStep(request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), message)) << s.error_message();
    const std::optional<google::rpc::ErrorInfo> info = ErrorInfoOf(s);
    ASSERT_TRUE(info.has_value()) << s.error_message();
    EXPECT_EQ(info->reason(), "INVALID_FIELD");
    const auto field = info->metadata().find("field");
    ASSERT_NE(field, info->metadata().end()) << s.error_message();
    EXPECT_EQ(field->second, message.substr(0, message.find(": "))) << s.error_message();
  };
  v1::MicroBatch mb = RuleBatch(2, 17, 1);
  expect(Step(id, 1, mb), "micro_batches[0].inputs: T = 17 exceeds context_length 16");
  mb = RuleBatch(2, 4, 1);
  reinterpret_cast<int32_t*>(mb.mutable_inputs()->mutable_data()->data())[5] = kVocab;
  expect(Step(id, 1, mb), "micro_batches[0].inputs[1, 1]: 32 is outside [0, 32)");
  mb = RuleBatch(2, 4, 1);
  reinterpret_cast<int32_t*>(mb.mutable_targets()->mutable_data()->data())[2] = -1;
  expect(Step(id, 1, mb), "micro_batches[0].targets[0, 2]: -1 is outside [0, 32)");
  mb = RuleBatch(2, 4, 1);
  mb.mutable_inputs()->clear_shape();
  mb.mutable_inputs()->add_shape(8);
  expect(Step(id, 1, mb), "micro_batches[0].inputs: expected I32 or I64 (B, T) token ids");
  mb = RuleBatch(2, 4, 1);
  mb.mutable_targets()->set_dtype(v1::DTYPE_F32);
  expect(Step(id, 1, mb), "micro_batches[0].targets: expected I32 or I64 (2, 4)");
  // None of them consumed the sequence number.
  absl::StatusOr<v1::StepResponse> ok = client_->Step(Step(id, 1, RuleBatch(2, 4, 1)));
  EXPECT_TRUE(ok.ok()) << ok.status();

  v1::CreateJobRequest both = GptRequest(1, v1::PRECISION_BF16);
  both.mutable_config()->mutable_model()->add_layers()->mutable_relu();
  grpc::Status s = RawCreate(both);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "config.model.layers: must be empty when gpt"))
      << s.error_message();
  // A d_model too large by itself is d_model's fault (not the mlp_ratio
  // it is multiplied with later).
  v1::CreateJobRequest wide = GptRequest(1, v1::PRECISION_BF16);
  wide.mutable_config()->mutable_model()->mutable_gpt()->set_d_model(int64_t{1} << 31);
  wide.mutable_config()->mutable_model()->mutable_gpt()->set_n_head(1);
  s = RawCreate(wide);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const std::optional<google::rpc::ErrorInfo> wide_info = ErrorInfoOf(s);
  ASSERT_TRUE(wide_info.has_value()) << s.error_message();
  EXPECT_EQ(wide_info->metadata().at("field"), "config.model.gpt.d_model") << s.error_message();
  v1::CreateJobRequest heads = GptRequest(1, v1::PRECISION_BF16);
  heads.mutable_config()->mutable_model()->mutable_gpt()->set_n_head(5);
  s = RawCreate(heads);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "model.gpt.n_head: must divide d_model 32"))
      << s.error_message();
  v1::CreateJobRequest huge = GptRequest(1, v1::PRECISION_BF16);
  huge.mutable_config()->mutable_model()->mutable_gpt()->set_vocab_size(int64_t{1} << 60);
  s = RawCreate(huge);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "model.gpt.vocab_size")) << s.error_message();
  // Still serving.
  EXPECT_TRUE(client_->GetJob(id).ok());
}

// A GPT job's checkpoint keeps its config (format_version 3) and state: a
// killed server restores it bitwise and the sequence goes on.
TEST_F(GptServiceTest, RestartRestoresAGptJob) {
  Start({"--checkpoint-every=2", "--checkpoint-sync"});
  absl::StatusOr<v1::Job> job = client_->CreateJob(GptRequest(3, v1::PRECISION_FP16));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  for (int s = 1; s <= 4; ++s) {
    ASSERT_TRUE(client_->Step(Step(id, s, RuleBatch(2, 8, s))).ok());
  }
  absl::StatusOr<std::string> before = client_->GetStateDict(id);
  ASSERT_TRUE(before.ok()) << before.status();
  server_->Signal(SIGKILL);
  server_->Wait(std::chrono::seconds(60));

  Start({"--checkpoint-every=2", "--checkpoint-sync"});
  absl::StatusOr<v1::Job> restored = client_->GetJob(id);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 4);
  EXPECT_EQ(restored->config().model().gpt().SerializeAsString(),
            job->config().model().gpt().SerializeAsString());
  absl::StatusOr<std::string> after = client_->GetStateDict(id);
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<StateDict> a = DecodeSafetensors(*before);
  absl::StatusOr<StateDict> b = DecodeSafetensors(*after);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->tensors.size(), b->tensors.size());
  for (size_t i = 0; i < a->tensors.size(); ++i) {
    EXPECT_EQ(a->tensors[i].name, b->tensors[i].name);
    EXPECT_TRUE(a->tensors[i].tensor.data == b->tensors[i].tensor.data) << a->tensors[i].name;
  }
  EXPECT_TRUE(client_->Step(Step(id, 5, RuleBatch(2, 8, 5))).ok());
}

}  // namespace
}  // namespace ampd
