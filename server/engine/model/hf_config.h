// The server's one reading of a Hugging Face config.json (what
// transformers' save_pretrained writes beside the weights) as a ModelSpec,
// for jobs made from a base model of --models-dir. It maps the keys the
// Python client's families map (client/python/ampd/families/: gpt2.py, and
// llama.py, qwen2.py, qwen3.py over _decoder.py, gemma3.py), with the same defaults
// and the same refusals, so that a base_model job is the model
// ampd.from_pretrained makes of the same folder; a family added to one
// belongs in the other (tests/engine/hf_config_test.cc, and
// test_hf_transformers.py's server tests, which hold them to each other).
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

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
// The spec is not yet validated (ValidateModelSpec).
absl::StatusOr<ModelSpec> ModelSpecOfHfConfig(absl::string_view config_json);

}  // namespace ampd::engine::model
