// Hugging Face folders for ampctl, in and out: the files transformers'
// save_pretrained writes (config.json, model.safetensors or the shards
// model-0000k-of-0000n.safetensors with model.safetensors.index.json,
// generation_config.json) and the ones PEFT's writes (adapter_config.json,
// adapter_model.safetensors). Only files: what config.json means is the
// server's one mapping (JobConfig.hf_config_json in, Job.hf_config_json
// out), which ampctl sends and writes as it is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ampd/v1/trainer.pb.h"
#include "codec/state_dict.h"

namespace ampd::hf {

// transformers 5.x's save_pretrained default (4.x wrote "5GB"): shards of
// at most this many tensor bytes.
inline constexpr uint64_t kDefaultMaxShardBytes = 50'000'000'000;

// A file's bytes; InvalidArgument naming `what` and the path when unreadable.
absl::StatusOr<std::string> ReadFile(absl::string_view what, const std::string& path);

// config.json and adapter_config.json are small; a larger file is not one.
inline constexpr uint64_t kMaxJsonFileBytes = uint64_t{16} << 20;

// A JSON file's text (config.json, adapter_config.json), checked to be one
// JSON document of at most kMaxJsonFileBytes before it is sent or read:
// InvalidArgument naming `what`, the path and the problem otherwise (text
// that is not UTF-8 above all, which a request's string field cannot carry:
// the request would not even serialize).
absl::StatusOr<std::string> ReadJsonFile(absl::string_view what, const std::string& path);

// The folder's weight files in load order: the shards its
// model.safetensors.index.json names (each once, sorted), or
// model.safetensors. InvalidArgument when it has neither or the index is
// malformed.
absl::StatusOr<std::vector<std::string>> WeightFiles(const std::string& directory);

// A weight file as a LoadStateDict takes it: F16 and BF16 tensors (most
// published checkpoints) widened to F32 exactly, since every job takes F32
// weights (a full job's masters are F32; a LoRA job rounds its base to the
// working dtype itself); a file without them comes back as it is.
absl::StatusOr<std::string> WidenToF32(std::string file);

// PEFT's adapter_config.json as the LoRA of a job over a base of
// num_layers layers: r, lora_alpha and target_modules (names such as
// q_proj, dotted suffixes such as self_attn.q_proj and "all-linear" go as
// they are, for the server to read; the full paths PEFT saves after
// expanding "all-linear", model.layers.{i}.self_attn.q_proj, become their
// module when they list it in every layer). Refused, naming the key: what
// would train differently (peft_type other than LORA, bias, use_rslora,
// use_dora, rank_pattern, alpha_pattern, layers_to_transform,
// modules_to_save, lora_bias; a regular expression as target_modules).
absl::StatusOr<v1::LoRA> LoraOfPeftConfig(absl::string_view adapter_config_json,
                                          int64_t num_layers);

// "50GB", "100KB", "2GiB", or a count of bytes, as transformers'
// max_shard_size reads them (KB/MB/GB powers of 10, KiB/MiB/GiB of 2).
absl::StatusOr<uint64_t> ParseShardSize(absl::string_view text);

// What an export writes into `directory` (made if missing): config_json as
// config.json, generation_config.json, and `state` (the merged view's
// weights) as model.safetensors, or, when its tensors' bytes pass
// max_shard_bytes, as shards split the way huggingface_hub's
// split_state_dict_into_shards splits them (in order; a new shard where the
// next tensor would pass the limit; a tensor larger than it alone) with
// model.safetensors.index.json. Returns the weight files' names.
absl::StatusOr<std::vector<std::string>> WriteFolder(const std::string& directory,
                                                     const std::string& config_json,
                                                     codec::StateDict state,
                                                     uint64_t max_shard_bytes);

}  // namespace ampd::hf
