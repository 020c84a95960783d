// safetensors encoding of a StateDict: 8-byte little-endian header length,
// a JSON header ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__":
// {string: string}}), then the tensor bytes back to back. The format
// Hugging Face's safetensors library reads, so `ampctl state export` files
// open in Python with safetensors.torch.load_file.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/engine/checkpoint/state_dict.h"

namespace ampd::engine::checkpoint {

std::string EncodeSafetensors(const StateDict& state);

// InvalidArgument naming what is wrong (header length past the end, bad
// JSON, unknown dtype, offsets that overlap, leave gaps or run past the end,
// duplicate names) — never a crash on hostile bytes.
absl::StatusOr<StateDict> DecodeSafetensors(absl::string_view bytes);

}  // namespace ampd::engine::checkpoint
