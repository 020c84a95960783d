// ampctl: the command-line client of ampd.
//   ampctl [--server=HOST:PORT] health
//   ampctl jobs create|list|get ID|delete ID
//   ampctl models
//   ampctl train --steps=N [--precision=fp16] [--scaler=pytorch --init-scale=..] [--json]
//   ampctl train --batches=FILE --layers=SPEC [--loss=mse|cross_entropy] --steps=N ...
//   ampctl train --layers=gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD [--batch-size=B --seq-len=T]
//   ampctl eval --job=ID [--batches=FILE | --batch-size=N --seed=S] [--json]
//   ampctl state export --job=ID --out=FILE | state import --job=ID FILE
// Flags may be spelled with dashes or underscores (--init-scale, --init_scale).
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/batch_file.h"
#include "client/client.h"
#include "client/data_parallel.h"
#include "client/hf_folder.h"
#include "client/sequence_task.h"
#include "client/synthetic_task.h"
#include "codec/json_value.h"
#include "codec/safetensors.h"
#include "codec/tensor_proto.h"
#include "common/dashed_flags.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "ampd address HOST:PORT");
ABSL_FLAG(int64_t, deadline_ms, 60000, "Deadline of each call attempt");
ABSL_FLAG(std::string, token, "",
          "Bearer token for a server with --auth-tokens (default: $AMPD_TOKEN)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA that signed the server's certificate: connect over TLS");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate, for a server with --tls-client-ca (with --tls-key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name the server's certificate must carry when it is not --server's host (with "
          "--tls-ca)");
ABSL_FLAG(bool, json, false, "Machine-readable output (one JSON object per line)");
ABSL_FLAG(std::string, job, "", "Job id (state export/import, jobs get/delete)");
ABSL_FLAG(std::string, out, "", "Output file (state export)");
ABSL_FLAG(std::string, view, "full",
          "state export: full (the training state), or a LoRA job's adapter (PEFT's names, "
          "adapter_config in the metadata) or merged (the adapters merged into the weights)");
ABSL_FLAG(bool, partial, false,
          "state import: each FILE holds some of the model's weights (the files of a sharded "
          "checkpoint), loaded one by one; nothing else changes");
// Job creation (jobs create, train).
ABSL_FLAG(std::string, name, "", "Display name of the job");
ABSL_FLAG(
    std::string, base_model, "",
    "jobs create: a base model of the server's --models-dir (ampctl models lists them) "
    "instead of --layers; with --lora-rank a LoRA job sharing the base with the others on it");
ABSL_FLAG(std::string, from_hf, "",
          "A Hugging Face folder (config.json, model.safetensors or its shards with "
          "model.safetensors.index.json) to create the job from, its weights loaded file by file "
          "(train, jobs create); the server maps config.json");
ABSL_FLAG(std::string, adapter, "",
          "With --from-hf: a PEFT adapter folder (adapter_config.json, "
          "adapter_model.safetensors) loaded into a LoRA job over the folder's weights");
ABSL_FLAG(std::string, hf_dir, "",
          "state export: write the job as a Hugging Face folder here (config.json, "
          "generation_config.json, the merged weights) instead of --out");
ABSL_FLAG(std::string, max_shard_size, "50GB",
          "state export --hf-dir: the most tensor bytes a weight file holds before the export is "
          "sharded with model.safetensors.index.json (transformers' max_shard_size: 5GB, 100KB, "
          "2GiB or bytes)");
ABSL_FLAG(std::string, layers, "",
          "The job's model, comma-separated: linear:IN:OUT[:nobias], relu, gelu, tanh, "
          "layer_norm:N, embedding:VOCAB:DIM (first only); or a GPT, "
          "gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD; or a Llama/Qwen2 decoder, "
          "llama:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS[:CONTEXT] (qwen2:... biases q, k, v). "
          "Required with --batches; "
          "default: the synthetic task's linear:16:64,gelu,linear:64:4");
ABSL_FLAG(std::optional<std::string>, loss, std::nullopt,
          "The model's loss with --layers: mse (default) or cross_entropy");
ABSL_FLAG(std::optional<int64_t>, lora_rank, std::nullopt,
          "A decoder's LoRA rank: train adapters on frozen base weights");
ABSL_FLAG(std::optional<double>, lora_alpha, std::nullopt, "LoRA alpha (default: the rank)");
ABSL_FLAG(std::string, lora_targets, "",
          "LoRA target modules, comma-separated (default q_proj,k_proj,v_proj,o_proj)");
ABSL_FLAG(std::string, precision, "fp16", "fp32, fp16 or bf16");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the weights and of the synthetic task");
ABSL_FLAG(std::string, optimizer, "adamw", "sgd, adam or adamw");
ABSL_FLAG(std::optional<double>, lr, std::nullopt, "Learning rate (the optimizer's default)");
ABSL_FLAG(std::optional<double>, weight_decay, std::nullopt, "Weight decay");
ABSL_FLAG(std::optional<double>, momentum, std::nullopt, "SGD momentum");
ABSL_FLAG(std::optional<double>, max_grad_norm, std::nullopt, "Clip the gradients' L2 norm");
// Learning-rate schedule (jobs create, train).
ABSL_FLAG(std::string, lr_schedule, "constant",
          "constant, or warmup_cosine (nanoGPT's: linear warmup, cosine decay to --min-lr)");
ABSL_FLAG(std::optional<int64_t>, warmup_steps, std::nullopt, "warmup_cosine: warmup updates (0)");
ABSL_FLAG(std::optional<int64_t>, decay_steps, std::nullopt,
          "warmup_cosine: update count where the decay reaches --min-lr (> --warmup-steps)");
ABSL_FLAG(std::optional<double>, min_lr, std::nullopt, "warmup_cosine: lr floor (lr / 10)");
ABSL_FLAG(std::optional<double>, loss_multiplier, std::nullopt, "Constant the loss is scaled by");
ABSL_FLAG(std::string, scaler, "pytorch",
          "Loss-scaler policy: pytorch, paddle, deepspeed, megatron, adaptive");
ABSL_FLAG(std::optional<double>, init_scale, std::nullopt, "Initial loss scale");
ABSL_FLAG(std::optional<double>, growth_factor, std::nullopt, "Scale growth factor");
ABSL_FLAG(std::optional<double>, backoff_factor, std::nullopt, "Scale backoff factor");
ABSL_FLAG(std::optional<int64_t>, growth_interval, std::nullopt, "Good steps between growths");
ABSL_FLAG(std::optional<int64_t>, hysteresis, std::nullopt, "Overflows tolerated before backoff");
ABSL_FLAG(std::optional<double>, min_scale, std::nullopt, "Scale floor");
ABSL_FLAG(std::optional<double>, max_scale, std::nullopt, "Scale cap");
ABSL_FLAG(std::optional<int64_t>, overflow_margin_log2, std::nullopt,
          "adaptive: keep max|g| * scale * growth_factor <= 65504 / 2^this");
ABSL_FLAG(std::optional<double>, underflow_threshold, std::nullopt,
          "adaptive: grow early above this fraction of zero or fp16-subnormal gradients");
ABSL_FLAG(bool, per_layer_scales, false,
          "adaptive: one loss scale per layer group (each Linear of a layer stack with the "
          "layers after it; each block of a GPT) instead of one per job");
ABSL_FLAG(std::optional<bool>, dynamic, std::nullopt,
          "Dynamic scaling (false: a static scale that still skips non-finite steps)");
ABSL_FLAG(std::optional<bool>, scaling, std::nullopt,
          "Loss scaling enabled (the scaler's enabled)");
// Training (train).
ABSL_FLAG(int64_t, steps, 100, "Steps to run (train)");
ABSL_FLAG(std::string, init_from, "",
          "train: comma-separated safetensors files of weights (a pretrained model, a job's "
          "merged export, the shards of a checkpoint) loaded into the new job as partial loads "
          "before its first step: the base of a LoRA fine-tune (each file checked readable "
          "before the job is created; a load the server refuses deletes the job it created)");
ABSL_FLAG(std::string, batches, "",
          "Train on this safetensors file's inputs.<i>/targets.<i> (i = 0..B-1), cycled over "
          "--steps, instead of the synthetic task; needs --layers");
ABSL_FLAG(std::optional<int64_t>, batch_size, std::nullopt,
          "Rows per batch of the synthetic task (default 64), or sequences per batch of a "
          "GPT's synthetic sequence task (default 8)");
ABSL_FLAG(std::optional<int64_t>, seq_len, std::nullopt,
          "Tokens per sequence of a GPT's synthetic sequence task (default: its context_length)");
ABSL_FLAG(double, target_scale, 32.0,
          "Magnitude of the synthetic task's targets (32: the first fp16 steps overflow at 65536)");
ABSL_FLAG(bool, delete_after, false, "Delete the job when train ends");
ABSL_FLAG(int64_t, micro_batches, 1,
          "train: cut each step's batch into this many micro-batches (per rank with "
          "--world-size; gradients accumulate over them)");
// Data-parallel training (train): one job across --world-size ampd replicas.
ABSL_FLAG(int32_t, world_size, 1,
          "train: replicas the job spans; --server then lists their addresses in rank order "
          "(comma-separated) and --rendezvous names rank 0's --peer-address");
ABSL_FLAG(std::string, rendezvous, "", "train --world-size: HOST:PORT of rank 0's --peer-address");
ABSL_FLAG(std::string, group, "", "train --world-size: the group name (default: a random one)");
ABSL_FLAG(int64_t, dist_timeout_ms, 30000,
          "train --world-size: how long a rank waits for the others before its step fails "
          "UNAVAILABLE");
ABSL_FLAG(int64_t, retry_for_s, 300,
          "train --world-size: how long one step is resent while a replica is down");
ABSL_FLAG(int32_t, page_size, 0, "jobs list: jobs per page (0: the server's default)");

namespace {

absl::Status Fail(const std::string& message) { return absl::InvalidArgumentError(message); }

std::string ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

// config.json's num_hidden_layers (0 when absent): the layers a PEFT
// adapter's full-path target_modules must each list.
absl::StatusOr<int64_t> NumHiddenLayers(const std::string& config_json) {
  absl::StatusOr<ampd::codec::JsonValue> parsed = ampd::codec::ParseJson(config_json);
  if (!parsed.ok())
    return Fail(absl::StrCat("--from-hf: config.json: ", parsed.status().message()));
  const ampd::codec::JsonValue* n = parsed->Find("num_hidden_layers");
  int64_t layers = 0;
  if (n != nullptr && !absl::SimpleAtoi(n->text, &layers)) {
    return Fail("--from-hf: config.json: num_hidden_layers: not an integer");
  }
  return layers;
}

// The model --layers/--loss give, or nullopt for the synthetic task's own
// (whose targets are regression targets, so only mse fits it).
absl::StatusOr<std::optional<ampd::v1::ModelSpec>> ModelFromFlags() {
  const std::string layers = absl::GetFlag(FLAGS_layers);
  const std::string from_hf = absl::GetFlag(FLAGS_from_hf);
  const std::string adapter = absl::GetFlag(FLAGS_adapter);
  if (!from_hf.empty()) {
    // The folder's config.json is the model (mapped by the server): only
    // the adapters are ours.
    if (!layers.empty() || !absl::GetFlag(FLAGS_base_model).empty()) {
      return Fail("--from-hf, --layers, --base-model: give one");
    }
    ampd::v1::ModelSpec spec;
    if (!adapter.empty()) {
      if (absl::GetFlag(FLAGS_lora_rank).has_value()) {
        return Fail("--adapter, --lora-rank: give one (the adapter carries its LoRA config)");
      }
      AMPD_ASSIGN_OR_RETURN(const std::string config,
                            ampd::hf::ReadJsonFile("--from-hf", from_hf + "/config.json"));
      AMPD_ASSIGN_OR_RETURN(const std::string adapter_config,
                            ampd::hf::ReadJsonFile("--adapter", adapter + "/adapter_config.json"));
      AMPD_ASSIGN_OR_RETURN(const int64_t layers_count, NumHiddenLayers(config));
      AMPD_ASSIGN_OR_RETURN(*spec.mutable_decoder()->mutable_lora(),
                            ampd::hf::LoraOfPeftConfig(adapter_config, layers_count));
    } else if (const std::optional<int64_t> rank = absl::GetFlag(FLAGS_lora_rank)) {
      spec.mutable_decoder();
      AMPD_RETURN_IF_ERROR(ampd::ApplyLoraFlags(*rank, absl::GetFlag(FLAGS_lora_alpha),
                                                absl::GetFlag(FLAGS_lora_targets), spec));
    }
    return spec;
  }
  if (!adapter.empty()) return Fail("--adapter: give the base's folder as --from-hf too");
  if (!absl::GetFlag(FLAGS_base_model).empty()) {
    // The base's config.json is the model: only the adapters are ours.
    if (!layers.empty()) return Fail("--layers, --base-model: give one");
    ampd::v1::ModelSpec spec;
    if (const std::optional<int64_t> rank = absl::GetFlag(FLAGS_lora_rank)) {
      spec.mutable_decoder();
      AMPD_RETURN_IF_ERROR(ampd::ApplyLoraFlags(*rank, absl::GetFlag(FLAGS_lora_alpha),
                                                absl::GetFlag(FLAGS_lora_targets), spec));
    }
    return spec;
  }
  const std::optional<std::string> loss = absl::GetFlag(FLAGS_loss);
  if (layers.empty()) {
    if (absl::GetFlag(FLAGS_lora_rank).has_value()) {
      return Fail("--lora-rank: LoRA adapts a decoder; give --layers=llama:... or qwen2:...");
    }
    if (!absl::GetFlag(FLAGS_batches).empty()) {
      return Fail(
          "--batches: give the job's model too, e.g. --layers=linear:16:64,gelu,linear:64:8 "
          "[--loss=mse|cross_entropy]");
    }
    if (loss.has_value() && *loss != "mse") {
      return Fail(absl::StrCat("--loss=", *loss,
                               ": give --layers too (the synthetic task's default model is mse)"));
    }
    return std::nullopt;
  }
  AMPD_ASSIGN_OR_RETURN(ampd::v1::ModelSpec spec, ampd::ParseModelFlags(layers, loss.value_or("")));
  if (const std::optional<int64_t> rank = absl::GetFlag(FLAGS_lora_rank)) {
    AMPD_RETURN_IF_ERROR(ampd::ApplyLoraFlags(*rank, absl::GetFlag(FLAGS_lora_alpha),
                                              absl::GetFlag(FLAGS_lora_targets), spec));
  } else if (absl::GetFlag(FLAGS_lora_alpha).has_value() ||
             !absl::GetFlag(FLAGS_lora_targets).empty()) {
    return Fail("--lora-alpha, --lora-targets: give --lora-rank too");
  }
  return spec;
}

absl::StatusOr<ampd::v1::CreateJobRequest> BuildCreateRequest(const ampd::v1::ModelSpec& model) {
  ampd::v1::CreateJobRequest request;
  ampd::v1::JobConfig* config = request.mutable_config();
  config->set_display_name(absl::GetFlag(FLAGS_name));
  config->set_seed(absl::GetFlag(FLAGS_seed));
  config->set_base_model(absl::GetFlag(FLAGS_base_model));
  if (const std::string dir = absl::GetFlag(FLAGS_from_hf); !dir.empty()) {
    AMPD_ASSIGN_OR_RETURN(*config->mutable_hf_config_json(),
                          ampd::hf::ReadJsonFile("--from-hf", dir + "/config.json"));
  }
  *config->mutable_model() = model;
  if (auto m = absl::GetFlag(FLAGS_loss_multiplier))
    config->mutable_model()->set_loss_multiplier(*m);

  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision == "fp32")
    config->set_precision(ampd::v1::PRECISION_FP32);
  else if (precision == "fp16")
    config->set_precision(ampd::v1::PRECISION_FP16);
  else if (precision == "bf16")
    config->set_precision(ampd::v1::PRECISION_BF16);
  else
    return Fail(absl::StrCat("--precision: expected fp32, fp16 or bf16, got ", precision));

  ampd::v1::OptimizerConfig* o = config->mutable_optimizer();
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  if (optimizer == "sgd")
    o->set_kind(ampd::v1::OPTIMIZER_SGD);
  else if (optimizer == "adam")
    o->set_kind(ampd::v1::OPTIMIZER_ADAM);
  else if (optimizer == "adamw")
    o->set_kind(ampd::v1::OPTIMIZER_ADAMW);
  else
    return Fail(absl::StrCat("--optimizer: expected sgd, adam or adamw, got ", optimizer));
  if (auto v = absl::GetFlag(FLAGS_lr)) o->set_lr(static_cast<float>(*v));
  if (auto v = absl::GetFlag(FLAGS_weight_decay)) o->set_weight_decay(static_cast<float>(*v));
  if (auto v = absl::GetFlag(FLAGS_momentum)) o->set_momentum(static_cast<float>(*v));
  if (auto v = absl::GetFlag(FLAGS_max_grad_norm)) o->set_max_grad_norm(static_cast<float>(*v));
  const std::string schedule = absl::GetFlag(FLAGS_lr_schedule);
  if (schedule == "warmup_cosine")
    o->set_lr_schedule(ampd::v1::LR_SCHEDULE_WARMUP_COSINE);
  else if (schedule != "constant")
    return Fail(absl::StrCat("--lr_schedule: expected constant or warmup_cosine, got ", schedule));
  if (auto v = absl::GetFlag(FLAGS_warmup_steps)) o->set_warmup_steps(*v);
  if (auto v = absl::GetFlag(FLAGS_decay_steps)) o->set_decay_steps(*v);
  if (auto v = absl::GetFlag(FLAGS_min_lr)) o->set_min_lr(static_cast<float>(*v));

  ampd::v1::ScalerConfig* s = config->mutable_scaler();
  const std::string policy = absl::GetFlag(FLAGS_scaler);
  if (policy == "pytorch")
    s->set_policy(ampd::v1::SCALER_POLICY_PYTORCH);
  else if (policy == "paddle")
    s->set_policy(ampd::v1::SCALER_POLICY_PADDLE);
  else if (policy == "deepspeed")
    s->set_policy(ampd::v1::SCALER_POLICY_DEEPSPEED);
  else if (policy == "megatron")
    s->set_policy(ampd::v1::SCALER_POLICY_MEGATRON);
  else if (policy == "adaptive")
    s->set_policy(ampd::v1::SCALER_POLICY_ADAPTIVE);
  else
    return Fail(absl::StrCat(
        "--scaler: expected pytorch, paddle, deepspeed, megatron or adaptive, got ", policy));
  if (auto v = absl::GetFlag(FLAGS_init_scale)) s->set_init_scale(*v);
  if (auto v = absl::GetFlag(FLAGS_growth_factor)) s->set_growth_factor(*v);
  if (auto v = absl::GetFlag(FLAGS_backoff_factor)) s->set_backoff_factor(*v);
  if (auto v = absl::GetFlag(FLAGS_growth_interval)) s->set_growth_interval(*v);
  if (auto v = absl::GetFlag(FLAGS_hysteresis)) s->set_hysteresis(*v);
  if (auto v = absl::GetFlag(FLAGS_min_scale)) s->set_min_scale(*v);
  if (auto v = absl::GetFlag(FLAGS_max_scale)) s->set_max_scale(*v);
  if (auto v = absl::GetFlag(FLAGS_dynamic)) s->set_dynamic(*v);
  if (auto v = absl::GetFlag(FLAGS_scaling)) s->set_enabled(*v);
  if (auto v = absl::GetFlag(FLAGS_overflow_margin_log2)) s->set_overflow_margin_log2(*v);
  if (auto v = absl::GetFlag(FLAGS_underflow_threshold)) s->set_underflow_threshold(*v);
  if (absl::GetFlag(FLAGS_per_layer_scales)) s->set_per_layer_scales(true);
  return request;
}

ampd::SyntheticTask MakeTask() {
  ampd::SyntheticTaskOptions options;
  options.batch_size = absl::GetFlag(FLAGS_batch_size).value_or(64);
  options.target_scale = static_cast<float>(absl::GetFlag(FLAGS_target_scale));
  options.seed = absl::GetFlag(FLAGS_seed);
  return ampd::SyntheticTask(options);
}

// A GPT's or decoder's synthetic sequence task (`model` their batch
// layout) from --batch-size, --seq-len and --seed.
absl::StatusOr<ampd::SequenceTask> MakeSequenceTask(const ampd::codec::BatchLayout& model) {
  if (absl::GetFlag(FLAGS_seq_len).value_or(0) > model.context_length) {
    return Fail(absl::StrCat("--seq_len: must be at most the model's context length ",
                             model.context_length, ", got ", *absl::GetFlag(FLAGS_seq_len)));
  }
  return ampd::SequenceTask::Create(
      {.vocab_size = model.num_embeddings,
       .batch_size = absl::GetFlag(FLAGS_batch_size).value_or(8),
       .seq_len = absl::GetFlag(FLAGS_seq_len).value_or(model.context_length),
       .seed = absl::GetFlag(FLAGS_seed)});
}

std::string JsonNumber(double v) {
  return std::isfinite(v) ? absl::StrFormat("%.9g", v) : std::string("null");
}

// Where train's batches come from: a batch file (cycled) or the synthetic
// task. Everything is checked before the job is created, so a bad file or
// model leaves nothing behind on the server.
struct TrainData {
  ampd::v1::ModelSpec model;
  std::vector<ampd::v1::MicroBatch> file_batches;  // empty: a synthetic task
  std::optional<ampd::SyntheticTask> task;
  std::optional<ampd::SequenceTask> sequences;  // a GPT's or a decoder's

  ampd::v1::MicroBatch Batch(int64_t step) {  // step: 1-based
    if (task) return task->NextBatch();
    if (sequences) return sequences->NextBatch();
    return file_batches[static_cast<size_t>((step - 1) %
                                            static_cast<int64_t>(file_batches.size()))];
  }
};

// created: the effective model of a job made already (--from-hf, whose
// model is the server's reading of config.json), instead of the flags'.
absl::StatusOr<TrainData> PrepareTrainData(std::optional<ampd::v1::ModelSpec> created) {
  std::optional<ampd::v1::ModelSpec> spec = std::move(created);
  if (!spec.has_value()) {
    if (!absl::GetFlag(FLAGS_base_model).empty()) {
      // Its batches' layout comes from the server's config.json, which
      // ampctl does not read: create the job, then drive it from a client.
      return Fail("--base-model: taken by `ampctl jobs create` only");
    }
    AMPD_ASSIGN_OR_RETURN(spec, ModelFromFlags());
  }
  TrainData data;
  const std::string path = absl::GetFlag(FLAGS_batches);
  if (!path.empty()) {
    AMPD_ASSIGN_OR_RETURN(std::string bytes, ampd::ReadBatchFile(path));
    absl::StatusOr<std::vector<ampd::v1::MicroBatch>> batches =
        ampd::BatchesFromSafetensors(bytes, ampd::BatchLayoutOf(*spec));
    if (!batches.ok()) {
      return Fail(absl::StrCat("--batches=", path, ": ", batches.status().message()));
    }
    data.file_batches = *std::move(batches);
    data.model = *spec;
    return data;
  }
  if (spec.has_value() && ampd::BatchLayoutOf(*spec).sequences) {
    AMPD_ASSIGN_OR_RETURN(ampd::SequenceTask task, MakeSequenceTask(ampd::BatchLayoutOf(*spec)));
    data.sequences.emplace(std::move(task));
    data.model = *spec;
    return data;
  }
  if (absl::GetFlag(FLAGS_seq_len).has_value())
    return Fail("--seq_len: only for a GPT or a decoder");
  if (absl::GetFlag(FLAGS_batch_size).value_or(64) < 1) return Fail("--batch_size: must be >= 1");
  data.task.emplace(MakeTask());
  if (!spec.has_value()) {
    data.model = data.task->Model();
    return data;
  }
  // A --layers model must take the synthetic task's shapes; a copy of the
  // task draws the probe batch so the real batch stream is untouched.
  ampd::SyntheticTask probe = *data.task;
  const ampd::v1::MicroBatch batch = probe.NextBatch();
  AMPD_ASSIGN_OR_RETURN(ampd::codec::HostTensor inputs,
                        ampd::codec::TensorFromProto(batch.inputs(), "inputs"));
  AMPD_ASSIGN_OR_RETURN(ampd::codec::HostTensor targets,
                        ampd::codec::TensorFromProto(batch.targets(), "targets"));
  if (absl::Status s = ampd::codec::CheckBatchLayout(ampd::BatchLayoutOf(*spec), inputs, targets,
                                                     "the synthetic task's inputs",
                                                     "the synthetic task's targets");
      !s.ok()) {
    return Fail(absl::StrCat("--layers: ", s.message()));
  }
  data.model = *spec;
  return data;
}

void PrintStep(const std::string& job_id, const ampd::v1::StepResponse& r, bool json) {
  const double ms = r.timings().total_seconds() * 1e3;
  // Per-layer scales only: each layer group's scale after the step.
  std::vector<std::string> layers;
  for (const float s : r.layer_scales_after()) {
    layers.push_back(json ? JsonNumber(s) : absl::StrFormat("%g", s));
  }
  if (json) {
    const std::string layer_field =
        layers.empty() ? "" : absl::StrCat(",\"layer_scales\":[", absl::StrJoin(layers, ","), "]");
    std::printf(
        "{\"job_id\":\"%s\",\"step\":%lld,\"loss\":%s,\"loss_scale\":%s,\"scale_before\":%s,"
        "\"skipped\":%s,\"found_inf\":%s,\"growth_deferred\":%s,\"grad_norm\":%s,"
        "\"applied_steps\":%lld,\"learning_rate\":%s,\"ms\":%s,\"allreduce_ms\":%s,"
        "\"wait_ms\":%s%s}\n",
        job_id.c_str(), static_cast<long long>(r.global_step()), JsonNumber(r.loss()).c_str(),
        JsonNumber(r.scale_after()).c_str(), JsonNumber(r.scale_before()).c_str(),
        r.skipped() ? "true" : "false", r.found_inf() ? "true" : "false",
        r.scale_growth_deferred() ? "true" : "false",
        r.has_grad_norm() ? JsonNumber(r.grad_norm()).c_str() : "null",
        static_cast<long long>(r.applied_steps()), JsonNumber(r.learning_rate()).c_str(),
        JsonNumber(ms).c_str(), JsonNumber(r.timings().allreduce_seconds() * 1e3).c_str(),
        JsonNumber(r.timings().wait_seconds() * 1e3).c_str(), layer_field.c_str());
  } else {
    std::string scale = absl::StrFormat("%g", r.scale_after());
    if (r.scale_after() != r.scale_before()) {
      scale = absl::StrFormat("%g -> %g", r.scale_before(), r.scale_after());
    }
    std::printf("step %4lld  loss %-12.6g scale %-18s %s  grad_norm %-10s lr %-10.4g %7.2f ms\n",
                static_cast<long long>(r.global_step()), r.loss(), scale.c_str(),
                r.skipped() ? "SKIPPED (overflow)" : "applied           ",
                r.has_grad_norm() ? absl::StrFormat("%.4g", r.grad_norm()).c_str() : "-",
                r.learning_rate(), ms);
    if (!layers.empty())
      std::printf("           layer scales %s\n", absl::StrJoin(layers, " ").c_str());
  }
  std::fflush(stdout);
}

// A step's batch as --micro-batches micro-batches (one rank's share of
// them, of `ranks`, with --world-size).
absl::StatusOr<std::vector<ampd::v1::MicroBatch>> MicroBatches(const ampd::v1::MicroBatch& batch,
                                                               int64_t ranks) {
  const int64_t per_rank = absl::GetFlag(FLAGS_micro_batches);
  if (per_rank < 1) return Fail("--micro_batches: must be >= 1");
  if (ranks == 1 && per_rank == 1) return std::vector<ampd::v1::MicroBatch>{batch};
  absl::StatusOr<std::vector<ampd::v1::MicroBatch>> parts =
      ampd::SplitRows(batch, ranks * per_rank);
  if (!parts.ok()) {
    return Fail(absl::StrCat("--micro_batches=", per_rank,
                             ranks > 1 ? absl::StrCat(" x --world_size=", ranks) : "",
                             ": the batch does not split: ", parts.status().message()));
  }
  return parts;
}

// train --world-size=N: the job on N replicas, each step's batch cut into
// N x --micro-batches micro-batches, rank r taking the r-th run of
// --micro-batches of them: the same data, in the same micro-batches, as one
// process training with --micro-batches=N x M.
absl::Status TrainDistributed(const ampd::ClientOptions& client_options, TrainData& data,
                              const ampd::v1::CreateJobRequest& request, int64_t steps) {
  const int32_t world = absl::GetFlag(FLAGS_world_size);
  ampd::DataParallelOptions options;
  options.servers = absl::StrSplit(absl::GetFlag(FLAGS_server), ',', absl::SkipEmpty());
  if (static_cast<int32_t>(options.servers.size()) != world) {
    return Fail(absl::StrCat("--server: --world_size=", world, " needs ", world,
                             " comma-separated addresses in rank order, got ",
                             options.servers.size()));
  }
  options.rendezvous = absl::GetFlag(FLAGS_rendezvous);
  if (options.rendezvous.empty()) {
    return Fail("--rendezvous: give rank 0's --peer-address (HOST:PORT) with --world_size");
  }
  options.group = absl::GetFlag(FLAGS_group);
  const int64_t timeout_ms = absl::GetFlag(FLAGS_dist_timeout_ms);
  if (timeout_ms < 1) return Fail("--dist_timeout_ms: must be >= 1");
  options.timeout = absl::Milliseconds(timeout_ms);
  options.retry_for = absl::Seconds(absl::GetFlag(FLAGS_retry_for_s));
  options.client = client_options;
  // A step waits up to the timeout for its peers, then answers.
  options.client.deadline = std::max(options.client.deadline, options.timeout + absl::Seconds(30));
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<ampd::DataParallelJob> job,
                        ampd::DataParallelJob::Create(request, options));
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("group %s: %d replicas, jobs", job->group().c_str(), world);
    for (const ampd::v1::Job& j : job->jobs()) std::printf(" %s", j.job_id().c_str());
    std::printf(" (%lld parameters, %s, scaler %s)\n",
                static_cast<long long>(job->jobs()[0].parameter_count()),
                absl::GetFlag(FLAGS_precision).c_str(), absl::GetFlag(FLAGS_scaler).c_str());
  }
  const int64_t per_rank = absl::GetFlag(FLAGS_micro_batches);
  const int64_t start = job->jobs()[0].step();
  int64_t skipped = 0;
  for (int64_t i = 1; i <= steps; ++i) {
    AMPD_ASSIGN_OR_RETURN(std::vector<ampd::v1::MicroBatch> parts,
                          MicroBatches(data.Batch(i), world));
    std::vector<std::vector<ampd::v1::MicroBatch>> shares(static_cast<size_t>(world));
    for (size_t p = 0; p < parts.size(); ++p) {
      shares[p / static_cast<size_t>(per_rank)].push_back(std::move(parts[p]));
    }
    AMPD_ASSIGN_OR_RETURN(ampd::v1::StepResponse r, job->Step(start + i, shares));
    skipped += r.skipped() ? 1 : 0;
    PrintStep(job->group(), r, json);
  }
  if (!json) {
    std::printf("group %s: %lld steps, %lld skipped\n", job->group().c_str(),
                static_cast<long long>(steps), static_cast<long long>(skipped));
  }
  if (absl::GetFlag(FLAGS_delete_after)) return job->Delete();
  return absl::OkStatus();
}

// --init-from's paths, each checked readable before the job is created (so
// that a missing file creates nothing); read one at a time when loaded.
absl::StatusOr<std::vector<std::string>> InitFromPaths(const std::string& files) {
  std::vector<std::string> paths;
  if (files.empty()) return paths;
  for (absl::string_view item : absl::StrSplit(files, ',')) {
    std::string path(absl::StripAsciiWhitespace(item));
    if (path.empty()) return Fail("--init-from: empty item in the list");
    if (!std::ifstream(path, std::ios::binary)) return Fail("--init-from: cannot read " + path);
    paths.push_back(std::move(path));
  }
  return paths;
}

// One file's tensors into the job as a partial load, said on stdout unless
// --json; an error names `flag` and the path, keeping the server's code.
absl::Status LoadPartial(ampd::Client& client, const std::string& job_id, const std::string& flag,
                         const std::string& path, const std::string& bytes, bool json) {
  absl::StatusOr<ampd::v1::LoadStateDictResponse> r =
      client.LoadStateDict(job_id, bytes, /*partial=*/true);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(flag, " ", path, ": ", r.status().message()));
  }
  if (!json) {
    std::printf("job %s: loaded %lld tensors from %s\n", job_id.c_str(),
                static_cast<long long>(r->tensors()), path.c_str());
  }
  return absl::OkStatus();
}

// --init-from: each file loaded into the job as a partial load (the
// weights it holds replace the job's), in order.
absl::Status InitFrom(ampd::Client& client, const std::string& job_id,
                      const std::vector<std::string>& paths, bool json) {
  for (const std::string& path : paths) {
    AMPD_ASSIGN_OR_RETURN(std::string bytes, ampd::hf::ReadFile("--init-from", path));
    AMPD_RETURN_IF_ERROR(LoadPartial(client, job_id, "--init-from", path, bytes, json));
  }
  return absl::OkStatus();
}

// A job made for this run alone and never trained is deleted when what
// follows its creation fails (none is left counted against --max-jobs or
// a quota); failed says why.
absl::Status DeleteAfter(ampd::Client& client, const std::string& job_id, absl::Status failed) {
  if (absl::Status deleted = client.DeleteJob(job_id); !deleted.ok()) {
    return absl::Status(failed.code(), absl::StrCat(failed.message(), "; deleting job ", job_id,
                                                    " failed too: ", deleted.message()));
  }
  return absl::Status(failed.code(), absl::StrCat(failed.message(), " (job ", job_id, " deleted)"));
}

// --from-hf's weights into the job, one file at a time (each shard read,
// widened to F32 where it is F16 or BF16, and sent as a partial load before
// the next is read), then --adapter's.
absl::Status LoadHfWeights(ampd::Client& client, const std::string& job_id, bool json) {
  const std::string dir = absl::GetFlag(FLAGS_from_hf);
  AMPD_ASSIGN_OR_RETURN(std::vector<std::string> files, ampd::hf::WeightFiles(dir));
  if (const std::string adapter = absl::GetFlag(FLAGS_adapter); !adapter.empty()) {
    files.push_back(adapter + "/adapter_model.safetensors");
  }
  for (const std::string& path : files) {
    AMPD_ASSIGN_OR_RETURN(std::string bytes, ampd::hf::ReadFile("--from-hf", path));
    absl::StatusOr<std::string> widened = ampd::hf::WidenToF32(std::move(bytes));
    if (!widened.ok()) {
      return Fail(absl::StrCat("--from-hf ", path, ": ", widened.status().message()));
    }
    AMPD_RETURN_IF_ERROR(LoadPartial(client, job_id, "--from-hf", path, *widened, json));
  }
  return absl::OkStatus();
}

// CreateJob, then --from-hf's weights when it is given (the job deleted if
// they do not load).
absl::StatusOr<ampd::v1::Job> CreateJob(ampd::Client& client,
                                        const ampd::v1::CreateJobRequest& request, bool json) {
  AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job, client.CreateJob(request));
  if (absl::GetFlag(FLAGS_from_hf).empty()) return job;
  if (absl::Status loaded = LoadHfWeights(client, job.job_id(), json); !loaded.ok()) {
    return DeleteAfter(client, job.job_id(), loaded);
  }
  return job;
}

absl::Status Train(ampd::Client& client, const ampd::ClientOptions& client_options) {
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  if (steps < 0) return Fail("--steps: must be >= 0");
  const bool json = absl::GetFlag(FLAGS_json);
  if (absl::GetFlag(FLAGS_world_size) < 1) return Fail("--world_size: must be >= 1");
  const bool from_hf = !absl::GetFlag(FLAGS_from_hf).empty();
  TrainData data;
  ampd::v1::Job job;
  if (from_hf) {
    // The model is the server's reading of config.json: the job first,
    // then the batches of its effective model.
    if (absl::GetFlag(FLAGS_world_size) > 1) {
      return Fail("--from-hf: loads one job; not available with --world-size > 1");
    }
    AMPD_ASSIGN_OR_RETURN(std::optional<ampd::v1::ModelSpec> spec, ModelFromFlags());
    AMPD_ASSIGN_OR_RETURN(ampd::v1::CreateJobRequest request, BuildCreateRequest(*spec));
    AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> init_paths,
                          InitFromPaths(absl::GetFlag(FLAGS_init_from)));
    AMPD_ASSIGN_OR_RETURN(job, CreateJob(client, request, json));
    absl::StatusOr<TrainData> prepared = PrepareTrainData(job.config().model());
    if (!prepared.ok()) return DeleteAfter(client, job.job_id(), prepared.status());
    data = *std::move(prepared);
    if (absl::Status loaded = InitFrom(client, job.job_id(), init_paths, json); !loaded.ok()) {
      return DeleteAfter(client, job.job_id(), loaded);
    }
  } else {
    AMPD_ASSIGN_OR_RETURN(data, PrepareTrainData(std::nullopt));
    AMPD_ASSIGN_OR_RETURN(ampd::v1::CreateJobRequest request, BuildCreateRequest(data.model));
    if (absl::GetFlag(FLAGS_world_size) > 1) {
      if (!absl::GetFlag(FLAGS_init_from).empty()) {
        return Fail("--init-from: loads one job; not available with --world-size > 1");
      }
      return TrainDistributed(client_options, data, request, steps);
    }
    AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> init_paths,
                          InitFromPaths(absl::GetFlag(FLAGS_init_from)));
    AMPD_ASSIGN_OR_RETURN(job, client.CreateJob(request));
    if (absl::Status loaded = InitFrom(client, job.job_id(), init_paths, json); !loaded.ok()) {
      return DeleteAfter(client, job.job_id(), loaded);
    }
  }
  const ampd::v1::ScalerConfig& sc = job.config().scaler();
  if (!json) {
    std::printf("job %s: %lld parameters, %s, scaler %s (init_scale %g, growth_interval %lld)\n",
                job.job_id().c_str(), static_cast<long long>(job.parameter_count()),
                absl::GetFlag(FLAGS_precision).c_str(), absl::GetFlag(FLAGS_scaler).c_str(),
                sc.init_scale(), static_cast<long long>(sc.growth_interval()));
    if (!data.file_batches.empty()) {
      std::printf("training on %zu batches from %s\n", data.file_batches.size(),
                  absl::GetFlag(FLAGS_batches).c_str());
    }
    if (data.sequences) {
      const int64_t vocab = ampd::BatchLayoutOf(data.model).num_embeddings;
      std::printf(
          "synthetic sequences: a Markov chain over %lld tokens with %d likely successors "
          "each; loss floor %.3f nats/token, ln(vocab) %.3f\n",
          static_cast<long long>(vocab), ampd::SequenceTask::kSuccessors,
          ampd::SequenceTask::EntropyRate(), std::log(static_cast<double>(vocab)));
    }
  }
  int64_t skipped = 0;
  for (int64_t i = 1; i <= steps; ++i) {
    ampd::v1::StepRequest step;
    step.set_job_id(job.job_id());
    step.set_sequence(job.step() + i);
    AMPD_ASSIGN_OR_RETURN(std::vector<ampd::v1::MicroBatch> parts, MicroBatches(data.Batch(i), 1));
    for (ampd::v1::MicroBatch& mb : parts) *step.add_micro_batches() = std::move(mb);
    AMPD_ASSIGN_OR_RETURN(ampd::v1::StepResponse r, client.Step(step));
    skipped += r.skipped() ? 1 : 0;
    PrintStep(job.job_id(), r, json);
  }
  if (!json) {
    std::printf("job %s: %lld steps, %lld skipped\n", job.job_id().c_str(),
                static_cast<long long>(steps), static_cast<long long>(skipped));
  }
  if (absl::GetFlag(FLAGS_delete_after)) return client.DeleteJob(job.job_id());
  return absl::OkStatus();
}

absl::StatusOr<std::string> JobArg(const std::vector<char*>& args, size_t index) {
  if (!absl::GetFlag(FLAGS_job).empty()) return absl::GetFlag(FLAGS_job);
  if (args.size() > index) return std::string(args[index]);
  return Fail("give the job id as --job=ID");
}

// ---- eval ------------------------------------------------------------------------

// The micro-batches `ampctl eval` sends for a job of `model`: every batch of
// --batches=FILE, read with the job's own model's layout, or one batch of
// the synthetic task (--batch-size, --seed: the first batch `train` with
// that seed trains on; a GPT's sequence task, also with --seq-len), checked
// against the model before anything is sent.
absl::StatusOr<std::vector<ampd::v1::MicroBatch>> EvalBatches(const ampd::v1::ModelSpec& model) {
  const std::string path = absl::GetFlag(FLAGS_batches);
  if (!path.empty()) {
    AMPD_ASSIGN_OR_RETURN(std::string bytes, ampd::ReadBatchFile(path));
    absl::StatusOr<std::vector<ampd::v1::MicroBatch>> batches =
        ampd::BatchesFromSafetensors(bytes, ampd::BatchLayoutOf(model));
    if (!batches.ok()) {
      return Fail(absl::StrCat("--batches=", path, ": ", batches.status().message()));
    }
    return batches;
  }
  if (ampd::BatchLayoutOf(model).sequences) {
    AMPD_ASSIGN_OR_RETURN(ampd::SequenceTask sequences,
                          MakeSequenceTask(ampd::BatchLayoutOf(model)));
    return std::vector<ampd::v1::MicroBatch>{sequences.NextBatch()};
  }
  if (absl::GetFlag(FLAGS_seq_len).has_value())
    return Fail("--seq_len: only for a GPT or a decoder");
  if (absl::GetFlag(FLAGS_batch_size).value_or(64) < 1) return Fail("--batch_size: must be >= 1");
  ampd::SyntheticTask task = MakeTask();
  std::vector<ampd::v1::MicroBatch> batches = {task.NextBatch()};
  AMPD_ASSIGN_OR_RETURN(ampd::codec::HostTensor inputs,
                        ampd::codec::TensorFromProto(batches[0].inputs(), "inputs"));
  AMPD_ASSIGN_OR_RETURN(ampd::codec::HostTensor targets,
                        ampd::codec::TensorFromProto(batches[0].targets(), "targets"));
  if (absl::Status s = ampd::codec::CheckBatchLayout(ampd::BatchLayoutOf(model), inputs, targets,
                                                     "the synthetic task's inputs",
                                                     "the synthetic task's targets");
      !s.ok()) {
    return Fail(absl::StrCat("the job's model does not take the synthetic task's batches (",
                             s.message(), "); give --batches=FILE"));
  }
  return batches;
}

absl::Status Eval(ampd::Client& client, const std::vector<char*>& args) {
  AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 2));
  AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job, client.GetJob(id));
  AMPD_ASSIGN_OR_RETURN(std::vector<ampd::v1::MicroBatch> batches,
                        EvalBatches(job.config().model()));
  ampd::v1::EvaluateRequest request;
  request.set_job_id(id);
  for (ampd::v1::MicroBatch& mb : batches) *request.add_micro_batches() = std::move(mb);
  AMPD_ASSIGN_OR_RETURN(ampd::v1::EvaluateResponse r, client.Evaluate(request));
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"job_id\":\"%s\",\"step\":%lld,\"loss\":%s,\"samples\":%lld,\"ms\":%s}\n",
                id.c_str(), static_cast<long long>(job.step()), JsonNumber(r.loss()).c_str(),
                static_cast<long long>(r.samples()), JsonNumber(r.seconds() * 1e3).c_str());
  } else {
    std::printf(
        "job %s after step %lld: eval loss %.9g over %lld samples (%d micro-batch%s, %.2f ms)\n",
        id.c_str(), static_cast<long long>(job.step()), r.loss(),
        static_cast<long long>(r.samples()), request.micro_batches_size(),
        request.micro_batches_size() == 1 ? "" : "es", r.seconds() * 1e3);
  }
  return absl::OkStatus();
}

absl::Status Jobs(ampd::Client& client, const std::vector<char*>& args) {
  const std::string verb = args.size() > 2 ? args[2] : "";
  if (verb == "create") {
    AMPD_ASSIGN_OR_RETURN(std::optional<ampd::v1::ModelSpec> spec, ModelFromFlags());
    AMPD_ASSIGN_OR_RETURN(ampd::v1::CreateJobRequest request,
                          BuildCreateRequest(spec.has_value() ? *spec : MakeTask().Model()));
    AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job,
                          CreateJob(client, request, /*json=*/true));  // prints the id alone
    std::printf("%s\n", absl::GetFlag(FLAGS_json) ? ToJson(job).c_str() : job.job_id().c_str());
    return absl::OkStatus();
  }
  if (verb == "list") {
    AMPD_ASSIGN_OR_RETURN(std::vector<ampd::v1::Job> jobs, client.ListAllJobs());
    for (const ampd::v1::Job& job : jobs) {
      if (absl::GetFlag(FLAGS_json)) {
        std::printf("%s\n", ToJson(job).c_str());
      } else {
        std::printf("%s  step %-8lld scale %-10g %s\n", job.job_id().c_str(),
                    static_cast<long long>(job.step()), job.loss_scale(),
                    job.config().display_name().c_str());
      }
    }
    return absl::OkStatus();
  }
  if (verb == "get") {
    AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 3));
    AMPD_ASSIGN_OR_RETURN(ampd::v1::Job job, client.GetJob(id));
    std::printf("%s\n", ToJson(job).c_str());
    return absl::OkStatus();
  }
  if (verb == "delete") {
    AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 3));
    return client.DeleteJob(id);
  }
  return Fail("usage: ampctl jobs create|list|get ID|delete ID");
}

// The base models of the server's --models-dir, one a line.
absl::Status Models(ampd::Client& client) {
  AMPD_ASSIGN_OR_RETURN(std::vector<std::string> models, client.ListModels());
  for (const std::string& name : models) std::printf("%s\n", name.c_str());
  return absl::OkStatus();
}

// state export --hf-dir: the job as a folder AutoModelForCausalLM opens:
// the config.json the server writes for its model (Job.hf_config_json),
// generation_config.json, and the merged view's weights, sharded past
// --max-shard-size.
absl::Status ExportHf(ampd::Client& client, const std::string& id, const std::string& dir) {
  if (!absl::GetFlag(FLAGS_out).empty()) return Fail("--hf-dir, --out: give one");
  if (absl::GetFlag(FLAGS_view) != "full" && absl::GetFlag(FLAGS_view) != "merged") {
    return Fail("--hf-dir: the folder holds the merged view; leave --view out");
  }
  AMPD_ASSIGN_OR_RETURN(const uint64_t shard_bytes,
                        ampd::hf::ParseShardSize(absl::GetFlag(FLAGS_max_shard_size)));
  AMPD_ASSIGN_OR_RETURN(const ampd::v1::Job job, client.GetJob(id));
  if (job.hf_config_json().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--hf-dir: job ", id,
                     "'s model is no Hugging Face family (gpt2, llama, qwen2, qwen3, "
                     "gemma3_text); export its state dict with --out"));
  }
  AMPD_ASSIGN_OR_RETURN(std::string bytes, client.GetStateDict(id, ampd::v1::STATE_VIEW_MERGED));
  absl::StatusOr<ampd::codec::StateDict> state = ampd::codec::DecodeSafetensors(bytes);
  if (!state.ok())
    return absl::InternalError(absl::StrCat("the merged view: ", state.status().message()));
  bytes.clear();
  bytes.shrink_to_fit();
  AMPD_ASSIGN_OR_RETURN(
      const std::vector<std::string> files,
      ampd::hf::WriteFolder(dir, job.hf_config_json(), *std::move(state), shard_bytes));
  std::printf("wrote job %s to %s: config.json, generation_config.json, %s%s\n", id.c_str(),
              dir.c_str(), absl::StrJoin(files, ", ").c_str(),
              files.size() > 1 ? ", model.safetensors.index.json" : "");
  return absl::OkStatus();
}

absl::Status State(ampd::Client& client, const std::vector<char*>& args) {
  const std::string verb = args.size() > 2 ? args[2] : "";
  if (verb == "export" && !absl::GetFlag(FLAGS_hf_dir).empty()) {
    AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 99));
    return ExportHf(client, id, absl::GetFlag(FLAGS_hf_dir));
  }
  if (verb == "export") {
    AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 99));
    std::string out = absl::GetFlag(FLAGS_out);
    if (out.empty() && args.size() > 3) out = args[3];
    if (out.empty()) return Fail("--out: give the output file");
    const std::string view_name = absl::GetFlag(FLAGS_view);
    ampd::v1::StateView view = ampd::v1::STATE_VIEW_FULL;
    if (view_name == "adapter") {
      view = ampd::v1::STATE_VIEW_ADAPTER;
    } else if (view_name == "merged") {
      view = ampd::v1::STATE_VIEW_MERGED;
    } else if (view_name != "full") {
      return Fail(absl::StrCat("--view: full, adapter or merged, got \"", view_name, "\""));
    }
    AMPD_ASSIGN_OR_RETURN(std::string bytes, client.GetStateDict(id, view));
    std::ofstream file(out, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!file.good()) return absl::InternalError(absl::StrCat("--out: cannot write ", out));
    std::printf("wrote %zu bytes to %s\n", bytes.size(), out.c_str());
    return absl::OkStatus();
  }
  if (verb == "import") {
    AMPD_ASSIGN_OR_RETURN(std::string id, JobArg(args, 99));
    if (args.size() < 4) return Fail("usage: ampctl state import --job=ID [--partial] FILE...");
    const bool partial = absl::GetFlag(FLAGS_partial);
    if (args.size() > 4 && !partial) {
      return Fail("state import: several files are the shards of one checkpoint: add --partial");
    }
    for (size_t i = 3; i < args.size(); ++i) {
      AMPD_ASSIGN_OR_RETURN(std::string bytes, ampd::hf::ReadFile("state import", args[i]));
      absl::StatusOr<ampd::v1::LoadStateDictResponse> r = client.LoadStateDict(id, bytes, partial);
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrCat(args[i], ": ", r.status().message()));
      }
      std::printf("loaded %lld tensors (%lld bytes) from %s into %s\n",
                  static_cast<long long>(r->tensors()), static_cast<long long>(r->bytes()), args[i],
                  id.c_str());
    }
    return absl::OkStatus();
  }
  return Fail(
      "usage: ampctl state export --job=ID --out=FILE | state export --job=ID --hf-dir=DIR | "
      "state import --job=ID FILE");
}

absl::Status Health(ampd::Client& client) {
  AMPD_ASSIGN_OR_RETURN(auto status, client.Health());
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(status);
  std::printf("%s\n", name.c_str());
  if (status != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("server is ", name));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "ampctl: command-line client of ampd.\n"
      "  ampctl [--server=HOST:PORT] [--token=T] [--tls-ca=PEM [--tls-cert=PEM --tls-key=PEM]]"
      " health\n"
      "  ampctl jobs create [--layers=SPEC --loss=mse|cross_entropy | --base-model=NAME "
      "[--lora-rank=R] | --from-hf=DIR [--adapter=DIR]]|list|get ID|delete ID\n"
      "  ampctl models\n"
      "  ampctl train --steps=N [--precision=fp16|bf16|fp32] [--scaler=pytorch --init-scale=..]"
      " [--loss-multiplier=X] [--json]\n"
      "  ampctl train --batches=FILE --layers=SPEC [--loss=mse|cross_entropy] --steps=N ...\n"
      "  ampctl train ... [--lr=X --lr-schedule=warmup_cosine --warmup-steps=W --decay-steps=D"
      " --min-lr=M]\n"
      "  ampctl eval --job=ID [--batches=FILE | --batch-size=N --seed=S] [--json]\n"
      "  ampctl train --layers=gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD [--batch-size=B]"
      " [--seq-len=T] [--batches=FILE] ...\n"
      "  ampctl train --layers=llama|qwen2|qwen3|gemma3:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS"
      "[:CONTEXT]"
      " [--batch-size=B] [--seq-len=T] ...\n"
      "  ampctl train --world-size=N --server=HOST:PORT,... --rendezvous=HOST:PORT"
      " [--micro-batches=M] ...\n"
      "  ampctl train --from-hf=DIR [--adapter=PEFT_DIR | --lora-rank=R] [--batches=FILE] ...\n"
      "  ampctl state export --job=ID --out=FILE [--view=full|adapter|merged]\n"
      "  ampctl state export --job=ID --hf-dir=DIR [--max-shard-size=50GB]\n"
      "  ampctl state import --job=ID FILE | --partial FILE...  (the shards of a checkpoint)\n"
      "\n"
      "train runs the built-in synthetic regression task unless --batches names a safetensors\n"
      "file holding inputs.<i> and targets.<i> for i = 0..B-1, used in order and cycled over\n"
      "--steps (step s trains on batch (s-1) mod B):\n"
      "  inputs.<i>   F32/F16/BF16 (N, IN), or I32/I64 (N) ids when the first layer is embedding\n"
      "  targets.<i>  F32 (N, OUT) for --loss=mse, I32/I64 (N) labels for --loss=cross_entropy\n"
      "  for a GPT: inputs.<i> I32/I64 (B, T) token ids, T <= CONTEXT, and targets.<i>\n"
      "  I32/I64 (B, T) next-token ids, -100 where a position carries no loss\n"
      "--layers=SPEC is the job's model, comma-separated layers:\n"
      "  linear:IN:OUT  linear:IN:OUT:nobias  relu  gelu  tanh  layer_norm:N  embedding:VOCAB:DIM\n"
      "  e.g. --layers=linear:16:64,gelu,linear:64:8 --loss=mse\n"
      "It is required with --batches and optional otherwise (the synthetic task is\n"
      "linear:16:64,gelu,linear:64:4 with mse; a --layers model must map 16 -> 4). The file\n"
      "and model are checked before the job is created; a missing or malformed tensor is\n"
      "named in the error.\n"
      "eval prints the job's loss on --batches=FILE's batches (all of them, as the micro-batches\n"
      "of one Evaluate: their mean loss) or on the synthetic task's first batch for --seed,\n"
      "without changing the job.\n"
      "--layers=gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD trains a GPT-2-style transformer; without\n"
      "--batches on token sequences from a fixed random Markov chain (--seed) whose loss can\n"
      "fall well below ln(VOCAB), --batch-size sequences (default 8) of --seq-len tokens\n"
      "(default CONTEXT) a step.\n"
      "--layers=llama:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS[:CONTEXT] trains a Llama-family\n"
      "decoder (RMSNorm, rotary positions, KV_HEADS K/V heads shared by the HEADS query heads,\n"
      "SwiGLU MLP of width INTER; CONTEXT default 2048) on the same sequences; qwen2:... gives\n"
      "q, k and v their biases as Qwen2 does, qwen3:... each q and k head its RMSNorm, and\n"
      "gemma3:... Gemma 3's parts (every layer global).\n"
      "--from-hf=DIR creates the job from a Hugging Face folder (the server maps config.json;\n"
      "the weights load shard by shard), with --adapter=DIR a PEFT adapter over it; state\n"
      "export --hf-dir=DIR writes the job back as a folder transformers opens.\n"
      "Exit status: 0 on success, 2 for invalid arguments (flags, batch file), 1 otherwise.");

  std::vector<std::string> arg_storage;
  std::vector<char*> args = ampd::ParseDashedCommandLine(argc, argv, arg_storage);

  ampd::ClientOptions options;
  options.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  options.token = absl::GetFlag(FLAGS_token);
  if (const char* env = std::getenv("AMPD_TOKEN"); options.token.empty() && env != nullptr) {
    options.token = env;
  }
  if (absl::Status s =
          ampd::LoadTlsFiles(absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                             absl::GetFlag(FLAGS_tls_key), options);
      !s.ok()) {
    std::fprintf(stderr, "ampctl: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!options.tls_server_name.empty() && !options.tls) {
    std::fprintf(stderr, "ampctl: --tls-server-name needs --tls-ca\n");
    return 2;
  }
  std::unique_ptr<ampd::Client> client =
      ampd::Client::Connect(absl::GetFlag(FLAGS_server), options);
  const std::string command = args.size() > 1 ? args[1] : "";
  absl::Status status;
  if (command == "health")
    status = Health(*client);
  else if (command == "jobs")
    status = Jobs(*client, args);
  else if (command == "models")
    status = Models(*client);
  else if (command == "train")
    status = Train(*client, options);
  else if (command == "state")
    status = State(*client, args);
  else if (command == "eval")
    status = Eval(*client, args);
  else
    status = Fail(
        "usage: ampctl health | jobs ... | models | train ... | eval ... | state ... (see "
        "--help)");
  if (!status.ok()) {
    std::fprintf(stderr, "ampctl: %s\n", ampd::DescribeError(status).c_str());
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
