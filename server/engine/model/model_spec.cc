// Model spec validation and the derived sizes (input/output widths,
// parameter count) the Trainer and the service need before building anything.
#include "server/engine/model/model_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

absl::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kFp16:
      return "fp16";
    case Precision::kBf16:
      return "bf16";
  }
  return "?";
}

codec::DType WorkingDType(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return codec::DType::kF32;
    case Precision::kFp16:
      return codec::DType::kF16;
    case Precision::kBf16:
      return codec::DType::kBF16;
  }
  return codec::DType::kF32;
}

absl::string_view LayerKindName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kLinear:
      return "linear";
    case LayerKind::kReLU:
      return "relu";
    case LayerKind::kGELU:
      return "gelu";
    case LayerKind::kTanh:
      return "tanh";
    case LayerKind::kLayerNorm:
      return "layer_norm";
    case LayerKind::kEmbedding:
      return "embedding";
  }
  return "?";
}

namespace {

bool IsElementwise(LayerKind kind) {
  return kind == LayerKind::kReLU || kind == LayerKind::kGELU || kind == LayerKind::kTanh;
}

// Width a layer expects on its input; 0 for element-wise layers (any width).
int64_t LayerInWidth(const LayerSpec& layer) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return layer.in_features;
    case LayerKind::kLayerNorm:
      return layer.normalized_shape;
    default:
      return 0;
  }
}

int64_t LayerOutWidth(const LayerSpec& layer, int64_t in_width) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return layer.out_features;
    case LayerKind::kLayerNorm:
      return layer.normalized_shape;
    case LayerKind::kEmbedding:
      return layer.embedding_dim;
    default:
      return in_width;
  }
}

// Elements of the layer's parameters (weight and bias), saturating at
// INT64_MAX when the product overflows.
int64_t LayerParameterCount(const LayerSpec& layer) {
  switch (layer.kind) {
    case LayerKind::kLinear:
      return SaturatingAdd(SaturatingMul(layer.in_features, layer.out_features),
                           layer.bias ? layer.out_features : 0);
    case LayerKind::kLayerNorm:
      return layer.elementwise_affine ? SaturatingMul(2, layer.normalized_shape) : 0;
    case LayerKind::kEmbedding:
      return SaturatingMul(layer.num_embeddings, layer.embedding_dim);
    default:
      return 0;
  }
}

absl::Status Positive(int64_t value, size_t i, absl::string_view field) {
  if (value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers[", i, "].", field, ": must be > 0, got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelSpec(const ModelSpec& spec) {
  if (spec.layers.empty()) return absl::InvalidArgumentError("layers: the model has no layers");
  int64_t width = 0;  // 0 until a sized layer fixes it
  bool sized = false;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& layer = spec.layers[i];
    switch (layer.kind) {
      case LayerKind::kLinear:
        AMPD_RETURN_IF_ERROR(Positive(layer.in_features, i, "in_features"));
        AMPD_RETURN_IF_ERROR(Positive(layer.out_features, i, "out_features"));
        break;
      case LayerKind::kLayerNorm:
        AMPD_RETURN_IF_ERROR(Positive(layer.normalized_shape, i, "normalized_shape"));
        if (!std::isfinite(layer.eps) || layer.eps <= 0.0f) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "].eps: must be finite and > 0, got ", layer.eps));
        }
        break;
      case LayerKind::kEmbedding:
        if (i != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "].kind: Embedding is only allowed as the first layer"));
        }
        AMPD_RETURN_IF_ERROR(Positive(layer.num_embeddings, i, "num_embeddings"));
        AMPD_RETURN_IF_ERROR(Positive(layer.embedding_dim, i, "embedding_dim"));
        break;
      case LayerKind::kReLU:
      case LayerKind::kGELU:
      case LayerKind::kTanh:
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("layers[", i, "].kind: unknown layer kind"));
    }
    // Sizes are positive here; their product is checked before anything
    // multiplies them again (the parameter count, byte estimates, buffers).
    if (LayerParameterCount(layer) > kMaxParameters) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "]: these sizes give the ",
                                                     LayerKindName(layer.kind), " layer more than ",
                                                     kMaxParameters, " (2^56) parameters"));
    }
    const int64_t in = LayerInWidth(layer);
    if (sized && in != 0 && in != width) {
      const absl::string_view field =
          layer.kind == LayerKind::kLinear ? "in_features" : "normalized_shape";
      return absl::InvalidArgumentError(absl::StrCat("layers[", i, "].", field,
                                                     ": the previous layer produces ", width,
                                                     " features, got ", in));
    }
    if (!IsElementwise(layer.kind)) sized = true;
    width = LayerOutWidth(layer, in != 0 ? in : width);
  }
  if (!sized) {
    return absl::InvalidArgumentError(
        "layers: at least one Linear, LayerNorm or Embedding layer is needed to fix the widths");
  }
  if (ParameterCount(spec) > kMaxParameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: the model has more than ", kMaxParameters, " (2^56) parameters"));
  }
  if (spec.loss != LossKind::kMse && spec.loss != LossKind::kCrossEntropy) {
    return absl::InvalidArgumentError("loss: unknown loss kind");
  }
  if (!std::isfinite(spec.loss_multiplier) || spec.loss_multiplier <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_multiplier: must be finite and > 0, got ", spec.loss_multiplier));
  }
  return absl::OkStatus();
}

int64_t InputFeatures(const ModelSpec& spec) {
  for (const LayerSpec& layer : spec.layers) {
    if (layer.kind == LayerKind::kEmbedding) return 0;
    const int64_t in = LayerInWidth(layer);
    if (in != 0) return in;
  }
  return 0;
}

int64_t OutputFeatures(const ModelSpec& spec) {
  int64_t width = InputFeatures(spec);
  for (const LayerSpec& layer : spec.layers) width = LayerOutWidth(layer, width);
  return width;
}

int64_t ParameterCount(const ModelSpec& spec) {
  int64_t count = 0;
  for (const LayerSpec& layer : spec.layers) {
    count = SaturatingAdd(count, LayerParameterCount(layer));
  }
  return count;
}

}  // namespace ampd::engine::model
