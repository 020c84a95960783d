// The config.json an export of a job writes beside its weights, one writer
// per Hugging Face family (the inverse of hf_config.cc's readers), and the
// JSON text they are written as. hf_config.cc's family table pairs each
// reader with its writer; nothing else includes this header.
#pragma once

#include <string>

#include "codec/json_value.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model::hf {

// Each writer takes a spec its family owns (hf_config.cc checks first) and
// gives the keys transformers' AutoModelForCausalLM.from_pretrained needs
// to build the same model: transformers 4.x's names (rope_theta,
// rope_scaling), which 5.x reads too, except Gemma 3's RoPE per layer type,
// which only 5.x's rope_parameters can say.
codec::JsonValue Gpt2Config(const ModelSpec& spec);
codec::JsonValue LlamaConfig(const ModelSpec& spec);
codec::JsonValue Qwen2Config(const ModelSpec& spec);
codec::JsonValue Qwen3Config(const ModelSpec& spec);
codec::JsonValue Gemma3Config(const ModelSpec& spec);

// value as JSON text, two spaces an indent level (as Python's json.dump
// with indent=2 writes it), members in their order, a newline at the end.
std::string JsonText(const codec::JsonValue& value);

}  // namespace ampd::engine::model::hf
