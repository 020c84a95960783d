// ampd_bench_service: drives a running ampd over gRPC, as a client would,
// and prints what a user of the service sees: CreateJob time, the first
// step, median step time and TFLOP/s, state-dict export/import GB/s, and
// the steps/s of N small jobs stepping concurrently. Four models:
//
//   token: Embedding(V, D), depth x (Linear D->D, GELU), Linear D->V,
//          cross-entropy over T tokens a step (ids I32). Defaults are the
//          335M-parameter model of the H100 comparison (V 32768, D 4096,
//          depth 4, T 8192); bench/pytorch/token_model.py is its PyTorch peer.
//   mlp:   the reference MLP, 4 x Linear(1024, 1024) with GELU between,
//          batch 256, MSE (bench/pytorch/amp_mlp.py's peer).
//   gpt:   a GPT-2 (ModelSpec.gpt), GPT-2 small by default (vocab 50304,
//          context 1024, d_model 768, 12 layers, 12 heads), micro-batch
//          8 x 1024 random tokens, AdamW(lr 6e-4, betas (0.9, 0.95), weight
//          decay 0.1); bench/pytorch/gpt.py is its PyTorch peer, and its
//          lines have the peer's format: tokens/s and MFU.
//   decoder: a Qwen2-style decoder (ModelSpec.decoder), Qwen2.5-0.5B's shape
//          by default (vocab 151936, hidden 896, intermediate 4864, 24
//          layers, 14 heads, 2 K/V heads, tied, q/k/v biases), 8 x 1024
//          random tokens, the GPT's optimizer; bench/pytorch/decoder.py's peer.
//
// TFLOP/s counts the GEMMs only: 6 x (Linear parameters) x rows, i.e. the
// forward product and the two backward products of every Linear layer. For
// the GPT it is gpt.py's count: 6 N + 12 n_layer T d_model per token (N:
// every parameter but the position table; the attention's QK^T and PV over
// the full T x T), and MFU divides it by --peak_tflops; for the decoder
// decoder.py's, 6 N + 12 L T (heads x head width). --decoder_lora_rank=R
// makes the decoder a LoRA fine-tune (alpha 2R; targets q/k/v/o_proj or
// --decoder_lora_targets): the frozen base runs its forward and its input
// gradients but no weight gradients, so 4 N_base + 6 N_adapters + the
// attention's, as decoder.py --lora-rank counts.
// Prints figures; it never passes or fails.
//
//   ampd_bench_service --server=127.0.0.1:50051 [--model=token|mlp]
//       [--precisions=fp16,bf16,fp32] [--steps=20] [--warmup=3]
//       [--vocab=32768 --width=4096 --depth=4 --tokens=8192]
//       [--concurrent=1,4,16] [--concurrent_steps=50] [--state=true]
//   ampd_bench_service --model=gpt --precisions=bf16,fp16 --concurrent= [--gpt_vocab=50304
//       --gpt_context=1024 --gpt_d_model=768 --gpt_n_layer=12 --gpt_n_head=12
//       --gpt_batch=8 --gpt_seq_len=1024] [--peak_tflops=989.4]
//   ampd_bench_service --model=decoder --precisions=bf16,fp16 --concurrent= [--decoder_vocab=151936
//       --decoder_hidden=896 --decoder_intermediate=4864 --decoder_layers=24 --decoder_heads=14
//       --decoder_kv_heads=2 --decoder_batch=8 --decoder_seq_len=1024] [--peak_tflops=989.4]
//       [--decoder_lora_rank=16 [--decoder_lora_targets=q_proj,k_proj,v_proj,o_proj]]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "ampd's gRPC address");
ABSL_FLAG(std::string, model, "token", "token, mlp, gpt or decoder");
ABSL_FLAG(std::string, precisions, "fp16,bf16,fp32", "comma-separated: fp16, bf16, fp32");
ABSL_FLAG(int, steps, 20, "timed steps per precision");
ABSL_FLAG(int, warmup, 3, "untimed steps after the first");
ABSL_FLAG(int64_t, vocab, 32768, "token model: vocabulary (embedding rows, classes)");
ABSL_FLAG(int64_t, width, 4096, "token model: hidden width D");
ABSL_FLAG(int64_t, depth, 4, "token model: hidden Linear+GELU layers");
ABSL_FLAG(int64_t, tokens, 8192, "token model: tokens (rows) per step");
ABSL_FLAG(int64_t, gpt_vocab, 50304, "gpt: vocab_size");
ABSL_FLAG(int64_t, gpt_context, 1024, "gpt: context_length");
ABSL_FLAG(int64_t, gpt_d_model, 768, "gpt: d_model");
ABSL_FLAG(int64_t, gpt_n_layer, 12, "gpt: n_layer");
ABSL_FLAG(int64_t, gpt_n_head, 12, "gpt: n_head");
ABSL_FLAG(int64_t, gpt_batch, 8, "gpt: sequences per step");
ABSL_FLAG(int64_t, gpt_seq_len, 0, "gpt: tokens per sequence (0: the context)");
ABSL_FLAG(int64_t, decoder_vocab, 151936, "decoder: vocab_size");
ABSL_FLAG(int64_t, decoder_hidden, 896, "decoder: hidden_size");
ABSL_FLAG(int64_t, decoder_intermediate, 4864, "decoder: intermediate_size");
ABSL_FLAG(int64_t, decoder_layers, 24, "decoder: num_hidden_layers");
ABSL_FLAG(int64_t, decoder_heads, 14, "decoder: num_attention_heads");
ABSL_FLAG(int64_t, decoder_kv_heads, 2, "decoder: num_key_value_heads");
ABSL_FLAG(int64_t, decoder_batch, 8, "decoder: sequences per step");
ABSL_FLAG(int64_t, decoder_seq_len, 1024, "decoder: tokens per sequence");
ABSL_FLAG(int64_t, decoder_lora_rank, 0,
          "decoder: LoRA rank (alpha 2 x rank, base frozen); 0: full fine-tuning");
ABSL_FLAG(std::string, decoder_lora_targets, "q_proj,k_proj,v_proj,o_proj",
          "decoder: the projections LoRA adapts, comma-separated");
ABSL_FLAG(double, peak_tflops, 989.4,
          "gpt: the device's dense peak for MFU (989.4: H100 SXM bf16; 0 prints no MFU)");
ABSL_FLAG(std::string, concurrent, "1,4,16", "small-job counts for the concurrency run ('' skips)");
ABSL_FLAG(int, concurrent_steps, 50, "steps each small job takes in the concurrency run");
ABSL_FLAG(std::string, concurrent_model, "mlp",
          "the concurrency run's jobs: mlp (the reference MLP, fp16) or io (a Linear(1024, 1) "
          "in fp32 fed a 2 MB F32 batch, as the MLP's: next to no compute, so the steps/s "
          "measure the service's own per-step cost)");
ABSL_FLAG(bool, share_connection, false,
          "concurrency run: every job's client on one channel (one HTTP/2 connection) instead of "
          "a connection each");
ABSL_FLAG(bool, state, true, "time GetStateDict and LoadStateDict of each job");

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

ampd::v1::Precision ParsePrecision(const std::string& name) {
  if (name == "fp32") return ampd::v1::PRECISION_FP32;
  if (name == "bf16") return ampd::v1::PRECISION_BF16;
  return ampd::v1::PRECISION_FP16;
}

void AddLinear(ampd::v1::ModelSpec& m, int64_t in, int64_t out) {
  ampd::v1::Linear* l = m.add_layers()->mutable_linear();
  l->set_in_features(in);
  l->set_out_features(out);
}

struct Workload {
  ampd::v1::ModelSpec model;
  ampd::v1::MicroBatch batch;  // one micro-batch, reused every step
  int64_t linear_params = 0;   // weights of the Linear layers (the GEMMs' size)
  int64_t rows = 0;            // samples (tokens) a step
  std::string name;
  double gpt_flops = 0;  // a GPT's FLOPs a step (gpt.py's count); 0 for the others
  // A LoRA decoder's frozen base (its linear_params are then the adapters').
  int64_t frozen_params = 0;
};

ampd::v1::Tensor RandomIds(int64_t n, int64_t vocab, std::mt19937_64& rng) {
  ampd::v1::Tensor t;
  t.set_dtype(ampd::v1::DTYPE_I32);
  t.add_shape(n);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  for (int32_t& id : ids) id = pick(rng);
  t.set_data(ids.data(), ids.size() * sizeof(int32_t));
  return t;
}

ampd::v1::Tensor RandomF32(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  ampd::v1::Tensor t;
  t.set_dtype(ampd::v1::DTYPE_F32);
  t.add_shape(rows);
  t.add_shape(cols);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : v) x = normal(rng);
  t.set_data(v.data(), v.size() * sizeof(float));
  return t;
}

Workload TokenWorkload(int64_t vocab, int64_t width, int64_t depth, int64_t tokens) {
  Workload w;
  w.name = absl::StrCat("token model: Embedding(", vocab, ", ", width, "), ", depth, " x (Linear ",
                        width, "->", width, ", GELU), Linear ", width, "->", vocab,
                        ", cross-entropy, ", tokens, " tokens/step");
  ampd::v1::Embedding* e = w.model.add_layers()->mutable_embedding();
  e->set_num_embeddings(vocab);
  e->set_embedding_dim(width);
  for (int64_t i = 0; i < depth; ++i) {
    AddLinear(w.model, width, width);
    w.model.add_layers()->mutable_gelu();
    w.linear_params += width * width;
  }
  AddLinear(w.model, width, vocab);
  w.linear_params += width * vocab;
  w.model.set_loss(ampd::v1::LOSS_CROSS_ENTROPY);
  std::mt19937_64 rng(1);
  *w.batch.mutable_inputs() = RandomIds(tokens, vocab, rng);
  *w.batch.mutable_targets() = RandomIds(tokens, vocab, rng);
  w.rows = tokens;
  return w;
}

// GPT-2 with gpt.py's optimizer; (B, T) random ids and targets.
Workload GptWorkload(int64_t vocab, int64_t context, int64_t d_model, int64_t n_layer,
                     int64_t n_head, int64_t batch, int64_t seq_len) {
  Workload w;
  ampd::v1::Gpt* g = w.model.mutable_gpt();
  g->set_vocab_size(vocab);
  g->set_context_length(context);
  g->set_d_model(d_model);
  g->set_n_layer(n_layer);
  g->set_n_head(n_head);
  w.model.set_loss(ampd::v1::LOSS_CROSS_ENTROPY);
  // Parameters that multiply: wte (the tied LM head's GEMM), the blocks, ln_f.
  const double c = static_cast<double>(d_model);
  const double block =
      4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c);
  const double n = static_cast<double>(vocab) * c + static_cast<double>(n_layer) * block + 2 * c;
  const double tokens = static_cast<double>(batch * seq_len);
  w.gpt_flops = (6 * n + 12.0 * static_cast<double>(n_layer * seq_len) * c) * tokens;
  w.linear_params = static_cast<int64_t>(n);
  w.name = absl::StrCat("gpt: vocab ", vocab, ", context ", context, ", d_model ", d_model, ", ",
                        n_layer, " layers, ", n_head, " heads, batch ", batch, " x ", seq_len,
                        " tokens, AdamW");
  std::mt19937_64 rng(1);
  for (ampd::v1::Tensor* t : {w.batch.mutable_inputs(), w.batch.mutable_targets()}) {
    *t = RandomIds(batch * seq_len, vocab, rng);
    t->clear_shape();
    t->add_shape(batch);
    t->add_shape(seq_len);
  }
  w.rows = batch * seq_len;
  return w;
}

// A Qwen2-style decoder (tied, q/k/v biases, rope_theta 1e6) with gpt.py's
// optimizer, as bench/pytorch/decoder.py builds it; (B, T) random ids and
// targets. FLOPs: decoder.py's count, 6 N + 12 L T (heads x head width);
// with LoRA (lora_rank > 0) 4 N + 6 N_adapters + 12 L T (heads x head width).
Workload DecoderWorkload(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                         int64_t heads, int64_t kv_heads, int64_t batch, int64_t seq_len,
                         int64_t lora_rank, const std::vector<std::string>& lora_targets) {
  Workload w;
  ampd::v1::Decoder* d = w.model.mutable_decoder();
  d->set_vocab_size(vocab);
  d->set_hidden_size(hidden);
  d->set_intermediate_size(inter);
  d->set_num_hidden_layers(layers);
  d->set_num_attention_heads(heads);
  d->set_num_key_value_heads(kv_heads);
  d->set_max_position_embeddings(seq_len);
  d->set_rope_theta(1000000.0f);
  d->set_tie_word_embeddings(true);
  d->set_qkv_bias(true);
  w.model.set_loss(ampd::v1::LOSS_CROSS_ENTROPY);
  const double c = static_cast<double>(hidden);
  const double head_dim = static_cast<double>(hidden / heads);
  const double q = static_cast<double>(heads) * head_dim;
  const double kv = static_cast<double>(kv_heads) * head_dim;
  const double qkv = q + 2 * kv;
  const double block = 2 * c + qkv * c + qkv + c * q + 3 * static_cast<double>(inter) * c;
  const double n = static_cast<double>(vocab) * c + static_cast<double>(layers) * block + c;
  const double tokens = static_cast<double>(batch * seq_len);
  const double attention = 12.0 * static_cast<double>(layers * seq_len) * q;
  w.gpt_flops = (6 * n + attention) * tokens;
  w.linear_params = static_cast<int64_t>(n);
  w.name = absl::StrCat("decoder: vocab ", vocab, ", hidden ", hidden, ", intermediate ", inter,
                        ", ", layers, " layers, ", heads, " heads / ", kv_heads,
                        " kv heads, tied, batch ", batch, " x ", seq_len, " tokens, AdamW");
  if (lora_rank > 0) {
    ampd::v1::LoRA* lora = d->mutable_lora();
    lora->set_rank(lora_rank);
    lora->set_alpha(2.0f * static_cast<float>(lora_rank));
    // Each target's rank x (in + out) a layer (the server's
    // LoraParameterCount); an unknown name counts 0 here and CreateJob
    // rejects it, naming the field.
    const double i = static_cast<double>(inter);
    double adapters = 0;
    for (const std::string& target : lora_targets) {
      lora->add_target_modules(target);
      const double in_out = target == "q_proj"                             ? c + q
                            : target == "k_proj" || target == "v_proj"     ? c + kv
                            : target == "o_proj"                           ? q + c
                            : target == "gate_proj" || target == "up_proj" ? c + i
                            : target == "down_proj"                        ? i + c
                                                                           : 0;
      adapters += static_cast<double>(lora_rank) * in_out;
    }
    adapters *= static_cast<double>(layers);
    w.gpt_flops = (4 * n + 6 * adapters + attention) * tokens;
    w.frozen_params = static_cast<int64_t>(n);
    w.linear_params = static_cast<int64_t>(adapters);
    absl::StrAppend(&w.name, ", LoRA rank ", lora_rank, ", alpha ", 2 * lora_rank, ", targets ",
                    absl::StrJoin(lora_targets, ","),
                    " (base frozen; FLOPs a token 4 x base + 6 x adapter params + attention)");
  }
  std::mt19937_64 rng(1);
  for (ampd::v1::Tensor* t : {w.batch.mutable_inputs(), w.batch.mutable_targets()}) {
    *t = RandomIds(batch * seq_len, vocab, rng);
    t->clear_shape();
    t->add_shape(batch);
    t->add_shape(seq_len);
  }
  w.rows = batch * seq_len;
  return w;
}

// The MLP's payload (2 MB of F32 a step) with next to no compute: inputs
// (512, 1024) and targets (512, 1) through one Linear(1024, 1), so the
// step's rate is the service's own per-step cost (receiving, checking and
// uploading the batch) rather than the model's.
Workload IoWorkload() {
  constexpr int64_t kWidth = 1024, kBatch = 512;
  Workload w;
  w.name = "io: Linear(1024, 1), batch 512 x 1024 F32 inputs (2 MB), MSE";
  AddLinear(w.model, kWidth, 1);
  w.linear_params = kWidth;
  w.model.set_loss(ampd::v1::LOSS_MSE);
  std::mt19937_64 rng(1);
  *w.batch.mutable_inputs() = RandomF32(kBatch, kWidth, rng);
  *w.batch.mutable_targets() = RandomF32(kBatch, 1, rng);
  w.rows = kBatch;
  return w;
}

Workload MlpWorkload() {
  constexpr int64_t kWidth = 1024, kLayers = 4, kBatch = 256;
  Workload w;
  w.name = "reference MLP: 4 x Linear(1024, 1024), GELU between, batch 256, MSE";
  for (int64_t i = 0; i < kLayers; ++i) {
    if (i > 0) w.model.add_layers()->mutable_gelu();
    AddLinear(w.model, kWidth, kWidth);
    w.linear_params += kWidth * kWidth;
  }
  w.model.set_loss(ampd::v1::LOSS_MSE);
  std::mt19937_64 rng(1);
  *w.batch.mutable_inputs() = RandomF32(kBatch, kWidth, rng);
  *w.batch.mutable_targets() = RandomF32(kBatch, kWidth, rng);
  w.rows = kBatch;
  return w;
}

absl::StatusOr<ampd::v1::Job> Create(ampd::Client& client, const Workload& w,
                                     ampd::v1::Precision precision, const std::string& name) {
  ampd::v1::CreateJobRequest request;
  *request.mutable_config()->mutable_model() = w.model;
  request.mutable_config()->set_precision(precision);
  request.mutable_config()->set_display_name(name);
  ampd::v1::OptimizerConfig* o = request.mutable_config()->mutable_optimizer();
  if (w.model.has_gpt() || w.model.has_decoder()) {
    o->set_kind(ampd::v1::OPTIMIZER_ADAMW);
    o->set_lr(6e-4f);
    o->set_beta1(0.9f);
    o->set_beta2(0.95f);
    o->set_weight_decay(0.1f);
  } else {
    o->set_lr(1e-4f);
  }
  request.mutable_config()->set_seed(1);
  return client.CreateJob(std::move(request));
}

// The round trip's seconds; *engine_seconds (when given) gets the step's
// own time as the server reports it (timings.total_seconds).
absl::StatusOr<double> TimedStep(ampd::Client& client, ampd::v1::StepRequest& request,
                                 int64_t sequence, float* loss = nullptr,
                                 double* engine_seconds = nullptr) {
  request.set_sequence(sequence);
  const Clock::time_point t0 = Clock::now();
  AMPD_ASSIGN_OR_RETURN(ampd::v1::StepResponse r, client.Step(request));
  if (loss != nullptr) *loss = r.loss();
  if (engine_seconds != nullptr) *engine_seconds = r.timings().total_seconds();
  return Since(t0);
}

absl::Status RunPrecision(ampd::Client& client, const Workload& w, const std::string& precision) {
  const Clock::time_point t_create = Clock::now();
  AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job, Create(client, w, ParsePrecision(precision),
                                                  absl::StrCat("bench-", precision)));
  const double create_s = Since(t_create);
  ampd::v1::StepRequest request;
  request.set_job_id(job.job_id());
  *request.add_micro_batches() = w.batch;
  int64_t sequence = 0;
  AMPD_ASSIGN_OR_RETURN(double first, TimedStep(client, request, ++sequence));
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    AMPD_RETURN_IF_ERROR(TimedStep(client, request, ++sequence).status());
  }
  std::vector<double> times;
  float loss = 0;
  for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    AMPD_ASSIGN_OR_RETURN(double t, TimedStep(client, request, ++sequence, &loss));
    times.push_back(t);
  }
  const double median = Median(times);
  if (w.gpt_flops > 0) {
    const double tflops = w.gpt_flops / median / 1e12;
    const double peak = absl::GetFlag(FLAGS_peak_tflops);
    const std::string mfu =
        peak > 0 ? absl::StrFormat("MFU %5.1f%%", 100.0 * tflops / peak) : "MFU n/a";
    const std::string params =
        w.frozen_params > 0
            ? absl::StrCat(w.frozen_params, " base + ", w.linear_params, " adapter params")
            : absl::StrCat(w.linear_params, " params");
    std::printf(
        "%-5s step median %9.3f ms  %10.0f tokens/s  %7.2f TFLOP/s  %s  (%s, "
        "loss %.4f)\n      create %.3f s, first step %.3f s\n",
        precision.c_str(), median * 1e3, static_cast<double>(w.rows) / median, tflops, mfu.c_str(),
        params.c_str(), loss, create_s, first);
  } else {
    const double tflops =
        6.0 * static_cast<double>(w.linear_params) * static_cast<double>(w.rows) / median / 1e12;
    std::printf(
        "%-5s create %8.3f s  first step %8.3f s  step median %9.3f ms  %8.1f TFLOP/s  "
        "%10.0f rows/s\n",
        precision.c_str(), create_s, first, median * 1e3, tflops,
        static_cast<double>(w.rows) / median);
  }
  if (absl::GetFlag(FLAGS_state)) {
    const Clock::time_point t_export = Clock::now();
    AMPD_ASSIGN_OR_RETURN(std::string state, client.GetStateDict(job.job_id()));
    const double export_s = Since(t_export);
    const Clock::time_point t_import = Clock::now();
    AMPD_RETURN_IF_ERROR(client.LoadStateDict(job.job_id(), state).status());
    const double import_s = Since(t_import);
    const double gb = static_cast<double>(state.size()) / 1e9;
    std::printf("      state dict %.3f GB: export %.3f s (%.2f GB/s), import %.3f s (%.2f GB/s)\n",
                gb, export_s, gb / export_s, import_s, gb / import_s);
  }
  std::fflush(stdout);
  return client.DeleteJob(job.job_id());
}

// n small jobs (the reference MLP, or the io model), one client thread each,
// stepping at once; each client on a connection of its own unless
// --share_connection.
absl::Status RunConcurrent(const std::string& server, int n, int steps) {
  const bool io = absl::GetFlag(FLAGS_concurrent_model) == "io";
  const Workload w = io ? IoWorkload() : MlpWorkload();
  // fp32 for the io model: no casts of the batch, the least compute a step.
  const ampd::v1::Precision precision = io ? ampd::v1::PRECISION_FP32 : ampd::v1::PRECISION_FP16;
  std::vector<std::unique_ptr<ampd::Client>> clients;
  std::vector<std::string> ids;
  const std::unique_ptr<ampd::Client> shared = ampd::Client::Connect(server);
  for (int i = 0; i < n; ++i) {
    clients.push_back(absl::GetFlag(FLAGS_share_connection)
                          ? std::make_unique<ampd::Client>(shared->channel(), ampd::ClientOptions())
                          : ampd::Client::Connect(server));
    AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job, Create(*clients.back(), w, precision,
                                                    absl::StrCat("bench-concurrent-", i)));
    ids.push_back(job.job_id());
  }
  std::vector<absl::Status> results(static_cast<size_t>(n));
  // One warm-up step each (workspaces), outside the timed window.
  for (int i = 0; i < n; ++i) {
    ampd::v1::StepRequest request;
    request.set_job_id(ids[i]);
    *request.add_micro_batches() = w.batch;
    AMPD_RETURN_IF_ERROR(TimedStep(*clients[i], request, 1).status());
  }
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> threads;
  // Per job: the sums of the round trips and of the server's step times.
  std::vector<double> round_trip(static_cast<size_t>(n)), engine(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ampd::v1::StepRequest request;
      request.set_job_id(ids[i]);
      *request.add_micro_batches() = w.batch;
      for (int s = 0; s < steps; ++s) {
        double engine_s = 0;
        absl::StatusOr<double> t = TimedStep(*clients[i], request, 2 + s, nullptr, &engine_s);
        if (!t.ok()) {
          results[i] = t.status();
          return;
        }
        round_trip[i] += *t;
        engine[i] += engine_s;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = Since(t0);
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  double round_trip_sum = 0, engine_sum = 0;
  for (int i = 0; i < n; ++i) {
    round_trip_sum += round_trip[i];
    engine_sum += engine[i];
  }
  const double per_step = static_cast<double>(n) * steps;
  // The step time the engine reports against the whole round trip: the
  // difference is the service's (and, with many jobs, the queueing's).
  std::printf(
      "%3d concurrent small jobs (%s%s): %8.1f steps/s in all  (round trip %.3f ms, of "
      "which the engine's step %.3f ms)\n",
      n, io ? "io model, fp32" : "reference MLP, fp16",
      absl::GetFlag(FLAGS_share_connection) ? ", one connection" : "", per_step / seconds,
      1e3 * round_trip_sum / per_step, 1e3 * engine_sum / per_step);
  std::fflush(stdout);
  for (int i = 0; i < n; ++i) (void)clients[i]->DeleteJob(ids[i]);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string server = absl::GetFlag(FLAGS_server);
  ampd::ClientOptions options;
  options.deadline = absl::Minutes(10);  // large models: creation and state transfer
  std::unique_ptr<ampd::Client> client = ampd::Client::Connect(server, options);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model != "token" && model != "mlp" && model != "gpt" && model != "decoder") {
    std::fprintf(stderr, "ampd_bench_service: --model must be token, mlp, gpt or decoder, got %s\n",
                 model.c_str());
    return 2;
  }
  const int64_t seq_len = absl::GetFlag(FLAGS_gpt_seq_len) > 0 ? absl::GetFlag(FLAGS_gpt_seq_len)
                                                               : absl::GetFlag(FLAGS_gpt_context);
  if (model == "gpt" && (absl::GetFlag(FLAGS_gpt_batch) < 1 || seq_len < 1 ||
                         absl::GetFlag(FLAGS_gpt_batch) > (int64_t{1} << 30) / seq_len)) {
    std::fprintf(stderr, "ampd_bench_service: --gpt_batch x --gpt_seq_len must be in [1, 2^30]\n");
    return 2;
  }
  const int64_t decoder_batch = absl::GetFlag(FLAGS_decoder_batch);
  const int64_t decoder_seq = absl::GetFlag(FLAGS_decoder_seq_len);
  if (model == "decoder" &&
      (decoder_batch < 1 || decoder_seq < 1 || decoder_batch > (int64_t{1} << 30) / decoder_seq)) {
    std::fprintf(stderr,
                 "ampd_bench_service: --decoder_batch x --decoder_seq_len must be in [1, 2^30]\n");
    return 2;
  }
  const int64_t lora_rank = absl::GetFlag(FLAGS_decoder_lora_rank);
  if (lora_rank < 0 || (lora_rank > 0 && model != "decoder")) {
    std::fprintf(stderr,
                 "ampd_bench_service: --decoder_lora_rank must be >= 0, and only with "
                 "--model=decoder\n");
    return 2;
  }
  const std::vector<std::string> lora_targets =
      absl::StrSplit(absl::GetFlag(FLAGS_decoder_lora_targets), ',', absl::SkipEmpty());
  if (lora_rank > 0 && lora_targets.empty()) {
    // (The wire's empty list means the default four; the FLOP count would not.)
    std::fprintf(stderr, "ampd_bench_service: --decoder_lora_targets must name a projection\n");
    return 2;
  }
  const Workload w =
      model == "mlp" ? MlpWorkload()
      : model == "decoder"
          ? DecoderWorkload(absl::GetFlag(FLAGS_decoder_vocab), absl::GetFlag(FLAGS_decoder_hidden),
                            absl::GetFlag(FLAGS_decoder_intermediate),
                            absl::GetFlag(FLAGS_decoder_layers), absl::GetFlag(FLAGS_decoder_heads),
                            absl::GetFlag(FLAGS_decoder_kv_heads), decoder_batch, decoder_seq,
                            lora_rank, lora_targets)
      : model == "gpt"
          ? GptWorkload(absl::GetFlag(FLAGS_gpt_vocab), absl::GetFlag(FLAGS_gpt_context),
                        absl::GetFlag(FLAGS_gpt_d_model), absl::GetFlag(FLAGS_gpt_n_layer),
                        absl::GetFlag(FLAGS_gpt_n_head), absl::GetFlag(FLAGS_gpt_batch), seq_len)
          : TokenWorkload(absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_width),
                          absl::GetFlag(FLAGS_depth), absl::GetFlag(FLAGS_tokens));
  if (model == "gpt" || model == "decoder") {
    std::printf(
        "ampd at %s\n%s%s\n", server.c_str(), w.name.c_str(),
        absl::GetFlag(FLAGS_peak_tflops) > 0
            ? absl::StrFormat(", peak %.1f TFLOP/s", absl::GetFlag(FLAGS_peak_tflops)).c_str()
            : "");
  } else {
    std::printf("ampd at %s\n%s\n%.1fM Linear parameters, %lld rows/step, %d timed steps\n",
                server.c_str(), w.name.c_str(), static_cast<double>(w.linear_params) / 1e6,
                static_cast<long long>(w.rows), absl::GetFlag(FLAGS_steps));
  }
  int failures = 0;
  for (const absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_precisions), ',', absl::SkipEmpty())) {
    const absl::Status s = RunPrecision(*client, w, std::string(p));
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", std::string(p).c_str(), s.ToString().c_str());
      ++failures;
    }
  }
  for (const absl::string_view c :
       absl::StrSplit(absl::GetFlag(FLAGS_concurrent), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(c, &n) || n <= 0) {
      std::fprintf(stderr, "--concurrent: not a positive count: %s\n", std::string(c).c_str());
      return 2;
    }
    const absl::Status s = RunConcurrent(server, n, absl::GetFlag(FLAGS_concurrent_steps));
    if (!s.ok()) {
      std::fprintf(stderr, "concurrent %d: %s\n", n, s.ToString().c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
