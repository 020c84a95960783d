// StateDict: a job's full state as named host tensors plus string metadata,
// the in-memory form of a safetensors file. Naming (PyTorch's, so a state
// dict reads naturally next to torch's):
//   model.{i}.weight, model.{i}.bias            F32 master weights, layer i
//   optimizer.{param}.exp_avg / .exp_avg_sq     Adam/AdamW moments (F32)
//   optimizer.{param}.momentum_buffer           SGD momentum (F32)
// and metadata:
//   scaler.{key}      the scaler's state_dict, keys as SCALER.md names them
//                     per policy, values as decimal text (exact round trip)
//   optimizer.step    optimizer updates applied so far
//   ampd.step         Step calls run so far (the job's sequence number)
//   ampd.*            other job bookkeeping, written by its owner
#pragma once

#include <map>
#include <string>
#include <vector>

#include "server/engine/host_tensor.h"

namespace ampd::engine::checkpoint {

struct NamedTensor {
  std::string name;
  HostTensor tensor;
};

struct StateDict {
  std::vector<NamedTensor> tensors;  // in a stable order (model order)
  std::map<std::string, std::string> metadata;

  // nullptr when absent.
  const HostTensor* Find(absl::string_view name) const;
};

}  // namespace ampd::engine::checkpoint
