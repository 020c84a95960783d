// ampd_bench_engine: median Trainer::Step time and samples/s of the
// reference MLP (4 x Linear(1024, 1024), GELU between, batch 256, MSE,
// AdamW) in fp32, fp16 and bf16, and the fused AdamUpdate's bandwidth over
// the same parameters, on the backend --device names. Prints figures; it
// never passes or fails. --create times Trainer::Create (what CreateJob
// runs: weight initialisation, optimizer state) for a ~100M-parameter MLP
// instead. --model=gpt times a GPT (GPT-2 small by default: vocab 50304,
// context 1024, d_model 768, 12 layers, 12 heads, micro-batch 8 x 1024
// random tokens, AdamW lr 6e-4, betas (0.9, 0.95), weight decay 0.1) in
// --precisions, and prints bench/pytorch/gpt.py's line: median step time
// (wall time of Trainer::Step, which returns after the step's one read-back),
// tokens/s, TFLOP/s and MFU, counting 6 N + 12 n_layer T d_model FLOPs a
// token (N: every parameter but the position table) over --peak-tflops
// (default 989.4, an H100 SXM's dense bf16, on CUDA; none on the CPU).
// --model=decoder times a Llama/Qwen2 decoder the same way (Qwen2.5-0.5B's
// shape by default, 8 x 1024 tokens; FLOPs 6 N + 12 L T (heads x head
// width) a token, N every parameter but an untied embedding), beside
// bench/pytorch/decoder.py's line. --lora-rank=R makes it a LoRA fine-tune
// of that decoder (alpha 2R, PEFT's usual; targets q/k/v/o_proj or
// --lora-targets): its step runs the frozen base's forward (2 FLOPs a
// parameter a token) and its activation gradients (2) but no weight
// gradients, so it counts 4 N_base + 6 N_adapters + the attention's.
//
//   ampd_bench_engine [--device=cpu|cuda|cuda:N] [--steps=N] [--warmup=N] [--create]
//   ampd_bench_engine --model=gpt [--device=cuda:0] [--precisions=bf16,fp16] [--vocab=50304]
//       [--context=1024] [--d-model=768] [--n-layer=12] [--n-head=12] [--batch=8]
//       [--seq-len=1024] [--peak-tflops=989.4] [--steps=20] [--warmup=5]
//   ampd_bench_engine --model=decoder [--device=cuda:0] [--precisions=bf16,fp16] [--vocab=151936]
//       [--hidden=896] [--intermediate=4864] [--layers=24] [--heads=14] [--kv-heads=2] [--untied]
//       [--batch=8] [--seq-len=1024] [--peak-tflops=989.4] [--steps=20] [--warmup=5]
//       [--lora-rank=R [--lora-targets=q_proj,k_proj,v_proj,o_proj]]
//   ampd_bench_engine --model=token [--device=cuda:0] [--precisions=fp16,bf16] [--vocab=32768]
//       [--width=4096] [--depth=4] [--tokens=8192]   (service_bench's token model, in process)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/backend_factory.h"
#include "server/engine/config/job_config.h"
#include "server/engine/trainer/trainer.h"

namespace {

using ampd::engine::JobConfig;
using ampd::engine::MicroBatch;
using ampd::engine::StepInput;
using ampd::engine::model::Precision;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWidth = 1024, kBatch = 256, kLayers = 4;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

JobConfig ReferenceConfig(Precision precision) {
  JobConfig config = ampd::engine::DefaultJobConfig(precision);
  for (int64_t i = 0; i < kLayers; ++i) {
    if (i > 0) {
      ampd::engine::model::LayerSpec gelu;
      gelu.kind = ampd::engine::model::LayerKind::kGELU;
      config.model.layers.push_back(gelu);
    }
    ampd::engine::model::LayerSpec linear;
    linear.kind = ampd::engine::model::LayerKind::kLinear;
    linear.in_features = kWidth;
    linear.out_features = kWidth;
    config.model.layers.push_back(linear);
  }
  config.model.loss = ampd::engine::model::LossKind::kMse;
  config.optimizer.adam.lr = 1e-4f;
  return config;
}

ampd::engine::HostTensor RandomF32(int64_t rows, int64_t cols, std::mt19937_64& rng, float amp) {
  ampd::engine::HostTensor t;
  t.dtype = ampd::kernels::DType::kF32;
  t.shape = {rows, cols};
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = amp * (static_cast<float>(rng() >> 40) / 16777216.0f * 2.0f - 1.0f);
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

// Times AdamUpdate alone over tensors shaped like the model's parameters.
int BenchAdam(const std::string& device, Precision precision, int warmup, int steps) {
  namespace k = ampd::kernels;
  auto backend_or = k::CreateBackend(device);
  if (!backend_or.ok())
    return std::fprintf(stderr, "%s\n", backend_or.status().ToString().c_str()), 1;
  k::Backend& b = **backend_or;
  const k::DType wd = ampd::engine::model::WorkingDType(precision);
  std::vector<k::Shape> shapes;
  for (int64_t i = 0; i < kLayers; ++i) {
    shapes.push_back({kWidth, kWidth});
    shapes.push_back({kWidth});
  }
  std::vector<k::Tensor> tensors;
  tensors.reserve(shapes.size() * 5 + 1);
  std::vector<k::ParamRef> refs;
  int64_t params = 0;
  auto alloc = [&](k::DType dt, const k::Shape& s) -> k::Tensor* {
    auto t = b.Allocate(dt, s);
    if (!t.ok() || !b.Fill(*t, 1e-3f).ok()) return nullptr;
    tensors.push_back(*std::move(t));
    return &tensors.back();
  };
  for (const k::Shape& s : shapes) {
    k::ParamRef r{};
    r.master = alloc(k::DType::kF32, s);
    r.working = wd == k::DType::kF32 ? nullptr : alloc(wd, s);
    r.grad = alloc(wd, s);
    r.state0 = alloc(k::DType::kF32, s);
    r.state1 = alloc(k::DType::kF32, s);
    refs.push_back(r);
    params += k::NumElements(s);
  }
  k::Tensor* found_inf = alloc(k::DType::kF32, {1});
  if (found_inf == nullptr || !b.Fill(*found_inf, 0.0f).ok()) return 1;
  k::GradTransform transform;
  transform.inv_scale = 1.0f / 65536.0f;
  transform.found_inf = found_inf;
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = Clock::now();
    if (!b.AdamUpdate(refs, k::AdamConfig{}, s + 1, transform).ok() || !b.Synchronize().ok()) {
      return 1;
    }
    if (s >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // grad read + master/m/v read and written + working copy written.
  const double bytes_per_param =
      static_cast<double>(k::SizeOf(wd)) + 24.0 + (wd == k::DType::kF32 ? 0.0 : k::SizeOf(wd));
  const double t = Median(times);
  std::printf("  fused AdamUpdate: %lld params, %.0f B/param, median %.3f ms, %.2f GB/s\n",
              static_cast<long long>(params), bytes_per_param, t * 1e3,
              bytes_per_param * static_cast<double>(params) / t / 1e9);
  return 0;
}

// The host-to-device part of every step: the reference MLP's inputs and
// targets through CopyFromHost, then Synchronize, as a Step uploads them
// (PyTorch's peer keeps its batch on the device, so this is work only the
// service-shaped loop does).
int BenchUpload(const std::string& device, const MicroBatch& batch, int warmup, int steps) {
  namespace k = ampd::kernels;
  auto backend_or = k::CreateBackend(device);
  if (!backend_or.ok())
    return std::fprintf(stderr, "%s\n", backend_or.status().ToString().c_str()), 1;
  k::Backend& b = **backend_or;
  auto inputs = b.Allocate(k::DType::kF32, batch.inputs.shape);
  auto targets = b.Allocate(k::DType::kF32, batch.targets.shape);
  if (!inputs.ok() || !targets.ok()) return std::fprintf(stderr, "Allocate failed\n"), 1;
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = Clock::now();
    if (!b.CopyFromHost(batch.inputs.data.data(), batch.inputs.data.size(), *inputs).ok() ||
        !b.CopyFromHost(batch.targets.data.data(), batch.targets.data.size(), *targets).ok() ||
        !b.Synchronize().ok()) {
      return std::fprintf(stderr, "upload failed\n"), 1;
    }
    if (s >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::printf(
      "batch upload: inputs + targets, %.2f MB, CopyFromHost + Synchronize: median %.3f ms\n",
      static_cast<double>(batch.inputs.data.size() + batch.targets.data.size()) / 1e6,
      Median(times) * 1e3);
  return 0;
}

// Median wall time of Trainer::Create for 8 x Linear(3584, 3584) with bias
// (102.8M parameters), per precision: allocation, initialisation of every
// weight from the seed, the working copy and the optimizer state.
int BenchCreate(const std::string& device, int repeats) {
  constexpr int64_t kBigWidth = 3584, kBigLayers = 8;
  for (Precision precision : {Precision::kFp32, Precision::kFp16}) {
    JobConfig config = ampd::engine::DefaultJobConfig(precision);
    for (int64_t i = 0; i < kBigLayers; ++i) {
      ampd::engine::model::LayerSpec linear;
      linear.kind = ampd::engine::model::LayerKind::kLinear;
      linear.in_features = kBigWidth;
      linear.out_features = kBigWidth;
      config.model.layers.push_back(linear);
    }
    config.model.loss = ampd::engine::model::LossKind::kMse;
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
      auto backend = ampd::kernels::CreateBackend(device);
      if (!backend.ok()) {
        std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
        return 1;
      }
      const auto t0 = Clock::now();
      auto trainer = ampd::engine::Trainer::Create(config, *std::move(backend));
      if (!trainer.ok()) {
        std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
        return 1;
      }
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::printf(
        "%s: Trainer::Create of %lld x Linear(%lld, %lld), %.1fM parameters: median %.3f s\n",
        std::string(ampd::engine::model::PrecisionName(precision)).c_str(),
        static_cast<long long>(kBigLayers), static_cast<long long>(kBigWidth),
        static_cast<long long>(kBigWidth),
        static_cast<double>(kBigLayers * (kBigWidth * kBigWidth + kBigWidth)) / 1e6, Median(times));
  }
  return 0;
}

struct GptBench {
  ampd::engine::model::GptSpec spec = {
      .vocab_size = 50304, .context_length = 1024, .d_model = 768, .n_layer = 12, .n_head = 12};
  int64_t batch = 8;
  int64_t seq_len = 0;  // 0: the context
  std::string precisions = "bf16,fp16";
  double peak_tflops = -1;  // < 0: the CUDA default, none on the CPU
};

ampd::engine::HostTensor RandomIds(int64_t b, int64_t t, int64_t vocab, std::mt19937_64& rng) {
  ampd::engine::HostTensor ids;
  ids.dtype = ampd::kernels::DType::kI32;
  ids.shape = {b, t};
  std::vector<int32_t> v(static_cast<size_t>(b * t));
  for (int32_t& id : v) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  ids.data.resize(v.size() * 4);
  std::memcpy(ids.data.data(), v.data(), ids.data.size());
  return ids;
}

// The shape of a token model's step, what it multiplies and how it prints.
struct SequenceBench {
  ampd::engine::model::ModelSpec model;
  int64_t vocab = 0;
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t flop_params = 0;         // trainable N of 6 N FLOPs a token
  int64_t frozen_flop_params = 0;  // frozen N of 4 N (forward, input gradients)
  int64_t attention_flops = 0;     // 12 L T (heads x head width) a token
  std::string precisions;
  double peak_tflops = -1;
};

int BenchSequenceModel(const std::string& device, const SequenceBench& sb, int warmup, int steps);

int BenchGpt(const std::string& device, const GptBench& g, int warmup, int steps) {
  namespace m = ampd::engine::model;
  const int64_t t = g.seq_len > 0 ? g.seq_len : g.spec.context_length;
  SequenceBench sb;
  sb.model.kind = g.spec;
  sb.model.loss = m::LossKind::kCrossEntropy;
  sb.vocab = g.spec.vocab_size;
  sb.batch = g.batch;
  sb.seq_len = t;
  // Parameters that multiply: all but the position table (a lookup).
  sb.flop_params = m::GptParameterCount(g.spec) - g.spec.context_length * g.spec.d_model;
  sb.attention_flops = 12 * g.spec.n_layer * t * g.spec.d_model;
  sb.precisions = g.precisions;
  sb.peak_tflops = g.peak_tflops;
  char peak_text[48] = "";
  const double peak =
      g.peak_tflops >= 0 ? g.peak_tflops : (device.rfind("cuda", 0) == 0 ? 989.4 : 0);
  if (peak > 0) std::snprintf(peak_text, sizeof(peak_text), ", peak %.1f TFLOP/s", peak);
  std::printf(
      "device: %s\ngpt: vocab %lld, context %lld, d_model %lld, %lld layers, %lld heads, "
      "batch %lld x %lld tokens, AdamW, in-process Trainer%s\n",
      device.c_str(), static_cast<long long>(g.spec.vocab_size),
      static_cast<long long>(g.spec.context_length), static_cast<long long>(g.spec.d_model),
      static_cast<long long>(g.spec.n_layer), static_cast<long long>(g.spec.n_head),
      static_cast<long long>(g.batch), static_cast<long long>(t), peak_text);
  return BenchSequenceModel(device, sb, warmup, steps);
}

// A Llama/Qwen2 decoder (Qwen2.5-0.5B's shape by default: 24 layers, hidden
// 896, 14 heads, 2 K/V heads, intermediate 4864, vocab 151936, tied, q/k/v
// biases), as bench/pytorch/decoder.py builds it.
struct DecoderBench {
  ampd::engine::model::DecoderSpec spec = {.vocab_size = 151936,
                                           .hidden_size = 896,
                                           .intermediate_size = 4864,
                                           .num_hidden_layers = 24,
                                           .num_attention_heads = 14,
                                           .num_key_value_heads = 2,
                                           .rope_theta = 1000000.0f,
                                           .rope_scaling = {},
                                           .max_position_embeddings = 1024,
                                           .tie_word_embeddings = true,
                                           .qkv_bias = true,
                                           .lora = std::nullopt};
  // --lora-rank: set, LoRA of rank R and alpha 2 R on lora_targets.
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets = ampd::engine::model::LoraSpec().target_modules;
};

int BenchDecoder(const std::string& device, const DecoderBench& d, const GptBench& g, int warmup,
                 int steps) {
  namespace m = ampd::engine::model;
  const int64_t t = g.seq_len > 0 ? g.seq_len : d.spec.max_position_embeddings;
  SequenceBench sb;
  sb.model.kind = d.spec;
  sb.model.decoder()->max_position_embeddings = std::max(t, d.spec.max_position_embeddings);
  if (d.lora_rank > 0) {
    sb.model.decoder()->lora = m::LoraSpec{.rank = d.lora_rank,
                                           .alpha = 2.0f * static_cast<float>(d.lora_rank),
                                           .target_modules = d.lora_targets};
  }
  sb.model.loss = m::LossKind::kCrossEntropy;
  sb.vocab = d.spec.vocab_size;
  sb.batch = g.batch;
  sb.seq_len = t;
  // Parameters that multiply: all but an untied embedding (a lookup); a
  // tied one is counted once, as the LM head's GEMM (decoder.py's count).
  // DecoderParameterCount is the base's alone: the adapters are LoRA's.
  const int64_t base = m::DecoderParameterCount(d.spec) -
                       (d.spec.tie_word_embeddings ? 0 : d.spec.vocab_size * d.spec.hidden_size);
  if (d.lora_rank > 0) {
    // The frozen base computes its forward and the gradients of its inputs
    // (the adapters below it need them) but no weight gradients.
    sb.flop_params = m::LoraParameterCount(*sb.model.decoder());
    sb.frozen_flop_params = base;
  } else {
    sb.flop_params = base;
  }
  sb.attention_flops =
      12 * d.spec.num_hidden_layers * t * d.spec.num_attention_heads * m::DecoderHeadDim(d.spec);
  sb.precisions = g.precisions;
  sb.peak_tflops = g.peak_tflops;
  char peak_text[48] = "";
  const double peak =
      g.peak_tflops >= 0 ? g.peak_tflops : (device.rfind("cuda", 0) == 0 ? 989.4 : 0);
  if (peak > 0) std::snprintf(peak_text, sizeof(peak_text), ", peak %.1f TFLOP/s", peak);
  std::printf(
      "device: %s\ndecoder: vocab %lld, hidden %lld, intermediate %lld, %lld layers, %lld heads "
      "/ %lld kv heads, %s, batch %lld x %lld tokens, AdamW, in-process Trainer%s\n",
      device.c_str(), static_cast<long long>(d.spec.vocab_size),
      static_cast<long long>(d.spec.hidden_size), static_cast<long long>(d.spec.intermediate_size),
      static_cast<long long>(d.spec.num_hidden_layers),
      static_cast<long long>(d.spec.num_attention_heads),
      static_cast<long long>(d.spec.num_key_value_heads),
      d.spec.tie_word_embeddings ? "tied" : "untied", static_cast<long long>(g.batch),
      static_cast<long long>(t), peak_text);
  if (d.lora_rank > 0) {
    std::printf(
        "LoRA rank %lld, alpha %lld, targets %s: base frozen, FLOPs a token 4 x %lld base + 6 x "
        "%lld adapter params + attention %lld\n",
        static_cast<long long>(d.lora_rank), static_cast<long long>(2 * d.lora_rank),
        absl::StrJoin(d.lora_targets, ",").c_str(), static_cast<long long>(sb.frozen_flop_params),
        static_cast<long long>(sb.flop_params), static_cast<long long>(sb.attention_flops));
  }
  return BenchSequenceModel(device, sb, warmup, steps);
}

int BenchSequenceModel(const std::string& device, const SequenceBench& sb, int warmup, int steps) {
  namespace m = ampd::engine::model;
  double peak = sb.peak_tflops;
  if (peak < 0) peak = device.rfind("cuda", 0) == 0 ? 989.4 : 0;
  const int64_t t = sb.seq_len;
  const int64_t n = sb.flop_params;
  const double tokens = static_cast<double>(sb.batch * t);
  const double flops =
      (6.0 * static_cast<double>(n) + 4.0 * static_cast<double>(sb.frozen_flop_params) +
       static_cast<double>(sb.attention_flops)) *
      tokens;
  std::mt19937_64 rng(1);
  StepInput input;
  input.micro_batches.push_back(
      MicroBatch{RandomIds(sb.batch, t, sb.vocab, rng), RandomIds(sb.batch, t, sb.vocab, rng)});
  for (const absl::string_view name : absl::StrSplit(sb.precisions, ',', absl::SkipEmpty())) {
    Precision precision;
    if (name == "fp32") {
      precision = Precision::kFp32;
    } else if (name == "fp16") {
      precision = Precision::kFp16;
    } else if (name == "bf16") {
      precision = Precision::kBf16;
    } else {
      std::fprintf(stderr, "--precisions: expected fp32, fp16 or bf16, got %s\n",
                   std::string(name).c_str());
      return 2;
    }
    JobConfig config = ampd::engine::DefaultJobConfig(precision);
    config.model = sb.model;
    config.optimizer.adam.lr = 6e-4f;
    config.optimizer.adam.beta1 = 0.9f;
    config.optimizer.adam.beta2 = 0.95f;
    config.optimizer.adam.weight_decay = 0.1f;
    auto backend = ampd::kernels::CreateBackend(device);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    auto trainer = ampd::engine::Trainer::Create(config, *std::move(backend));
    if (!trainer.ok()) {
      std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
      return 1;
    }
    std::vector<double> times, fwd, bwd, unscale, opt;
    float last_loss = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = Clock::now();
      auto r = (*trainer)->Step(input);
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      last_loss = r->loss;
      if (s >= warmup) {
        times.push_back(seconds);
        fwd.push_back(r->seconds.forward);
        bwd.push_back(r->seconds.backward);
        unscale.push_back(r->seconds.unscale);
        opt.push_back(r->seconds.optimizer);
      }
    }
    const double median = Median(times);
    const double tflops = flops / median / 1e12;
    char mfu[32] = "MFU n/a";
    if (peak > 0) std::snprintf(mfu, sizeof(mfu), "MFU %5.1f%%", 100.0 * tflops / peak);
    char params[80];
    if (sb.frozen_flop_params > 0) {
      std::snprintf(params, sizeof(params), "%lld base + %lld adapter params",
                    static_cast<long long>(sb.frozen_flop_params), static_cast<long long>(n));
    } else {
      std::snprintf(params, sizeof(params), "%lld params", static_cast<long long>(n));
    }
    std::printf("%-5s step median %9.3f ms  %10.0f tokens/s  %7.2f TFLOP/s  %s  (%s, loss %.4f)\n",
                std::string(name).c_str(), median * 1e3, tokens / median, tflops, mfu, params,
                static_cast<double>(last_loss));
    // Where the step's wall time goes, as the Trainer reports it (host
    // clocks around each phase; on a GPU, queued work shows up in the phase
    // that waits for it).
    std::printf("      phases: forward %.3f, backward %.3f, unscale %.3f, optimizer %.3f ms\n",
                Median(fwd) * 1e3, Median(bwd) * 1e3, Median(unscale) * 1e3, Median(opt) * 1e3);
    std::fflush(stdout);
  }
  return 0;
}

struct TokenBench {
  int64_t vocab = 32768, width = 4096, depth = 4, tokens = 8192;
  std::string precisions = "fp16,bf16";
};

// The service benchmark's token model in process: Embedding(V, D), depth x
// (Linear D->D, GELU), Linear D->V, cross-entropy over `tokens` random ids,
// AdamW. Prints service_bench's line (median step, TFLOP/s of the Linear
// GEMMs, 6 x Linear parameters x rows, rows/s) and the phase times.
int BenchToken(const std::string& device, const TokenBench& tb, int warmup, int steps) {
  namespace m = ampd::engine::model;
  std::printf(
      "device: %s\ntoken model: Embedding(%lld, %lld), %lld x (Linear %lld->%lld, GELU), Linear "
      "%lld->%lld, cross-entropy, %lld tokens/step, in-process Trainer\n",
      device.c_str(), static_cast<long long>(tb.vocab), static_cast<long long>(tb.width),
      static_cast<long long>(tb.depth), static_cast<long long>(tb.width),
      static_cast<long long>(tb.width), static_cast<long long>(tb.width),
      static_cast<long long>(tb.vocab), static_cast<long long>(tb.tokens));
  std::mt19937_64 rng(1);
  StepInput input;
  ampd::engine::HostTensor ids = RandomIds(1, tb.tokens, tb.vocab, rng);
  ampd::engine::HostTensor targets = RandomIds(1, tb.tokens, tb.vocab, rng);
  ids.shape = {tb.tokens};
  targets.shape = {tb.tokens};
  input.micro_batches.push_back(MicroBatch{std::move(ids), std::move(targets)});
  const double linear_params =
      static_cast<double>(tb.depth * tb.width * tb.width + tb.width * tb.vocab);
  for (const absl::string_view name : absl::StrSplit(tb.precisions, ',', absl::SkipEmpty())) {
    Precision precision;
    if (name == "fp32") {
      precision = Precision::kFp32;
    } else if (name == "fp16") {
      precision = Precision::kFp16;
    } else if (name == "bf16") {
      precision = Precision::kBf16;
    } else {
      std::fprintf(stderr, "--precisions: expected fp32, fp16 or bf16\n");
      return 2;
    }
    JobConfig config = ampd::engine::DefaultJobConfig(precision);
    m::LayerSpec embedding;
    embedding.kind = m::LayerKind::kEmbedding;
    embedding.num_embeddings = tb.vocab;
    embedding.embedding_dim = tb.width;
    config.model.layers.push_back(embedding);
    auto linear = [&config](int64_t in, int64_t out) {
      m::LayerSpec l;
      l.kind = m::LayerKind::kLinear;
      l.in_features = in;
      l.out_features = out;
      config.model.layers.push_back(l);
    };
    for (int64_t i = 0; i < tb.depth; ++i) {
      linear(tb.width, tb.width);
      m::LayerSpec gelu;
      gelu.kind = m::LayerKind::kGELU;
      config.model.layers.push_back(gelu);
    }
    linear(tb.width, tb.vocab);
    config.model.loss = m::LossKind::kCrossEntropy;
    auto backend = ampd::kernels::CreateBackend(device);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    auto trainer = ampd::engine::Trainer::Create(config, *std::move(backend));
    if (!trainer.ok()) {
      std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
      return 1;
    }
    std::vector<double> times, fwd, bwd, unscale, opt;
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = Clock::now();
      auto r = (*trainer)->Step(input);
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      if (s < warmup) continue;
      times.push_back(seconds);
      fwd.push_back(r->seconds.forward);
      bwd.push_back(r->seconds.backward);
      unscale.push_back(r->seconds.unscale);
      opt.push_back(r->seconds.optimizer);
    }
    const double median = Median(times);
    std::printf("%-5s step median %9.3f ms  %8.1f TFLOP/s  %10.0f rows/s\n",
                std::string(name).c_str(), median * 1e3,
                6.0 * linear_params * static_cast<double>(tb.tokens) / median / 1e12,
                static_cast<double>(tb.tokens) / median);
    std::printf("      phases: forward %.3f, backward %.3f, unscale %.3f, optimizer %.3f ms\n",
                Median(fwd) * 1e3, Median(bwd) * 1e3, Median(unscale) * 1e3, Median(opt) * 1e3);
    std::fflush(stdout);
  }
  return 0;
}

// "--name=value" with an integer >= 1; false when `a` is not that flag.
bool PositiveFlag(const std::string& a, const std::string& name, int64_t* out, bool* bad) {
  const std::string prefix = "--" + name + "=";
  if (a.rfind(prefix, 0) != 0) return false;
  if (!absl::SimpleAtoi(a.substr(prefix.size()), out) || *out < 1) *bad = true;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cpu";
  int steps = 10, warmup = 3;
  bool create = false, gpt = false, token = false, decoder = false, bad = false,
       steps_given = false, warmup_given = false, vocab_given = false, lora_targets_given = false;
  GptBench g;
  DecoderBench d;
  TokenBench tb;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model=gpt") {
      gpt = true;
    } else if (a == "--model=token") {
      token = true;
    } else if (a == "--model=decoder") {
      decoder = true;
    } else if (PositiveFlag(a, "hidden", &d.spec.hidden_size, &bad) ||
               PositiveFlag(a, "intermediate", &d.spec.intermediate_size, &bad) ||
               PositiveFlag(a, "layers", &d.spec.num_hidden_layers, &bad) ||
               PositiveFlag(a, "heads", &d.spec.num_attention_heads, &bad) ||
               PositiveFlag(a, "kv-heads", &d.spec.num_key_value_heads, &bad)) {
    } else if (a == "--untied") {
      d.spec.tie_word_embeddings = false;
    } else if (PositiveFlag(a, "lora-rank", &d.lora_rank, &bad)) {
    } else if (a.rfind("--lora-targets=", 0) == 0) {
      d.lora_targets = absl::StrSplit(a.substr(15), ',', absl::SkipEmpty());
      lora_targets_given = true;
    } else if (a == "--model=mlp") {
      gpt = false;
    } else if (PositiveFlag(a, "vocab", &g.spec.vocab_size, &bad)) {
      vocab_given = true;
    } else if (PositiveFlag(a, "width", &tb.width, &bad) ||
               PositiveFlag(a, "depth", &tb.depth, &bad) ||
               PositiveFlag(a, "tokens", &tb.tokens, &bad) ||
               PositiveFlag(a, "context", &g.spec.context_length, &bad) ||
               PositiveFlag(a, "d-model", &g.spec.d_model, &bad) ||
               PositiveFlag(a, "n-layer", &g.spec.n_layer, &bad) ||
               PositiveFlag(a, "n-head", &g.spec.n_head, &bad) ||
               PositiveFlag(a, "batch", &g.batch, &bad) ||
               PositiveFlag(a, "seq-len", &g.seq_len, &bad)) {
    } else if (a.rfind("--precisions=", 0) == 0) {
      g.precisions = a.substr(13);
      tb.precisions = g.precisions;
    } else if (a.rfind("--peak-tflops=", 0) == 0) {
      bad = bad || !absl::SimpleAtod(a.substr(14), &g.peak_tflops) || g.peak_tflops < 0;
    } else if (a.rfind("--device=", 0) == 0) {
      device = a.substr(9);
    } else if (a.rfind("--steps=", 0) == 0) {
      steps = std::max(1, std::atoi(a.c_str() + 8));
      steps_given = true;
    } else if (a.rfind("--warmup=", 0) == 0) {
      warmup = std::max(0, std::atoi(a.c_str() + 9));
      warmup_given = true;
    } else if (a == "--create") {
      create = true;
    } else {
      bad = true;
    }
  }
  if (bad) {
    std::fprintf(stderr,
                 "usage: %s [--device=cpu|cuda:N] [--steps=N] [--warmup=N] [--create]\n"
                 "       %s --model=gpt [--device=..] [--precisions=bf16,fp16] [--vocab=V] "
                 "[--context=C] [--d-model=D] [--n-layer=L] [--n-head=H] [--batch=B] "
                 "[--seq-len=T] [--peak-tflops=P]\n"
                 "       %s --model=token [--device=..] [--precisions=fp16,bf16] [--vocab=V] "
                 "[--width=D] [--depth=L] [--tokens=N]\n"
                 "       %s --model=decoder [--device=..] [--precisions=bf16,fp16] [--vocab=V] "
                 "[--hidden=C] [--intermediate=I] [--layers=L] [--heads=H] [--kv-heads=K] "
                 "[--untied] [--batch=B] [--seq-len=T] [--peak-tflops=P] [--lora-rank=R "
                 "[--lora-targets=q_proj,k_proj,v_proj,o_proj]]\n",
                 argv[0], argv[0], argv[0], argv[0]);
    return 2;
  }
  if ((d.lora_rank > 0 || lora_targets_given) && !decoder) {
    std::fprintf(stderr, "--lora-rank and --lora-targets: only with --model=decoder\n");
    return 2;
  }
  if (lora_targets_given && d.lora_rank == 0) {
    std::fprintf(stderr, "--lora-targets: needs --lora-rank\n");
    return 2;
  }
  if (token) {
    if (vocab_given) tb.vocab = g.spec.vocab_size;
    return BenchToken(device, tb, warmup_given ? warmup : 3, steps_given ? steps : 20);
  }
  if (decoder) {
    if (vocab_given) d.spec.vocab_size = g.spec.vocab_size;
    const int64_t t = g.seq_len > 0 ? g.seq_len : d.spec.max_position_embeddings;
    if (g.batch > (int64_t{1} << 30) / t) {
      std::fprintf(stderr, "--batch x --seq-len must be <= 2^30\n");
      return 2;
    }
    return BenchDecoder(device, d, g, warmup_given ? warmup : 5, steps_given ? steps : 20);
  }
  if (gpt) {
    const int64_t t = g.seq_len > 0 ? g.seq_len : g.spec.context_length;
    if (t > g.spec.context_length || g.batch > (int64_t{1} << 30) / t) {
      std::fprintf(stderr, "--seq-len must be <= --context and --batch x --seq-len <= 2^30\n");
      return 2;
    }
    return BenchGpt(device, g, warmup_given ? warmup : 5, steps_given ? steps : 20);
  }
  if (create) return BenchCreate(device, std::max(1, steps));
  std::printf(
      "reference MLP: %lld x Linear(%lld, %lld), GELU between, batch %lld, MSE, AdamW; "
      "device %s, %d warm-up + %d timed steps\n",
      static_cast<long long>(kLayers), static_cast<long long>(kWidth),
      static_cast<long long>(kWidth), static_cast<long long>(kBatch), device.c_str(), warmup,
      steps);
  std::mt19937_64 rng(1);
  StepInput input;
  input.micro_batches.push_back(
      MicroBatch{RandomF32(kBatch, kWidth, rng, 1.0f), RandomF32(kBatch, kWidth, rng, 0.1f)});
  if (BenchUpload(device, input.micro_batches[0], warmup, steps) != 0) return 1;
  for (Precision precision : {Precision::kFp32, Precision::kFp16, Precision::kBf16}) {
    auto backend = ampd::kernels::CreateBackend(device);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    auto trainer = ampd::engine::Trainer::Create(ReferenceConfig(precision), *std::move(backend));
    if (!trainer.ok()) {
      std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
      return 1;
    }
    std::vector<double> total, fwd, bwd, unscale, opt;
    float last_loss = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      auto r = (*trainer)->Step(input);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      last_loss = r->loss;
      if (s < warmup) continue;
      total.push_back(r->seconds.total);
      fwd.push_back(r->seconds.forward);
      bwd.push_back(r->seconds.backward);
      unscale.push_back(r->seconds.unscale);
      opt.push_back(r->seconds.optimizer);
    }
    const double t = Median(total);
    std::printf(
        "%s: median step %.2f ms, %.1f samples/s (forward %.2f, backward %.2f, "
        "unscale %.2f, optimizer %.2f ms; last loss %.5f)\n",
        std::string(ampd::engine::model::PrecisionName(precision)).c_str(), t * 1e3,
        static_cast<double>(kBatch) / t, Median(fwd) * 1e3, Median(bwd) * 1e3,
        Median(unscale) * 1e3, Median(opt) * 1e3, static_cast<double>(last_loss));
    if (BenchAdam(device, precision, warmup, steps) != 0) return 1;
  }
  return 0;
}
