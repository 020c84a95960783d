// Per-layer loss scales in the step (CPU backend): the applied update is a
// single scale's, bit for bit, while no group under- or overflows; a model
// whose layers' gradients are 2^20 and more apart keeps the small ones that
// a single scale flushes to zero; the per-group state round-trips through
// the Trainer's state dicts; and the configs the engine refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend_factory.h"
#include "kernels/float16.h"
#include "server/engine/amp/grad_scaler.h"
#include "server/engine/config/job_config.h"
#include "server/engine/trainer/trainer.h"
#include "tests/engine/engine_test_util.h"

namespace ampd::engine {
namespace {

using testing::DataRng;
using testing::F32;
using testing::Linear;

JobConfig Config(model::Precision precision, bool per_layer) {
  JobConfig c = DefaultJobConfig(precision, amp::ScalerPolicy::kAdaptive);
  // A dynamic adaptive scaler for every precision (fp32 too, where the
  // scales are exact whatever they are), no growth during the test, and
  // no underflow-driven growth: the scales stay where the test puts them.
  c.scaler = amp::ScalerConfig::Defaults(amp::ScalerPolicy::kAdaptive);
  c.scaler.growth_interval = 1000;
  c.scaler.underflow_threshold = 1.0;
  c.scaler.per_layer_scales = per_layer;
  // Three groups: Linear+GELU, Linear+LayerNorm+Tanh, Linear.
  c.model.layers = {Linear(16, 32),         testing::Act(model::LayerKind::kGELU), Linear(32, 32),
                    testing::LayerNorm(32), testing::Act(model::LayerKind::kTanh), Linear(32, 8)};
  c.model.loss = model::LossKind::kMse;
  c.seed = 5;
  return c;
}

StepInput Batch(uint64_t seed, bool histogram = false) {
  DataRng rng(seed);
  StepInput input;
  MicroBatch mb;
  mb.inputs = F32({24, 16}, rng.UniformVector(24 * 16, -1, 1));
  mb.targets = F32({24, 8}, rng.UniformVector(24 * 8, -2, 2));
  input.micro_batches.push_back(std::move(mb));
  input.sample_grad_histogram = histogram;
  return input;
}

StepReport Step(Trainer& t, const StepInput& input) {
  absl::StatusOr<StepReport> r = t.Step(input);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : StepReport{};
}

// Loads the trainer's own state with its scale(s) pinned and marked
// calibrated: one scale, or one per group (the last is also the job's).
void Pin(Trainer& t, const std::vector<float>& scales) {
  absl::StatusOr<checkpoint::StateDict> state = t.ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  state->metadata["scaler.scale"] = amp::FormatStateNumber(scales.back());
  state->metadata["scaler.calibrated"] = "1";
  if (scales.size() > 1 || t.config().scaler.per_layer_scales) {
    for (size_t g = 0; g < scales.size(); ++g) {
      state->metadata[absl::StrCat("scaler.layer.", g, ".scale")] =
          amp::FormatStateNumber(scales[g]);
    }
  }
  const absl::Status s = t.LoadState(*state);
  ASSERT_TRUE(s.ok()) << s;
}

checkpoint::StateDict State(const Trainer& t) {
  absl::StatusOr<checkpoint::StateDict> state = t.ExportState();
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? *std::move(state) : checkpoint::StateDict{};
}

// A fresh job of `config` loads a's state, then trains on batches
// first..last exactly as `a` does (the same group scales and losses on
// every step, the same state at the end); returns it (nullptr when it
// could not be made).
std::unique_ptr<Trainer> ExpectReloadTrainsAsTheOriginal(
    Trainer& a, const JobConfig& config, const std::function<StepInput(uint64_t)>& batch,
    uint64_t first, uint64_t last) {
  const checkpoint::StateDict state = State(a);
  std::unique_ptr<Trainer> b = testing::MakeTrainer(config);
  if (b == nullptr) return b;
  const absl::Status loaded = b->LoadState(state);
  EXPECT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(testing::StateDiff(State(*b), state), "");
  for (uint64_t i = first; i <= last; ++i) {
    const StepReport ra = Step(a, batch(i));
    const StepReport rb = Step(*b, batch(i));
    EXPECT_EQ(ra.scaler.layer_scales_after, rb.scaler.layer_scales_after) << "batch " << i;
    EXPECT_EQ(ra.loss, rb.loss) << "batch " << i;
  }
  EXPECT_EQ(testing::StateDiff(State(a), State(*b)), "");
  return b;
}

// Masters and optimizer moments, bit for bit (the scaler's metadata
// differs by construction).
void ExpectSameTensors(const Trainer& a, const Trainer& b) {
  EXPECT_EQ(testing::StateDiff(State(a), State(b), /*compare_metadata=*/false), "");
}

TEST(PerLayerTrainer, Fp32UpdatesAreASingleScalesBitForBitWhateverTheGroupScales) {
  std::unique_ptr<Trainer> single = testing::MakeTrainer(Config(model::Precision::kFp32, false));
  std::unique_ptr<Trainer> layered = testing::MakeTrainer(Config(model::Precision::kFp32, true));
  ASSERT_NE(single, nullptr);
  ASSERT_NE(layered, nullptr);
  Pin(*single, {64.0f});
  // Group scales 2^12, 2^2, 2^6: the upstream gradient is multiplied by
  // 2^10 and 2^-4 at the boundaries, and each group unscaled by its own.
  const std::vector<float> scales = {4096.0f, 4.0f, 64.0f};
  Pin(*layered, scales);
  for (uint64_t i = 1; i <= 4; ++i) {
    const StepReport s = Step(*single, Batch(i));
    const StepReport l = Step(*layered, Batch(i));
    EXPECT_FALSE(l.scaler.skipped);
    EXPECT_EQ(l.scaler.layer_scales_before, scales);
    EXPECT_EQ(l.scaler.scale_before, 64.0f);
    EXPECT_EQ(l.loss, s.loss);
    EXPECT_EQ(l.applied_steps, s.applied_steps);  // one optimizer step, not one per group
  }
  EXPECT_EQ(layered->applied_steps(), 4);
  ExpectSameTensors(*single, *layered);
}

TEST(PerLayerTrainer, Fp16UpdatesWithEqualGroupScalesAreASingleScalesBitForBit) {
  std::unique_ptr<Trainer> single = testing::MakeTrainer(Config(model::Precision::kFp16, false));
  std::unique_ptr<Trainer> layered = testing::MakeTrainer(Config(model::Precision::kFp16, true));
  ASSERT_NE(single, nullptr);
  ASSERT_NE(layered, nullptr);
  Pin(*single, {1024.0f});
  Pin(*layered, {1024.0f, 1024.0f, 1024.0f});
  for (uint64_t i = 1; i <= 4; ++i) {
    const StepReport s = Step(*single, Batch(i, /*histogram=*/i % 2 == 0));
    const StepReport l = Step(*layered, Batch(i, /*histogram=*/i % 2 == 0));
    EXPECT_EQ(l.loss, s.loss);
    EXPECT_EQ(l.grad_histogram, s.grad_histogram);  // the groups' histograms summed
  }
  ExpectSameTensors(*single, *layered);
}

// In fp16 the group scales may differ too, as long as no stored value
// reaches fp16's subnormal range or overflows at either scale: the sampled
// histograms show every gradient of both runs in the normal range, and the
// updates are bit for bit the same.
TEST(PerLayerTrainer, Fp16UpdatesWithUnequalGroupScalesInTheNormalRangeAreASingleScales) {
  std::unique_ptr<Trainer> single = testing::MakeTrainer(Config(model::Precision::kFp16, false));
  std::unique_ptr<Trainer> layered = testing::MakeTrainer(Config(model::Precision::kFp16, true));
  ASSERT_NE(single, nullptr);
  ASSERT_NE(layered, nullptr);
  Pin(*single, {1024.0f});
  Pin(*layered, {4096.0f, 256.0f, 1024.0f});
  // Bins of values below 2^-14 (zeros, below 2^-30, and the octaves up to
  // [2^-15, 2^-14)) and of 2^16 and above.
  const auto outside_normal = [](const std::vector<int64_t>& h) {
    int64_t n = 0;
    for (size_t b = 1; b < h.size(); ++b) {
      const int octave = static_cast<int>(b) - 2 + kGradHistogramMinLog2;
      if (b == 1 || octave < -14 || octave >= 16) n += h[b];
    }
    return n;
  };
  for (uint64_t i = 1; i <= 4; ++i) {
    const StepReport s = Step(*single, Batch(i, /*histogram=*/true));
    const StepReport l = Step(*layered, Batch(i, /*histogram=*/true));
    ASSERT_EQ(outside_normal(s.grad_histogram), 0) << "step " << i;
    ASSERT_EQ(outside_normal(l.grad_histogram), 0) << "step " << i;
    EXPECT_EQ(l.loss, s.loss);
  }
  ExpectSameTensors(*single, *layered);
}

// fp16 gradients of one parameter, unscaled by `scale` in double.
std::vector<double> Unscaled(Trainer& t, size_t param, double scale) {
  const kernels::Tensor& g = *t.gradient_tensors()[param];
  std::vector<double> out(static_cast<size_t>(g.numel()));
  if (g.dtype() == kernels::DType::kF32) {
    std::vector<float> host(out.size());
    EXPECT_TRUE(t.backend().CopyToHost(g, host.data(), host.size() * sizeof(float)).ok());
    for (size_t i = 0; i < out.size(); ++i) out[i] = host[i] / scale;
  } else {
    std::vector<uint16_t> host(out.size());
    EXPECT_TRUE(t.backend().CopyToHost(g, host.data(), host.size() * sizeof(uint16_t)).ok());
    for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::HalfBitsToFloat(host[i]) / scale;
  }
  return out;
}

// A layer stack whose first layer's weight gradients sit 2^20 and more
// below the last layer's: inputs of a few 2^-24 (exact fp16 subnormals)
// make dW0 = dh0^T x tiny, a second Linear scaled by 2^-12 shrinks dh0
// further, and targets of +-64 make the last layer's gradients large.
JobConfig WideRangeConfig(model::Precision precision, amp::ScalerPolicy policy, bool per_layer) {
  JobConfig c = DefaultJobConfig(precision, policy);
  c.scaler.per_layer_scales = per_layer;
  c.model.layers = {Linear(16, 32), testing::Act(model::LayerKind::kReLU), Linear(32, 8)};
  c.model.loss = model::LossKind::kMse;
  c.seed = 3;
  return c;
}

StepInput WideRangeBatch(uint64_t seed) {
  DataRng rng(seed);
  StepInput input;
  MicroBatch mb;
  std::vector<float> x = rng.UniformVector(32 * 16, -8, 8);
  for (float& v : x) v = std::ldexp(v >= 0 ? std::floor(v) + 1 : std::ceil(v) - 1, -24);
  mb.inputs = F32({32, 16}, x);
  mb.targets = F32({32, 8}, rng.UniformVector(32 * 8, -64, 64));
  input.micro_batches.push_back(std::move(mb));
  return input;
}

std::unique_ptr<Trainer> WideRangeTrainer(const JobConfig& config) {
  std::unique_ptr<Trainer> t = testing::MakeTrainer(config);
  if (t == nullptr) return t;
  checkpoint::StateDict state = State(*t);
  for (codec::NamedTensor& nt : state.tensors) {
    if (nt.name != "model.2.weight") continue;
    std::vector<float> w(nt.tensor.data.size() / sizeof(float));
    std::memcpy(w.data(), nt.tensor.data.data(), nt.tensor.data.size());
    for (float& v : w) v = std::ldexp(v, -12);
    std::memcpy(nt.tensor.data.data(), w.data(), nt.tensor.data.size());
  }
  EXPECT_TRUE(t->LoadState(state).ok());
  return t;
}

TEST(PerLayerTrainer, KeepsGradientsASingleScaleFlushesToZero) {
  std::unique_ptr<Trainer> reference = WideRangeTrainer(
      WideRangeConfig(model::Precision::kFp32, amp::ScalerPolicy::kAdaptive, false));
  std::unique_ptr<Trainer> single = WideRangeTrainer(
      WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, false));
  std::unique_ptr<Trainer> layered = WideRangeTrainer(
      WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, true));
  ASSERT_TRUE(reference && single && layered);
  const StepReport r = Step(*reference, WideRangeBatch(1));
  const StepReport s = Step(*single, WideRangeBatch(1));
  const StepReport l = Step(*layered, WideRangeBatch(1));
  ASSERT_FALSE(s.scaler.skipped);
  ASSERT_FALSE(l.scaler.skipped);
  ASSERT_EQ(l.scaler.layer_scales_before.size(), 2u);
  // Parameter 0 is model.0.weight (group 0), 2 is model.2.weight (group 1).
  const std::vector<double> want = Unscaled(*reference, 0, 1.0);
  const std::vector<double> got_single = Unscaled(*single, 0, s.scaler.scale_before);
  const std::vector<double> got_layered = Unscaled(*layered, 0, l.scaler.layer_scales_before[0]);
  double want_max = 0.0;
  for (double v : want) want_max = std::max(want_max, std::fabs(v));
  const std::vector<double> last = Unscaled(*reference, 3, 1.0);
  double last_max = 0.0;
  for (double v : last) last_max = std::max(last_max, std::fabs(v));
  // The construction: the layers' gradients are more than 2^20 apart.
  EXPECT_GT(last_max, std::ldexp(want_max, 20));
  int64_t nonzero = 0;
  int64_t flushed_single = 0;
  int64_t flushed_layered = 0;
  double worst_layered = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    // Elements within 2^10 of the layer's largest: fp16's forward differs
    // from fp32's, so an element near 0 may legitimately round to 0.
    if (std::fabs(want[i]) < std::ldexp(want_max, -10)) continue;
    ++nonzero;
    flushed_single += got_single[i] == 0.0 ? 1 : 0;
    flushed_layered += got_layered[i] == 0.0 ? 1 : 0;
    worst_layered = std::max(worst_layered, std::fabs(got_layered[i] - want[i]) / want_max);
  }
  ASSERT_GT(nonzero, 256);
  // The single scale is held down by the last layer's gradients; the first
  // layer's then fall below fp16's smallest subnormal.
  EXPECT_GT(flushed_single, nonzero / 10) << flushed_single << " of " << nonzero;
  EXPECT_EQ(flushed_layered, 0) << "of " << nonzero;
  EXPECT_GT(l.scaler.layer_scales_before[0], s.scaler.scale_before);
  // Per-layer gradients match fp32's to fp16's precision (relative to the
  // layer's largest; fp16 forward activations differ from fp32's too).
  EXPECT_LT(worst_layered, 1e-2);
  std::printf(
      "first-layer weight gradients: %lld within 2^10 of the largest in fp32; flushed to zero: "
      "single %lld, "
      "per-layer %lld; scales: single %g, per-layer %g / %g\n",
      static_cast<long long>(nonzero), static_cast<long long>(flushed_single),
      static_cast<long long>(flushed_layered), s.scaler.scale_before,
      l.scaler.layer_scales_before[0], l.scaler.layer_scales_before[1]);
}

TEST(PerLayerTrainer, GroupScalesRoundTripThroughStateDicts) {
  JobConfig config = WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, true);
  config.scaler.growth_interval = 2;
  std::unique_ptr<Trainer> a = WideRangeTrainer(config);
  ASSERT_NE(a, nullptr);
  for (uint64_t i = 1; i <= 3; ++i) Step(*a, WideRangeBatch(i));
  const checkpoint::StateDict state = State(*a);
  EXPECT_EQ(state.metadata.at("scaler.layer_groups"), "2");
  const std::vector<float> scales = {std::stof(state.metadata.at("scaler.layer.0.scale")),
                                     std::stof(state.metadata.at("scaler.layer.1.scale"))};
  EXPECT_GT(scales[0], scales[1]);  // the first group's gradients are the small ones
  EXPECT_EQ(state.metadata.at("scaler.scale"), state.metadata.at("scaler.layer.1.scale"));
  EXPECT_TRUE(state.metadata.contains("scaler.layer.0._growth_tracker"));

  std::unique_ptr<Trainer> b = ExpectReloadTrainsAsTheOriginal(*a, config, WideRangeBatch, 4, 7);
  ASSERT_NE(b, nullptr);

  // A job-wide adaptive job refuses the per-group keys, and a per-layer job
  // a state without them; neither changes.
  std::unique_ptr<Trainer> job_wide = testing::MakeTrainer(
      WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, false));
  ASSERT_NE(job_wide, nullptr);
  absl::Status st = job_wide->LoadState(state);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "unknown key 'layer.0._growth_tracker'")) << st;
  const checkpoint::StateDict before = State(*b);
  st = b->LoadState(State(*job_wide));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "missing key 'layer_groups'")) << st;
  EXPECT_EQ(testing::StateDiff(State(*b), before), "");
}

// A GPT's per-layer scales: one group per block, the embeddings in block
// 0's and ln_f (and an untied head) in the last block's.
JobConfig GptConfig(model::Precision precision, bool per_layer, bool tied) {
  JobConfig c = Config(precision, per_layer);
  c.model.layers.clear();
  c.model.loss = model::LossKind::kCrossEntropy;
  c.model.kind = model::GptSpec{.vocab_size = 48,
                                .context_length = 16,
                                .d_model = 32,
                                .n_layer = 3,
                                .n_head = 4,
                                .tie_embeddings = tied};
  return c;
}

// Two micro-batches of random token sequences (two shapes, so the
// accumulation and both workspaces run), the histogram when asked.
StepInput GptBatch(uint64_t seed, bool histogram = false) {
  DataRng rng(seed);
  StepInput input;
  for (const int64_t seq : {16, 9}) {
    std::vector<int32_t> ids;
    std::vector<int32_t> targets;
    for (int64_t i = 0; i < 3 * seq; ++i) {
      ids.push_back(rng.Index(48));
      targets.push_back(rng.Index(48));
    }
    input.micro_batches.push_back({testing::I32({3, seq}, ids), testing::I32({3, seq}, targets)});
  }
  input.sample_grad_histogram = histogram;
  return input;
}

TEST(PerLayerGpt, GroupsAreTheBlocksWithTheEmbeddingsFirstAndTheHeadLast) {
  for (const bool tied : {true, false}) {
    std::unique_ptr<Trainer> t =
        testing::MakeTrainer(GptConfig(model::Precision::kFp16, true, tied));
    ASSERT_NE(t, nullptr);
    const StepReport r = Step(*t, GptBatch(1));
    EXPECT_EQ(r.scaler.layer_scales_before.size(), 3u);
    const checkpoint::StateDict state = State(*t);
    EXPECT_EQ(state.metadata.at("scaler.layer_groups"), "3");
  }
}

// A GPT trained 3 steps at `single` and at the block scales `blocks`,
// tied and untied: the same losses and the same masters and moments bit for
// bit (with the histograms sampled, the same summed histograms too).
void ExpectGptUpdatesAreASingleScales(model::Precision precision, float single_scale,
                                      const std::vector<float>& blocks, bool histogram) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    std::unique_ptr<Trainer> single = testing::MakeTrainer(GptConfig(precision, false, tied));
    std::unique_ptr<Trainer> layered = testing::MakeTrainer(GptConfig(precision, true, tied));
    ASSERT_TRUE(single && layered);
    Pin(*single, {single_scale});
    Pin(*layered, blocks);
    for (uint64_t i = 1; i <= 3; ++i) {
      const StepReport s = Step(*single, GptBatch(i, histogram));
      const StepReport l = Step(*layered, GptBatch(i, histogram));
      EXPECT_FALSE(l.scaler.skipped);
      EXPECT_EQ(l.scaler.layer_scales_before, blocks);
      EXPECT_EQ(l.loss, s.loss);
      EXPECT_EQ(l.grad_histogram, s.grad_histogram);
    }
    ExpectSameTensors(*single, *layered);
  }
}

// fp32: the residual gradient moved between blocks by the add's scale, a
// tied head's gradient moved to block 0's scale by its GEMM's alpha, each
// group unscaled by its own 1 / S_g: a single scale's update bit for bit.
TEST(PerLayerGpt, Fp32UpdatesAreASingleScalesBitForBitTiedOrNot) {
  ExpectGptUpdatesAreASingleScales(model::Precision::kFp32, 64.0f, {4096.0f, 4.0f, 64.0f},
                                   /*histogram=*/false);
}

// fp16 with equal block scales: every boundary scale is 1 and each
// group's 1 / S_g the single one, so the update is a single scale's bit for
// bit. (Unequal scales cannot be checked so in fp16: a GPT's gradients span
// more octaves than fp16's normal range, so some sit in the subnormals at
// any scale and round differently at another; fp32 checks them above.)
TEST(PerLayerGpt, Fp16UpdatesWithEqualScalesAreASingleScalesBitForBit) {
  ExpectGptUpdatesAreASingleScales(model::Precision::kFp16, 8192.0f, {8192.0f, 8192.0f, 8192.0f},
                                   /*histogram=*/true);
}

// Deeper than 32 blocks, consecutive blocks share a group (each group one
// or two blocks, in order), and the update is still a single scale's bit
// for bit in fp32 with 32 different group scales.
TEST(PerLayerGpt, BeyondThirtyTwoBlocksConsecutiveBlocksShareAScale) {
  std::vector<int64_t> groups;
  for (int64_t l = 0; l < 48; ++l) groups.push_back(model::GptBlockScaleGroup(l, 48));
  EXPECT_EQ(groups.front(), 0);
  EXPECT_EQ(groups.back(), 31);
  for (size_t l = 1; l < groups.size(); ++l) {
    EXPECT_GE(groups[l] - groups[l - 1], 0);
    EXPECT_LE(groups[l] - groups[l - 1], 1);
  }
  for (int64_t g = 0; g < 32; ++g) {
    const auto blocks = std::count(groups.begin(), groups.end(), g);
    EXPECT_TRUE(blocks == 1 || blocks == 2) << "group " << g << ": " << blocks << " blocks";
  }

  JobConfig single_config = GptConfig(model::Precision::kFp32, false, true);
  single_config.model.kind = model::GptSpec{
      .vocab_size = 48, .context_length = 16, .d_model = 8, .n_layer = 34, .n_head = 2};
  JobConfig layered_config = single_config;
  layered_config.scaler.per_layer_scales = true;
  std::unique_ptr<Trainer> single = testing::MakeTrainer(single_config);
  std::unique_ptr<Trainer> layered = testing::MakeTrainer(layered_config);
  ASSERT_TRUE(single && layered);
  Pin(*single, {64.0f});
  std::vector<float> scales;
  for (int g = 0; g < 32; ++g) scales.push_back(std::ldexp(1.0f, 2 + (g * 5) % 11));
  scales.back() = 64.0f;
  Pin(*layered, scales);
  for (uint64_t i = 1; i <= 2; ++i) {
    const StepReport s = Step(*single, GptBatch(i));
    const StepReport l = Step(*layered, GptBatch(i));
    EXPECT_EQ(l.scaler.layer_scales_before, scales);
    EXPECT_EQ(l.loss, s.loss);
  }
  ExpectSameTensors(*single, *layered);
}

// Calibrated, trained and reloaded: every block's scale round-trips, and a
// fresh job loaded with the state trains on exactly as the original.
TEST(PerLayerGpt, BlockScalesRoundTripThroughStateDicts) {
  JobConfig config = GptConfig(model::Precision::kFp16, true, true);
  config.scaler.growth_interval = 2;
  config.scaler.underflow_threshold = 0x1p-10;
  std::unique_ptr<Trainer> a = testing::MakeTrainer(config);
  ASSERT_NE(a, nullptr);
  for (uint64_t i = 1; i <= 4; ++i) EXPECT_FALSE(Step(*a, GptBatch(i, true)).scaler.skipped);
  EXPECT_EQ(State(*a).metadata.at("scaler.layer_groups"), "3");
  EXPECT_NE(ExpectReloadTrainsAsTheOriginal(
                *a, config, [](uint64_t i) { return GptBatch(i); }, 5, 8),
            nullptr);
}

void ExpectInvalid(const JobConfig& config, absl::string_view message) {
  const absl::Status s = ValidateJobConfig(config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), message)) << s;
  std::unique_ptr<kernels::Backend> backend = *kernels::CreateBackend("cpu");
  EXPECT_EQ(Trainer::Create(config, std::move(backend)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PerLayerConfig, RefusedOutsideAdaptiveJobsOfOneAmpdAndBeyond32LinearGroups) {
  JobConfig ok = Config(model::Precision::kFp16, true);
  ASSERT_TRUE(ValidateJobConfig(ok).ok()) << ValidateJobConfig(ok);

  JobConfig pytorch = DefaultJobConfig(model::Precision::kFp16, amp::ScalerPolicy::kPyTorch);
  pytorch.model = ok.model;
  pytorch.scaler.per_layer_scales = true;
  ExpectInvalid(pytorch, "scaler.per_layer_scales: applies to the adaptive policy only");

  JobConfig bf16 = DefaultJobConfig(model::Precision::kBf16, amp::ScalerPolicy::kAdaptive);
  bf16.model = ok.model;
  bf16.scaler.per_layer_scales = true;  // bf16's default scale is static
  ExpectInvalid(bf16, "scaler.per_layer_scales: needs an enabled, dynamic scaler");

  // A GPT of any depth: beyond 32 blocks, consecutive blocks share a group.
  JobConfig gpt = ok;
  gpt.model.layers.clear();
  gpt.model.loss = model::LossKind::kCrossEntropy;
  gpt.model.kind = model::GptSpec{
      .vocab_size = 64, .context_length = 16, .d_model = 32, .n_layer = 48, .n_head = 4};
  ASSERT_TRUE(ValidateJobConfig(gpt).ok()) << ValidateJobConfig(gpt);
  EXPECT_EQ(model::LayerScaleGroups(gpt.model), 32);

  JobConfig distributed = ok;
  distributed.distributed.world_size = 2;
  distributed.distributed.rank = 1;
  distributed.distributed.group = "g";
  distributed.distributed.rendezvous = "127.0.0.1:9";
  distributed.distributed.secret = std::string(32, 's');
  distributed.scaler.per_layer_scales = false;
  ASSERT_TRUE(ValidateJobConfig(distributed).ok()) << ValidateJobConfig(distributed);
  distributed.scaler.per_layer_scales = true;
  ExpectInvalid(distributed, "scaler.per_layer_scales: not available for distributed jobs");

  // 33 Linear layers are 33 groups, one more than the metrics' bound.
  JobConfig deep = ok;
  deep.model.layers.clear();
  for (int i = 0; i < 33; ++i) deep.model.layers.push_back(Linear(4, 4));
  ExpectInvalid(deep, "scaler.per_layer_scales: the model has 33 layer groups");
  deep.model.layers.pop_back();
  EXPECT_TRUE(ValidateJobConfig(deep).ok()) << ValidateJobConfig(deep);
}

// docs/DESIGN.md's comparison: the wide-range model (first-layer weight
// gradients more than 2^20 below the last layer's) trained 300 steps on 8
// batches cycled, the gradient histogram sampled on every step. Zero
// elements are the histogram's zero bin summed over the steps, i.e. what
// ampd_grad_zero_elements_total counts on a server sampling every step;
// the fp32 run's count is the exact zeros any precision has (ReLU).
struct DemoRun {
  int64_t zeros = 0;
  int64_t skipped = 0;
  double final_loss = 0;  // mean of the last 20 steps
  std::vector<float> last_scales;
};

DemoRun RunDemo(const JobConfig& config) {
  DemoRun run;
  std::unique_ptr<Trainer> t = WideRangeTrainer(config);
  EXPECT_NE(t, nullptr);
  if (t == nullptr) return run;
  constexpr int kSteps = 300;
  for (int i = 1; i <= kSteps; ++i) {
    StepInput input = WideRangeBatch(static_cast<uint64_t>(1 + (i - 1) % 8));
    input.sample_grad_histogram = true;
    const StepReport r = Step(*t, input);
    run.zeros += r.grad_histogram.empty() ? 0 : r.grad_histogram[0];
    run.skipped += r.scaler.skipped ? 1 : 0;
    if (i > kSteps - 20) run.final_loss += r.loss / 20.0;
    run.last_scales = r.scaler.layer_scales_after.empty() ? std::vector<float>{r.scaler.scale_after}
                                                          : r.scaler.layer_scales_after;
  }
  return run;
}

TEST(PerLayerDemo, WideRangeLayersOverThreeHundredSteps) {
  const DemoRun fp32 =
      RunDemo(WideRangeConfig(model::Precision::kFp32, amp::ScalerPolicy::kPyTorch, false));
  const DemoRun pytorch =
      RunDemo(WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kPyTorch, false));
  const DemoRun adaptive =
      RunDemo(WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, false));
  const DemoRun layered =
      RunDemo(WideRangeConfig(model::Precision::kFp16, amp::ScalerPolicy::kAdaptive, true));
  const auto row = [](const char* name, const DemoRun& r) {
    std::string scales;
    for (float s : r.last_scales) absl::StrAppend(&scales, scales.empty() ? "" : " / ", s);
    std::printf("| %-28s | %8lld | %3lld | %-22s | %.6f |\n", name, static_cast<long long>(r.zeros),
                static_cast<long long>(r.skipped), scales.c_str(), r.final_loss);
  };
  std::printf(
      "| run | zero gradient elements (300 steps) | skipped | last scale(s) | final loss |\n");
  row("fp32", fp32);
  row("fp16 pytorch", pytorch);
  row("fp16 adaptive", adaptive);
  row("fp16 adaptive per-layer", layered);
  // Zeros beyond fp32's exact ones are gradients fp16 flushed.
  EXPECT_LT(layered.zeros, pytorch.zeros);
  EXPECT_LT(layered.zeros, adaptive.zeros);
  EXPECT_GE(layered.zeros, fp32.zeros);
  EXPECT_LE(layered.skipped, pytorch.skipped);
}

}  // namespace
}  // namespace ampd::engine
