// The server's one mapping between a Hugging Face config.json (what
// transformers' save_pretrained writes beside the weights) and a ModelSpec,
// both ways: read for a job made from a folder (JobConfig.hf_config_json,
// the Python client's ampd.from_pretrained and ampctl train --from-hf send
// the file's text) and for a base model of --models-dir; written for an
// export (Job.hf_config_json, which job.save_pretrained and ampctl state
// export --hf-dir put beside the weights). Each family is one entry of
// hf_config.cc's table: its model_type, its reader (the keys it maps and
// the ones it refuses), which specs it owns, and its writer
// (hf_config_writer.cc). The rpc layer sees this header (the engine's face).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

// The most layers a config.json may name: far above any released model
// (hundreds), and low enough that a per-layer list is small.
inline constexpr int64_t kMaxHfConfigLayers = 65536;

// model_type "gpt2" (GptSpec: n_embd, n_layer, n_head, n_positions,
// vocab_size, n_inner, layer_norm_epsilon, tie_word_embeddings), "llama",
// "qwen2" or "qwen3" (DecoderSpec: Hugging Face's field names and
// defaults; RoPE in transformers 4.x's rope_theta + rope_scaling or 5.x's
// rope_parameters; llama's and qwen3's attention_bias biases q, k, v and
// o_proj, qwen2 biases q, k, v; qwen3 adds the per-head q/k norm and a
// head_dim of 128 by default), "gemma3_text" (Gemma 3's parts: (1 + w)
// norms, sandwich norms, q/k norm, GeGLU, scaled embeddings,
// query_pre_attn_scalar, sliding layers from layer_types or
// sliding_window_pattern with their own RoPE base; soft-capping and
// bidirectional attention refused). What the model would compute differently
// is refused, naming the key (InvalidArgument "config.json: hidden_act:
// ..."): another model_type or activation, llama's mlp_bias, qwen2's and
// qwen3's sliding window (use_sliding_window, layer_types), partial
// rotary factors, a rope_type other than default, linear and llama3, a key
// of the wrong type.
// The layer count (num_hidden_layers, gpt2's n_layer) is refused above
// kMaxHfConfigLayers; a float key beyond float32's range is refused too.
// The spec is not yet validated (ValidateModelSpec).
absl::StatusOr<ModelSpec> ModelSpecOfHfConfig(absl::string_view config_json);

// The config.json (its text) of spec's family: gpt2 for a GPT; for a
// decoder, the family whose parts it has (llama: no q/k norm, q/k/v and o
// biased alike; qwen2: q/k/v biased, o not; qwen3: the q/k norm;
// gemma3_text: Gemma's parts), in the keys ModelSpecOfHfConfig reads back
// as spec (LoRA aside: an export's weights are the merged view).
// FailedPrecondition for a layer stack or a decoder no family owns.
absl::StatusOr<std::string> HfConfigOfModelSpec(const ModelSpec& spec);

}  // namespace ampd::engine::model
