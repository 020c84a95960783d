// Model: the layers of a ModelSpec built on one Backend, their parameters
// (fp32 master, working copy, gradient) and the forward/backward passes of
// the mixed-precision step. Activations and gradients live in the working
// dtype; the Backend does LayerNorm statistics and the losses in fp32.
// Buffers for a batch size are allocated once and reused (Workspace), so a
// step of a size seen before allocates nothing on the device; their size is
// known before they are allocated (WorkspaceBytes), so it can be admitted
// against a memory limit first.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/host_tensor.h"
#include "server/engine/model/model_spec.h"

namespace ampd::engine::model {

struct Parameter {
  std::string name;         // "model.{i}.weight" / "model.{i}.bias" (state_dict.h)
  kernels::Tensor master;   // F32, what the optimizer updates and the state dict holds
  kernels::Tensor working;  // F16/BF16 copy the GEMMs read; empty for fp32 jobs
  kernels::Tensor grad;     // working dtype (F32 for fp32), accumulated over micro-batches

  // The tensor forward/backward read: the working copy, or the master in fp32.
  const kernels::Tensor& value() const { return working.empty() ? master : working; }
};

// Buffers for one batch size N. acts[i] is layer i's input and acts[i + 1]
// its output; grads[i] is dL/dacts[i] (grads[0] is never computed: inputs
// need no gradient).
struct Workspace {
  int64_t rows = 0;
  kernels::Tensor staging;             // (N, C) host dtype when it differs from the working one
  std::vector<kernels::Tensor> acts;   // acts[0]: (N, C) working dtype or (N) ids
  std::vector<kernels::Tensor> grads;  // same shapes as acts (float layers only)
  std::vector<kernels::Tensor> mean;   // (N) F32 per LayerNorm layer, else empty
  std::vector<kernels::Tensor> rstd;   // (N) F32 per LayerNorm layer, else empty
  kernels::Tensor targets;             // (N, out) F32 for MSE, (N) labels for cross-entropy
};

// Bytes of the Workspace a micro-batch of `rows` rows needs: for every
// layer boundary i (widths w_i, the input width first), the activation
// rows x w_i and its gradient rows x w_i in the working dtype (2 bytes for
// fp16/bf16, 4 for fp32; the input's gradient only as a LayerNorm-first
// scratch; Embedding ids as rows x 8), 2 x rows x 4 for each LayerNorm's
// mean and rstd, the targets (rows x out x 4 for MSE, rows x 8 labels for
// cross-entropy) and rows x in x 4 for the input staging buffer. An upper
// bound of what AllocateWorkspace allocates, computed with overflow checks
// before anything is allocated: InvalidArgument when it overflows int64.
absl::StatusOr<int64_t> WorkspaceBytes(const ModelSpec& spec, Precision precision, int64_t rows);

class Model {
 public:
  // Builds the layers for a validated spec and initialises the masters on
  // the backend with PyTorch's default distributions: parameter k (in
  // params() order: layer by layer, weight before bias) draws from Philox
  // stream k of seed (init.h). Then casts the working copy.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelSpec& spec, Precision precision,
                                                       uint64_t seed, kernels::Backend& backend);

  const ModelSpec& spec() const { return spec_; }
  kernels::DType working_dtype() const { return working_dtype_; }
  std::vector<Parameter>& params() { return params_; }
  const std::vector<Parameter>& params() const { return params_; }
  int64_t parameter_count() const { return parameter_count_; }

  // The cached buffers for a batch of `rows` (allocated on first use).
  absl::StatusOr<Workspace*> GetWorkspace(int64_t rows);
  // Frees the cached workspaces whose row count is not in `rows` (a step
  // calls it with its own sizes first, so sizes it no longer uses never
  // stay allocated beside the ones it needs).
  void KeepWorkspaces(const std::vector<int64_t>& rows);
  // Frees every cached workspace.
  void ReleaseWorkspaces();
  // WorkspaceBytes summed over the cached workspaces.
  int64_t cached_workspace_bytes() const { return cached_workspace_bytes_; }
  // Copies a validated micro-batch into ws: float inputs are cast to the
  // working dtype, ids and targets keep their dtype.
  absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets, Workspace& ws);
  absl::Status Forward(Workspace& ws);
  // loss (1, 1) F32 = multiplier * loss; dL/dpred * grad_scale into grads.back().
  absl::Status Loss(Workspace& ws, float grad_scale, kernels::Tensor& loss);
  // Every parameter's gradient from grads.back(). The first micro-batch of
  // a step writes Linear gradients with beta = 0 (no zeroing pass over the
  // largest tensors); later ones accumulate with beta = 1. LayerNorm and
  // Embedding gradients always accumulate (+=), so ZeroGrads clears them.
  absl::Status Backward(Workspace& ws, bool first_micro_batch);

  // Zeroes the gradients Backward accumulates with += whatever the
  // micro-batch (LayerNorm, Embedding); call once at step start.
  absl::Status ZeroGrads();
  // working <- master (rounded RNE); a no-op for fp32.
  absl::Status CastWorking();

 private:
  struct LayerParams {
    int weight = -1;  // index into params_, -1 when absent
    int bias = -1;
  };

  // How a master starts: draws (fill, whose stream AddParameter sets to the
  // parameter's index) or the constant value.
  struct ParamInit {
    bool random = false;
    kernels::RandomFill fill;
    float value = 0.0f;
  };

  Model(const ModelSpec& spec, Precision precision, kernels::Backend& backend);
  // Allocates the parameter's tensors and initialises the master on the
  // backend as `init` says.
  absl::Status AddParameter(int64_t layer, const char* suffix, const kernels::Shape& shape,
                            ParamInit init);
  absl::Status AllocateWorkspace(int64_t rows, Workspace& ws);

  ModelSpec spec_;
  kernels::DType working_dtype_;
  kernels::Backend& backend_;
  std::vector<Parameter> params_;
  std::vector<LayerParams> layer_params_;  // one per layer
  std::vector<int> plus_equal_grads_;      // params whose backward only accumulates
  std::vector<int64_t> widths_;            // widths_[i]: features of acts[i]
  int64_t parameter_count_ = 0;
  // Batch sizes seen recently; cleared when it grows past kMaxWorkspaces so
  // a client cycling through sizes cannot grow memory without bound (the
  // Trainer also keeps only the sizes of the last step, and none at all
  // once they exceed its cache cap).
  static constexpr size_t kMaxWorkspaces = 4;
  std::map<int64_t, Workspace> workspaces_;
  int64_t cached_workspace_bytes_ = 0;
  Precision precision_;
};

}  // namespace ampd::engine::model
