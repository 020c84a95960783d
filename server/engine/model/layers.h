// Model: the layer stack of a ModelSpec as a Network (network.h) on one
// Backend, its parameters (fp32 master, working copy, gradient) and the
// forward/backward passes of the mixed-precision step. Activations and
// gradients live in the working dtype; the Backend does LayerNorm
// statistics and the losses in fp32. Buffers for a batch size are allocated
// once and reused (Workspace), so a step of a size seen before allocates
// nothing on the device; their size is known before they are allocated
// (WorkspaceBytes), so it can be admitted against a memory limit first.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/host_tensor.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

// Buffers for one batch size N. acts[i] is layer i's input and acts[i + 1]
// its output; grads[i] is dL/dacts[i] (grads[0] is never computed: inputs
// need no gradient).
struct LayerWorkspace : Workspace {
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

class Model final : public Network {
 public:
  // Builds the layers for a validated layer-stack spec and initialises the
  // masters on the backend with PyTorch's default distributions: parameter
  // k (in params() order: layer by layer, weight before bias) draws from
  // Philox stream k of seed (init.h); names "model.{i}.weight" /
  // "model.{i}.bias". Then casts the working copy.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelSpec& spec, Precision precision,
                                                       uint64_t seed, kernels::Backend& backend);

  // The cached buffers for a batch of `rows` (GetWorkspace of its shape).
  absl::StatusOr<Workspace*> GetWorkspace(int64_t rows);
  using Network::GetWorkspace;

  // Float inputs are cast to the working dtype, ids and targets keep their
  // dtype.
  // A layer stack has no token loss (CheckTokenLossInputs refuses one).
  using Network::LoadBatch;
  absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                         const TokenLossInputs& tokens, Workspace& ws) override;
  absl::Status Forward(Workspace& ws) override;
  // dL/dpred * grad_scale into grads.back() (no parameter's gradient, so
  // first_micro_batch changes nothing).
  using Network::Loss;
  absl::Status Loss(Workspace& ws, float grad_scale, bool first_micro_batch,
                    kernels::Tensor& loss) override;
  // Linear gradients by GEMM with beta = 0 on the first micro-batch;
  // LayerNorm and Embedding gradients always accumulate (+=).
  // With group scales set, a Linear that starts group g >= 1 writes its dx
  // with GEMM alpha = S_{g-1} / S_g: the fp32 sum is scaled before its one
  // rounding, so for powers of two dx is exactly the upstream gradient at
  // group g - 1's scale (unless it leaves fp16's range), at no extra pass.
  // Group entries: the loss gradient (last group) and each such dx.
  using Network::Backward;
  absl::Status Backward(Workspace& ws, bool first_micro_batch, const BackwardHooks& hooks) override;

  std::vector<int> ParamScaleGroups() const override;
  absl::Status SetGroupScales(absl::Span<const float> scales) override;

 protected:
  absl::StatusOr<int64_t> BytesFor(const kernels::Shape& input_shape) const override;
  absl::StatusOr<std::unique_ptr<Workspace>> NewWorkspace(
      const kernels::Shape& input_shape) override;

 private:
  struct LayerParams {
    int weight = -1;  // index into params(), -1 when absent
    int bias = -1;
  };

  Model(const ModelSpec& spec, Precision precision, kernels::Backend& backend);

  std::vector<LayerParams> layer_params_;  // one per layer
  std::vector<int64_t> widths_;            // widths_[i]: features of acts[i]
  std::vector<int> layer_group_;           // one per layer: its scale group
  // One per layer: the alpha of a group-starting Linear's dx GEMM
  // (S_{g-1} / S_g), 1 everywhere else and without group scales.
  std::vector<float> dx_scale_;
};

}  // namespace ampd::engine::model
