// StateDict: named host tensors plus string metadata, the in-memory form of
// a safetensors file (safetensors.h). A job's checkpoint and an ampctl batch
// file are both one; what the names and metadata keys mean belongs to whoever
// writes them (the engine's are listed in server/engine/checkpoint/state_dict.h).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "codec/host_tensor.h"

namespace ampd::codec {

struct NamedTensor {
  std::string name;
  HostTensor tensor;
};

struct StateDict {
  std::vector<NamedTensor> tensors;  // in a stable order (the file's order)
  std::map<std::string, std::string> metadata;

  // nullptr when absent.
  const HostTensor* Find(absl::string_view name) const;
};

}  // namespace ampd::codec
