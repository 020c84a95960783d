// The whole mixed-precision step on the CUDA backend against the CPU oracle:
// the same job (model, seed, scaler, optimizer) trained for many steps on
// both, with loss curves that agree within a per-precision tolerance and
// exactly the same steps skipped (the seed-000 overflow case backs the scale
// off identically on both). Skips when no GPU is visible; runs in full on one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/memory_pool.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "tests/engine/engine_test_util.h"

namespace ampd::engine {
namespace {

using testing::DataRng;
using testing::F32;
using testing::Linear;

struct Curve {
  std::vector<float> loss;
  std::vector<bool> skipped;
  std::vector<float> scale_after;
  std::vector<std::vector<float>> layer_scales_after;  // per-layer scales only
};

JobConfig MlpJob(model::Precision precision, double init_scale, float loss_multiplier) {
  JobConfig config = DefaultJobConfig(precision);
  config.model.layers = {
      Linear(32, 64),         testing::Act(model::LayerKind::kGELU), Linear(64, 64),
      testing::LayerNorm(64), testing::Act(model::LayerKind::kTanh), Linear(64, 8)};
  config.model.loss = model::LossKind::kMse;
  config.model.loss_multiplier = loss_multiplier;
  config.seed = 7;
  if (precision == model::Precision::kFp16) {
    config.scaler.init_scale = init_scale;
    config.scaler.growth_interval = 5;  // several growths within the run
  }
  return config;
}

// A small GPT: two blocks, four heads, tied embeddings.
JobConfig GptJob(model::Precision precision) {
  JobConfig config = DefaultJobConfig(precision);
  model::GptSpec gpt;
  gpt.vocab_size = 64;
  gpt.context_length = 32;
  gpt.d_model = 64;
  gpt.n_layer = 2;
  gpt.n_head = 4;
  config.model.kind = gpt;
  config.model.loss = model::LossKind::kCrossEntropy;
  config.optimizer.adam.lr = 3e-3f;
  config.seed = 7;
  return config;
}

// A Qwen2-style decoder of the same size: 4 query heads sharing 2 K/V
// heads (RoPE, the K/V expansion and its reduction), q/k/v biases, SwiGLU,
// an untied head.
JobConfig DecoderJob(model::Precision precision) {
  JobConfig config = GptJob(precision);
  config.model.kind = model::LayerStack{};
  model::DecoderSpec d;
  d.vocab_size = 64;
  d.hidden_size = 64;
  d.intermediate_size = 128;
  d.num_hidden_layers = 2;
  d.num_attention_heads = 4;
  d.num_key_value_heads = 2;
  d.max_position_embeddings = 32;
  d.qkv_bias = true;
  config.model.kind = d;
  return config;
}

// A Qwen3-style decoder: the per-head q/k norm (HeadRmsNorm on the fused
// rows, forward and backward), heads of 32 where hidden / heads is 16, no
// biases.
JobConfig Qwen3DecoderJob(model::Precision precision) {
  JobConfig config = DecoderJob(precision);
  config.model.decoder()->qkv_bias = false;
  config.model.decoder()->qk_norm = true;
  config.model.decoder()->head_dim = 32;
  return config;
}

// A Gemma 3-style decoder, the parts Gemma 3 brings: every RMSNorm scales
// by 1 + w (weights from 0), the sandwich norms after attention and MLP,
// GeGLU, embeddings times sqrt(hidden), the per-head q/k norm, heads of 32
// scaled by query_pre_attn_scalar^-1/2 (24, not head_dim), one K/V head for
// four query heads (Gemma 3 1B's), a tied head, and layer 0 sliding: it
// attends to its last 8 keys with RoPE of the local base while layer 1 is
// global with its own (the training sequences of 20 and 32 tokens and the
// sampled ones of up to 20 are longer than the window).
JobConfig Gemma3DecoderJob(model::Precision precision) {
  JobConfig config = DecoderJob(precision);
  model::DecoderSpec& d = *config.model.decoder();
  d.num_key_value_heads = 1;
  d.qkv_bias = false;
  d.qk_norm = true;
  d.head_dim = 32;
  d.norm_unit_offset = true;
  d.mlp_activation = model::MlpActivation::kGeluTanh;
  d.sandwich_norms = true;
  d.scale_embeddings = true;
  d.query_pre_attn_scalar = 24.0f;
  d.tie_word_embeddings = true;
  d.rope_theta = 1000000.0f;
  d.sliding_layers = {true, false};
  d.sliding_window = 8;
  d.rope_local_theta = 10000.0f;
  return config;
}

// The decoder above fine-tuned through LoRA adapters on every projection
// (the stacked q|k|v adapters' block-diagonal B among them), its base
// frozen in the working dtype and drawn wide enough (std 0.3) that the
// frozen head lets the loss fall far.
JobConfig LoraDecoderJob(model::Precision precision) {
  JobConfig config = DecoderJob(precision);
  config.model.decoder()->initializer_range = 0.3f;
  config.model.decoder()->lora = model::LoraSpec{
      8, 16.0f, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
  config.optimizer.adam.lr = 1e-2f;
  return config;
}

// Sequences following next = (5 t + 3) mod 64 from random starts, with the
// last target of each row ignored.
MicroBatch Sequences(DataRng& rng, int64_t batch, int64_t seq) {
  std::vector<int32_t> ids, targets;
  for (int64_t b = 0; b < batch; ++b) {
    int32_t t = rng.Index(64);
    for (int64_t s = 0; s < seq; ++s) {
      ids.push_back(t);
      t = (5 * t + 3) % 64;
      targets.push_back(s == seq - 1 ? -100 : t);
    }
  }
  return {testing::I32({batch, seq}, ids), testing::I32({batch, seq}, targets)};
}

// Trains `steps` steps of two micro-batches each on `device`.
Curve Train(const std::string& device, const JobConfig& config, int steps) {
  Curve curve;
  auto backend = kernels::CreateBackend(device);
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return curve;
  auto trainer = Trainer::Create(config, *std::move(backend));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return curve;
  DataRng rng(11);
  for (int s = 0; s < steps; ++s) {
    StepInput input;
    for (int k = 0; k < 2; ++k) {
      if (model::IsSequenceModel(config.model)) {
        // Two shapes, so each step runs two workspaces.
        input.micro_batches.push_back(Sequences(rng, 4, k == 0 ? 32 : 20));
        continue;
      }
      MicroBatch mb;
      mb.inputs = F32({16, 32}, rng.UniformVector(16 * 32, -1.0f, 1.0f));
      mb.targets = F32({16, 8}, rng.UniformVector(16 * 8, -0.5f, 0.5f));
      input.micro_batches.push_back(std::move(mb));
    }
    absl::StatusOr<StepReport> report = (*trainer)->Step(input);
    EXPECT_TRUE(report.ok()) << report.status();
    if (!report.ok()) return curve;
    curve.loss.push_back(report->loss);
    curve.skipped.push_back(report->scaler.skipped);
    curve.scale_after.push_back(report->scaler.scale_after);
    curve.layer_scales_after.push_back(report->scaler.layer_scales_after);
  }
  return curve;
}

class CudaTraining : public ::testing::TestWithParam<model::Precision> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
};

// Relative tolerance on the loss per precision: fp32 differs only in
// summation order; fp16/bf16 also round activations differently where the
// order of an fp32 sum differs by an ulp before the store.
double Tolerance(model::Precision p) {
  switch (p) {
    case model::Precision::kFp32:
      return 1e-4;
    case model::Precision::kFp16:
      return 2e-2;
    case model::Precision::kBf16:
      return 5e-2;
  }
  return 0;
}

TEST_P(CudaTraining, LossCurveAndSkippedStepsMatchTheCpuBackend) {
  // loss_multiplier 100 with init_scale 65536 overflows the first fp16 steps
  // (the loss-multiplier case), so the skip pattern is not trivially all-false.
  const JobConfig config = MlpJob(GetParam(), 65536.0, 100.0f);
  const int kSteps = 40;
  const Curve cpu = Train("cpu", config, kSteps);
  const Curve gpu = Train("cuda:0", config, kSteps);
  ASSERT_EQ(cpu.loss.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(gpu.loss.size(), static_cast<size_t>(kSteps));
  int skipped = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(cpu.skipped[s], gpu.skipped[s]) << "step " << s + 1;
    EXPECT_EQ(cpu.scale_after[s], gpu.scale_after[s]) << "step " << s + 1;
    if (std::isfinite(cpu.loss[s])) {
      EXPECT_NEAR(gpu.loss[s], cpu.loss[s], Tolerance(GetParam()) * std::fabs(cpu.loss[s]))
          << "step " << s + 1;
    }
    skipped += cpu.skipped[s] ? 1 : 0;
  }
  if (GetParam() == model::Precision::kFp16) {
    EXPECT_GT(skipped, 0) << "the fp16 run was meant to overflow at 65536";
  }
}

// 30 steps of `config` on CUDA and on the CPU oracle: the same steps
// skipped, every loss within the precision's tolerance, and the CPU's last
// loss below `falls_to` times its first.
void ExpectLossCurveMatchesTheCpuBackend(const JobConfig& config, model::Precision precision,
                                         float falls_to = 0.7f) {
  const int kSteps = 30;
  const Curve cpu = Train("cpu", config, kSteps);
  const Curve gpu = Train("cuda:0", config, kSteps);
  ASSERT_EQ(cpu.loss.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(gpu.loss.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(cpu.skipped[s], gpu.skipped[s]) << "step " << s + 1;
    EXPECT_NEAR(gpu.loss[s], cpu.loss[s], Tolerance(precision) * std::fabs(cpu.loss[s]))
        << "step " << s + 1;
  }
  EXPECT_LT(cpu.loss.back(), falls_to * cpu.loss.front());
}

// The GPT (attention, GELU-tanh, the chunked LM head) on CUDA against the
// CPU oracle, step by step.
TEST_P(CudaTraining, GptLossCurveMatchesTheCpuBackend) {
  ExpectLossCurveMatchesTheCpuBackend(GptJob(GetParam()), GetParam());
}

// The decoder (RMSNorm, RoPE, grouped K/V heads, SwiGLU, the stacked q|k|v
// projection) on CUDA against the CPU oracle, step by step.
TEST_P(CudaTraining, DecoderLossCurveMatchesTheCpuBackend) {
  ExpectLossCurveMatchesTheCpuBackend(DecoderJob(GetParam()), GetParam());
}

// The Qwen3-style decoder on CUDA against the CPU oracle, step by step: the
// per-head norms of q and k and their weights' gradients.
TEST_P(CudaTraining, Qwen3DecoderLossCurveMatchesTheCpuBackend) {
  ExpectLossCurveMatchesTheCpuBackend(Qwen3DecoderJob(GetParam()), GetParam());
}

// The Gemma 3-style decoder on CUDA against the CPU oracle, step by step:
// the (1 + w) norms and the sandwich norms, GeGLU's gate and its backward,
// the scaled embedding, and the sliding layer's window and local RoPE.
TEST_P(CudaTraining, Gemma3DecoderLossCurveMatchesTheCpuBackend) {
  const JobConfig config = Gemma3DecoderJob(GetParam());
  ASSERT_TRUE(ValidateJobConfig(config).ok()) << ValidateJobConfig(config);
  ExpectLossCurveMatchesTheCpuBackend(config, GetParam());
}

// A LoRA job on CUDA against the CPU oracle, step by step: the adapters'
// GEMMs, the column-block copies of the stacked q|k|v adapters, the
// frozen RMSNorms' backward without a weight gradient.
TEST_P(CudaTraining, LoraDecoderLossCurveMatchesTheCpuBackend) {
  // Only the adapters train: the loss falls less far in 30 steps.
  ExpectLossCurveMatchesTheCpuBackend(LoraDecoderJob(GetParam()), GetParam(), 0.9f);
}

// The sampling tests' pieces: which model a case is, a CUDA trainer of
// it, and four prompts of mixed lengths (1, 7, 3, 12 tokens, so decode rows
// sit at different positions), 8 new tokens each.
const char* ModelName(const JobConfig& config) {
  if (config.model.gpt() != nullptr) return "gpt";
  if (config.model.decoder()->norm_unit_offset) return "gemma3 decoder";
  if (config.model.decoder()->qk_norm) return "qwen3 decoder";
  return config.model.decoder()->lora.has_value() ? "LoRA decoder" : "decoder";
}

absl::StatusOr<std::unique_ptr<Trainer>> CudaTrainer(const JobConfig& config) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cuda:0");
  if (!backend.ok()) return backend.status();
  return Trainer::Create(config, *std::move(backend));
}

SampleInput MixedPrompts() {
  DataRng rng(3);
  SampleInput input;
  for (int64_t len : {1, 7, 3, 12}) {
    std::vector<int64_t> prompt;
    for (int64_t i = 0; i < len; ++i) prompt.push_back(rng.Index(64));
    input.prompts.push_back(prompt);
  }
  input.max_tokens = 8;
  return input;
}

// Sampling on CUDA (the KV cache, AttentionDecode's twins, the per-row
// cache writes), GPT, decoder and LoRA decoder: greedy completions of
// mixed-length prompts, each token's log-prob against the log-prob CUDA's
// own training forward (Evaluate) computes for the finished sequence.
// Without batch-invariant GEMMs (cuBLAS picks kernels by M) the two agree
// within the precision's tolerance, not bit for bit; the test after this
// one turns them on and asks for the bits.
TEST_P(CudaTraining, SampledLogprobsAgreeWithTheTrainingForward) {
  for (const JobConfig& config :
       {GptJob(GetParam()), DecoderJob(GetParam()), LoraDecoderJob(GetParam()),
        Qwen3DecoderJob(GetParam()), Gemma3DecoderJob(GetParam())}) {
    SCOPED_TRACE(ModelName(config));
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = CudaTrainer(config);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    SampleInput input = MixedPrompts();
    input.temperature = 0.0f;
    absl::StatusOr<SampleReport> sampled = (*trainer)->Sample(input);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    for (size_t p = 0; p < input.prompts.size(); ++p) {
      const Completion& c = sampled->completions[p][0];
      ASSERT_EQ(c.tokens.size(), 8u);
      std::vector<int32_t> ids, targets;
      std::vector<int64_t> sequence = input.prompts[p];
      sequence.insert(sequence.end(), c.tokens.begin(), c.tokens.end());
      for (size_t t = 0; t + 1 < sequence.size(); ++t) {
        ids.push_back(static_cast<int32_t>(sequence[t]));
        targets.push_back(static_cast<int32_t>(sequence[t + 1]));
      }
      const auto cols = static_cast<int64_t>(ids.size());
      EvaluateInput evaluate;
      evaluate.return_logprobs = true;
      evaluate.micro_batches.push_back(
          {testing::I32({1, cols}, ids), testing::I32({1, cols}, targets)});
      absl::StatusOr<EvaluateReport> trained = (*trainer)->Evaluate(evaluate);
      ASSERT_TRUE(trained.ok()) << trained.status();
      const std::vector<float> lp = testing::ToFloats(trained->logprobs[0]);
      const size_t start = input.prompts[p].size() - 1;
      for (size_t k = 0; k < c.logprobs.size(); ++k) {
        EXPECT_NEAR(c.logprobs[k], lp[start + k],
                    Tolerance(GetParam()) * (1.0 + std::fabs(lp[start + k])))
            << "prompt " << p << " token " << k;
      }
    }
  }
}

uint32_t Bits(float f) {
  uint32_t b = 0;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// The same with batch_invariant on (kernels/cuda/gemm_invariant.cu): each
// sampled token's log-prob equals, bit for bit, the one CUDA's training
// forward computes for the finished sequence, evaluated alone (M = its
// length) and with all four sequences in one padded micro-batch, while the
// sampler computed it in decode steps of one row per live sequence (tests/
// engine/sample_test.cc asks the same of the CPU backend). Temperature 1,
// so the completions, not only the greedy argmax, must agree.
TEST_P(CudaTraining, BatchInvariantSampledLogprobsEqualTheTrainingForwardBitForBit) {
  for (JobConfig config : {GptJob(GetParam()), DecoderJob(GetParam()), LoraDecoderJob(GetParam()),
                           Qwen3DecoderJob(GetParam()), Gemma3DecoderJob(GetParam())}) {
    config.batch_invariant = true;
    SCOPED_TRACE(ModelName(config));
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = CudaTrainer(config);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    // A few steps first, so the weights are not the initial ones.
    DataRng train_rng(5);
    for (int step = 0; step < 3; ++step) {
      StepInput input;
      input.micro_batches.push_back(Sequences(train_rng, 4, 16));
      absl::StatusOr<StepReport> report = (*trainer)->Step(input);
      ASSERT_TRUE(report.ok()) << report.status();
    }
    SampleInput input = MixedPrompts();
    input.temperature = 1.0f;
    input.seed = 17;
    absl::StatusOr<SampleReport> sampled = (*trainer)->Sample(input);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    // Row p of the padded batch: sequence p's ids and targets, padded to
    // the longest with target -100.
    std::vector<std::vector<int64_t>> sequences;
    size_t longest = 0;
    for (size_t p = 0; p < input.prompts.size(); ++p) {
      const Completion& c = sampled->completions[p][0];
      ASSERT_EQ(c.tokens.size(), 8u);
      std::vector<int64_t> sequence = input.prompts[p];
      sequence.insert(sequence.end(), c.tokens.begin(), c.tokens.end());
      longest = std::max(longest, sequence.size() - 1);
      sequences.push_back(std::move(sequence));
    }
    EvaluateInput evaluate;
    evaluate.return_logprobs = true;
    std::vector<int32_t> all_ids, all_targets;
    for (const std::vector<int64_t>& sequence : sequences) {
      std::vector<int32_t> ids, targets;
      for (size_t t = 0; t < longest; ++t) {
        const bool real = t + 1 < sequence.size();
        ids.push_back(real ? static_cast<int32_t>(sequence[t]) : 0);
        targets.push_back(real ? static_cast<int32_t>(sequence[t + 1]) : -100);
      }
      all_ids.insert(all_ids.end(), ids.begin(), ids.end());
      all_targets.insert(all_targets.end(), targets.begin(), targets.end());
      const auto cols = static_cast<int64_t>(sequence.size() - 1);
      ids.resize(static_cast<size_t>(cols));
      targets.resize(static_cast<size_t>(cols));
      evaluate.micro_batches.push_back(
          {testing::I32({1, cols}, ids), testing::I32({1, cols}, targets)});
    }
    const auto rows = static_cast<int64_t>(sequences.size());
    evaluate.micro_batches.push_back(
        {testing::I32({rows, static_cast<int64_t>(longest)}, all_ids),
         testing::I32({rows, static_cast<int64_t>(longest)}, all_targets)});
    absl::StatusOr<EvaluateReport> trained = (*trainer)->Evaluate(evaluate);
    ASSERT_TRUE(trained.ok()) << trained.status();
    const std::vector<float> batched = testing::ToFloats(trained->logprobs[sequences.size()]);
    for (size_t p = 0; p < sequences.size(); ++p) {
      const std::vector<float> alone = testing::ToFloats(trained->logprobs[p]);
      const std::vector<float>& sampled_lp = sampled->completions[p][0].logprobs;
      const size_t start = input.prompts[p].size() - 1;
      for (size_t k = 0; k < sampled_lp.size(); ++k) {
        EXPECT_EQ(Bits(sampled_lp[k]), Bits(alone[start + k]))
            << "prompt " << p << " token " << k << ": sampled " << sampled_lp[k]
            << ", evaluated alone " << alone[start + k];
        EXPECT_EQ(Bits(sampled_lp[k]), Bits(batched[p * longest + start + k]))
            << "prompt " << p << " token " << k << ": sampled " << sampled_lp[k]
            << ", evaluated in the batch " << batched[p * longest + start + k];
      }
    }
  }
}

// Per-layer loss scales (adaptive, fp16) on CUDA against the CPU oracle: a
// layer stack (the group boundary is a dx GEMM's alpha) and a GPT (the
// residual add's scale, the tied head's GEMM alpha), each calibrated and
// grown per group from its own max|g| (exact on both backends: a max never
// rounds). The same skips, the same group scales after every step, and the
// losses within fp16's tolerance.
class CudaPerLayerScales : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
};

TEST_F(CudaPerLayerScales, LayerStackAndGptMatchTheCpuBackend) {
  for (JobConfig config : {MlpJob(model::Precision::kFp16, 65536.0, 100.0f),
                           GptJob(model::Precision::kFp16), DecoderJob(model::Precision::kFp16)}) {
    SCOPED_TRACE(config.model.gpt() != nullptr       ? "gpt"
                 : config.model.decoder() != nullptr ? "decoder"
                                                     : "layer stack");
    config.scaler = amp::ScalerConfig::Defaults(amp::ScalerPolicy::kAdaptive);
    config.scaler.growth_interval = 5;
    config.scaler.per_layer_scales = true;
    const int kSteps = 30;
    const Curve cpu = Train("cpu", config, kSteps);
    const Curve gpu = Train("cuda:0", config, kSteps);
    ASSERT_EQ(cpu.loss.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(gpu.loss.size(), static_cast<size_t>(kSteps));
    ASSERT_GT(cpu.layer_scales_after.front().size(), 1u);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(cpu.skipped[s], gpu.skipped[s]) << "step " << s + 1;
      EXPECT_EQ(cpu.layer_scales_after[s], gpu.layer_scales_after[s]) << "step " << s + 1;
      EXPECT_NEAR(gpu.loss[s], cpu.loss[s],
                  Tolerance(model::Precision::kFp16) * std::fabs(cpu.loss[s]))
          << "step " << s + 1;
    }
  }
}

// A warm GPT or decoder step on CUDA takes nothing from the driver and no
// tensor from the pool: its workspaces (the whole LM head's logits, the
// decoder's stacked q|k|v matrices among them) stay cached from step to
// step, however large.
void ExpectWarmStepAllocatesNothing(const JobConfig& config) {
  auto backend = kernels::CreateBackend("cuda:0");
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto trainer = Trainer::Create(config, *std::move(backend));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  DataRng rng(12);
  auto step = [&] {
    StepInput input;
    input.micro_batches.push_back(Sequences(rng, 8, 32));
    input.micro_batches.push_back(Sequences(rng, 8, 32));
    absl::StatusOr<StepReport> r = (*trainer)->Step(input);
    EXPECT_TRUE(r.ok()) << r.status();
  };
  step();
  kernels::cuda::DevicePool& pool = kernels::cuda::DevicePool::ForDevice(0);
  const int64_t mallocs = pool.stats().device_allocations;
  const int64_t allocations = (*trainer)->backend().AllocationCount();
  const int64_t cached = (*trainer)->workspace_bytes();
  EXPECT_GT(cached, 0);
  for (int s = 0; s < 3; ++s) step();
  EXPECT_EQ(pool.stats().device_allocations, mallocs);
  EXPECT_EQ((*trainer)->backend().AllocationCount(), allocations);
  EXPECT_EQ((*trainer)->workspace_bytes(), cached);
}

// The reported loss is the same bits from run to run: two fresh jobs of
// the same seed, fed the same micro-batches, report bitwise equal losses at
// every step (the chunked LM-head loss adds its rows' terms in a fixed
// order, never atomically; an atomicAdd made the last bits depend on which
// block finished first).
TEST_P(CudaTraining, StepLossIsTheSameBitsFromRunToRun) {
  for (const JobConfig& config :
       {GptJob(GetParam()), DecoderJob(GetParam()), LoraDecoderJob(GetParam()),
        Qwen3DecoderJob(GetParam()), Gemma3DecoderJob(GetParam())}) {
    SCOPED_TRACE(ModelName(config));
    std::vector<std::vector<uint32_t>> runs;
    for (int run = 0; run < 2; ++run) {
      absl::StatusOr<std::unique_ptr<Trainer>> trainer = CudaTrainer(config);
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      DataRng rng(9);
      std::vector<uint32_t> losses;
      for (int step = 0; step < 4; ++step) {
        StepInput input;
        input.micro_batches.push_back(Sequences(rng, 8, 32));
        input.micro_batches.push_back(Sequences(rng, 8, 32));
        absl::StatusOr<StepReport> report = (*trainer)->Step(input);
        ASSERT_TRUE(report.ok()) << report.status();
        losses.push_back(Bits(report->loss));
      }
      runs.push_back(losses);
    }
    EXPECT_EQ(runs[0], runs[1]);
  }
}

TEST_P(CudaTraining, WarmGptAndDecoderStepsAllocateNothing) {
  for (const JobConfig& config :
       {GptJob(GetParam()), DecoderJob(GetParam()), LoraDecoderJob(GetParam()),
        Qwen3DecoderJob(GetParam()), Gemma3DecoderJob(GetParam())}) {
    SCOPED_TRACE(ModelName(config));
    ExpectWarmStepAllocatesNothing(config);
  }
}

// The LM head's rounding contract on cuBLAS: one GEMM with beta = 1 into
// the 16-bit gradient (one chunk) against chunks summed in an F32 buffer and
// added once. An untied head, one micro-batch. Both forms round the fp32
// sum once, so they agree to a unit in the last place, a few where cuBLAS's
// kernel for a different row count rounds a logit differently; each is
// also compared with the CPU oracle's same form.
TEST_P(CudaTraining, LmHeadInOneChunkAndInSeveralAgreeWithinOneRounding) {
  const model::Precision precision = GetParam();
  JobConfig config = GptJob(precision);
  config.model.gpt()->tie_embeddings = false;
  const model::ModelSpec& spec = config.model;
  const kernels::DType dtype = model::WorkingDType(precision);
  const int64_t vocab = spec.gpt()->vocab_size, rows = 4 * 32;
  // Room for 40 rows of 16-bit logits: four chunks of 32 (eight in fp32).
  const int64_t split_bytes = 40 * vocab * 2;
  ASSERT_LT(model::LmHeadChunkRows(spec.gpt()->vocab_size, precision, rows, split_bytes), rows);
  DataRng rng(13);
  const MicroBatch mb = Sequences(rng, 4, 32);
  auto head_grad = [&](const std::string& device, int64_t chunk_bytes) {
    std::vector<float> out;
    auto backend = kernels::CreateBackend(device);
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return out;
    auto net = model::TransformerModel::Create(spec, precision, 5, **backend, chunk_bytes);
    EXPECT_TRUE(net.ok()) << net.status();
    if (!net.ok()) return out;
    auto loss = (*backend)->Allocate(kernels::DType::kF32, {1, 1});
    auto ws = (*net)->GetWorkspace(mb.inputs.shape);
    EXPECT_TRUE(loss.ok() && ws.ok());
    if (!loss.ok() || !ws.ok()) return out;
    EXPECT_TRUE((*net)->LoadBatch(mb.inputs, mb.targets, **ws).ok());
    EXPECT_TRUE((*net)->ZeroGrads().ok());
    EXPECT_TRUE((*net)->Forward(**ws).ok());
    EXPECT_TRUE((*net)->Loss(**ws, 1024.0f, *loss).ok());
    EXPECT_TRUE((*net)->Backward(**ws, /*first_micro_batch=*/true).ok());
    const model::Parameter& head = (*net)->params().back();
    EXPECT_EQ(head.name, "lm_head.weight");
    auto f32 = (*backend)->Allocate(kernels::DType::kF32, head.grad.shape());
    EXPECT_TRUE(f32.ok());
    if (!f32.ok()) return out;
    EXPECT_TRUE((head.grad.dtype() == kernels::DType::kF32 ? (*backend)->Copy(head.grad, *f32)
                                                           : (*backend)->Cast(head.grad, *f32))
                    .ok());
    out.resize(static_cast<size_t>(f32->numel()));
    EXPECT_TRUE((*backend)->CopyToHost(*f32, out.data(), out.size() * 4).ok());
    return out;
  };
  const std::vector<float> one = head_grad("cuda:0", model::kLmHeadChunkBytes);
  const std::vector<float> split = head_grad("cuda:0", split_bytes);
  const std::vector<float> cpu_one = head_grad("cpu", model::kLmHeadChunkBytes);
  const std::vector<float> cpu_split = head_grad("cpu", split_bytes);
  ASSERT_EQ(one.size(), static_cast<size_t>(vocab * spec.gpt()->d_model));
  ASSERT_EQ(split.size(), one.size());
  double largest = 0;
  for (float g : cpu_one) largest = std::max(largest, std::fabs(static_cast<double>(g)));
  ASSERT_GT(largest, 0.0);
  const int mantissa = dtype == kernels::DType::kF16 ? 10 : dtype == kernels::DType::kBF16 ? 7 : 23;
  auto units = [&](double a, double b) {
    // |a - b| in units in the last place at max(|a|, |b|), with the
    // dtype's smallest normal's unit as the floor near zero.
    const double m =
        std::max({std::fabs(a), std::fabs(b),
                  dtype == kernels::DType::kF16 ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126)});
    return std::fabs(a - b) / std::ldexp(1.0, std::ilogb(m) - mantissa);
  };
  // A logit that cuBLAS rounds differently for another row count changes its
  // softmax gradient by a rounding, and that term can be far larger than the
  // column sum it joins: cancellation turns it into several units of the
  // result (4 units at one element of 4,096 on an H100). So two units bound
  // nearly all elements, and the few beyond are held to eight.
  size_t beyond_two_units = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    if (dtype == kernels::DType::kF32) {
      EXPECT_NEAR(one[i], split[i], 1e-5 * largest) << i;
    } else {
      const double u = units(one[i], split[i]);
      if (u > 2.0) ++beyond_two_units;
      EXPECT_LE(u, 8.0) << i << ": " << one[i] << " vs " << split[i];
    }
    // Against the oracle: the backward's other sums differ in order too.
    EXPECT_NEAR(one[i], cpu_one[i], Tolerance(precision) * largest) << i;
    EXPECT_NEAR(split[i], cpu_split[i], Tolerance(precision) * largest) << i;
  }
  EXPECT_LE(beyond_two_units, one.size() / 1000) << "elements beyond two units";
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaTraining,
                         ::testing::Values(model::Precision::kFp32, model::Precision::kFp16,
                                           model::Precision::kBf16),
                         [](const ::testing::TestParamInfo<model::Precision>& param) {
                           return std::string(model::PrecisionName(param.param));
                         });

}  // namespace
}  // namespace ampd::engine
