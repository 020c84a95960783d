// Trainer::Sample on the CPU backend, and the invariant it exists for: on
// a batch-invariant job, the log-prob Sample reports for each token equals
// bit for bit the one the training forward computes for that sequence
// (Evaluate with return_logprobs: the forward and the loss's kernel Step
// runs), whether the sequence was sampled alone, among 3 or among 16
// prompts of mixed lengths, and whether it is evaluated alone, in one
// padded batch of all of them, or split over micro-batches of other
// shapes. For a GPT-2-style model and Llama/Qwen-style decoders (grouped
// K/V heads; LoRA off and on), in fp32, fp16 and bf16, after a few
// training steps (so that the adapters are not zero); on the CPU backend,
// and on cuda:0 where a device is visible (skipped, saying so, elsewhere).
// The same at a temperature: a draw at temperature 0.7 reports as its
// sampling log-probs bit for bit what Evaluate and a token loss at
// temperature 0.7 compute (and a step on them no mismatch), while its
// temperature-1 log-probs stay the policy's.
// Also: the same
// request draws the same tokens, temperature 0 takes the most likely
// token, stop tokens end a completion, and the input checks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "server/engine/model/lm_head.h"

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

// qk_norm: Qwen3's shape (per-head q/k norm, head_dim 16 where hidden /
// heads is 8, no biases).
JobConfig Decoder(model::Precision precision, bool lora, bool qk_norm = false) {
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
  d.qkv_bias = !qk_norm;
  if (qk_norm) {
    d.qk_norm = true;
    d.head_dim = 16;
  }
  if (lora) {
    d.lora = model::LoraSpec{4, 8.0f, {"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"}};
  }
  config.model.kind = d;
  config.model.loss = model::LossKind::kCrossEntropy;
  return config;
}

// Mixed-length prompts (1 .. 13 tokens).
std::vector<std::vector<int64_t>> Prompts(int count, uint64_t seed) {
  DataRng rng(seed);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < count; ++i) {
    std::vector<int64_t> p(static_cast<size_t>(1 + (i * 5 + 3) % 13));
    for (int64_t& t : p) t = rng.Index(kVocab);
    prompts.push_back(p);
  }
  return prompts;
}

// A few steps on rule sequences, so the weights (and a LoRA job's B) move.
void Train(Trainer& trainer) {
  DataRng rng(4);
  for (int step = 0; step < 3; ++step) {
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
}

HostTensor I64(kernels::Shape shape, const std::vector<int64_t>& values) {
  HostTensor t;
  t.dtype = kernels::DType::kI64;
  t.shape = std::move(shape);
  t.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
  return t;
}

uint32_t Bits(float f) {
  uint32_t b = 0;
  std::memcpy(&b, &f, 4);
  return b;
}

struct Sampled {
  std::vector<int64_t> sequence;  // prompt + completion
  size_t prompt_len = 0;
  std::vector<float> logprobs;           // the completion's, as Sample reported them
  std::vector<float> sampling_logprobs;  // the drawn distribution's, as Sample reported them
};

// One micro-batch of the sequences in `group`: row r holds sequence
// group[r] as inputs seq[:-1] and targets seq[1:], right-padded to the
// longest with token 0 and target -100; `per_token`, when given, is called
// for every position (sequence, t) in row order, e.g. to fill per-token
// inputs of the same shape. completions_only: the prompt's targets are
// -100 too (only the sampled tokens count).
MicroBatch Padded(const std::vector<Sampled>& all, const std::vector<size_t>& group,
                  bool completions_only,
                  const std::function<void(const Sampled&, size_t, bool)>& per_token = nullptr) {
  size_t longest = 0;
  for (size_t i : group) longest = std::max(longest, all[i].sequence.size() - 1);
  std::vector<int64_t> ids, targets;
  for (size_t i : group) {
    const Sampled& s = all[i];
    for (size_t t = 0; t < longest; ++t) {
      const bool real = t + 1 < s.sequence.size();
      const bool kept = real && (!completions_only || t + 1 >= s.prompt_len);
      ids.push_back(real ? s.sequence[t] : 0);
      targets.push_back(kept ? s.sequence[t + 1] : model::kIgnoreIndex);
      if (per_token) per_token(s, t, kept);
    }
  }
  const kernels::Shape shape = {static_cast<int64_t>(group.size()), static_cast<int64_t>(longest)};
  return {I64(shape, ids), I64(shape, targets)};
}

// Every sequence's completion log-probs against Evaluate's, bit for bit:
// `groups` lists which sequences share an evaluation micro-batch (padded to
// its longest with targets -100). With a temperature, Evaluate's at it
// against the sampling log-probs.
void ExpectEvaluateAgrees(Trainer& trainer, const std::vector<Sampled>& all,
                          const std::vector<std::vector<size_t>>& groups, const std::string& how,
                          std::optional<float> temperature = std::nullopt) {
  EvaluateInput input;
  input.return_logprobs = true;
  input.temperature = temperature;
  for (const std::vector<size_t>& group : groups) {
    input.micro_batches.push_back(Padded(all, group, /*completions_only=*/false));
  }
  absl::StatusOr<EvaluateReport> r = trainer.Evaluate(input);
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<float> lp = ToFloats(r->logprobs[g]);
    const int64_t cols = r->logprobs[g].shape[1];
    for (size_t row = 0; row < groups[g].size(); ++row) {
      const Sampled& s = all[groups[g][row]];
      const std::vector<float>& sampled =
          temperature.has_value() ? s.sampling_logprobs : s.logprobs;
      for (size_t k = 0; k < sampled.size(); ++k) {
        // Completion token k sits at position prompt_len + k, predicted at
        // row position prompt_len + k - 1.
        const float trained = lp[row * cols + (s.prompt_len + k - 1)];
        ASSERT_EQ(Bits(sampled[k]), Bits(trained))
            << how << ": sequence " << groups[g][row] << " token " << k << ": sampled "
            << sampled[k] << ", trained " << trained;
      }
    }
  }
}

std::vector<Sampled> SampleAll(Trainer& trainer, const std::vector<std::vector<int64_t>>& prompts,
                               uint64_t seed, float temperature = 1.0f, float top_p = 1.0f) {
  SampleInput input;
  input.prompts = prompts;
  input.max_tokens = 6;
  input.temperature = temperature;
  input.top_p = top_p;
  input.seed = seed;
  absl::StatusOr<SampleReport> r = trainer.Sample(input);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<Sampled> out;
  if (!r.ok()) return out;
  EXPECT_EQ(r->completions.size(), prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    const Completion& c = r->completions[p][0];
    EXPECT_EQ(c.tokens.size(), 6u);
    EXPECT_EQ(c.logprobs.size(), c.tokens.size());
    Sampled s;
    s.sequence = prompts[p];
    s.prompt_len = prompts[p].size();
    s.sequence.insert(s.sequence.end(), c.tokens.begin(), c.tokens.end());
    s.logprobs = c.logprobs;
    s.sampling_logprobs = c.sampling_logprobs;
    EXPECT_EQ(c.sampling_logprobs.size(), c.tokens.size());
    for (float lp : c.logprobs) EXPECT_TRUE(std::isfinite(lp) && lp <= 0.0f) << lp;
    for (float lp : c.sampling_logprobs) EXPECT_TRUE(std::isfinite(lp) && lp <= 0.0f) << lp;
    // At temperature 1 with nothing truncated the two are one value.
    if (temperature == 1.0f && top_p == 1.0f) {
      for (size_t k = 0; k < c.logprobs.size(); ++k) {
        EXPECT_EQ(Bits(c.logprobs[k]), Bits(c.sampling_logprobs[k])) << "token " << k;
      }
    }
    out.push_back(std::move(s));
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
    cases.push_back({"qwen3 " + suffix, Decoder(p, false, true)});
    cases.push_back({"qwen3 LoRA " + suffix, Decoder(p, true, true)});
  }
  for (Case& c : cases) c.config.batch_invariant = true;
  return cases;
}

// The invariance cases run on each backend: the CPU oracle, and cuda:0
// where a device is visible (the backends' GEMMs, attention and norms are
// separate code, and each must keep its own sampler and trainer equal).
class SampleInvariance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::CreateBackend(GetParam());
    if (!b.ok()) GTEST_SKIP() << GetParam() << ": no device (" << b.status().message() << ")";
  }
  std::unique_ptr<Trainer> Make(const JobConfig& config) const {
    return MakeTrainer(config, GetParam());
  }
};

TEST_P(SampleInvariance, LogprobsEqualTheTrainingForwardBitForBit) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Trainer> trainer = Make(c.config);
    ASSERT_TRUE(trainer);
    Train(*trainer);
    const std::vector<std::vector<int64_t>> prompts = Prompts(16, 11);
    // Sampled among 16, among 3 and alone.
    std::vector<Sampled> all = SampleAll(*trainer, prompts, 7);
    ASSERT_EQ(all.size(), 16u);
    for (const Sampled& s : SampleAll(*trainer, {prompts[0], prompts[1], prompts[2]}, 8)) {
      all.push_back(s);
    }
    for (const Sampled& s : SampleAll(*trainer, {prompts[5]}, 9)) all.push_back(s);
    const size_t n = all.size();  // 20
    // Evaluated alone, all in one padded batch, and in three micro-batches.
    std::vector<std::vector<size_t>> alone, one, three(3);
    std::vector<size_t> everything;
    for (size_t i = 0; i < n; ++i) {
      alone.push_back({i});
      everything.push_back(i);
      three[i % 3].push_back(i);
    }
    one.push_back(everything);
    ExpectEvaluateAgrees(*trainer, all, alone, "alone");
    ExpectEvaluateAgrees(*trainer, all, one, "one batch");
    ExpectEvaluateAgrees(*trainer, all, three, "three micro-batches");
  }
}

// The sampled sequences as token-loss micro-batches (`groups` as in
// ExpectEvaluateAgrees): the prompt's targets -100, each completion token's
// sampling_logprob its Sample sampling log-prob and an advantage of 1; the
// loss at the draw's temperature, when given.
StepInput ImportanceSamplingStep(const std::vector<Sampled>& all,
                                 const std::vector<std::vector<size_t>>& groups,
                                 std::optional<float> temperature = std::nullopt) {
  StepInput input;
  input.loss_fn.kind = LossFnKind::kImportanceSampling;
  input.loss_fn.temperature = temperature;
  input.return_logprobs = true;
  for (const std::vector<size_t>& group : groups) {
    std::vector<float> q, advantages;
    MicroBatch mb =
        Padded(all, group, /*completions_only=*/true, [&](const Sampled& s, size_t t, bool kept) {
          q.push_back(kept ? s.sampling_logprobs[t + 1 - s.prompt_len] : 0.0f);
          advantages.push_back(1.0f);
        });
    mb.sampling_logprobs = F32(mb.targets.shape, q);
    mb.advantages = F32(mb.targets.shape, advantages);
    input.micro_batches.push_back(std::move(mb));
  }
  return input;
}

// What an RL step sees: a token loss on the samples, trained on the weights
// they came from, reports them with no mismatch at all (its own log-probs
// are the sampled ones, every ratio exactly 1), in one micro-batch or
// split; a second step on the same samples, after an update, does not.
TEST_P(SampleInvariance, AStepOnTheSamplesReportsNoMismatch) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Trainer> trainer = Make(c.config);
    ASSERT_TRUE(trainer);
    Train(*trainer);
    const std::vector<Sampled> all = SampleAll(*trainer, Prompts(16, 21), 5);
    ASSERT_EQ(all.size(), 16u);
    std::vector<size_t> everything(all.size());
    for (size_t i = 0; i < all.size(); ++i) everything[i] = i;
    // Two micro-batches of other shapes: the step forward's bits.
    std::vector<std::vector<size_t>> split(2);
    for (size_t i = 0; i < all.size(); ++i) split[i < 5 ? 0 : 1].push_back(i);
    for (const auto& groups : {std::vector<std::vector<size_t>>{everything}, split}) {
      // Each pass starts from the sampled weights: a fresh job of the same
      // seed, trained the same way, samples the same tokens.
      std::unique_ptr<Trainer> fresh = Make(c.config);
      ASSERT_TRUE(fresh);
      Train(*fresh);
      const StepInput input = ImportanceSamplingStep(all, groups);
      absl::StatusOr<StepReport> first = fresh->Step(input);
      ASSERT_TRUE(first.ok()) << first.status();
      ASSERT_TRUE(first->logprob_mismatch.has_value());
      EXPECT_EQ(Bits(*first->logprob_mismatch), Bits(0.0f));
      ASSERT_EQ(first->logprobs.size(), groups.size());
      ASSERT_EQ(first->ratios.size(), groups.size());
      for (size_t g = 0; g < groups.size(); ++g) {
        const std::vector<float> lp = ToFloats(first->logprobs[g]);
        const std::vector<float> ratio = ToFloats(first->ratios[g]);
        const std::vector<float> q = ToFloats(*input.micro_batches[g].sampling_logprobs);
        ASSERT_EQ(lp.size(), q.size());
        for (size_t i = 0; i < lp.size(); ++i) {
          ASSERT_EQ(Bits(lp[i]), Bits(q[i])) << "micro-batch " << g << " token " << i;
          const bool kept = model::TokenIdAt(input.micro_batches[g].targets,
                                             static_cast<int64_t>(i)) != model::kIgnoreIndex;
          EXPECT_EQ(ratio[i], kept ? 1.0f : 0.0f) << "micro-batch " << g << " token " << i;
        }
      }
      absl::StatusOr<StepReport> second = fresh->Step(input);
      ASSERT_TRUE(second.ok()) << second.status();
      ASSERT_TRUE(second->logprob_mismatch.has_value());
      if (!first->scaler.skipped) {
        EXPECT_GT(*second->logprob_mismatch, 0.0f);
      }
    }
  }
}

// At temperature 0.7 (top_p 1) a draw's sampling log-probs are the
// distribution's it came from, log_softmax(logits / 0.7), and equal bit for
// bit what Evaluate at temperature 0.7 computes (alone and in one padded
// batch) and what an importance-sampling step at temperature 0.7 computes
// for them (no mismatch, every ratio 1); its temperature-1 log-probs are
// still the policy's (Evaluate without a temperature), other values.
TEST_P(SampleInvariance, TemperatureLogprobsEqualATemperatureLossBitForBit) {
  constexpr float kTemperature = 0.7f;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<Trainer> trainer = Make(c.config);
    ASSERT_TRUE(trainer);
    Train(*trainer);
    std::vector<Sampled> all = SampleAll(*trainer, Prompts(12, 31), 17, kTemperature);
    ASSERT_EQ(all.size(), 12u);
    for (const Sampled& s : SampleAll(*trainer, {Prompts(12, 31)[4]}, 18, kTemperature)) {
      all.push_back(s);
    }
    bool differ = false;
    for (const Sampled& s : all) {
      for (size_t k = 0; k < s.logprobs.size(); ++k) {
        differ = differ || s.logprobs[k] != s.sampling_logprobs[k];
      }
    }
    EXPECT_TRUE(differ) << "temperature 0.7 reported the temperature-1 log-probs";
    std::vector<std::vector<size_t>> alone;
    std::vector<size_t> everything;
    for (size_t i = 0; i < all.size(); ++i) {
      alone.push_back({i});
      everything.push_back(i);
    }
    ExpectEvaluateAgrees(*trainer, all, alone, "alone", kTemperature);
    ExpectEvaluateAgrees(*trainer, all, {everything}, "one batch", kTemperature);
    ExpectEvaluateAgrees(*trainer, all, {everything}, "policy");
    const StepInput input = ImportanceSamplingStep(all, {everything}, kTemperature);
    absl::StatusOr<StepReport> step = trainer->Step(input);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE(step->logprob_mismatch.has_value());
    EXPECT_EQ(Bits(*step->logprob_mismatch), Bits(0.0f));
    const std::vector<float> lp = ToFloats(step->logprobs[0]);
    const std::vector<float> q = ToFloats(*input.micro_batches[0].sampling_logprobs);
    ASSERT_EQ(lp.size(), q.size());
    for (size_t i = 0; i < lp.size(); ++i) ASSERT_EQ(Bits(lp[i]), Bits(q[i])) << "token " << i;
  }
}

// top_p below 1 renormalises over the nucleus: each sampling log-prob is
// the temperature's log-prob minus the log of the kept mass, so at least
// the temperature's (and, where the nucleus cut anything, above it); a
// greedy draw is certain: 0.
TEST_P(SampleInvariance, ANucleusRaisesTheSamplingLogprobAndGreedyIsCertain) {
  const Case c = Cases()[0];
  std::unique_ptr<Trainer> trainer = Make(c.config);
  ASSERT_TRUE(trainer);
  Train(*trainer);
  const std::vector<Sampled> all = SampleAll(*trainer, Prompts(8, 41), 3, 0.7f, 0.5f);
  ASSERT_EQ(all.size(), 8u);
  std::vector<std::vector<size_t>> alone;
  for (size_t i = 0; i < all.size(); ++i) alone.push_back({i});
  EvaluateInput input;
  input.return_logprobs = true;
  input.temperature = 0.7f;
  bool raised = false;
  for (size_t i = 0; i < all.size(); ++i) {
    input.micro_batches = {Padded(all, {i}, false)};
    absl::StatusOr<EvaluateReport> r = trainer->Evaluate(input);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<float> lp = ToFloats(r->logprobs[0]);
    const Sampled& s = all[i];
    for (size_t k = 0; k < s.sampling_logprobs.size(); ++k) {
      const float tempered = lp[s.prompt_len + k - 1];
      EXPECT_GE(s.sampling_logprobs[k], tempered) << "sequence " << i << " token " << k;
      raised = raised || s.sampling_logprobs[k] > tempered + 1e-3f;
    }
  }
  EXPECT_TRUE(raised) << "top_p 0.5 cut nothing from any draw";
  for (const Sampled& s : SampleAll(*trainer, Prompts(4, 42), 3, 0.0f)) {
    for (float q : s.sampling_logprobs) EXPECT_EQ(Bits(q), Bits(0.0f));
    for (float lp : s.logprobs) EXPECT_LT(lp, 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, SampleInvariance,
                         ::testing::Values(std::string("cpu"), std::string("cuda:0")),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param == "cpu" ? std::string("cpu") : std::string("cuda0");
                         });

TEST(Sample, TheSameRequestDrawsTheSameTokensAndTemperatureZeroIsGreedy) {
  JobConfig config = Decoder(model::Precision::kBf16, true);
  config.batch_invariant = true;
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer);
  Train(*trainer);
  SampleInput input;
  input.prompts = Prompts(4, 3);
  input.num_samples = 3;
  input.max_tokens = 5;
  input.seed = 42;
  absl::StatusOr<SampleReport> a = trainer->Sample(input);
  absl::StatusOr<SampleReport> b = trainer->Sample(input);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->tokens, 4 * 3 * 5);
  for (size_t p = 0; p < 4; ++p) {
    ASSERT_EQ(a->completions[p].size(), 3u);
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_EQ(a->completions[p][j].tokens, b->completions[p][j].tokens);
    }
  }
  // Another seed draws other tokens somewhere.
  input.seed = 43;
  absl::StatusOr<SampleReport> c = trainer->Sample(input);
  ASSERT_TRUE(c.ok());
  bool differs = false;
  for (size_t p = 0; p < 4; ++p) {
    for (size_t j = 0; j < 3; ++j) {
      differs = differs || c->completions[p][j].tokens != a->completions[p][j].tokens;
    }
  }
  EXPECT_TRUE(differs);
  // Greedy: each token is the most likely one, whose log-prob is the
  // largest: every sample of a prompt is the same.
  input.temperature = 0.0f;
  absl::StatusOr<SampleReport> greedy = trainer->Sample(input);
  ASSERT_TRUE(greedy.ok());
  for (size_t p = 0; p < 4; ++p) {
    EXPECT_EQ(greedy->completions[p][0].tokens, greedy->completions[p][2].tokens);
    for (float lp : greedy->completions[p][0].logprobs) EXPECT_GT(lp, -std::log(float{kVocab}));
  }
  // Truncated to the most likely token (top_k 1, or a nucleus of mass
  // 1e-6), any draw is the greedy one.
  input.temperature = 1.0f;
  for (const auto& [top_k, top_p] : {std::pair<int64_t, float>{1, 1.0f}, {0, 1e-6f}}) {
    input.top_k = top_k;
    input.top_p = top_p;
    absl::StatusOr<SampleReport> truncated = trainer->Sample(input);
    ASSERT_TRUE(truncated.ok()) << truncated.status();
    for (size_t p = 0; p < 4; ++p) {
      for (size_t j = 0; j < 3; ++j) {
        EXPECT_EQ(truncated->completions[p][j].tokens, greedy->completions[p][0].tokens)
            << "top_k " << top_k << " top_p " << top_p;
      }
    }
  }
  input.top_k = 0;
  input.top_p = 1.0f;
  // A stop token ends its completion, kept; the others run to max_tokens.
  input.temperature = 1.0f;
  input.seed = 42;
  const int64_t stop = a->completions[0][0].tokens[1];
  input.stop_token_ids = {stop};
  absl::StatusOr<SampleReport> stopped = trainer->Sample(input);
  ASSERT_TRUE(stopped.ok());
  const Completion& first = stopped->completions[0][0];
  ASSERT_LE(first.tokens.size(), 2u);
  EXPECT_EQ(first.tokens.back(), stop);
  EXPECT_EQ(first.stop, StopReason::kStopToken);
}

TEST(Sample, RefusesWhatTheModelCannotTake) {
  JobConfig config = Gpt(model::Precision::kFp32);
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer);
  auto refused = [&](SampleInput input) {
    const absl::Status s = trainer->Sample(input).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  SampleInput ok;
  ok.prompts = {{1, 2, 3}};
  SampleInput bad = ok;
  bad.prompts = {{1, 2}, {}};
  EXPECT_TRUE(absl::StartsWith(refused(bad), "prompts[1]: empty"));
  bad = ok;
  bad.prompts = {{1, kVocab}};
  EXPECT_TRUE(absl::StartsWith(refused(bad), "prompts[0][1]: token 29")) << refused(bad);
  bad = ok;
  bad.max_tokens = 31;  // 3 + 31 - 1 > 32
  EXPECT_TRUE(absl::StartsWith(refused(bad), "prompts[0]: 3 tokens + max_tokens 31"));
  bad = ok;
  bad.temperature = -1.0f;
  EXPECT_TRUE(absl::StartsWith(refused(bad), "temperature"));
  bad = ok;
  bad.top_p = 0.0f;
  EXPECT_TRUE(absl::StartsWith(refused(bad), "top_p"));
  bad = ok;
  bad.num_samples = 0;
  EXPECT_TRUE(absl::StartsWith(refused(bad), "num_samples"));
  bad = ok;
  bad.stop_token_ids = {-1};
  EXPECT_TRUE(absl::StartsWith(refused(bad), "stop_token_ids[0]"));
  // A model without an LM head cannot sample.
  JobConfig mlp = DefaultJobConfig(model::Precision::kFp32);
  mlp.model.layers = {Linear(4, 4)};
  std::unique_ptr<Trainer> stack = MakeTrainer(mlp);
  ASSERT_TRUE(stack);
  EXPECT_TRUE(absl::StrContains(stack->Sample(ok).status().message(), "language model"));
  // And the job is untouched by any of it.
  EXPECT_TRUE(trainer->Sample(ok).ok());
  EXPECT_EQ(trainer->steps_run(), 0);
}

// The prompts' workspace, the KV cache and the logits are admitted before
// anything is allocated: a refusal leaves the backend as it was.
TEST(Sample, AdmitsBeforeAllocating) {
  JobConfig config = Decoder(model::Precision::kFp16, false);
  std::unique_ptr<Trainer> trainer = MakeTrainer(config);
  ASSERT_TRUE(trainer);
  SampleInput input;
  input.prompts = Prompts(16, 5);
  input.num_samples = 8;
  input.max_tokens = 12;
  int64_t asked = 0;
  const auto refuse = [&asked](int64_t bytes) {
    asked = bytes;
    return absl::ResourceExhaustedError("over the limit");
  };
  const int64_t allocations = trainer->backend().AllocationCount();
  const int64_t in_use = trainer->backend().BytesInUse();
  const absl::Status s = trainer->Sample(input, refuse).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(trainer->backend().AllocationCount(), allocations);
  EXPECT_EQ(trainer->backend().BytesInUse(), in_use);
  // At least the cache: 2 x layers x 128 sequences x 24 positions x KV (16) x 2 bytes.
  EXPECT_GE(asked, 2 * 2 * 128 * 24 * 16 * 2);
  // Admitted, it runs.
  int64_t admitted = 0;
  absl::StatusOr<SampleReport> r = trainer->Sample(input, [&admitted](int64_t bytes) {
    admitted = bytes;
    return absl::OkStatus();
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(admitted, asked);
  EXPECT_EQ(r->tokens, 16 * 8 * 12);
}

}  // namespace
}  // namespace ampd::engine
