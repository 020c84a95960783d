// What `ampctl train` needs to train on the user's own data: the compact
// model flags (--layers, --loss) and batch files. A batch file is a
// safetensors file (what safetensors.torch.save_file / safetensors.numpy
// write) holding inputs.<i> and targets.<i> for i = 0..B-1:
//   inputs.<i>   F32/F16/BF16 (N, in_features), or I32/I64 (N) ids when the
//                first layer is an Embedding
//   targets.<i>  F32 (N, out) for MSE, I32/I64 (N) labels for cross-entropy
// Everything is checked here, before a job exists, with the same rules the
// engine applies to a Step, so a bad file fails fast and the message names
// the file's tensor ("targets.1") instead of the wire field a server would.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ampd/v1/trainer.pb.h"
#include "server/engine/host_tensor.h"
#include "server/engine/model/model_spec.h"

namespace ampd {

// --layers: comma-separated layers, each a kind and its sizes:
//   linear:IN:OUT  linear:IN:OUT:nobias  relu  gelu  tanh
//   layer_norm:N  (or layernorm:N)  embedding:VOCAB:DIM (first layer only)
// --loss: "mse" or "cross_entropy" ("cross-entropy" and "ce" too).
// The result passed ValidateModelSpec (the engine's own check, so sizes that
// do not chain are reported here as "--layers: layers[2].in_features ...").
// InvalidArgument naming the flag and the offending item otherwise.
absl::StatusOr<engine::model::ModelSpec> ParseModelFlags(absl::string_view layers,
                                                         absl::string_view loss);

// The batches of a safetensors batch file's bytes, in index order, each
// checked against `model`. InvalidArgument naming the missing, unexpected or
// malformed tensor ("targets.1 is missing", "inputs.0: expected ...").
absl::StatusOr<std::vector<v1::MicroBatch>> BatchesFromSafetensors(
    absl::string_view bytes, const engine::model::ModelSpec& model);

// The file's bytes; InvalidArgument when it cannot be read (a usage error).
absl::StatusOr<std::string> ReadBatchFile(const std::string& path);

}  // namespace ampd
