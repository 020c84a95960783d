// JobConfig <-> the JSON of a checkpoint's ampd.config (see the header). A
// small strict JSON document reader and writer: the format is a handful of
// keys, and the reader must refuse what a general-purpose library would
// accept (duplicate keys, unknown keys, numbers that do not fit the field).
// String literals are read and written by codec/json_text.h, as the
// safetensors header's are.
#include "server/engine/config/job_config_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec/json_text.h"
#include "common/overloaded.h"
#include "common/status_macros.h"

namespace ampd::engine {
namespace {

constexpr char kKey[] = "ampd.config";
// The format nests four deep (config, model, layers, layer); anything much
// deeper is not a config, and the reader's recursion stays bounded.
constexpr int kMaxDepth = 16;

absl::Status Corrupt(absl::string_view path, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(kKey, ": ", path, ": ", what));
}

// ---- JSON values and the reader ---------------------------------------------------

struct JsonMember;

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  std::string text;  // kNumber: the literal as written; kString: the decoded bytes
  std::vector<Json> items;
  // In document order. A named struct, not std::pair: a pair holding the
  // still-incomplete Json is ill-formed (libc++ and clang refuse it).
  std::vector<JsonMember> members;
};

struct JsonMember {
  std::string key;
  Json value;
};

class Reader {
 public:
  explicit Reader(absl::string_view text) : s_(text) {}

  absl::StatusOr<Json> Document() {
    SkipSpace();
    AMPD_ASSIGN_OR_RETURN(Json value, Value(0));
    SkipSpace();
    if (pos_ != s_.size()) return Error("characters after the value");
    return value;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(
        absl::StrCat(kKey, ": not a JSON document: ", what, " at offset ", pos_));
  }

  void SkipSpace() { codec::SkipJsonSpace(s_, &pos_); }

  bool Consume(absl::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::StatusOr<Json> Value(int depth) {
    if (depth > kMaxDepth) return Error("nested too deep");
    if (pos_ >= s_.size()) return Error("unexpected end");
    Json v;
    const char c = s_[pos_];
    if (c == '{') return Object(depth);
    if (c == '[') return Array(depth);
    if (c == '"') {
      v.type = Json::Type::kString;
      AMPD_ASSIGN_OR_RETURN(v.text, String());
      return v;
    }
    if (Consume("true")) {
      v.type = Json::Type::kBool;
      v.boolean = true;
      return v;
    }
    if (Consume("false")) {
      v.type = Json::Type::kBool;
      return v;
    }
    if (Consume("null")) return v;
    if (c == '-' || absl::ascii_isdigit(static_cast<unsigned char>(c))) return Number();
    return Error(absl::StrCat("unexpected character '", absl::CHexEscape(s_.substr(pos_, 1)), "'"));
  }

  absl::StatusOr<Json> Object(int depth) {
    Json v;
    v.type = Json::Type::kObject;
    ++pos_;  // {
    SkipSpace();
    if (Consume("}")) return v;
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a key");
      AMPD_ASSIGN_OR_RETURN(std::string key, String());
      SkipSpace();
      if (!Consume(":")) return Error("expected ':'");
      SkipSpace();
      AMPD_ASSIGN_OR_RETURN(Json member, Value(depth + 1));
      v.members.push_back(JsonMember{std::move(key), std::move(member)});
      SkipSpace();
      if (Consume("}")) return v;
      if (!Consume(",")) return Error("expected ',' or '}'");
    }
  }

  absl::StatusOr<Json> Array(int depth) {
    Json v;
    v.type = Json::Type::kArray;
    ++pos_;  // [
    SkipSpace();
    if (Consume("]")) return v;
    while (true) {
      SkipSpace();
      AMPD_ASSIGN_OR_RETURN(Json item, Value(depth + 1));
      v.items.push_back(std::move(item));
      SkipSpace();
      if (Consume("]")) return v;
      if (!Consume(",")) return Error("expected ',' or ']'");
    }
  }

  // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, kept as written.
  absl::StatusOr<Json> Number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      return pos_ - from;
    };
    Consume("-");
    if (Consume("0")) {
      if (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) {
        return Error("a number with a leading zero");
      }
    } else if (digits() == 0) {
      return Error("a number without digits");
    }
    if (Consume(".") && digits() == 0) return Error("a number without digits after '.'");
    if (Consume("e") || Consume("E")) {
      if (!Consume("+")) Consume("-");
      if (digits() == 0) return Error("a number without exponent digits");
    }
    Json v;
    v.type = Json::Type::kNumber;
    v.text = std::string(s_.substr(start, pos_ - start));
    return v;
  }

  absl::StatusOr<std::string> String() {
    std::string out;
    if (absl::Status s = codec::ReadJsonString(s_, &pos_, &out); !s.ok()) {
      return Error(s.message());
    }
    return out;
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

// ---- typed access with the key's path in every error ------------------------------

absl::string_view TypeName(Json::Type type) {
  switch (type) {
    case Json::Type::kNull:
      return "null";
    case Json::Type::kBool:
      return "a boolean";
    case Json::Type::kNumber:
      return "a number";
    case Json::Type::kString:
      return "a string";
    case Json::Type::kArray:
      return "an array";
    case Json::Type::kObject:
      return "an object";
  }
  return "?";
}

absl::Status Expect(const Json& v, Json::Type type, absl::string_view path) {
  if (v.type == type) return absl::OkStatus();
  return Corrupt(path, absl::StrCat("expected ", TypeName(type), ", got ", TypeName(v.type)));
}

// The members of one object, each to be read once; Done() refuses the
// members nobody read.
class Fields {
 public:
  static absl::StatusOr<Fields> Of(const Json& v, std::string path) {
    AMPD_RETURN_IF_ERROR(Expect(v, Json::Type::kObject, path.empty() ? "(the document)" : path));
    Fields f;
    f.path_ = std::move(path);
    for (const auto& [key, value] : v.members) {
      if (!f.members_.emplace(key, &value).second) {
        return Corrupt(f.PathOf(key), "duplicate key");
      }
    }
    return f;
  }

  std::string PathOf(absl::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }

  bool Has(absl::string_view key) const { return members_.contains(std::string(key)); }

  absl::StatusOr<const Json*> Get(absl::string_view key) {
    auto it = members_.find(std::string(key));
    if (it == members_.end()) return Corrupt(PathOf(key), "missing");
    read_.insert(it->first);
    return it->second;
  }

  absl::StatusOr<std::string> String(absl::string_view key) {
    AMPD_ASSIGN_OR_RETURN(const Json* v, Get(key));
    AMPD_RETURN_IF_ERROR(Expect(*v, Json::Type::kString, PathOf(key)));
    return v->text;
  }

  absl::StatusOr<bool> Bool(absl::string_view key) {
    AMPD_ASSIGN_OR_RETURN(const Json* v, Get(key));
    AMPD_RETURN_IF_ERROR(Expect(*v, Json::Type::kBool, PathOf(key)));
    return v->boolean;
  }

  absl::StatusOr<float> Float(absl::string_view key) {
    AMPD_ASSIGN_OR_RETURN(const Json* v, Get(key));
    AMPD_RETURN_IF_ERROR(Expect(*v, Json::Type::kNumber, PathOf(key)));
    float value = 0;
    if (!absl::SimpleAtof(v->text, &value) || !std::isfinite(value)) {
      return Corrupt(PathOf(key), absl::StrCat("not a finite float32: ", v->text));
    }
    return value;
  }

  absl::StatusOr<double> Double(absl::string_view key) {
    AMPD_ASSIGN_OR_RETURN(const Json* v, Get(key));
    AMPD_RETURN_IF_ERROR(Expect(*v, Json::Type::kNumber, PathOf(key)));
    double value = 0;
    if (!absl::SimpleAtod(v->text, &value) || !std::isfinite(value)) {
      return Corrupt(PathOf(key), absl::StrCat("not a finite float64: ", v->text));
    }
    return value;
  }

  // Integers are written without fraction or exponent.
  template <typename Int>
  absl::StatusOr<Int> Integer(absl::string_view key) {
    AMPD_ASSIGN_OR_RETURN(const Json* v, Get(key));
    AMPD_RETURN_IF_ERROR(Expect(*v, Json::Type::kNumber, PathOf(key)));
    Int value = 0;
    if (v->text.find_first_of(".eE") != std::string::npos || !absl::SimpleAtoi(v->text, &value)) {
      return Corrupt(PathOf(key), absl::StrCat("not an integer of the field's range: ", v->text));
    }
    return value;
  }

  absl::Status Done() const {
    for (const auto& [key, value] : members_) {
      if (!read_.contains(key)) return Corrupt(PathOf(key), "unknown key");
    }
    return absl::OkStatus();
  }

 private:
  std::string path_;
  std::map<std::string, const Json*> members_;
  std::set<std::string> read_;
};

// ---- names ------------------------------------------------------------------------

absl::string_view LossName(model::LossKind loss) {
  return loss == model::LossKind::kCrossEntropy ? "cross_entropy" : "mse";
}

template <typename Enum, typename NameOf>
absl::StatusOr<Enum> FromName(absl::string_view name, std::initializer_list<Enum> values,
                              NameOf name_of, absl::string_view path) {
  for (Enum value : values) {
    if (name_of(value) == name) return value;
  }
  std::string known;
  for (Enum value : values) absl::StrAppend(&known, known.empty() ? "" : ", ", name_of(value));
  return Corrupt(path,
                 absl::StrCat("unknown value '", absl::CHexEscape(name), "' (one of ", known, ")"));
}

// ---- writer -----------------------------------------------------------------------

// 9 significant digits read back to the same float32, 17 to the same
// float64. A non-finite value (which ValidateJobConfig refuses) is written
// as null, which the reader refuses.
std::string FloatText(float v) {
  return std::isfinite(v) ? absl::StrFormat("%.9g", v) : std::string("null");
}
std::string DoubleText(double v) {
  return std::isfinite(v) ? absl::StrFormat("%.17g", v) : std::string("null");
}

// Appends "key":value members, comma-separated.
class ObjectWriter {
 public:
  explicit ObjectWriter(std::string* out) : out_(out) { out_->push_back('{'); }
  void Raw(absl::string_view key, absl::string_view value) {
    if (!first_) out_->push_back(',');
    first_ = false;
    codec::AppendJsonString(key, out_);
    out_->push_back(':');
    out_->append(value.data(), value.size());
  }
  void String(absl::string_view key, absl::string_view value) {
    std::string quoted;
    codec::AppendJsonString(value, &quoted);
    Raw(key, quoted);
  }
  void Bool(absl::string_view key, bool value) { Raw(key, value ? "true" : "false"); }
  void Float(absl::string_view key, float value) { Raw(key, FloatText(value)); }
  void Double(absl::string_view key, double value) { Raw(key, DoubleText(value)); }
  void Int(absl::string_view key, int64_t value) { Raw(key, absl::StrCat(value)); }
  void Close() { out_->push_back('}'); }

 private:
  std::string* out_;
  bool first_ = true;
};

std::string LayerJson(const model::LayerSpec& layer) {
  std::string out;
  ObjectWriter w(&out);
  w.String("kind", model::LayerKindName(layer.kind));
  switch (layer.kind) {
    case model::LayerKind::kLinear:
      w.Int("in_features", layer.in_features);
      w.Int("out_features", layer.out_features);
      w.Bool("bias", layer.bias);
      break;
    case model::LayerKind::kLayerNorm:
      w.Int("normalized_shape", layer.normalized_shape);
      w.Float("eps", layer.eps);
      w.Bool("elementwise_affine", layer.elementwise_affine);
      break;
    case model::LayerKind::kEmbedding:
      w.Int("num_embeddings", layer.num_embeddings);
      w.Int("embedding_dim", layer.embedding_dim);
      break;
    case model::LayerKind::kReLU:
    case model::LayerKind::kGELU:
    case model::LayerKind::kTanh:
      break;
  }
  w.Close();
  return out;
}

std::string GptJson(const model::GptSpec& gpt) {
  std::string out;
  ObjectWriter w(&out);
  w.Int("vocab_size", gpt.vocab_size);
  w.Int("context_length", gpt.context_length);
  w.Int("d_model", gpt.d_model);
  w.Int("n_layer", gpt.n_layer);
  w.Int("n_head", gpt.n_head);
  w.Int("mlp_ratio", gpt.mlp_ratio);
  w.Float("layer_norm_eps", gpt.layer_norm_eps);
  w.Bool("tie_embeddings", gpt.tie_embeddings);
  w.Close();
  return out;
}

// Whether a decoder has one of Gemma 3's parts (format version 12).
bool HasGemmaParts(const model::DecoderSpec& d) {
  return d.norm_unit_offset || d.mlp_activation != model::MlpActivation::kSilu ||
         d.sandwich_norms || d.scale_embeddings || d.query_pre_attn_scalar != 0.0f ||
         !d.sliding_layers.empty() || d.sliding_window != 0 || d.rope_local_theta != 10000.0f;
}

std::string DecoderJson(const model::DecoderSpec& d) {
  std::string out;
  ObjectWriter w(&out);
  w.Int("vocab_size", d.vocab_size);
  w.Int("hidden_size", d.hidden_size);
  w.Int("intermediate_size", d.intermediate_size);
  w.Int("num_hidden_layers", d.num_hidden_layers);
  w.Int("num_attention_heads", d.num_attention_heads);
  w.Int("num_key_value_heads", d.num_key_value_heads);
  w.Int("head_dim", d.head_dim);
  w.Float("rms_norm_eps", d.rms_norm_eps);
  w.Float("rope_theta", d.rope_theta);
  w.Int("max_position_embeddings", d.max_position_embeddings);
  w.Bool("tie_word_embeddings", d.tie_word_embeddings);
  w.Float("initializer_range", d.initializer_range);
  w.Bool("qkv_bias", d.qkv_bias);
  w.Bool("o_bias", d.o_bias);
  // Version 10, and only when set: every other decoder keeps its bytes.
  if (d.qk_norm) w.Bool("qk_norm", true);
  // Version 11, and only with one of Gemma 3's parts.
  if (HasGemmaParts(d)) {
    std::string parts;
    ObjectWriter g(&parts);
    g.Bool("norm_unit_offset", d.norm_unit_offset);
    g.String("mlp_activation",
             d.mlp_activation == model::MlpActivation::kGeluTanh ? "gelu_tanh" : "silu");
    g.Bool("sandwich_norms", d.sandwich_norms);
    g.Bool("scale_embeddings", d.scale_embeddings);
    g.Float("query_pre_attn_scalar", d.query_pre_attn_scalar);
    std::string layers;
    for (const bool slides : d.sliding_layers) layers.push_back(slides ? '1' : '0');
    g.String("sliding_layers", layers);
    g.Int("sliding_window", d.sliding_window);
    g.Float("rope_local_theta", d.rope_local_theta);
    g.Close();
    w.Raw("gemma", parts);
  }
  // Version 9, and only when scaled: every other decoder keeps its bytes.
  if (d.rope_scaling.type != model::RopeType::kDefault) {
    std::string rope;
    ObjectWriter r(&rope);
    r.String("rope_type", model::RopeTypeName(d.rope_scaling.type));
    r.Float("factor", d.rope_scaling.factor);
    r.Float("low_freq_factor", d.rope_scaling.low_freq_factor);
    r.Float("high_freq_factor", d.rope_scaling.high_freq_factor);
    r.Int("original_max_position_embeddings", d.rope_scaling.original_max_position_embeddings);
    r.Close();
    w.Raw("rope_scaling", rope);
  }
  // Version 7, and only when set: a full fine-tune keeps its bytes.
  if (d.lora.has_value()) {
    std::string modules = "[";
    for (size_t i = 0; i < d.lora->target_modules.size(); ++i) {
      if (i > 0) modules.push_back(',');
      codec::AppendJsonString(d.lora->target_modules[i], &modules);
    }
    modules.push_back(']');
    std::string lora;
    ObjectWriter l(&lora);
    l.Int("rank", d.lora->rank);
    l.Float("alpha", d.lora->alpha);
    l.Raw("target_modules", modules);
    l.Close();
    w.Raw("lora", lora);
  }
  w.Close();
  return out;
}

std::string DistributedJson(const dist::DistributedSpec& spec) {
  std::string out;
  ObjectWriter w(&out);
  w.Int("world_size", spec.world_size);
  w.Int("rank", spec.rank);
  w.String("group", spec.group);
  w.String("rendezvous", spec.rendezvous);
  w.Int("timeout_ms", spec.timeout_ms);
  // Hex; absent from configs written before distributed jobs carried one.
  if (!spec.secret.empty()) w.String("secret", absl::BytesToHexString(spec.secret));
  w.Close();
  return out;
}

std::string ModelJson(const model::ModelSpec& spec) {
  std::string layers = "[";
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (i > 0) layers.push_back(',');
    layers += LayerJson(spec.layers[i]);
  }
  layers.push_back(']');
  std::string out;
  ObjectWriter w(&out);
  w.Raw("layers", layers);
  // Only when set: a layer-stack config encodes as it always has.
  std::visit(Overloaded{[](const model::LayerStack&) {},
                        [&w](const model::GptSpec& g) { w.Raw("gpt", GptJson(g)); },
                        [&w](const model::DecoderSpec& d) { w.Raw("decoder", DecoderJson(d)); }},
             spec.kind);
  w.String("loss", LossName(spec.loss));
  w.Float("loss_multiplier", spec.loss_multiplier);
  w.Close();
  return out;
}

std::string OptimizerJson(const optim::OptimizerSpec& spec) {
  std::string out;
  ObjectWriter w(&out);
  w.String("kind", optim::OptimizerName(spec.kind));
  if (spec.kind == optim::OptimizerKind::kSgd) {
    w.Float("lr", spec.sgd.lr);
    w.Float("momentum", spec.sgd.momentum);
    w.Float("dampening", spec.sgd.dampening);
    w.Float("weight_decay", spec.sgd.weight_decay);
    w.Bool("nesterov", spec.sgd.nesterov);
  } else {
    w.Float("lr", spec.adam.lr);
    w.Float("beta1", spec.adam.beta1);
    w.Float("beta2", spec.adam.beta2);
    w.Float("eps", spec.adam.eps);
    w.Float("weight_decay", spec.adam.weight_decay);
  }
  w.Float("max_grad_norm", spec.max_grad_norm);
  if (spec.lr_schedule.kind != optim::LrScheduleKind::kConstant) {
    std::string schedule;
    ObjectWriter s(&schedule);
    s.String("kind", optim::LrScheduleName(spec.lr_schedule.kind));
    s.Int("warmup_steps", spec.lr_schedule.warmup_steps);
    s.Int("decay_steps", spec.lr_schedule.decay_steps);
    s.Float("min_lr", spec.lr_schedule.min_lr);
    s.Close();
    w.Raw("lr_schedule", schedule);
  }
  w.Close();
  return out;
}

std::string ScalerJson(const amp::ScalerConfig& c) {
  std::string out;
  ObjectWriter w(&out);
  w.String("policy", amp::PolicyName(c.policy));
  w.Bool("enabled", c.enabled);
  w.Bool("dynamic", c.dynamic);
  w.Double("init_scale", c.init_scale);
  w.Double("growth_factor", c.growth_factor);
  w.Double("backoff_factor", c.backoff_factor);
  w.Int("growth_interval", c.growth_interval);
  w.Int("hysteresis", c.hysteresis);
  w.Bool("consecutive_hysteresis", c.consecutive_hysteresis);
  w.Bool("raise_at_min_scale", c.raise_at_min_scale);
  if (c.min_scale.has_value()) w.Double("min_scale", *c.min_scale);
  if (c.max_scale.has_value()) w.Double("max_scale", *c.max_scale);
  if (c.policy == amp::ScalerPolicy::kAdaptive) {
    w.Int("overflow_margin_log2", c.overflow_margin_log2);
    w.Double("underflow_threshold", c.underflow_threshold);
    // Version 5, and only when set: every other config keeps its bytes.
    if (c.per_layer_scales) w.Bool("per_layer_scales", true);
  }
  w.Close();
  return out;
}

// ---- reader -----------------------------------------------------------------------

absl::StatusOr<model::LayerSpec> LayerFromJson(const Json& v, const std::string& path) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, path));
  AMPD_ASSIGN_OR_RETURN(const std::string kind_name, f.String("kind"));
  model::LayerSpec layer;
  AMPD_ASSIGN_OR_RETURN(layer.kind,
                        FromName(kind_name,
                                 {model::LayerKind::kLinear, model::LayerKind::kReLU,
                                  model::LayerKind::kGELU, model::LayerKind::kTanh,
                                  model::LayerKind::kLayerNorm, model::LayerKind::kEmbedding},
                                 model::LayerKindName, f.PathOf("kind")));
  switch (layer.kind) {
    case model::LayerKind::kLinear: {
      AMPD_ASSIGN_OR_RETURN(layer.in_features, f.Integer<int64_t>("in_features"));
      AMPD_ASSIGN_OR_RETURN(layer.out_features, f.Integer<int64_t>("out_features"));
      AMPD_ASSIGN_OR_RETURN(layer.bias, f.Bool("bias"));
      break;
    }
    case model::LayerKind::kLayerNorm: {
      AMPD_ASSIGN_OR_RETURN(layer.normalized_shape, f.Integer<int64_t>("normalized_shape"));
      AMPD_ASSIGN_OR_RETURN(layer.eps, f.Float("eps"));
      AMPD_ASSIGN_OR_RETURN(layer.elementwise_affine, f.Bool("elementwise_affine"));
      break;
    }
    case model::LayerKind::kEmbedding: {
      AMPD_ASSIGN_OR_RETURN(layer.num_embeddings, f.Integer<int64_t>("num_embeddings"));
      AMPD_ASSIGN_OR_RETURN(layer.embedding_dim, f.Integer<int64_t>("embedding_dim"));
      break;
    }
    case model::LayerKind::kReLU:
    case model::LayerKind::kGELU:
    case model::LayerKind::kTanh:
      break;
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return layer;
}

absl::StatusOr<model::GptSpec> GptFromJson(const Json& v) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model.gpt"));
  model::GptSpec gpt;
  AMPD_ASSIGN_OR_RETURN(gpt.vocab_size, f.Integer<int64_t>("vocab_size"));
  AMPD_ASSIGN_OR_RETURN(gpt.context_length, f.Integer<int64_t>("context_length"));
  AMPD_ASSIGN_OR_RETURN(gpt.d_model, f.Integer<int64_t>("d_model"));
  AMPD_ASSIGN_OR_RETURN(gpt.n_layer, f.Integer<int64_t>("n_layer"));
  AMPD_ASSIGN_OR_RETURN(gpt.n_head, f.Integer<int64_t>("n_head"));
  AMPD_ASSIGN_OR_RETURN(gpt.mlp_ratio, f.Integer<int64_t>("mlp_ratio"));
  AMPD_ASSIGN_OR_RETURN(gpt.layer_norm_eps, f.Float("layer_norm_eps"));
  AMPD_ASSIGN_OR_RETURN(gpt.tie_embeddings, f.Bool("tie_embeddings"));
  AMPD_RETURN_IF_ERROR(f.Done());
  return gpt;
}

absl::StatusOr<model::LoraSpec> LoraFromJson(const Json& v) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model.decoder.lora"));
  model::LoraSpec lora;
  AMPD_ASSIGN_OR_RETURN(lora.rank, f.Integer<int64_t>("rank"));
  AMPD_ASSIGN_OR_RETURN(lora.alpha, f.Float("alpha"));
  AMPD_ASSIGN_OR_RETURN(const Json* modules, f.Get("target_modules"));
  const std::string path = f.PathOf("target_modules");
  AMPD_RETURN_IF_ERROR(Expect(*modules, Json::Type::kArray, path));
  lora.target_modules.clear();
  for (size_t i = 0; i < modules->items.size(); ++i) {
    AMPD_RETURN_IF_ERROR(
        Expect(modules->items[i], Json::Type::kString, absl::StrCat(path, "[", i, "]")));
    lora.target_modules.push_back(modules->items[i].text);
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return lora;
}

absl::StatusOr<model::RopeScaling> RopeScalingFromJson(const Json& v) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model.decoder.rope_scaling"));
  model::RopeScaling r;
  AMPD_ASSIGN_OR_RETURN(const std::string type, f.String("rope_type"));
  AMPD_ASSIGN_OR_RETURN(r.type, FromName(type,
                                         {model::RopeType::kDefault, model::RopeType::kLinear,
                                          model::RopeType::kLlama3},
                                         model::RopeTypeName, f.PathOf("rope_type")));
  AMPD_ASSIGN_OR_RETURN(r.factor, f.Float("factor"));
  AMPD_ASSIGN_OR_RETURN(r.low_freq_factor, f.Float("low_freq_factor"));
  AMPD_ASSIGN_OR_RETURN(r.high_freq_factor, f.Float("high_freq_factor"));
  AMPD_ASSIGN_OR_RETURN(r.original_max_position_embeddings,
                        f.Integer<int64_t>("original_max_position_embeddings"));
  AMPD_RETURN_IF_ERROR(f.Done());
  return r;
}

absl::Status GemmaPartsFromJson(const Json& v, model::DecoderSpec& d) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model.decoder.gemma"));
  AMPD_ASSIGN_OR_RETURN(d.norm_unit_offset, f.Bool("norm_unit_offset"));
  AMPD_ASSIGN_OR_RETURN(const std::string act, f.String("mlp_activation"));
  if (act != "silu" && act != "gelu_tanh") {
    return Corrupt(f.PathOf("mlp_activation"), absl::StrCat("unknown value \"", act, "\""));
  }
  d.mlp_activation = act == "silu" ? model::MlpActivation::kSilu : model::MlpActivation::kGeluTanh;
  AMPD_ASSIGN_OR_RETURN(d.sandwich_norms, f.Bool("sandwich_norms"));
  AMPD_ASSIGN_OR_RETURN(d.scale_embeddings, f.Bool("scale_embeddings"));
  AMPD_ASSIGN_OR_RETURN(d.query_pre_attn_scalar, f.Float("query_pre_attn_scalar"));
  AMPD_ASSIGN_OR_RETURN(const std::string layers, f.String("sliding_layers"));
  for (const char c : layers) {
    if (c != '0' && c != '1') {
      return Corrupt(f.PathOf("sliding_layers"), "expected one \"0\" or \"1\" per layer");
    }
    d.sliding_layers.push_back(c == '1');
  }
  AMPD_ASSIGN_OR_RETURN(d.sliding_window, f.Integer<int64_t>("sliding_window"));
  AMPD_ASSIGN_OR_RETURN(d.rope_local_theta, f.Float("rope_local_theta"));
  return f.Done();
}

absl::StatusOr<model::DecoderSpec> DecoderFromJson(const Json& v, int64_t version) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model.decoder"));
  model::DecoderSpec d;
  AMPD_ASSIGN_OR_RETURN(d.vocab_size, f.Integer<int64_t>("vocab_size"));
  AMPD_ASSIGN_OR_RETURN(d.hidden_size, f.Integer<int64_t>("hidden_size"));
  AMPD_ASSIGN_OR_RETURN(d.intermediate_size, f.Integer<int64_t>("intermediate_size"));
  AMPD_ASSIGN_OR_RETURN(d.num_hidden_layers, f.Integer<int64_t>("num_hidden_layers"));
  AMPD_ASSIGN_OR_RETURN(d.num_attention_heads, f.Integer<int64_t>("num_attention_heads"));
  AMPD_ASSIGN_OR_RETURN(d.num_key_value_heads, f.Integer<int64_t>("num_key_value_heads"));
  AMPD_ASSIGN_OR_RETURN(d.head_dim, f.Integer<int64_t>("head_dim"));
  AMPD_ASSIGN_OR_RETURN(d.rms_norm_eps, f.Float("rms_norm_eps"));
  AMPD_ASSIGN_OR_RETURN(d.rope_theta, f.Float("rope_theta"));
  AMPD_ASSIGN_OR_RETURN(d.max_position_embeddings, f.Integer<int64_t>("max_position_embeddings"));
  AMPD_ASSIGN_OR_RETURN(d.tie_word_embeddings, f.Bool("tie_word_embeddings"));
  AMPD_ASSIGN_OR_RETURN(d.initializer_range, f.Float("initializer_range"));
  AMPD_ASSIGN_OR_RETURN(d.qkv_bias, f.Bool("qkv_bias"));
  AMPD_ASSIGN_OR_RETURN(d.o_bias, f.Bool("o_bias"));
  if (f.Has("qk_norm")) {
    if (version < 10) {
      return Corrupt("model.decoder.qk_norm",
                     absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(d.qk_norm, f.Bool("qk_norm"));
  }
  if (f.Has("gemma")) {
    if (version < 12) {
      return Corrupt("model.decoder.gemma", absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(const Json* gemma, f.Get("gemma"));
    AMPD_RETURN_IF_ERROR(GemmaPartsFromJson(*gemma, d));
  }
  if (f.Has("rope_scaling")) {
    if (version < 9) {
      return Corrupt("model.decoder.rope_scaling",
                     absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(const Json* rope, f.Get("rope_scaling"));
    AMPD_ASSIGN_OR_RETURN(d.rope_scaling, RopeScalingFromJson(*rope));
  }
  if (f.Has("lora")) {
    if (version < 7) {
      return Corrupt("model.decoder.lora", absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(const Json* lora, f.Get("lora"));
    AMPD_ASSIGN_OR_RETURN(d.lora, LoraFromJson(*lora));
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return d;
}

absl::StatusOr<model::ModelSpec> ModelFromJson(const Json& v, int64_t version) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "model"));
  model::ModelSpec spec;
  AMPD_ASSIGN_OR_RETURN(const Json* layers, f.Get("layers"));
  AMPD_RETURN_IF_ERROR(Expect(*layers, Json::Type::kArray, "model.layers"));
  for (size_t i = 0; i < layers->items.size(); ++i) {
    AMPD_ASSIGN_OR_RETURN(model::LayerSpec layer,
                          LayerFromJson(layers->items[i], absl::StrCat("model.layers[", i, "]")));
    spec.layers.push_back(layer);
  }
  // Absent in configs written before GPTs existed.
  if (f.Has("gpt")) {
    if (version < 3) return Corrupt("model.gpt", "not a key of format_version 1 or 2");
    AMPD_ASSIGN_OR_RETURN(const Json* gpt, f.Get("gpt"));
    AMPD_ASSIGN_OR_RETURN(spec.kind, GptFromJson(*gpt));
  }
  if (f.Has("decoder")) {
    if (version < 6) {
      return Corrupt("model.decoder", absl::StrCat("not a key of format_version ", version));
    }
    if (spec.gpt() != nullptr) {
      return Corrupt("model.decoder", "a model is a GPT or a decoder, not both");
    }
    AMPD_ASSIGN_OR_RETURN(const Json* decoder, f.Get("decoder"));
    AMPD_ASSIGN_OR_RETURN(spec.kind, DecoderFromJson(*decoder, version));
  }
  AMPD_ASSIGN_OR_RETURN(const std::string loss, f.String("loss"));
  AMPD_ASSIGN_OR_RETURN(
      spec.loss, FromName(loss, {model::LossKind::kMse, model::LossKind::kCrossEntropy}, LossName,
                          "model.loss"));
  AMPD_ASSIGN_OR_RETURN(spec.loss_multiplier, f.Float("loss_multiplier"));
  AMPD_RETURN_IF_ERROR(f.Done());
  return spec;
}

absl::StatusOr<optim::LrSchedule> LrScheduleFromJson(const Json& v) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "optimizer.lr_schedule"));
  optim::LrSchedule schedule;
  AMPD_ASSIGN_OR_RETURN(const std::string kind, f.String("kind"));
  // Only non-constant schedules are written.
  AMPD_ASSIGN_OR_RETURN(
      schedule.kind, FromName(kind, {optim::LrScheduleKind::kWarmupCosine}, optim::LrScheduleName,
                              "optimizer.lr_schedule.kind"));
  AMPD_ASSIGN_OR_RETURN(schedule.warmup_steps, f.Integer<int64_t>("warmup_steps"));
  AMPD_ASSIGN_OR_RETURN(schedule.decay_steps, f.Integer<int64_t>("decay_steps"));
  AMPD_ASSIGN_OR_RETURN(schedule.min_lr, f.Float("min_lr"));
  AMPD_RETURN_IF_ERROR(f.Done());
  return schedule;
}

absl::StatusOr<optim::OptimizerSpec> OptimizerFromJson(const Json& v, int64_t version) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "optimizer"));
  AMPD_ASSIGN_OR_RETURN(const std::string kind_name, f.String("kind"));
  AMPD_ASSIGN_OR_RETURN(const optim::OptimizerKind kind,
                        FromName(kind_name,
                                 {optim::OptimizerKind::kSgd, optim::OptimizerKind::kAdam,
                                  optim::OptimizerKind::kAdamW},
                                 optim::OptimizerName, "optimizer.kind"));
  // Every field of the kind is read below; the defaults only fill the
  // other kind's, which the job never reads.
  optim::OptimizerSpec spec = optim::DefaultOptimizerSpec(kind);
  if (kind == optim::OptimizerKind::kSgd) {
    AMPD_ASSIGN_OR_RETURN(spec.sgd.lr, f.Float("lr"));
    AMPD_ASSIGN_OR_RETURN(spec.sgd.momentum, f.Float("momentum"));
    AMPD_ASSIGN_OR_RETURN(spec.sgd.dampening, f.Float("dampening"));
    AMPD_ASSIGN_OR_RETURN(spec.sgd.weight_decay, f.Float("weight_decay"));
    AMPD_ASSIGN_OR_RETURN(spec.sgd.nesterov, f.Bool("nesterov"));
  } else {
    AMPD_ASSIGN_OR_RETURN(spec.adam.lr, f.Float("lr"));
    AMPD_ASSIGN_OR_RETURN(spec.adam.beta1, f.Float("beta1"));
    AMPD_ASSIGN_OR_RETURN(spec.adam.beta2, f.Float("beta2"));
    AMPD_ASSIGN_OR_RETURN(spec.adam.eps, f.Float("eps"));
    AMPD_ASSIGN_OR_RETURN(spec.adam.weight_decay, f.Float("weight_decay"));
  }
  AMPD_ASSIGN_OR_RETURN(spec.max_grad_norm, f.Float("max_grad_norm"));
  if (f.Has("lr_schedule")) {
    if (version < 3) {
      return Corrupt("optimizer.lr_schedule",
                     absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(const Json* schedule, f.Get("lr_schedule"));
    AMPD_ASSIGN_OR_RETURN(spec.lr_schedule, LrScheduleFromJson(*schedule));
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return spec;
}

absl::StatusOr<amp::ScalerConfig> ScalerFromJson(const Json& v, int64_t version) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "scaler"));
  amp::ScalerConfig c;
  AMPD_ASSIGN_OR_RETURN(const std::string policy, f.String("policy"));
  AMPD_ASSIGN_OR_RETURN(c.policy,
                        FromName(policy,
                                 {amp::ScalerPolicy::kPyTorch, amp::ScalerPolicy::kPaddle,
                                  amp::ScalerPolicy::kDeepSpeed, amp::ScalerPolicy::kMegatron,
                                  amp::ScalerPolicy::kAdaptive},
                                 amp::PolicyName, "scaler.policy"));
  if (c.policy == amp::ScalerPolicy::kAdaptive && version < 2) {
    return Corrupt("scaler.policy", "adaptive is not a policy of format_version 1");
  }
  AMPD_ASSIGN_OR_RETURN(c.enabled, f.Bool("enabled"));
  AMPD_ASSIGN_OR_RETURN(c.dynamic, f.Bool("dynamic"));
  AMPD_ASSIGN_OR_RETURN(c.init_scale, f.Double("init_scale"));
  AMPD_ASSIGN_OR_RETURN(c.growth_factor, f.Double("growth_factor"));
  AMPD_ASSIGN_OR_RETURN(c.backoff_factor, f.Double("backoff_factor"));
  AMPD_ASSIGN_OR_RETURN(c.growth_interval, f.Integer<int64_t>("growth_interval"));
  AMPD_ASSIGN_OR_RETURN(c.hysteresis, f.Integer<int64_t>("hysteresis"));
  AMPD_ASSIGN_OR_RETURN(c.consecutive_hysteresis, f.Bool("consecutive_hysteresis"));
  AMPD_ASSIGN_OR_RETURN(c.raise_at_min_scale, f.Bool("raise_at_min_scale"));
  if (f.Has("min_scale")) {
    AMPD_ASSIGN_OR_RETURN(c.min_scale, f.Double("min_scale"));
  }
  if (f.Has("max_scale")) {
    AMPD_ASSIGN_OR_RETURN(c.max_scale, f.Double("max_scale"));
  }
  if (c.policy == amp::ScalerPolicy::kAdaptive) {
    AMPD_ASSIGN_OR_RETURN(c.overflow_margin_log2, f.Integer<int64_t>("overflow_margin_log2"));
    AMPD_ASSIGN_OR_RETURN(c.underflow_threshold, f.Double("underflow_threshold"));
    // Absent in configs written before per-layer scales existed.
    if (f.Has("per_layer_scales")) {
      if (version < 5) {
        return Corrupt("scaler.per_layer_scales",
                       absl::StrCat("not a key of format_version ", version));
      }
      AMPD_ASSIGN_OR_RETURN(c.per_layer_scales, f.Bool("per_layer_scales"));
    }
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return c;
}

absl::StatusOr<dist::DistributedSpec> DistributedFromJson(const Json& v) {
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(v, "distributed"));
  dist::DistributedSpec spec;
  AMPD_ASSIGN_OR_RETURN(spec.world_size, f.Integer<int32_t>("world_size"));
  AMPD_ASSIGN_OR_RETURN(spec.rank, f.Integer<int32_t>("rank"));
  AMPD_ASSIGN_OR_RETURN(spec.group, f.String("group"));
  AMPD_ASSIGN_OR_RETURN(spec.rendezvous, f.String("rendezvous"));
  AMPD_ASSIGN_OR_RETURN(spec.timeout_ms, f.Integer<int64_t>("timeout_ms"));
  if (f.Has("secret")) {
    AMPD_ASSIGN_OR_RETURN(const std::string hex, f.String("secret"));
    const bool is_hex = hex.size() % 2 == 0 && std::all_of(hex.begin(), hex.end(), [](char c) {
                          return absl::ascii_isxdigit(static_cast<unsigned char>(c));
                        });
    if (!is_hex) return Corrupt(f.PathOf("secret"), "not a hex string");
    spec.secret = absl::HexStringToBytes(hex);
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  return spec;
}

}  // namespace

std::string EncodeJobConfig(const JobConfig& config, absl::string_view request_id) {
  std::string out;
  ObjectWriter w(&out);
  // The oldest version that holds the config (the header says why).
  int64_t version = 1;
  if (config.scaler.policy == amp::ScalerPolicy::kAdaptive) version = 2;
  if (config.optimizer.lr_schedule.kind != optim::LrScheduleKind::kConstant) version = 3;
  const model::DecoderSpec* decoder = config.model.decoder();
  if (config.model.gpt() != nullptr) version = 3;
  if (config.distributed.enabled()) version = 4;
  if (config.scaler.per_layer_scales) version = 5;
  if (decoder != nullptr) version = 6;
  if (decoder != nullptr && decoder->lora.has_value()) version = 7;
  if (config.batch_invariant) version = 8;
  if (decoder != nullptr && decoder->rope_scaling.type != model::RopeType::kDefault) version = 9;
  if (decoder != nullptr && decoder->qk_norm) version = 10;
  if (!config.base_model.empty()) version = 11;
  if (decoder != nullptr && HasGemmaParts(*decoder)) version = 12;
  w.Int("format_version", version);
  w.String("display_name", config.display_name);
  if (!request_id.empty()) w.String("request_id", request_id);
  w.Raw("seed", absl::StrCat(config.seed));
  w.String("precision", model::PrecisionName(config.precision));
  w.Raw("model", ModelJson(config.model));
  w.Raw("optimizer", OptimizerJson(config.optimizer));
  w.Raw("scaler", ScalerJson(config.scaler));
  if (config.distributed.enabled()) w.Raw("distributed", DistributedJson(config.distributed));
  if (config.batch_invariant) w.Raw("batch_invariant", "true");
  if (!config.base_model.empty()) w.String("base_model", config.base_model);
  w.Close();
  return out;
}

absl::StatusOr<DecodedJobConfig> DecodeJobConfig(absl::string_view json) {
  AMPD_ASSIGN_OR_RETURN(const Json document, Reader(json).Document());
  AMPD_ASSIGN_OR_RETURN(Fields f, Fields::Of(document, ""));
  // The version first: a later format may have changed any other key.
  AMPD_ASSIGN_OR_RETURN(const int64_t version, f.Integer<int64_t>("format_version"));
  if (version < 1 || version > kJobConfigFormatVersion) {
    return Corrupt(
        "format_version",
        absl::StrCat(version, " is not a version this ampd reads (1 to ", kJobConfigFormatVersion,
                     "); the checkpoint was written by ",
                     version > kJobConfigFormatVersion ? "a newer" : "another", " ampd"));
  }
  JobConfigRecord record;
  JobConfig& config = record.config;
  AMPD_ASSIGN_OR_RETURN(config.display_name, f.String("display_name"));
  if (f.Has("request_id")) {
    AMPD_ASSIGN_OR_RETURN(record.request_id, f.String("request_id"));
  }
  AMPD_ASSIGN_OR_RETURN(config.seed, f.Integer<uint64_t>("seed"));
  AMPD_ASSIGN_OR_RETURN(const std::string precision, f.String("precision"));
  AMPD_ASSIGN_OR_RETURN(
      config.precision,
      FromName(precision,
               {model::Precision::kFp32, model::Precision::kFp16, model::Precision::kBf16},
               model::PrecisionName, "precision"));
  AMPD_ASSIGN_OR_RETURN(const Json* model, f.Get("model"));
  AMPD_ASSIGN_OR_RETURN(config.model, ModelFromJson(*model, version));
  AMPD_ASSIGN_OR_RETURN(const Json* optimizer, f.Get("optimizer"));
  AMPD_ASSIGN_OR_RETURN(config.optimizer, OptimizerFromJson(*optimizer, version));
  AMPD_ASSIGN_OR_RETURN(const Json* scaler, f.Get("scaler"));
  AMPD_ASSIGN_OR_RETURN(config.scaler, ScalerFromJson(*scaler, version));
  // Absent in configs of jobs of one ampd.
  if (f.Has("distributed")) {
    if (version < 4) {
      return Corrupt("distributed", absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(const Json* distributed, f.Get("distributed"));
    AMPD_ASSIGN_OR_RETURN(config.distributed, DistributedFromJson(*distributed));
  }
  // Absent in configs of jobs without batch-invariant kernels.
  if (f.Has("batch_invariant")) {
    if (version < 8) {
      return Corrupt("batch_invariant", absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(config.batch_invariant, f.Bool("batch_invariant"));
  }
  // Absent in configs of jobs without a base model.
  if (f.Has("base_model")) {
    if (version < 11) {
      return Corrupt("base_model", absl::StrCat("not a key of format_version ", version));
    }
    AMPD_ASSIGN_OR_RETURN(config.base_model, f.String("base_model"));
  }
  AMPD_RETURN_IF_ERROR(f.Done());
  absl::StatusOr<ValidJobConfig> valid = ValidJobConfig::Check(std::move(record.config));
  if (!valid.ok()) {
    return absl::Status(valid.status().code(), absl::StrCat(kKey, ": ", valid.status().message()));
  }
  return DecodedJobConfig{*std::move(valid), std::move(record.request_id)};
}

}  // namespace ampd::engine
