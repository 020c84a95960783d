// The engine's own encoding of a JobConfig, stored in every checkpoint's
// metadata under ampd.config so that the engine restores its jobs without
// the rpc layer and a wire-format change is never a checkpoint-format
// change. It is JSON, versioned by format_version, with every field written
// (no defaults implied, so a later change of a default cannot change a
// restored job):
//
//   {"format_version":1,"display_name":"...","request_id":"...","seed":7,
//    "precision":"fp16",
//    "model":{"layers":[{"kind":"linear","in_features":16,"out_features":64,
//                        "bias":true},{"kind":"gelu"},...],
//             "loss":"mse","loss_multiplier":1},
//    "optimizer":{"kind":"adamw","lr":0.001,"beta1":0.9,"beta2":0.999,
//                 "eps":1e-08,"weight_decay":0.01,"max_grad_norm":0},
//    "scaler":{"policy":"pytorch","enabled":true,"dynamic":true,
//              "init_scale":65536,...,"min_scale":1,"max_scale":16777216}}
//
// request_id, min_scale and max_scale are present only when set.
// Version 2 adds the adaptive scaler policy, whose scaler object also
// carries overflow_margin_log2 and underflow_threshold (and only its does).
// A config version 1 can hold (any other policy) is still written as
// version 1, byte for byte as before, so that an ampd predating version 2
// can restore it; the reader takes both. Version 3 adds learning-rate
// schedules and the GPT: an optimizer with a schedule other than constant
// carries "lr_schedule":{"kind":"warmup_cosine","warmup_steps":W,
// "decay_steps":D,"min_lr":M}, and a GPT's model carries "gpt":{"vocab_size",
// "context_length","d_model","n_layer","n_head","mlp_ratio","layer_norm_eps",
// "tie_embeddings"} beside an empty layers array. A config with neither is
// written as version 1 or 2 as before, byte for byte. Version 4 adds the
// data-parallel replica's place: "distributed":{"world_size","rank","group",
// "rendezvous","timeout_ms"} after the scaler, written only for a job of
// world_size > 1 (any other is written as before). Version 5 adds
// per-layer loss scales: an adaptive scaler object carries
// "per_layer_scales":true last, written only when they are on (such a
// config is never distributed, so 4 and 5 never meet). Version 6 adds the
// Llama/Qwen2 decoder: its model carries "decoder":{"vocab_size",
// "hidden_size","intermediate_size","num_hidden_layers",
// "num_attention_heads","num_key_value_heads","head_dim","rms_norm_eps",
// "rope_theta","max_position_embeddings","tie_word_embeddings",
// "initializer_range","qkv_bias","o_bias"} beside an empty layers array
// (written only for a decoder, whatever else the config holds). Version 7
// adds a decoder's LoRA adapters ("lora":{"rank","alpha","target_modules"}
// in the decoder object), written only for a LoRA job. Version 8 adds
// "batch_invariant":true last, written only when it is on. Version 9 adds
// a decoder's RoPE scaling ("rope_scaling":{"rope_type","factor",
// "low_freq_factor","high_freq_factor","original_max_position_embeddings"}
// after "o_bias"), written only when its type is not "default". Version
// 10 adds a decoder's per-head q/k norm ("qk_norm":true right after
// "o_bias"), written only when it is on. Version 11 adds
// "base_model":"NAME" last, written only for a job made from a base model
// of --models-dir. Version 12 adds Gemma 3's parts
// ("gemma":{"norm_unit_offset","mlp_activation" ("silu" or "gelu_tanh"),
// "sandwich_norms","scale_embeddings","query_pre_attn_scalar",
// "sliding_layers" (one "0" or "1" per layer, "" for none),
// "sliding_window","rope_local_theta"} after "qk_norm"'s place), written
// only when one of them differs from the Llama default. A layer
// carries the fields of its kind only (linear: in_features, out_features,
// bias; layer_norm: normalized_shape, eps, elementwise_affine; embedding:
// num_embeddings, embedding_dim); the optimizer those of its kind (sgd: lr,
// momentum, dampening, weight_decay, nesterov; adam and adamw: lr, beta1,
// beta2, eps, weight_decay; all: max_grad_norm). float32 values are written
// with 9 significant digits and float64 values with 17, which read back to
// the same bits; integers are written exactly.
//
// The reader is strict: every key of the format must be present, an
// unknown key, a wrong type, a duplicate key or a format_version other than
// the one it reads is an error naming the key, and the decoded config must
// pass ValidateJobConfig (DecodeJobConfig returns it as a ValidJobConfig).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/config/job_config.h"

namespace ampd::engine {

// The newest format_version: EncodeJobConfig writes the oldest version that
// holds a config (12 for a decoder with Gemma 3's parts, 11 for a job on a base model, 10 for a
// decoder with qk_norm, 9 for one with RoPE
// scaling, 8 batch-invariant, 7 for a decoder with LoRA, 6 for a decoder,
// 5 with per-layer loss scales, 4 for a distributed job, else 3 with an lr
// schedule or a GPT, else 2 for adaptive-scaler configs, else 1),
// DecodeJobConfig reads 1 to it.
inline constexpr int kJobConfigFormatVersion = 12;

// A job's config and the request_id it was created with ("" when none), as
// an older checkpoint's create request decodes (not yet validated).
struct JobConfigRecord {
  JobConfig config;
  std::string request_id;
};

// A decoded ampd.config: validated once, here, so a restore holds the proof.
struct DecodedJobConfig {
  ValidJobConfig config;
  std::string request_id;
};

// The JSON text of a valid config (ValidateJobConfig: every number finite).
std::string EncodeJobConfig(const JobConfig& config, absl::string_view request_id);

// DataLoss naming the key ("ampd.config: optimizer.beta1: expected a
// number") for text that is not a config of a version it reads;
// ValidateJobConfig's error, prefixed "ampd.config: ", for one that decodes
// but is not valid.
absl::StatusOr<DecodedJobConfig> DecodeJobConfig(absl::string_view json);

}  // namespace ampd::engine
