// Model flags and safetensors batch files for `ampctl train` (batch_file.h).
#include "client/batch_file.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "codec/safetensors.h"
#include "codec/tensor_proto.h"
#include "common/status_macros.h"

namespace ampd {
namespace {

using codec::HostTensor;

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

absl::StatusOr<v1::Layer> ParseLayer(absl::string_view item) {
  const std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
  const std::string kind = absl::AsciiStrToLower(parts[0]);
  auto arity = [&](size_t lo, size_t hi, absl::string_view form) -> absl::Status {
    if (parts.size() - 1 < lo || parts.size() - 1 > hi) {
      return Invalid(absl::StrCat("--layers: \"", item, "\": expected ", form));
    }
    return absl::OkStatus();
  };
  v1::Layer layer;
  if (kind == "linear") {
    AMPD_RETURN_IF_ERROR(arity(2, 3, "linear:IN:OUT or linear:IN:OUT:nobias"));
    AMPD_ASSIGN_OR_RETURN(const int64_t in, ParseSize(item, "IN", parts[1]));
    AMPD_ASSIGN_OR_RETURN(const int64_t out, ParseSize(item, "OUT", parts[2]));
    v1::Linear* linear = layer.mutable_linear();
    linear->set_in_features(in);
    linear->set_out_features(out);
    bool bias = true;
    if (parts.size() == 4) {
      if (parts[3] != "nobias") {
        return Invalid(absl::StrCat(
            "--layers: \"", item, "\": the only linear option is nobias, got \"", parts[3], "\""));
      }
      bias = false;
    }
    linear->set_bias(bias);
  } else if (kind == "relu" || kind == "gelu" || kind == "tanh") {
    AMPD_RETURN_IF_ERROR(arity(0, 0, kind));
    if (kind == "relu") {
      layer.mutable_relu();
    } else if (kind == "gelu") {
      layer.mutable_gelu();
    } else {
      layer.mutable_tanh();
    }
  } else if (kind == "layer_norm" || kind == "layernorm") {
    AMPD_RETURN_IF_ERROR(arity(1, 1, "layer_norm:N"));
    AMPD_ASSIGN_OR_RETURN(const int64_t n, ParseSize(item, "N", parts[1]));
    layer.mutable_layer_norm()->set_normalized_shape(n);
  } else if (kind == "embedding") {
    AMPD_RETURN_IF_ERROR(arity(2, 2, "embedding:VOCAB:DIM"));
    AMPD_ASSIGN_OR_RETURN(const int64_t vocab, ParseSize(item, "VOCAB", parts[1]));
    AMPD_ASSIGN_OR_RETURN(const int64_t dim, ParseSize(item, "DIM", parts[2]));
    layer.mutable_embedding()->set_num_embeddings(vocab);
    layer.mutable_embedding()->set_embedding_dim(dim);
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

// "gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD": the whole model, not a layer.
absl::StatusOr<v1::ModelSpec> ParseGpt(absl::string_view item, absl::string_view loss) {
  const std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
  if (parts.size() != 6) {
    return Invalid(
        absl::StrCat("--layers: \"", item, "\": expected gpt:VOCAB:CONTEXT:DMODEL:NLAYER:NHEAD"));
  }
  AMPD_ASSIGN_OR_RETURN(const int64_t vocab, ParseSize(item, "VOCAB", parts[1]));
  AMPD_ASSIGN_OR_RETURN(const int64_t context, ParseSize(item, "CONTEXT", parts[2]));
  AMPD_ASSIGN_OR_RETURN(const int64_t d_model, ParseSize(item, "DMODEL", parts[3]));
  AMPD_ASSIGN_OR_RETURN(const int64_t n_layer, ParseSize(item, "NLAYER", parts[4]));
  AMPD_ASSIGN_OR_RETURN(const int64_t n_head, ParseSize(item, "NHEAD", parts[5]));
  const std::string l = absl::AsciiStrToLower(loss);
  if (!l.empty() && l != "cross_entropy" && l != "cross-entropy" && l != "ce") {
    return Invalid(absl::StrCat("--loss=", loss,
                                ": a GPT's loss is the token cross-entropy (leave --loss out)"));
  }
  v1::ModelSpec spec;
  v1::Gpt* gpt = spec.mutable_gpt();
  gpt->set_vocab_size(vocab);
  gpt->set_context_length(context);
  gpt->set_d_model(d_model);
  gpt->set_n_layer(n_layer);
  gpt->set_n_head(n_head);
  spec.set_loss(v1::LOSS_CROSS_ENTROPY);
  return spec;
}

// "llama:VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS[:CONTEXT]" (no biases),
// "qwen2:..." (q, k and v biased), "qwen3:..." (the per-head q/k norm) or
// "gemma3:..." (Gemma 3's parts: (1 + w) norms, sandwich norms, q/k norm,
// GeGLU, scaled embeddings, a tied head; every layer global): a decoder of
// that family's parts with Hugging Face's other defaults, CONTEXT
// (max_position_embeddings) 2048 unless given.
absl::StatusOr<v1::ModelSpec> ParseDecoder(absl::string_view item, absl::string_view loss) {
  const std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
  const std::string family = absl::AsciiStrToLower(parts[0]);
  if (parts.size() != 7 && parts.size() != 8) {
    return Invalid(absl::StrCat("--layers: \"", item, "\": expected ", family,
                                ":VOCAB:HIDDEN:INTER:LAYERS:HEADS:KV_HEADS[:CONTEXT]"));
  }
  AMPD_ASSIGN_OR_RETURN(const int64_t vocab, ParseSize(item, "VOCAB", parts[1]));
  AMPD_ASSIGN_OR_RETURN(const int64_t hidden, ParseSize(item, "HIDDEN", parts[2]));
  AMPD_ASSIGN_OR_RETURN(const int64_t inter, ParseSize(item, "INTER", parts[3]));
  AMPD_ASSIGN_OR_RETURN(const int64_t layers, ParseSize(item, "LAYERS", parts[4]));
  AMPD_ASSIGN_OR_RETURN(const int64_t heads, ParseSize(item, "HEADS", parts[5]));
  AMPD_ASSIGN_OR_RETURN(const int64_t kv_heads, ParseSize(item, "KV_HEADS", parts[6]));
  int64_t context = 2048;
  if (parts.size() == 8) {
    AMPD_ASSIGN_OR_RETURN(context, ParseSize(item, "CONTEXT", parts[7]));
  }
  const std::string l = absl::AsciiStrToLower(loss);
  if (!l.empty() && l != "cross_entropy" && l != "cross-entropy" && l != "ce") {
    return Invalid(absl::StrCat(
        "--loss=", loss, ": a decoder's loss is the token cross-entropy (leave --loss out)"));
  }
  v1::ModelSpec spec;
  v1::Decoder* d = spec.mutable_decoder();
  d->set_vocab_size(vocab);
  d->set_hidden_size(hidden);
  d->set_intermediate_size(inter);
  d->set_num_hidden_layers(layers);
  d->set_num_attention_heads(heads);
  d->set_num_key_value_heads(kv_heads);
  d->set_max_position_embeddings(context);
  d->set_qkv_bias(family == "qwen2");
  if (family == "qwen3" || family == "gemma3") d->set_qk_norm(true);
  if (family == "gemma3") {
    d->set_norm_unit_offset(true);
    d->set_sandwich_norms(true);
    d->set_scale_embeddings(true);
    d->set_mlp_activation(v1::MLP_ACTIVATION_GELU_TANH);
    d->set_tie_word_embeddings(true);
  }
  spec.set_loss(v1::LOSS_CROSS_ENTROPY);
  return spec;
}

}  // namespace

absl::Status ApplyLoraFlags(int64_t rank, std::optional<double> alpha, absl::string_view targets,
                            v1::ModelSpec& spec) {
  if (!spec.has_decoder()) {
    return Invalid(
        "--lora-rank: LoRA adapts a decoder; give --layers=llama:... or --layers=qwen2:...");
  }
  v1::LoRA* lora = spec.mutable_decoder()->mutable_lora();
  lora->set_rank(rank);
  lora->set_alpha(static_cast<float>(alpha.value_or(static_cast<double>(rank))));
  if (absl::StripAsciiWhitespace(targets).empty()) return absl::OkStatus();
  for (absl::string_view item : absl::StrSplit(targets, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) {
      return Invalid(absl::StrCat("--lora-targets: empty item in \"", targets, "\""));
    }
    lora->add_target_modules(std::string(item));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelSpec> ParseModelFlags(absl::string_view layers, absl::string_view loss) {
  v1::ModelSpec spec;
  if (absl::StripAsciiWhitespace(layers).empty()) {
    return Invalid(absl::StrCat("--layers: empty; ", kLayersGrammar));
  }
  if (absl::StartsWithIgnoreCase(absl::StripAsciiWhitespace(layers), "gpt:")) {
    return ParseGpt(absl::StripAsciiWhitespace(layers), loss);
  }
  for (const char* family : {"llama:", "qwen2:", "qwen3:", "gemma3:"}) {
    if (absl::StartsWithIgnoreCase(absl::StripAsciiWhitespace(layers), family)) {
      return ParseDecoder(absl::StripAsciiWhitespace(layers), loss);
    }
  }
  for (absl::string_view item : absl::StrSplit(layers, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) return Invalid(absl::StrCat("--layers: empty item in \"", layers, "\""));
    AMPD_ASSIGN_OR_RETURN(v1::Layer layer, ParseLayer(item));
    // Part of the flag's grammar: what the inputs are (ids or features)
    // is read off the first layer, so an embedding elsewhere has no meaning.
    if (layer.has_embedding() && spec.layers_size() > 0) {
      return Invalid(
          absl::StrCat("--layers: \"", item, "\": embedding can only be the first layer"));
    }
    *spec.add_layers() = std::move(layer);
  }
  // The batch layout is read off the sized layers (BatchLayoutOf).
  if (std::none_of(spec.layers().begin(), spec.layers().end(), [](const v1::Layer& layer) {
        return layer.has_linear() || layer.has_layer_norm() || layer.has_embedding();
      })) {
    return Invalid(
        absl::StrCat("--layers: \"", layers,
                     "\" has no linear, layer_norm or embedding layer to fix the widths"));
  }
  const std::string l = absl::AsciiStrToLower(loss);
  if (l.empty() || l == "mse") {
    spec.set_loss(v1::LOSS_MSE);
  } else if (l == "cross_entropy" || l == "cross-entropy" || l == "ce") {
    spec.set_loss(v1::LOSS_CROSS_ENTROPY);
  } else {
    return Invalid(absl::StrCat("--loss: expected mse or cross_entropy, got \"", loss, "\""));
  }
  return spec;
}

codec::BatchLayout BatchLayoutOf(const v1::ModelSpec& model) {
  codec::BatchLayout layout;
  if (model.has_gpt()) {
    layout.sequences = true;
    layout.context_length = model.gpt().context_length();
    layout.num_embeddings = model.gpt().vocab_size();
    layout.outputs = model.gpt().vocab_size();
    return layout;
  }
  if (model.has_decoder()) {
    layout.sequences = true;
    layout.context_length = model.decoder().max_position_embeddings();
    layout.num_embeddings = model.decoder().vocab_size();
    layout.outputs = model.decoder().vocab_size();
    return layout;
  }
  if (model.layers_size() > 0 && model.layers(0).has_embedding()) {
    layout.input_ids = true;
    layout.num_embeddings = model.layers(0).embedding().num_embeddings();
  }
  // The widths follow the layers: a sized layer sets the width it produces,
  // an elementwise one passes it on.
  int64_t width = 0;
  for (const v1::Layer& layer : model.layers()) {
    int64_t in = 0;
    switch (layer.kind_case()) {
      case v1::Layer::kLinear:
        in = layer.linear().in_features();
        width = layer.linear().out_features();
        break;
      case v1::Layer::kLayerNorm:
        in = layer.layer_norm().normalized_shape();
        width = in;
        break;
      case v1::Layer::kEmbedding:
        width = layer.embedding().embedding_dim();
        break;
      default:
        break;
    }
    if (!layout.input_ids && layout.input_features == 0) layout.input_features = in;
  }
  layout.target_labels = model.loss() == v1::LOSS_CROSS_ENTROPY;
  layout.outputs = width;
  return layout;
}

absl::StatusOr<std::vector<v1::MicroBatch>> BatchesFromSafetensors(
    absl::string_view bytes, const codec::BatchLayout& layout) {
  absl::StatusOr<codec::StateDict> state = codec::DecodeSafetensors(bytes);
  if (!state.ok())
    return Invalid(absl::StrCat("not a safetensors file: ", state.status().message()));
  // index -> (inputs, targets); a map so the indices come out sorted.
  std::map<int64_t, std::pair<const HostTensor*, const HostTensor*>> found;
  for (const codec::NamedTensor& t : state->tensors) {
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
    AMPD_RETURN_IF_ERROR(codec::CheckBatchLayout(layout, *inputs, *targets, in_name, tg_name));
    v1::MicroBatch batch;
    *batch.mutable_inputs() = codec::TensorToProto(*inputs);
    *batch.mutable_targets() = codec::TensorToProto(*targets);
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
