// The parts of a Network every model kind shares: parameters, the
// workspace cache, gradient zeroing and the working-copy cast; and the
// choice of kind from the spec (layer stack, GPT, decoder).
#include "server/engine/model/network.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/layers.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine::model {

using kernels::DType;

absl::StatusOr<int64_t> WorkspaceBytes(const ModelSpec& spec, Precision precision,
                                       const kernels::Shape& input_shape) {
  if (IsSequenceModel(spec)) return TransformerWorkspaceBytes(spec, precision, input_shape);
  if (input_shape.empty()) {
    return absl::InvalidArgumentError("inputs: a batch needs at least one dimension");
  }
  return WorkspaceBytes(spec, precision, input_shape[0]);
}

kernels::ScratchExtents StepScratchExtents(const ModelSpec& spec, Precision precision,
                                           const kernels::Shape& input_shape, bool backward) {
  if (IsSequenceModel(spec))
    return TransformerScratchExtents(spec, precision, input_shape, backward);
  kernels::ScratchExtents e;
  e.dtype = WorkingDType(precision);
  const int64_t rows = input_shape.empty() ? 0 : input_shape[0];
  // A Linear (in, out) over N rows: forward (N, in) x (in, out) -> (N, out),
  // backward (N, out) x (out, in) -> (N, in) and (out, N) x (N, in) ->
  // (out, in). So every operand and result is at most N max(in, out) or
  // in out elements.
  int64_t widest = 0;
  int64_t weights = 0;
  for (const LayerSpec& layer : spec.layers) {
    if (layer.kind != LayerKind::kLinear) continue;
    widest = std::max({widest, layer.in_features, layer.out_features});
    weights = std::max(weights, SaturatingMul(layer.in_features, layer.out_features));
  }
  const int64_t activations = SaturatingMul(rows, widest);
  e.gemm_a = activations;
  e.gemm_b = std::max(activations, weights);
  e.gemm_c = std::max(activations, weights);
  // A layer stack counts its fused sums as it always has (both, for either
  // direction): its steps are small.
  e.bias_activation_c = e.gemm_c;
  e.activation_backward_c = e.gemm_c;
  if (spec.loss == LossKind::kCrossEntropy) {
    e.classes = widest;
    e.rows = rows;
  }
  return e;
}

kernels::ScratchExtents DecodeScratchExtents(const ModelSpec& spec, Precision precision,
                                             int64_t sequences) {
  kernels::ScratchExtents e;
  e.dtype = WorkingDType(precision);
  const std::optional<TransformerParts> parts = TransformerPartsOf(spec);
  if (!parts.has_value()) return e;
  // One chunk of all S rows: the sampler's logits are not split.
  AddLmHeadExtents(parts->vocab, parts->hidden, precision, sequences,
                   std::numeric_limits<int64_t>::max(), /*with_grad=*/false, e);
  return e;
}

void WidenExtents(const kernels::ScratchExtents& e, kernels::ScratchExtents& into) {
  into.gemm_a = std::max(into.gemm_a, e.gemm_a);
  into.gemm_b = std::max(into.gemm_b, e.gemm_b);
  into.gemm_c = std::max(into.gemm_c, e.gemm_c);
  into.bias_activation_c = std::max(into.bias_activation_c, e.bias_activation_c);
  into.activation_backward_c = std::max(into.activation_backward_c, e.activation_backward_c);
  into.attention_seq = std::max(into.attention_seq, e.attention_seq);
  into.head_dim = std::max(into.head_dim, e.head_dim);
  into.classes = std::max(into.classes, e.classes);
  into.rows = std::max(into.rows, e.rows);
}

absl::StatusOr<std::unique_ptr<Network>> CreateNetwork(const ModelSpec& spec, Precision precision,
                                                       uint64_t seed, kernels::Backend& backend,
                                                       std::shared_ptr<const FrozenBase> base) {
  if (base != nullptr && LoraOf(spec) == nullptr) {
    return absl::InvalidArgumentError("base_model: only a LoRA decoder shares a base's weights");
  }
  if (IsSequenceModel(spec)) {
    AMPD_ASSIGN_OR_RETURN(std::unique_ptr<TransformerModel> transformer,
                          TransformerModel::Create(spec, precision, seed, backend,
                                                   kLmHeadChunkBytes, std::move(base)));
    return std::unique_ptr<Network>(std::move(transformer));
  }
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<Model> stack,
                        Model::Create(spec, precision, seed, backend));
  return std::unique_ptr<Network>(std::move(stack));
}

Network::Network(const ModelSpec& spec, Precision precision, kernels::Backend& backend)
    : backend_(backend),
      spec_(spec),
      precision_(precision),
      working_dtype_(WorkingDType(precision)) {}

Network::~Network() {
  if (frozen_base_ != nullptr) (void)backend_.Synchronize();
}

absl::StatusOr<int> Network::AddParameter(std::string name, const kernels::Shape& shape,
                                          ParamInit init, bool plus_equal) {
  Parameter p;
  p.name = std::move(name);
  // Everything is drawn on the backend, straight into the master: no host
  // staging vector, so a parameter too large for the device is refused by
  // its allocation's Status and nothing on the host grows with it.
  AMPD_ASSIGN_OR_RETURN(p.master, backend_.Allocate(DType::kF32, shape));
  if (init.random) {
    init.fill.stream = params_.size();
    AMPD_RETURN_IF_ERROR(backend_.FillRandom(p.master, init.fill));
  } else {
    AMPD_RETURN_IF_ERROR(backend_.Fill(p.master, init.value));
  }
  if (working_dtype_ != DType::kF32) {
    AMPD_ASSIGN_OR_RETURN(p.working, backend_.Allocate(working_dtype_, shape));
  }
  AMPD_ASSIGN_OR_RETURN(p.grad, backend_.Allocate(working_dtype_, shape));
  parameter_count_ += p.master.numel();
  const auto index = static_cast<int>(params_.size());
  params_.push_back(std::move(p));
  trainable_.push_back(index);
  if (plus_equal) plus_equal_grads_.push_back(index);
  return index;
}

absl::StatusOr<int> Network::AddFrozenParameter(std::string name, const kernels::Shape& shape,
                                                ParamInit init) {
  Parameter p;
  p.name = std::move(name);
  p.frozen = true;
  if (frozen_base_ != nullptr) {
    if (frozen_base_->precision() != precision_) {
      return absl::InternalError("base_model: the shared base is held in another precision");
    }
    AMPD_ASSIGN_OR_RETURN(kernels::Tensor view, frozen_base_->View(p.name, shape));
    (working_dtype_ == DType::kF32 ? p.master : p.working) = std::move(view);
    p.shared = true;
    parameter_count_ += p.held().numel();
    const auto index = static_cast<int>(params_.size());
    params_.push_back(std::move(p));
    return index;
  }
  // Drawn in F32 as a trainable parameter's master is; a 16-bit job keeps
  // the rounded copy only (the F32 draw is freed on return).
  AMPD_ASSIGN_OR_RETURN(kernels::Tensor drawn, backend_.Allocate(DType::kF32, shape));
  if (init.random) {
    init.fill.stream = params_.size();
    AMPD_RETURN_IF_ERROR(backend_.FillRandom(drawn, init.fill));
  } else {
    AMPD_RETURN_IF_ERROR(backend_.Fill(drawn, init.value));
  }
  if (working_dtype_ == DType::kF32) {
    p.master = std::move(drawn);
  } else {
    AMPD_ASSIGN_OR_RETURN(p.working, backend_.Allocate(working_dtype_, shape));
    // Freeing the draw after a queued cast is safe: the backends free in
    // stream order.
    AMPD_RETURN_IF_ERROR(backend_.Cast(drawn, p.working));
  }
  parameter_count_ += p.held().numel();
  const auto index = static_cast<int>(params_.size());
  params_.push_back(std::move(p));
  return index;
}

absl::Status Network::CheckFrozenBaseUsed() const {
  if (frozen_base_ == nullptr) return absl::OkStatus();
  std::set<std::string> viewed;
  for (const Parameter& p : params_) {
    if (p.shared) viewed.insert(p.name);
  }
  for (const std::string& name : frozen_base_->names()) {
    if (!viewed.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.base_model: ", frozen_base_->identity().name, ": ", name,
                       ": not a weight of the model its config.json describes"));
    }
  }
  return absl::OkStatus();
}

absl::Status Network::CastWorking() {
  if (working_dtype_ == DType::kF32) return absl::OkStatus();
  for (Parameter& p : params_) {
    if (!p.frozen) AMPD_RETURN_IF_ERROR(backend_.Cast(p.master, p.working));
  }
  return absl::OkStatus();
}

absl::Status Network::ZeroGrads() {
  // Pointers into params_, which stops growing once the model is built (and
  // LoadState move-assigns into the same tensors): listed on the first call,
  // then the list is reused.
  if (zeroed_grads_.size() != plus_equal_grads_.size()) {
    zeroed_grads_.clear();
    for (int p : plus_equal_grads_) zeroed_grads_.push_back(&params_[p].grad);
  }
  return backend_.FillTensors(zeroed_grads_, 0.0f);
}

absl::StatusOr<std::vector<std::string>> Network::CanonicalNames(
    const codec::StateDict& state) const {
  std::vector<std::string> names;
  names.reserve(state.tensors.size());
  for (const codec::NamedTensor& t : state.tensors) names.push_back(t.name);
  return names;
}

void Network::AnnotateExport(codec::StateDict&) const {}

namespace {
absl::Status NotALanguageModel() {
  return absl::InvalidArgumentError("sampling: needs a language model (gpt or decoder)");
}
}  // namespace

absl::StatusOr<int64_t> Network::DecodeStateBytes(int64_t, int64_t) const {
  return NotALanguageModel();
}

absl::StatusOr<std::unique_ptr<DecodeState>> Network::NewDecodeState(int64_t sequences,
                                                                     int64_t max_len) {
  AMPD_RETURN_IF_ERROR(DecodeStateBytes(sequences, max_len).status());
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<DecodeState> state, MakeDecodeState(sequences, max_len));
  state->owner_ = this;
  state->sequences_ = sequences;
  state->max_len_ = max_len;
  return state;
}

absl::StatusOr<std::unique_ptr<DecodeState>> Network::MakeDecodeState(int64_t, int64_t) {
  return NotALanguageModel();
}

absl::Status Network::Prefill(Workspace&, absl::Span<const int64_t>, DecodeState&) {
  return NotALanguageModel();
}

absl::Status Network::DecodeStep(absl::Span<const int64_t>, absl::Span<const int64_t>,
                                 DecodeState&) {
  return NotALanguageModel();
}

absl::Status Network::CheckGroupScaleCount(absl::Span<const float> scales) const {
  const int64_t groups = LayerScaleGroups(spec_);
  if (static_cast<int64_t>(scales.size()) == groups) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("per_layer_scales: ", scales.size(), " scales for ", groups, " layer groups"));
}

absl::StatusOr<Workspace*> Network::GetWorkspace(const kernels::Shape& input_shape) {
  auto it = workspaces_.find(input_shape);
  if (it != workspaces_.end()) return it->second.ws.get();
  if (workspaces_.size() >= kMaxWorkspaces) ReleaseWorkspaces();
  AMPD_ASSIGN_OR_RETURN(const int64_t bytes, BytesFor(input_shape));
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<Workspace> ws, NewWorkspace(input_shape));
  ws->owner_ = this;
  ws->shape_ = input_shape;
  cached_workspace_bytes_ = SaturatingAdd(cached_workspace_bytes_, bytes);
  Cached& cached = workspaces_[input_shape];
  cached.ws = std::move(ws);
  cached.bytes = bytes;
  return cached.ws.get();
}

void Network::KeepWorkspaces(const std::vector<kernels::Shape>& shapes) {
  for (auto it = workspaces_.begin(); it != workspaces_.end();) {
    bool keep = false;
    for (const kernels::Shape& s : shapes) keep = keep || s == it->first;
    if (keep) {
      ++it;
      continue;
    }
    cached_workspace_bytes_ -= it->second.bytes;
    it = workspaces_.erase(it);
  }
}

void Network::ReleaseWorkspaces() {
  workspaces_.clear();
  cached_workspace_bytes_ = 0;
}

absl::Status EnsureTensor(kernels::Backend& backend, kernels::DType dtype,
                          const kernels::Shape& shape, kernels::Tensor& t) {
  if (!t.empty() && t.dtype() == dtype && t.shape() == shape) return absl::OkStatus();
  AMPD_ASSIGN_OR_RETURN(t, backend.Allocate(dtype, shape));
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
