// Lookup by name in a StateDict.
#include "server/engine/checkpoint/state_dict.h"

namespace ampd::engine::checkpoint {

const HostTensor* StateDict::Find(absl::string_view name) const {
  for (const NamedTensor& t : tensors) {
    if (t.name == name) return &t.tensor;
  }
  return nullptr;
}

}  // namespace ampd::engine::checkpoint
