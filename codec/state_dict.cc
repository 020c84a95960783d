// Lookup by name in a StateDict.
#include "codec/state_dict.h"

namespace ampd::codec {

const HostTensor* StateDict::Find(absl::string_view name) const {
  for (const NamedTensor& t : tensors) {
    if (t.name == name) return &t.tensor;
  }
  return nullptr;
}

}  // namespace ampd::codec
