// Model flags and safetensors batch files for `ampctl train` (batch_file.h).
#include "client/batch_file.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/engine/checkpoint/safetensors.h"
#include "server/engine/model/batch_check.h"
#include "server/rpc/wire.h"

namespace ampd {
namespace {

using engine::HostTensor;
using engine::model::LayerKind;
using engine::model::LayerSpec;
using engine::model::LossKind;
using engine::model::ModelSpec;
using kernels::DType;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

constexpr absl::string_view kLayersGrammar =
    "expected comma-separated layers: linear:IN:OUT[:nobias], relu, gelu, tanh, layer_norm:N, "
    "embedding:VOCAB:DIM";

// One positive size of a layer item; names the item and which size it is.
absl::StatusOr<int64_t> ParseSize(absl::string_view item, absl::string_view what,
                                  absl::string_view text) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 1) {
    return Invalid(absl::StrCat("--layers: \"", item, "\": ", what,
                                " must be a positive integer, got \"", text, "\""));
  }
  return value;
}

absl::StatusOr<LayerSpec> ParseLayer(absl::string_view item) {
  const std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
  const std::string kind = absl::AsciiStrToLower(parts[0]);
  auto arity = [&](size_t lo, size_t hi, absl::string_view form) -> absl::Status {
    if (parts.size() - 1 < lo || parts.size() - 1 > hi) {
      return Invalid(absl::StrCat("--layers: \"", item, "\": expected ", form));
    }
    return absl::OkStatus();
  };
  LayerSpec layer;
  if (kind == "linear") {
    if (absl::Status s = arity(2, 3, "linear:IN:OUT or linear:IN:OUT:nobias"); !s.ok()) return s;
    layer.kind = LayerKind::kLinear;
    absl::StatusOr<int64_t> in = ParseSize(item, "IN", parts[1]);
    if (!in.ok()) return in.status();
    absl::StatusOr<int64_t> out = ParseSize(item, "OUT", parts[2]);
    if (!out.ok()) return out.status();
    layer.in_features = *in;
    layer.out_features = *out;
    if (parts.size() == 4) {
      if (parts[3] != "nobias") {
        return Invalid(absl::StrCat(
            "--layers: \"", item, "\": the only linear option is nobias, got \"", parts[3], "\""));
      }
      layer.bias = false;
    }
  } else if (kind == "relu" || kind == "gelu" || kind == "tanh") {
    if (absl::Status s = arity(0, 0, kind); !s.ok()) return s;
    layer.kind = kind == "relu"   ? LayerKind::kReLU
                 : kind == "gelu" ? LayerKind::kGELU
                                  : LayerKind::kTanh;
  } else if (kind == "layer_norm" || kind == "layernorm") {
    if (absl::Status s = arity(1, 1, "layer_norm:N"); !s.ok()) return s;
    layer.kind = LayerKind::kLayerNorm;
    absl::StatusOr<int64_t> n = ParseSize(item, "N", parts[1]);
    if (!n.ok()) return n.status();
    layer.normalized_shape = *n;
  } else if (kind == "embedding") {
    if (absl::Status s = arity(2, 2, "embedding:VOCAB:DIM"); !s.ok()) return s;
    layer.kind = LayerKind::kEmbedding;
    absl::StatusOr<int64_t> vocab = ParseSize(item, "VOCAB", parts[1]);
    if (!vocab.ok()) return vocab.status();
    absl::StatusOr<int64_t> dim = ParseSize(item, "DIM", parts[2]);
    if (!dim.ok()) return dim.status();
    layer.num_embeddings = *vocab;
    layer.embedding_dim = *dim;
  } else {
    return Invalid(absl::StrCat("--layers: unknown layer \"", parts[0], "\" in \"", item, "\"; ",
                                kLayersGrammar));
  }
  return layer;
}

// "inputs.12" -> ("inputs", 12). Digits only, no leading zeros, so each
// index has exactly one spelling and "inputs.01" is not silently batch 1.
std::optional<std::pair<std::string, int64_t>> SplitName(absl::string_view name) {
  const size_t dot = name.find('.');
  if (dot == absl::string_view::npos) return std::nullopt;
  const absl::string_view role = name.substr(0, dot);
  const absl::string_view digits = name.substr(dot + 1);
  if (role != "inputs" && role != "targets") return std::nullopt;
  if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0')) {
    return std::nullopt;
  }
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  int64_t index = 0;
  if (!absl::SimpleAtoi(digits, &index)) return std::nullopt;
  return std::make_pair(std::string(role), index);
}

}  // namespace

absl::StatusOr<ModelSpec> ParseModelFlags(absl::string_view layers, absl::string_view loss) {
  ModelSpec spec;
  if (absl::StripAsciiWhitespace(layers).empty()) {
    return Invalid(absl::StrCat("--layers: empty; ", kLayersGrammar));
  }
  for (absl::string_view item : absl::StrSplit(layers, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) return Invalid(absl::StrCat("--layers: empty item in \"", layers, "\""));
    absl::StatusOr<LayerSpec> layer = ParseLayer(item);
    if (!layer.ok()) return layer.status();
    spec.layers.push_back(*layer);
  }
  const std::string l = absl::AsciiStrToLower(loss);
  if (l.empty() || l == "mse") {
    spec.loss = LossKind::kMse;
  } else if (l == "cross_entropy" || l == "cross-entropy" || l == "ce") {
    spec.loss = LossKind::kCrossEntropy;
  } else {
    return Invalid(absl::StrCat("--loss: expected mse or cross_entropy, got \"", loss, "\""));
  }
  if (absl::Status s = engine::model::ValidateModelSpec(spec); !s.ok()) {
    return Invalid(absl::StrCat("--layers: ", s.message()));
  }
  return spec;
}

absl::StatusOr<std::vector<v1::MicroBatch>> BatchesFromSafetensors(absl::string_view bytes,
                                                                   const ModelSpec& model) {
  absl::StatusOr<engine::checkpoint::StateDict> state =
      engine::checkpoint::DecodeSafetensors(bytes);
  if (!state.ok())
    return Invalid(absl::StrCat("not a safetensors file: ", state.status().message()));
  // index -> (inputs, targets); a map so the indices come out sorted.
  std::map<int64_t, std::pair<const HostTensor*, const HostTensor*>> found;
  for (const engine::checkpoint::NamedTensor& t : state->tensors) {
    const std::optional<std::pair<std::string, int64_t>> name = SplitName(t.name);
    if (!name) {
      return Invalid(absl::StrCat("unexpected tensor \"", t.name,
                                  "\" (a batch file holds only inputs.<i> and targets.<i>, "
                                  "i = 0, 1, ...)"));
    }
    auto& slot = found[name->second];
    (name->first == "inputs" ? slot.first : slot.second) = &t.tensor;
  }
  if (found.empty()) return Invalid("no batches: the file holds no inputs.0 / targets.0");
  const int64_t count = found.rbegin()->first + 1;
  std::vector<v1::MicroBatch> batches;
  batches.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const std::string in_name = absl::StrCat("inputs.", i);
    const std::string tg_name = absl::StrCat("targets.", i);
    auto it = found.find(i);
    const HostTensor* inputs = it == found.end() ? nullptr : it->second.first;
    const HostTensor* targets = it == found.end() ? nullptr : it->second.second;
    // Batches are numbered 0..B-1 by the highest index present, so a gap or
    // a half batch is reported by the name that is absent.
    if (inputs == nullptr || targets == nullptr) {
      const std::string missing = inputs == nullptr && targets == nullptr
                                      ? absl::StrCat(in_name, " and ", tg_name)
                                  : inputs == nullptr ? in_name
                                                      : tg_name;
      return Invalid(absl::StrCat("batch ", i, ": ", missing,
                                  inputs == nullptr && targets == nullptr ? " are" : " is",
                                  " missing (the file has batches up to ", count - 1,
                                  ", each needs inputs.<i> and targets.<i>)"));
    }
    if (absl::Status s =
            engine::model::CheckBatchFitsModel(model, *inputs, *targets, in_name, tg_name);
        !s.ok()) {
      return s;
    }
    v1::MicroBatch batch;
    *batch.mutable_inputs() = rpc::TensorToProto(*inputs);
    *batch.mutable_targets() = rpc::TensorToProto(*targets);
    batches.push_back(std::move(batch));
  }
  return batches;
}

absl::StatusOr<std::string> ReadBatchFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return Invalid(absl::StrCat("--batches: cannot open ", path));
  std::stringstream buffer;
  buffer << file.rdbuf();
  if (file.bad()) return Invalid(absl::StrCat("--batches: cannot read ", path));
  return buffer.str();
}

}  // namespace ampd
