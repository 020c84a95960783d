// Trainer's sampler weights (sampler_weights.cc) on the CPU backend, and
// cuda:0 where a device is visible: a copy taken at a step samples, bit for
// bit, what the job sampled at that step and the log-probs its training
// forward computed then (Evaluate with return_logprobs at that step), while
// the job trains on; sampling from it leaves the job's own weights exactly
// as they were; its host form loads back to the same bits; a LoRA job's
// copy holds the adapters alone. For a GPT, a decoder and a LoRA decoder in
// fp32, fp16 and bf16 (batch_invariant).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "gtest/gtest.h"

namespace ampd::engine {
namespace {

using namespace ampd::engine::testing;

constexpr int64_t kVocab = 29;

JobConfig Gpt(model::Precision precision) {
  JobConfig config = DefaultJobConfig(precision);
  model::GptSpec g;
  g.vocab_size = kVocab;
  g.context_length = 32;
  g.d_model = 32;
  g.n_layer = 2;
  g.n_head = 4;
  config.model.kind = g;
  config.model.loss = model::LossKind::kCrossEntropy;
  return config;
}

JobConfig Decoder(model::Precision precision, bool lora) {
  JobConfig config = DefaultJobConfig(precision);
  model::DecoderSpec d;
  d.vocab_size = kVocab;
  d.hidden_size = 32;
  d.intermediate_size = 48;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = 2;
  d.max_position_embeddings = 32;
  d.rope_theta = 10000.0f;
  if (lora) d.lora = model::LoraSpec{4, 8.0f, {"q_proj", "v_proj", "o_proj", "down_proj"}};
  config.model.kind = d;
  config.model.loss = model::LossKind::kCrossEntropy;
  return config;
}

// One step on rule sequences from `seed`, so the weights (a LoRA job's B
// too) move.
void TrainStep(Trainer& trainer, uint64_t seed) {
  DataRng rng(seed);
  std::vector<int32_t> ids, targets;
  for (int b = 0; b < 4; ++b) {
    int32_t t = rng.Index(kVocab);
    for (int s = 0; s < 12; ++s) {
      ids.push_back(t);
      t = (3 * t + 1) % kVocab;
      targets.push_back(t);
    }
  }
  StepInput input;
  input.micro_batches.push_back({I32({4, 12}, ids), I32({4, 12}, targets)});
  absl::StatusOr<StepReport> r = trainer.Step(input);
  ASSERT_TRUE(r.ok()) << r.status();
}

// SampleFrom takes the request as the registry hands it over: checked.
Valid<SampleRequest> Checked(SampleInput input) {
  return Valid<SampleRequest>::Check(SampleRequest{std::move(input)}).value();
}

SampleInput Request() {
  SampleInput input;
  input.prompts = {{3, 1, 4}, {1}, {5, 9, 2, 6, 5}};
  input.num_samples = 2;
  input.max_tokens = 5;
  input.seed = 17;
  return input;
}

// Every completion's tokens and log-prob bits, in order.
std::vector<std::vector<int64_t>> Flatten(const SampleReport& r) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& per_prompt : r.completions) {
    for (const Completion& c : per_prompt) {
      std::vector<int64_t> row = c.tokens;
      for (float lp : c.logprobs) {
        uint32_t b = 0;
        std::memcpy(&b, &lp, 4);
        row.push_back(b);
      }
      out.push_back(row);
    }
  }
  return out;
}

// Evaluate's log-prob bits of every completion token (the training
// forward's), each sequence its own micro-batch.
std::vector<std::vector<int64_t>> TrainingLogprobs(Trainer& trainer, const SampleInput& request,
                                                   const SampleReport& r) {
  EvaluateInput input;
  input.return_logprobs = true;
  std::vector<size_t> prompt_lens;
  for (size_t p = 0; p < r.completions.size(); ++p) {
    for (const Completion& c : r.completions[p]) {
      std::vector<int32_t> seq(request.prompts[p].begin(), request.prompts[p].end());
      seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
      const auto t = static_cast<int64_t>(seq.size() - 1);
      input.micro_batches.push_back(
          {I32({1, t}, std::vector<int32_t>(seq.begin(), seq.end() - 1)),
           I32({1, t}, std::vector<int32_t>(seq.begin() + 1, seq.end()))});
      prompt_lens.push_back(request.prompts[p].size());
    }
  }
  absl::StatusOr<EvaluateReport> e = trainer.Evaluate(input);
  EXPECT_TRUE(e.ok()) << e.status();
  std::vector<std::vector<int64_t>> out;
  if (!e.ok()) return out;
  for (size_t i = 0; i < e->logprobs.size(); ++i) {
    const std::vector<float> lp = ToFloats(e->logprobs[i]);
    std::vector<int64_t> row;
    for (size_t k = prompt_lens[i] - 1; k < lp.size(); ++k) {
      uint32_t b = 0;
      std::memcpy(&b, &lp[k], 4);
      row.push_back(b);
    }
    out.push_back(row);
  }
  return out;
}

// The log-prob bits alone of Flatten's rows.
std::vector<std::vector<int64_t>> LogprobBits(const SampleReport& r) {
  std::vector<std::vector<int64_t>> out;
  for (std::vector<int64_t> row : Flatten(r)) {
    row.erase(row.begin(), row.begin() + static_cast<int64_t>(row.size() / 2));
    out.push_back(row);
  }
  return out;
}

struct Case {
  std::string name;
  JobConfig config;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (model::Precision p :
       {model::Precision::kFp32, model::Precision::kFp16, model::Precision::kBf16}) {
    const std::string suffix(model::PrecisionName(p));
    cases.push_back({"gpt " + suffix, Gpt(p)});
    cases.push_back({"decoder " + suffix, Decoder(p, false)});
    cases.push_back({"decoder LoRA " + suffix, Decoder(p, true)});
  }
  for (Case& c : cases) c.config.batch_invariant = true;
  return cases;
}

class SamplerSnapshot : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::CreateBackend(GetParam());
    if (!b.ok()) GTEST_SKIP() << GetParam() << ": no device (" << b.status().message() << ")";
  }
};

TEST_P(SamplerSnapshot, SamplesTheTrainingForwardOfItsStepWhileTheJobTrainsOn) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Trainer> trainer = MakeTrainer(c.config, GetParam());
    ASSERT_TRUE(trainer);
    for (uint64_t s = 1; s <= 3; ++s) TrainStep(*trainer, s);
    const SampleInput request = Request();
    absl::StatusOr<SampleReport> at_step = trainer->Sample(request);
    ASSERT_TRUE(at_step.ok()) << at_step.status();
    const std::vector<std::vector<int64_t>> trained = TrainingLogprobs(*trainer, request, *at_step);
    ASSERT_EQ(LogprobBits(*at_step), trained);
    absl::StatusOr<SamplerWeights> snapshot = trainer->CopySamplerWeights();
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_EQ(snapshot->bytes(), trainer->sampler_weights_bytes());

    for (uint64_t s = 4; s <= 6; ++s) {
      TrainStep(*trainer, s);
      const absl::StatusOr<SampleReport> live_before = trainer->Sample(request);
      ASSERT_TRUE(live_before.ok()) << live_before.status();
      absl::StatusOr<SampleReport> from = trainer->SampleFrom(*snapshot, Checked(request), nullptr);
      ASSERT_TRUE(from.ok()) << from.status();
      // The snapshot's step, bit for bit: its draws and the training
      // forward's log-probs then.
      EXPECT_EQ(Flatten(*from), Flatten(*at_step)) << "after step " << s;
      EXPECT_EQ(LogprobBits(*from), trained);
      // The job's own weights were put back exactly.
      absl::StatusOr<SampleReport> live_after = trainer->Sample(request);
      ASSERT_TRUE(live_after.ok()) << live_after.status();
      EXPECT_EQ(Flatten(*live_after), Flatten(*live_before));
      EXPECT_NE(Flatten(*live_after), Flatten(*at_step)) << "the job did not move";
    }

    // The file's form loads back to the same bits.
    absl::StatusOr<checkpoint::StateDict> host = trainer->ExportSamplerWeights(*snapshot);
    ASSERT_TRUE(host.ok()) << host.status();
    absl::StatusOr<SamplerWeights> loaded = trainer->LoadSamplerWeights(*host);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    absl::StatusOr<SampleReport> from_loaded =
        trainer->SampleFrom(*loaded, Checked(request), nullptr);
    ASSERT_TRUE(from_loaded.ok()) << from_loaded.status();
    EXPECT_EQ(Flatten(*from_loaded), Flatten(*at_step));

    // A copy holds the trainable weights' working copies only.
    int64_t expected = 0;
    const bool lora = c.config.model.decoder() != nullptr && c.config.model.decoder()->lora;
    for (const codec::NamedTensor& t : host->tensors) {
      expected += static_cast<int64_t>(t.tensor.data.size());
      EXPECT_EQ(t.tensor.dtype,
                c.config.precision == model::Precision::kFp32
                    ? kernels::DType::kF32
                    : (c.config.precision == model::Precision::kFp16 ? kernels::DType::kF16
                                                                     : kernels::DType::kBF16))
          << t.name;
      if (lora) {
        EXPECT_NE(t.name.find("lora_"), std::string::npos) << t.name;
      }
    }
    EXPECT_EQ(snapshot->bytes(), expected);
    if (lora) {
      EXPECT_EQ(static_cast<int64_t>(host->tensors.size()), 2 * 2 * 4);  // A, B x layers x targets
    } else {
      EXPECT_EQ(expected, trainer->parameter_count() *
                              (c.config.precision == model::Precision::kFp32 ? 4 : 2));
    }
  }
}

TEST_P(SamplerSnapshot, AFileOfOtherWeightsIsRefusedByName) {
  std::unique_ptr<Trainer> trainer =
      MakeTrainer(Decoder(model::Precision::kFp16, true), GetParam());
  ASSERT_TRUE(trainer);
  absl::StatusOr<SamplerWeights> snapshot = trainer->CopySamplerWeights();
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  absl::StatusOr<checkpoint::StateDict> host = trainer->ExportSamplerWeights(*snapshot);
  ASSERT_TRUE(host.ok()) << host.status();
  checkpoint::StateDict missing = *host;
  const std::string first = missing.tensors.front().name;
  missing.tensors.erase(missing.tensors.begin());
  absl::StatusOr<SamplerWeights> refused = trainer->LoadSamplerWeights(missing);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find(first), std::string::npos) << refused.status();
  checkpoint::StateDict wrong = *host;
  wrong.tensors.back().tensor.dtype = kernels::DType::kF32;
  EXPECT_EQ(trainer->LoadSamplerWeights(wrong).status().code(), absl::StatusCode::kDataLoss);
  // Weights of another Trainer are not sampled from.
  std::unique_ptr<Trainer> other = MakeTrainer(Decoder(model::Precision::kFp16, true), GetParam());
  ASSERT_TRUE(other);
  EXPECT_EQ(other->SampleFrom(*snapshot, Checked(Request()), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, SamplerSnapshot, ::testing::Values("cpu", "cuda:0"));

}  // namespace
}  // namespace ampd::engine
