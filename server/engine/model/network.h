// Network: what the Trainer needs of a model, whatever its kind (the layer
// stack of layers.h, or the one transformer of
// transformer/transformer_model.h, a GPT or a decoder): its parameters (fp32
// master, working copy, gradient), per-batch-shape buffers whose size is
// known before they are allocated, and the passes of the mixed-precision
// step. A step calls, per micro-batch, GetWorkspace(inputs.shape),
// LoadBatch, Forward, Loss and Backward; an evaluation calls the same
// without Backward.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "codec/state_dict.h"
#include "kernels/backend.h"
#include "server/engine/api.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/host_tensor.h"
#include "server/engine/model/frozen_base.h"

namespace ampd::engine::model {

// A trainable parameter has all three tensors below (working empty in fp32).
// A frozen one (a LoRA job's base weights) is held once, in the working
// dtype: the working copy of a 16-bit job (no master) or the F32 master of
// an fp32 one, and never has a gradient, an optimizer state or an update;
// that is what makes a LoRA job cost about 2 bytes per base parameter in
// fp16/bf16 instead of 16.
struct Parameter {
  std::string name;         // its state-dict name (state_dict.h, model/families/)
  kernels::Tensor master;   // F32, what the optimizer updates; empty when frozen in 16 bits
  kernels::Tensor working;  // F16/BF16 copy the GEMMs read; empty for fp32 jobs
  kernels::Tensor grad;     // working dtype (F32 for fp32), accumulated over
                            // micro-batches; empty when frozen
  bool frozen = false;
  // Frozen and a view of a base model's tensor shared with other jobs
  // (frozen_base.h): never written, exported or loaded by this job.
  bool shared = false;

  // The tensor forward/backward read: the working copy, or the master in fp32.
  const kernels::Tensor& value() const { return working.empty() ? master : working; }
  // The tensor the state dict holds: the master, or a frozen 16-bit
  // parameter's working copy (exported and loaded in the working dtype).
  kernels::Tensor& held() { return master.empty() ? working : master; }
};

// A micro-batch's token loss (api.h's LossFn and MicroBatch fields) as a
// model's Loss reads it: the kind, its parameters and the per-token
// inputs, each null when absent. kModel (the default): the model's own loss.
struct TokenLossInputs {
  LossFn fn;
  const HostTensor* weights = nullptr;
  const HostTensor* advantages = nullptr;
  const HostTensor* sampling_logprobs = nullptr;
  // Whether the next Loss/EvalLoss keeps each token's log-prob
  // (Network::TokenLogprobs) and each token's loss (Network::TokenLosses).
  bool logprobs = false;
  bool token_losses = false;

  // The step's loss_fn with the micro-batch's inputs.
  static TokenLossInputs Of(const LossFn& fn, const MicroBatch& mb) {
    auto ptr = [](const std::optional<HostTensor>& t) { return t.has_value() ? &*t : nullptr; };
    return {fn, ptr(mb.weights), ptr(mb.advantages), ptr(mb.sampling_logprobs)};
  }
};

class Network;

// A language model's state for sampling S sequences of up to max_len
// positions each (Network::NewDecodeState): its KV cache and the buffers of
// one decode step over the S rows; each kind derives its own and only
// accepts those it made.
class DecodeState {
 public:
  virtual ~DecodeState() = default;
  int64_t sequences() const { return sequences_; }
  int64_t max_len() const { return max_len_; }
  // (S, C): each sequence's last token's final-norm output, the LM head's
  // input (Network::Prefill and DecodeStep write it).
  kernels::Tensor hidden;
  kernels::Tensor positions;  // (S) I64, the decode step's positions on the device
  kernels::Tensor tokens;     // (S) I64, the decode step's tokens on the device

 private:
  friend class Network;
  const Network* owner_ = nullptr;
  int64_t sequences_ = 0;
  int64_t max_len_ = 0;
};

// The buffers of one micro-batch shape; each kind of Network derives its own
// and only accepts those it made.
class Workspace {
 public:
  virtual ~Workspace() = default;
  // The inputs' shape these buffers serve.
  const kernels::Shape& shape() const { return shape_; }

 private:
  friend class Network;
  const Network* owner_ = nullptr;
  kernels::Shape shape_;
};

// Bytes of the Workspace a micro-batch whose inputs have `input_shape`
// needs through this model (an upper bound of what is allocated), computed
// with overflow checks before anything is allocated: InvalidArgument when it
// overflows int64 or the shape does not fit the model.
absl::StatusOr<int64_t> WorkspaceBytes(const ModelSpec& spec, Precision precision,
                                       const kernels::Shape& input_shape);

// What a step of a micro-batch whose inputs have `input_shape` runs
// through this model beyond its workspace: its GEMMs' largest operands and
// result, its attention and its loss (kernels::ScratchExtents), for the
// backend's Backend::ScratchBytes, which admission adds to WorkspaceBytes.
// The shape must fit the model (WorkspaceBytes succeeded for it). Without
// `backward` (an evaluation, a sampler's prefill) only the forward's GEMMs
// and the loss count.
kernels::ScratchExtents StepScratchExtents(const ModelSpec& spec, Precision precision,
                                           const kernels::Shape& input_shape, bool backward = true);

// What a sampler's decode steps run for `sequences` rows beyond the
// prompts' forward (StepScratchExtents of (S, P) without backward), whose
// blocks' ops on S <= S P rows it covers: the head over all S rows at once
// (Trainer::Sample's (S, V) logits, one GEMM however many chunks the
// prefill's head took) and the draw's and log-probs' rows over V. A
// language model's; empty extents for a layer stack.
kernels::ScratchExtents DecodeScratchExtents(const ModelSpec& spec, Precision precision,
                                             int64_t sequences);

// Widens each of `into`'s extents to e's where e's is larger (the dtype is
// left as it is): the scratch a backend reuses across a call's ops.
void WidenExtents(const kernels::ScratchExtents& e, kernels::ScratchExtents& into);

class Network {
 public:
  // With a shared base: waits for this network's queued work first, which
  // may still read the base's tensors that the last job's end frees (on
  // the base's own stream).
  virtual ~Network();
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  const ModelSpec& spec() const { return spec_; }
  Precision precision() const { return precision_; }
  kernels::DType working_dtype() const { return working_dtype_; }
  std::vector<Parameter>& params() { return params_; }
  const std::vector<Parameter>& params() const { return params_; }
  // Elements of every parameter, frozen ones included.
  int64_t parameter_count() const { return parameter_count_; }
  // The indices into params() of the parameters that train (all but the
  // frozen ones), in params()' order: what the optimizer, the loss scaler's
  // checks and the update cover.
  const std::vector<int>& trainable() const { return trainable_; }

  // The cached buffers for inputs of this shape (allocated on first use).
  absl::StatusOr<Workspace*> GetWorkspace(const kernels::Shape& input_shape);
  // Frees the cached workspaces whose shape is not in `shapes` (a step calls
  // it with its own shapes first, so shapes it no longer uses never stay
  // allocated beside the ones it needs).
  void KeepWorkspaces(const std::vector<kernels::Shape>& shapes);
  // Frees every cached workspace.
  void ReleaseWorkspaces();
  // WorkspaceBytes summed over the cached workspaces.
  int64_t cached_workspace_bytes() const { return cached_workspace_bytes_; }

  // Copies a validated micro-batch (model/batch_check.h) into ws, with the
  // token-loss inputs the next Loss trains on (CheckTokenLossInputs
  // passed; none: the model's own loss). Every LoadBatch sets them afresh,
  // so a cached workspace never carries a previous step's.
  virtual absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                                 const TokenLossInputs& tokens, Workspace& ws) = 0;
  absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets, Workspace& ws) {
    return LoadBatch(inputs, targets, TokenLossInputs{}, ws);
  }
  virtual absl::Status Forward(Workspace& ws) = 0;
  // loss (1, 1) F32 = loss_multiplier * the micro-batch's mean loss, and its
  // gradient times grad_scale into ws, where Backward starts. A kind whose
  // loss reads parameters directly (a transformer's LM head) also forms
  // their gradient here: on the update's first micro-batch
  // (first_micro_batch, as Backward's) it writes it (GEMM beta = 0: the
  // values of adding to the zeros ZeroGrads left, without reading them),
  // on a later one it adds to it; ZeroGrads clears those.
  virtual absl::Status Loss(Workspace& ws, float grad_scale, bool first_micro_batch,
                            kernels::Tensor& loss) = 0;
  // Loss adding to the gradients whatever they hold (a later micro-batch's).
  absl::Status Loss(Workspace& ws, float grad_scale, kernels::Tensor& loss) {
    return Loss(ws, grad_scale, /*first_micro_batch=*/false, loss);
  }
  // The same loss for an evaluation, leaving every parameter's gradient as
  // it was. By default Loss with grad_scale 1, whose dL/dpred stays in ws
  // only; a kind whose Loss touches parameter gradients overrides it.
  virtual absl::Status EvalLoss(Workspace& ws, kernels::Tensor& loss) {
    return Loss(ws, 1.0f, loss);
  }
  // The (N) F32 log-probs of the targets that the last Loss or EvalLoss
  // wrote, when LoadBatch asked for them (TokenLossInputs::logprobs); a
  // model without a language-model head has none (InvalidArgument).
  virtual absl::StatusOr<const kernels::Tensor*> TokenLogprobs(Workspace& ws) {
    (void)ws;
    return absl::InvalidArgumentError(
        "return_logprobs: per-token log-probs need a language model (gpt or decoder)");
  }
  // The (N) F32 per-token losses (what each target added to the loss) the
  // last Loss wrote, when LoadBatch asked for them
  // (TokenLossInputs::token_losses); none without a language-model head.
  virtual absl::StatusOr<const kernels::Tensor*> TokenLosses(Workspace& ws) {
    (void)ws;
    return absl::InvalidArgumentError(
        "return_logprobs: per-token losses need a language model (gpt or decoder)");
  }
  // What Backward calls as it goes; each may be empty, and an error from
  // either ends Backward.
  using GradsReady = std::function<absl::Status(absl::Span<const int> params)>;
  using GroupEntry = std::function<absl::Status(int group, kernels::Tensor& entry)>;
  struct BackwardHooks {
    // Called as backward finishes parameters' gradients for this
    // micro-batch, with their indices into params() (each parameter once,
    // in the same order on every run of the same model), so that a
    // distributed step can start summing them across ranks while backward
    // goes on.
    GradsReady grads_ready;
    // Per-layer scales: called once per layer group g (SetGroupScales), from
    // the last group down, with the activation gradient entering it (the
    // loss gradient for the last group; for the others what the next group
    // passed down, already at S_g) while it is whole, before backward
    // overwrites it, so that the group's check bounds what flows through
    // the group as well as its parameters' gradients.
    GroupEntry group_entry;
  };
  // Every parameter's gradient from what Loss left in ws. The first
  // micro-batch of a step writes GEMM gradients with beta = 0 (no zeroing
  // pass over the largest tensors); later ones accumulate with beta = 1.
  // Gradients that only ever accumulate (+=) are cleared by ZeroGrads.
  virtual absl::Status Backward(Workspace& ws, bool first_micro_batch,
                                const BackwardHooks& hooks) = 0;
  absl::Status Backward(Workspace& ws, bool first_micro_batch) {
    return Backward(ws, first_micro_batch, BackwardHooks{});
  }
  // Zeroes the gradients that Loss and Backward accumulate with += whatever
  // the micro-batch, all of them in one FillTensors (one launch on CUDA);
  // call once at step start. They are the ones their op cannot simply write
  // on the first micro-batch: LayerNorm's dgamma/dbeta (the op adds into
  // them), an embedding's scatter-add (it touches only the rows of the ids
  // it sees), a GPT's position table (only its first T rows, and T may
  // differ by micro-batch) and its LM head (a tied one shares wte's
  // gradient with the scatter-add; a head over several chunks adds them
  // up). Zeroing them together costs one pass over their bytes, dominated
  // by the embedding's, whatever their number.
  absl::Status ZeroGrads();
  // working <- master (rounded RNE) of every trainable parameter; a no-op
  // for fp32.
  absl::Status CastWorking();

  // This model's own name for each of a loaded state dict's tensors, in
  // order ("" for a tensor it ignores): e.g. a GPT accepts Hugging Face's
  // variants. InvalidArgument for what cannot belong to it. The default
  // takes the names as they are.
  virtual absl::StatusOr<std::vector<std::string>> CanonicalNames(
      const codec::StateDict& state) const;
  // Metadata this model's exported state dicts carry beside the Trainer's.
  virtual void AnnotateExport(codec::StateDict& state) const;

  // ---- sampling (language models: a GPT, a decoder) ------------------------
  // A sampler runs the model's own forward on the prompts (S sequences
  // right-padded to P tokens: causal, so a sequence's rows never read its
  // padding), then one token per sequence at a time against a KV cache.
  // Every row goes through the same model code and kernels as training's
  // forward (the decode step shares each block's code with Forward; only
  // the attention reads the cache, Backend::AttentionDecode), so with
  // batch-invariant kernels (Backend::SetBatchInvariant) a token's
  // log-prob is the training forward's bit for bit.
  //
  // Bytes of a DecodeState for `sequences` x `max_len` (overflow-checked,
  // InvalidArgument when it overflows or max_len exceeds the model's
  // context); a model without an LM head refuses sampling.
  virtual absl::StatusOr<int64_t> DecodeStateBytes(int64_t sequences, int64_t max_len) const;
  absl::StatusOr<std::unique_ptr<DecodeState>> NewDecodeState(int64_t sequences, int64_t max_len);
  // After Forward over a workspace of (S, P) prompts: sequence s's first
  // lengths[s] positions' keys and values into the cache, and the final
  // norm's output at position lengths[s] - 1 into state.hidden.
  virtual absl::Status Prefill(Workspace& ws, absl::Span<const int64_t> lengths,
                               DecodeState& state);
  // One token per sequence (tokens[s] at positions[s], each < max_len): the
  // forward of those S rows, their keys and values written into the cache
  // at their positions, the final norm's output into state.hidden.
  virtual absl::Status DecodeStep(absl::Span<const int64_t> tokens,
                                  absl::Span<const int64_t> positions, DecodeState& state);
  // The LM head's weight (V, C) as the loss's GEMM reads it; null for a
  // model without one.
  virtual const Parameter* LmHead() const { return nullptr; }

  // LoRA (a decoder's, transformer/lora.h): each adapter as indices
  // into params() of the frozen weight W (out, in) it adapts and of its A
  // (r, in) and B (out, r), in params()' order of the A's; empty for a model
  // without adapters. The adapted weight is W + scale B A.
  struct AdapterRef {
    int weight = -1;
    int a = -1;
    int b = -1;
  };
  virtual std::vector<AdapterRef> Adapters() const { return {}; }
  virtual float AdapterScale() const { return 0.0f; }
  // PEFT's adapter_config.json for the adapters ("" without any).
  virtual std::string AdapterConfigJson() const { return ""; }
  // The shared base whose tensors the frozen parameters view (nullptr: the
  // job holds its own).
  const FrozenBase* frozen_base() const { return frozen_base_.get(); }

  // Per-layer loss scales (amp/grad_scaler.h): the layer group of each
  // parameter in params() order, groups numbered from 0 in forward order
  // (model::LayerScaleGroups of them).
  virtual std::vector<int> ParamScaleGroups() const = 0;
  // The groups' scales for the backward passes that follow: where the
  // upstream gradient leaves group g for group g - 1 it is multiplied by
  // scales[g - 1] / scales[g], in a pass backward makes anyway (a GEMM's
  // alpha, a residual add's scale). A host-side setting (nothing runs on
  // the device). InvalidArgument unless there is one scale per group.
  virtual absl::Status SetGroupScales(absl::Span<const float> scales) = 0;

 protected:
  // How a master starts: draws (fill, whose stream AddParameter sets to the
  // parameter's index) or the constant value.
  struct ParamInit {
    bool random = false;
    kernels::RandomFill fill;
    float value = 0.0f;
  };

  Network(const ModelSpec& spec, Precision precision, kernels::Backend& backend);

  // Allocates a parameter's tensors, initialises the master on the backend
  // as `init` says (Philox stream = the parameter's index) and returns its
  // index in params(). plus_equal: its gradient only accumulates (ZeroGrads
  // clears it).
  absl::StatusOr<int> AddParameter(std::string name, const kernels::Shape& shape, ParamInit init,
                                   bool plus_equal);
  // A frozen parameter (see Parameter), drawn as AddParameter would draw it
  // (the same Philox stream for the same index, so a LoRA job's base equals
  // the full job's of the same seed) and held in the working dtype only;
  // with a shared base (UseFrozenBase), a view of its tensor of that name
  // instead (nothing drawn or allocated).
  absl::StatusOr<int> AddFrozenParameter(std::string name, const kernels::Shape& shape,
                                         ParamInit init);
  // The frozen parameters added from now on view `base`'s tensors; set
  // before the first of them. The network keeps it alive.
  void UseFrozenBase(std::shared_ptr<const FrozenBase> base) { frozen_base_ = std::move(base); }
  // With a shared base: InvalidArgument naming a tensor of the base that
  // no parameter views (the files hold a weight the model does not have).
  absl::Status CheckFrozenBaseUsed() const;

  // SetGroupScales' check: InvalidArgument unless there is one scale per
  // layer group (LayerScaleGroups of the spec).
  absl::Status CheckGroupScaleCount(absl::Span<const float> scales) const;

  // This kind's DecodeState for NewDecodeState (DecodeStateBytes checked).
  virtual absl::StatusOr<std::unique_ptr<DecodeState>> MakeDecodeState(int64_t sequences,
                                                                       int64_t max_len);
  // state as the derived kind D, when this network made it.
  template <typename D>
  absl::StatusOr<D*> OwnState(DecodeState& state) const {
    if (state.owner_ != this) {
      return absl::FailedPreconditionError("decode state: made by another model");
    }
    return static_cast<D*>(&state);
  }

  // This kind's WorkspaceBytes and its buffers for one input shape.
  virtual absl::StatusOr<int64_t> BytesFor(const kernels::Shape& input_shape) const = 0;
  virtual absl::StatusOr<std::unique_ptr<Workspace>> NewWorkspace(
      const kernels::Shape& input_shape) = 0;

  // ws as the derived kind W, when this network made it.
  template <typename W>
  absl::StatusOr<W*> Own(Workspace& ws) const {
    if (ws.owner_ != this) {
      return absl::FailedPreconditionError("workspace: made by another model");
    }
    return static_cast<W*>(&ws);
  }

  kernels::Backend& backend_;

 private:
  ModelSpec spec_;
  Precision precision_;
  kernels::DType working_dtype_;
  std::vector<Parameter> params_;
  std::vector<int> trainable_;
  std::vector<int> plus_equal_grads_;
  std::vector<kernels::Tensor*> zeroed_grads_;  // ZeroGrads' list, built once
  int64_t parameter_count_ = 0;
  // Shapes seen recently; cleared when it grows past kMaxWorkspaces so a
  // client cycling through shapes cannot grow memory without bound (the
  // Trainer also keeps only the shapes of the last step, until the job
  // gives them up under memory pressure).
  static constexpr size_t kMaxWorkspaces = 4;
  struct Cached {
    std::unique_ptr<Workspace> ws;
    int64_t bytes = 0;
  };
  std::map<kernels::Shape, Cached> workspaces_;
  int64_t cached_workspace_bytes_ = 0;
  std::shared_ptr<const FrozenBase> frozen_base_;
};

// Builds the model a validated spec describes (layer stack or GPT) on
// backend, its masters drawn from seed, the working copy cast. `base`
// (a LoRA decoder's only): its frozen parameters are views of that shared
// base's tensors.
absl::StatusOr<std::unique_ptr<Network>> CreateNetwork(
    const ModelSpec& spec, Precision precision, uint64_t seed, kernels::Backend& backend,
    std::shared_ptr<const FrozenBase> base = nullptr);

// Reallocates t when its dtype or shape differs from the wanted one: a
// workspace's ids, labels and targets follow the client's I32/I64 (and
// batch) choice, so this allocates only when that choice changes.
absl::Status EnsureTensor(kernels::Backend& backend, kernels::DType dtype,
                          const kernels::Shape& shape, kernels::Tensor& t);

}  // namespace ampd::engine::model
