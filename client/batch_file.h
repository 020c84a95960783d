// What `ampctl train` needs to train on the user's own data: the compact
// model flags (--layers, --loss) and batch files. A batch file is a
// safetensors file (what safetensors.torch.save_file / safetensors.numpy
// write) holding inputs.<i> and targets.<i> for i = 0..B-1:
//   inputs.<i>   F32/F16/BF16 (N, in_features), or I32/I64 (N) ids when the
//                first layer is an Embedding
//   targets.<i>  F32 (N, out) for MSE, I32/I64 (N) labels for cross-entropy
// Each batch is checked here, before a job exists, with the codec's batch
// rule the engine applies to every Step (codec/batch_layout.h), so a bad file
// fails fast and the message names the file's tensor ("targets.1") instead
// of the wire field a server would. The model itself is the server's to
// judge: CreateJob refuses one whose sizes do not chain, before any job
// exists. Nothing here links the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ampd/v1/trainer.pb.h"
#include "codec/batch_layout.h"

namespace ampd {

// --layers: comma-separated layers, each a kind and its sizes:
//   linear:IN:OUT  linear:IN:OUT:nobias  relu  gelu  tanh
//   layer_norm:N  (or layernorm:N)  embedding:VOCAB:DIM (first layer only)
// Or the whole model as a GPT: gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD (the
// other GPT fields take the server's defaults; --loss may only be
// cross_entropy or empty), or a Llama/Qwen2 decoder:
// llama:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS[:CONTEXT] without biases,
// qwen2:... with q/k/v biases, qwen3:... with the per-head q/k norm,
// gemma3:... with Gemma 3's parts (every layer global) (CONTEXT,
// max_position_embeddings, 2048 when not given; the rest the server's
// defaults).
// --loss: "mse" or "cross_entropy" ("cross-entropy" and "ce" too).
// Fields the flags do not give (eps, loss_multiplier) stay unset, for the
// server's defaults. InvalidArgument naming the flag and the offending item
// otherwise; whether the sizes chain is the server's check (CreateJob).
absl::StatusOr<v1::ModelSpec> ParseModelFlags(absl::string_view layers, absl::string_view loss);

// LoRA adapters on a decoder spec from --lora-rank, --lora-alpha (unset:
// the rank, PEFT's default scale of 1) and --lora-targets (comma-separated
// module names; empty: the server's default, q/k/v/o_proj). InvalidArgument
// naming the flag when the model is not a decoder or an item is empty;
// the values themselves are the server's check (CreateJob).
absl::Status ApplyLoraFlags(int64_t rank, std::optional<double> alpha, absl::string_view targets,
                            v1::ModelSpec& spec);

// The batch layout of `model` as the wire describes it: a GPT's token
// sequences ((B, T) ids, T <= context_length, next-token targets or -100),
// a decoder's likewise up to max_position_embeddings;
// otherwise ids when the first layer is an embedding, else the first sized
// layer's input width; labels for cross-entropy, else the width the last
// layer produces. For a model
// whose sizes chain it is the layout the engine derives from the same model.
codec::BatchLayout BatchLayoutOf(const v1::ModelSpec& model);

// The batches of a safetensors batch file's bytes, in index order, each
// checked against `layout`. InvalidArgument naming the missing, unexpected or
// malformed tensor ("targets.1 is missing", "inputs.0: expected ...").
absl::StatusOr<std::vector<v1::MicroBatch>> BatchesFromSafetensors(
    absl::string_view bytes, const codec::BatchLayout& layout);

// The file's bytes; InvalidArgument when it cannot be read (a usage error).
absl::StatusOr<std::string> ReadBatchFile(const std::string& path);

}  // namespace ampd
