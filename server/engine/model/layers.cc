// Forward and backward of every layer kind through the Backend. The layer
// math itself is in kernels/; this file wires activations, gradients and
// parameters together in the order a mixed-precision step needs (cast the
// master weights, forward, scaled backward, then unscale and update).
#include "server/engine/model/layers.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/init.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

namespace {

kernels::Activation ActivationOf(LayerKind kind) {
  switch (kind) {
    case LayerKind::kGELU:
      return kernels::Activation::kGELU;
    case LayerKind::kTanh:
      return kernels::Activation::kTanh;
    default:
      return kernels::Activation::kReLU;
  }
}

}  // namespace

absl::StatusOr<int64_t> WorkspaceBytes(const ModelSpec& spec, Precision precision, int64_t rows) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (IsSequenceModel(spec)) return absl::InvalidArgumentError("model: not a layer stack");
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows: ", rows, " < 0"));
  const auto working = static_cast<int64_t>(kernels::SizeOf(WorkingDType(precision)));
  const bool embedding_first = spec.layers.front().kind == LayerKind::kEmbedding;
  const bool layer_norm_first = spec.layers.front().kind == LayerKind::kLayerNorm;
  bool ok = true;
  int64_t total = 0;
  // total += a * b * c, remembering any overflow.
  auto add = [&](int64_t a, int64_t b, int64_t c) {
    int64_t ab = 0;
    int64_t abc = 0;
    ok = ok && CheckedMul(a, b, &ab) && CheckedMul(ab, c, &abc) && CheckedAdd(total, abc, &total);
  };
  const int64_t in = InputFeatures(spec);
  int64_t width = in;
  for (size_t i = 0; i <= spec.layers.size(); ++i) {
    if (i > 0) {
      const LayerSpec& l = spec.layers[i - 1];
      if (l.kind == LayerKind::kLinear) width = l.out_features;
      if (l.kind == LayerKind::kLayerNorm) width = l.normalized_shape;
      if (l.kind == LayerKind::kEmbedding) width = l.embedding_dim;
      if (l.kind == LayerKind::kLayerNorm) add(2, rows, 4);  // mean, rstd (N) F32
    }
    if (i == 0 && embedding_first) {
      add(rows, 1, 8);  // (N) ids, I64 at most
      continue;
    }
    add(rows, width, working);                                 // acts[i]
    if (i > 0 || layer_norm_first) add(rows, width, working);  // grads[i]
  }
  if (!embedding_first) add(rows, in, 4);  // staging: (N, in) of an F32 input at most
  if (spec.loss == LossKind::kCrossEntropy) {
    add(rows, 1, 8);  // (N) labels, I64 at most
  } else {
    add(rows, OutputFeatures(spec), 4);  // (N, out) F32
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro_batches: ", rows, " rows through this model need more than 2^63 bytes"));
  }
  return total;
}

Model::Model(const ModelSpec& spec, Precision precision, kernels::Backend& backend)
    : Network(spec, precision, backend) {
  int linears = 0;
  for (const LayerSpec& l : spec.layers) {
    linears += l.kind == LayerKind::kLinear ? 1 : 0;
    layer_group_.push_back(std::max(0, linears - 1));
  }
  dx_scale_.assign(spec.layers.size(), 1.0f);
}

std::vector<int> Model::ParamScaleGroups() const {
  std::vector<int> groups(params().size(), 0);
  for (size_t i = 0; i < layer_params_.size(); ++i) {
    for (const int p : {layer_params_[i].weight, layer_params_[i].bias}) {
      if (p >= 0) groups[static_cast<size_t>(p)] = layer_group_[i];
    }
  }
  return groups;
}

absl::Status Model::SetGroupScales(absl::Span<const float> scales) {
  AMPD_RETURN_IF_ERROR(CheckGroupScaleCount(scales));
  for (size_t i = 0; i < dx_scale_.size(); ++i) {
    const int g = layer_group_[i];
    // Every Linear but the first starts its own group.
    const bool starts_group = spec().layers[i].kind == LayerKind::kLinear && g > 0;
    // A ratio of powers of two, exact in double and in float while it is a
    // normal float.
    dx_scale_[i] = starts_group ? static_cast<float>(static_cast<double>(scales[g - 1]) /
                                                     static_cast<double>(scales[g]))
                                : 1.0f;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelSpec& spec, Precision precision,
                                                     uint64_t seed, kernels::Backend& backend) {
  AMPD_RETURN_IF_ERROR(ValidateModelSpec(spec));
  if (IsSequenceModel(spec)) return absl::InvalidArgumentError("model: not a layer stack");
  std::unique_ptr<Model> m(new Model(spec, precision, backend));
  int64_t width = InputFeatures(spec);
  m->widths_.push_back(width);
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& l = spec.layers[i];
    auto name = [i](const char* suffix) { return absl::StrCat("model.", i, ".", suffix); };
    LayerParams lp;
    switch (l.kind) {
      case LayerKind::kLinear: {
        const ParamInit uniform{true, LinearUniformInit(seed, 0, l.in_features)};
        AMPD_ASSIGN_OR_RETURN(
            lp.weight, m->AddParameter(name("weight"), {l.out_features, l.in_features}, uniform,
                                       /*plus_equal=*/false));
        if (l.bias) {
          AMPD_ASSIGN_OR_RETURN(lp.bias, m->AddParameter(name("bias"), {l.out_features}, uniform,
                                                         /*plus_equal=*/false));
        }
        width = l.out_features;
        break;
      }
      case LayerKind::kLayerNorm:
        if (l.elementwise_affine) {
          ParamInit constant;
          constant.value = 1.0f;
          AMPD_ASSIGN_OR_RETURN(lp.weight, m->AddParameter(name("weight"), {l.normalized_shape},
                                                           constant, /*plus_equal=*/true));
          constant.value = 0.0f;
          AMPD_ASSIGN_OR_RETURN(lp.bias, m->AddParameter(name("bias"), {l.normalized_shape},
                                                         constant, /*plus_equal=*/true));
        }
        width = l.normalized_shape;
        break;
      case LayerKind::kEmbedding: {
        AMPD_ASSIGN_OR_RETURN(
            lp.weight,
            m->AddParameter(name("weight"), {l.num_embeddings, l.embedding_dim},
                            ParamInit{true, StandardNormalInit(seed, 0)}, /*plus_equal=*/true));
        width = l.embedding_dim;
        break;
      }
      default:
        break;  // element-wise: width unchanged, no parameters
    }
    m->layer_params_.push_back(lp);
    m->widths_.push_back(width);
  }
  AMPD_RETURN_IF_ERROR(m->CastWorking());
  return m;
}

absl::StatusOr<int64_t> Model::BytesFor(const kernels::Shape& input_shape) const {
  return model::WorkspaceBytes(spec(), precision(), input_shape);
}

absl::StatusOr<std::unique_ptr<Workspace>> Model::NewWorkspace(const kernels::Shape& input_shape) {
  if (input_shape.empty()) {
    return absl::InvalidArgumentError("inputs: a batch needs at least one dimension");
  }
  const int64_t rows = input_shape[0];
  auto owned = std::make_unique<LayerWorkspace>();
  LayerWorkspace& ws = *owned;
  const size_t n_layers = spec().layers.size();
  ws.rows = rows;
  ws.acts.resize(n_layers + 1);
  ws.grads.resize(n_layers + 1);
  ws.mean.resize(n_layers);
  ws.rstd.resize(n_layers);
  const bool embedding_first = spec().layers.front().kind == LayerKind::kEmbedding;
  for (size_t i = 0; i <= n_layers; ++i) {
    if (i == 0 && embedding_first) continue;  // ids: allocated in LoadBatch with the host dtype
    AMPD_ASSIGN_OR_RETURN(ws.acts[i], backend_.Allocate(working_dtype(), {rows, widths_[i]}));
    // No gradient for the inputs, except the scratch dx a LayerNorm first
    // layer's backward writes.
    if (i == 0 && spec().layers.front().kind != LayerKind::kLayerNorm) continue;
    AMPD_ASSIGN_OR_RETURN(ws.grads[i], backend_.Allocate(working_dtype(), {rows, widths_[i]}));
  }
  for (size_t i = 0; i < n_layers; ++i) {
    if (spec().layers[i].kind != LayerKind::kLayerNorm) continue;
    AMPD_ASSIGN_OR_RETURN(ws.mean[i], backend_.Allocate(DType::kF32, {rows}));
    AMPD_ASSIGN_OR_RETURN(ws.rstd[i], backend_.Allocate(DType::kF32, {rows}));
  }
  return std::unique_ptr<Workspace>(std::move(owned));
}

absl::StatusOr<Workspace*> Model::GetWorkspace(int64_t rows) {
  const int64_t input_features = InputFeatures(spec());
  return GetWorkspace(input_features == 0 ? kernels::Shape{rows}
                                          : kernels::Shape{rows, input_features});
}

absl::Status Model::LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                              const TokenLossInputs& tokens, Workspace& any) {
  if (tokens.fn.kind != LossFnKind::kModel) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_fn: ", LossFnName(tokens.fn.kind),
                     " is a token loss, which needs a language model (gpt or decoder)"));
  }
  AMPD_ASSIGN_OR_RETURN(LayerWorkspace * own, Own<LayerWorkspace>(any));
  LayerWorkspace& ws = *own;
  if (spec().layers.front().kind == LayerKind::kEmbedding) {
    AMPD_RETURN_IF_ERROR(EnsureTensor(backend_, inputs.dtype, inputs.shape, ws.acts[0]));
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(inputs.data.data(), inputs.data.size(), ws.acts[0]));
  } else if (inputs.dtype == working_dtype()) {
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(inputs.data.data(), inputs.data.size(), ws.acts[0]));
  } else {
    AMPD_RETURN_IF_ERROR(EnsureTensor(backend_, inputs.dtype, inputs.shape, ws.staging));
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(inputs.data.data(), inputs.data.size(), ws.staging));
    AMPD_RETURN_IF_ERROR(backend_.Cast(ws.staging, ws.acts[0]));
  }
  AMPD_RETURN_IF_ERROR(EnsureTensor(backend_, targets.dtype, targets.shape, ws.targets));
  return backend_.CopyFromHost(targets.data.data(), targets.data.size(), ws.targets);
}

absl::Status Model::Forward(Workspace& any) {
  AMPD_ASSIGN_OR_RETURN(LayerWorkspace * own, Own<LayerWorkspace>(any));
  LayerWorkspace& ws = *own;
  for (size_t i = 0; i < spec().layers.size(); ++i) {
    const LayerSpec& l = spec().layers[i];
    const LayerParams& lp = layer_params_[i];
    const Tensor& x = ws.acts[i];  // (N, in)
    Tensor& y = ws.acts[i + 1];    // (N, out)
    switch (l.kind) {
      case LayerKind::kLinear:
        // y (N, out) = x (N, in) @ W^T + b, W (out, in): fp32 accumulation,
        // the bias added in the GEMM's epilogue before the one rounding. A
        // GELU after it stays its own layer: the spec's GELU is the exact
        // form, and the epilogues' is the tanh approximation.
        AMPD_RETURN_IF_ERROR(
            backend_.GemmBiasActivation(false, true, x, params()[lp.weight].value(),
                                        lp.bias >= 0 ? &params()[lp.bias].value() : nullptr,
                                        kernels::GemmActivation::kNone, y, nullptr));
        break;
      case LayerKind::kLayerNorm:
        AMPD_RETURN_IF_ERROR(backend_.LayerNormForward(
            x, lp.weight >= 0 ? &params()[lp.weight].value() : nullptr,
            lp.bias >= 0 ? &params()[lp.bias].value() : nullptr, l.eps, y, ws.mean[i], ws.rstd[i]));
        break;
      case LayerKind::kEmbedding:
        AMPD_RETURN_IF_ERROR(backend_.EmbeddingForward(x, params()[lp.weight].value(), y));
        break;
      default:
        AMPD_RETURN_IF_ERROR(backend_.ActivationForward(ActivationOf(l.kind), x, y));
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status Model::Loss(Workspace& any, float grad_scale, bool /*first_micro_batch*/,
                         Tensor& loss) {
  AMPD_ASSIGN_OR_RETURN(LayerWorkspace * own, Own<LayerWorkspace>(any));
  LayerWorkspace& ws = *own;
  const Tensor& pred = ws.acts.back();  // (N, out)
  Tensor& dpred = ws.grads.back();      // (N, out)
  if (spec().loss == LossKind::kCrossEntropy) {
    return backend_.CrossEntropyLoss(pred, ws.targets, spec().loss_multiplier, grad_scale, loss,
                                     dpred);
  }
  return backend_.MseLoss(pred, ws.targets, spec().loss_multiplier, grad_scale, loss, dpred);
}

absl::Status Model::Backward(Workspace& any, bool first_micro_batch, const BackwardHooks& hooks) {
  AMPD_ASSIGN_OR_RETURN(LayerWorkspace * own, Own<LayerWorkspace>(any));
  LayerWorkspace& ws = *own;
  const float beta = first_micro_batch ? 0.0f : 1.0f;
  if (hooks.group_entry) {
    // (N, out) the loss gradient enters the last group.
    AMPD_RETURN_IF_ERROR(hooks.group_entry(layer_group_.back(), ws.grads.back()));
  }
  for (size_t i = spec().layers.size(); i-- > 0;) {
    const LayerSpec& l = spec().layers[i];
    const LayerParams& lp = layer_params_[i];
    const Tensor& x = ws.acts[i];                 // (N, in) layer input
    const Tensor& dy = ws.grads[i + 1];           // (N, out)
    Tensor* dx = i > 0 ? &ws.grads[i] : nullptr;  // (N, in); inputs need no gradient
    switch (l.kind) {
      case LayerKind::kLinear: {
        // dW (out, in) = dy^T (out, N) @ x (N, in) + beta dW: beta = 1
        // accumulates micro-batches in one rounding per element, so an inf
        // from any micro-batch survives (inf + x = inf). db (out) = column
        // sums of dy + beta db, in the same GEMM's epilogue.
        if (lp.bias >= 0) {
          AMPD_RETURN_IF_ERROR(
              backend_.GemmBiasGrad(true, false, dy, x, beta, params()[lp.weight].grad,
                                    kernels::BiasGradOf::kA, params()[lp.bias].grad));
        } else {
          AMPD_RETURN_IF_ERROR(
              backend_.Gemm(true, false, 1.0f, dy, x, beta, params()[lp.weight].grad));
        }
        // dx (N, in) = dx_scale * dy (N, out) @ W (out, in); dx_scale moves
        // the gradient to the previous group's loss scale (Backward's header).
        if (dx != nullptr) {
          AMPD_RETURN_IF_ERROR(backend_.Gemm(false, false, dx_scale_[i], dy,
                                             params()[lp.weight].value(), 0.0f, *dx));
          // A Linear that starts group g passes group g - 1 its entry.
          if (hooks.group_entry && layer_group_[i] > 0) {
            AMPD_RETURN_IF_ERROR(hooks.group_entry(layer_group_[i] - 1, *dx));
          }
        }
        break;
      }
      case LayerKind::kLayerNorm:
        // The backend always writes dx; a LayerNorm first layer writes it to
        // grads[0], a scratch buffer allocated for exactly that.
        AMPD_RETURN_IF_ERROR(backend_.LayerNormBackward(
            x, lp.weight >= 0 ? &params()[lp.weight].value() : nullptr, ws.mean[i], ws.rstd[i], dy,
            ws.grads[i], lp.weight >= 0 ? &params()[lp.weight].grad : nullptr,
            lp.bias >= 0 ? &params()[lp.bias].grad : nullptr));
        break;
      case LayerKind::kEmbedding:
        AMPD_RETURN_IF_ERROR(backend_.EmbeddingBackward(x, dy, params()[lp.weight].grad));
        break;
      default:
        if (dx != nullptr) {
          AMPD_RETURN_IF_ERROR(backend_.ActivationBackward(ActivationOf(l.kind), x, dy, *dx));
        }
        break;
    }
    // This layer's parameters are done: their sum can start.
    if (hooks.grads_ready && lp.weight >= 0) {
      const int done[2] = {lp.weight, lp.bias};
      AMPD_RETURN_IF_ERROR(hooks.grads_ready(absl::MakeConstSpan(done, lp.bias >= 0 ? 2 : 1)));
    }
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
