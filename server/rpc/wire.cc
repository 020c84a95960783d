// Model spec conversions and field checks of the rpc layer (wire.h).
#include "server/rpc/wire.h"

#include <cmath>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/overloaded.h"
#include "common/status_macros.h"

namespace ampd::rpc {

namespace model = engine::model;

absl::Status CheckLength(absl::string_view field, absl::string_view value) {
  if (value.size() <= kMaxNameBytes) return absl::OkStatus();
  return FieldError(field, absl::StrCat("at most ", kMaxNameBytes, " bytes, got ", value.size()));
}

absl::Status CheckFinite(absl::string_view field, double value) {
  if (std::isfinite(value)) return absl::OkStatus();
  return FieldError(field, absl::StrCat("must be finite, got ", value));
}

namespace {

// The GPT's fields with the defaults of unset optional ones filled in; the
// engine validates the sizes (ValidateModelSpec).
absl::Status GptFromProto(const v1::Gpt& proto, absl::string_view field_prefix,
                          model::GptSpec* gpt) {
  gpt->vocab_size = proto.vocab_size();
  gpt->context_length = proto.context_length();
  gpt->d_model = proto.d_model();
  gpt->n_layer = proto.n_layer();
  gpt->n_head = proto.n_head();
  if (proto.has_mlp_ratio()) gpt->mlp_ratio = proto.mlp_ratio();
  if (proto.has_layer_norm_eps()) {
    if (absl::Status s =
            CheckFinite(absl::StrCat(field_prefix, ".gpt.layer_norm_eps"), proto.layer_norm_eps());
        !s.ok()) {
      return s;
    }
    gpt->layer_norm_eps = proto.layer_norm_eps();
  }
  if (proto.has_tie_embeddings()) gpt->tie_embeddings = proto.tie_embeddings();
  return absl::OkStatus();
}

// RoPE's scaling: the type and the fields it reads (one it does not read
// must be unset, so that nothing sent is silently ignored); the engine
// validates the values.
absl::Status RopeScalingFromProto(const v1::RopeScaling& proto, absl::string_view field_prefix,
                                  model::RopeScaling* r) {
  const std::string prefix = absl::StrCat(field_prefix, ".decoder.rope_scaling.");
  switch (proto.rope_type()) {
    case v1::ROPE_TYPE_DEFAULT:
      r->type = model::RopeType::kDefault;
      break;
    case v1::ROPE_TYPE_LINEAR:
      r->type = model::RopeType::kLinear;
      break;
    case v1::ROPE_TYPE_LLAMA3:
      r->type = model::RopeType::kLlama3;
      break;
    default:
      return FieldError(absl::StrCat(prefix, "rope_type"),
                        absl::StrCat("must be default, linear or llama3, got ", proto.rope_type()));
  }
  const bool scaled = r->type != model::RopeType::kDefault;
  const bool llama3 = r->type == model::RopeType::kLlama3;
  const struct {
    bool set, read;
    const char* name;
  } fields[] = {
      {proto.has_factor(), scaled, "factor"},
      {proto.has_low_freq_factor(), llama3, "low_freq_factor"},
      {proto.has_high_freq_factor(), llama3, "high_freq_factor"},
      {proto.has_original_max_position_embeddings(), llama3, "original_max_position_embeddings"},
  };
  for (const auto& f : fields) {
    if (f.set == f.read) continue;
    return FieldError(absl::StrCat(prefix, f.name),
                      absl::StrCat(f.read ? "required" : "not read", " by rope_type ",
                                   model::RopeTypeName(r->type)));
  }
  const std::pair<const char*, float> reals[] = {{"factor", proto.factor()},
                                                 {"low_freq_factor", proto.low_freq_factor()},
                                                 {"high_freq_factor", proto.high_freq_factor()}};
  for (const auto& [name, value] : reals) {
    AMPD_RETURN_IF_ERROR(CheckFinite(absl::StrCat(prefix, name), value));
  }
  if (scaled) r->factor = proto.factor();
  r->low_freq_factor = proto.low_freq_factor();
  r->high_freq_factor = proto.high_freq_factor();
  r->original_max_position_embeddings = proto.original_max_position_embeddings();
  return absl::OkStatus();
}

// PEFT's target_modules forms as kLoraModules names: a dotted suffix
// becomes its module, "all-linear" every module; the engine refuses the
// rest, naming the entry.
std::vector<std::string> LoraTargetsFromProto(const v1::LoRA& proto) {
  std::vector<std::string> targets;
  for (const std::string& target : proto.target_modules()) {
    if (target == model::kLoraAllLinear) {
      targets.insert(targets.end(), std::begin(model::kLoraModules), std::end(model::kLoraModules));
    } else {
      targets.push_back(model::LoraModuleOfPeftTarget(target));
    }
  }
  return targets;
}

// The decoder's fields with Hugging Face's defaults for unset optional
// ones; the engine validates the sizes.
absl::Status DecoderFromProto(const v1::Decoder& proto, absl::string_view field_prefix,
                              model::DecoderSpec* d) {
  d->vocab_size = proto.vocab_size();
  d->hidden_size = proto.hidden_size();
  d->intermediate_size = proto.intermediate_size();
  d->num_hidden_layers = proto.num_hidden_layers();
  d->num_attention_heads = proto.num_attention_heads();
  d->num_key_value_heads =
      proto.has_num_key_value_heads() ? proto.num_key_value_heads() : proto.num_attention_heads();
  // The engine's 0 is "unset" (hidden_size / num_attention_heads): an
  // explicit 0 is a width, and no width is 0.
  if (proto.has_head_dim() && proto.head_dim() == 0) {
    return FieldError(absl::StrCat(field_prefix, ".decoder.head_dim"),
                      "must be even and > 0 when set (unset: hidden_size / num_attention_heads), "
                      "got 0");
  }
  d->head_dim = proto.head_dim();
  d->max_position_embeddings = proto.max_position_embeddings();
  const std::pair<bool, std::pair<const char*, float>> reals[] = {
      {proto.has_rms_norm_eps(), {"rms_norm_eps", proto.rms_norm_eps()}},
      {proto.has_rope_theta(), {"rope_theta", proto.rope_theta()}},
      {proto.has_initializer_range(), {"initializer_range", proto.initializer_range()}},
  };
  for (const auto& [set, field] : reals) {
    if (!set) continue;
    AMPD_RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field_prefix, ".decoder.", field.first), field.second));
  }
  if (proto.has_rms_norm_eps()) d->rms_norm_eps = proto.rms_norm_eps();
  if (proto.has_rope_theta()) d->rope_theta = proto.rope_theta();
  if (proto.has_initializer_range()) d->initializer_range = proto.initializer_range();
  d->tie_word_embeddings = proto.tie_word_embeddings();
  d->qkv_bias = proto.qkv_bias();
  d->o_bias = proto.o_bias();
  d->qk_norm = proto.qk_norm();
  d->norm_unit_offset = proto.norm_unit_offset();
  switch (proto.mlp_activation()) {
    case v1::MLP_ACTIVATION_SILU:
      d->mlp_activation = model::MlpActivation::kSilu;
      break;
    case v1::MLP_ACTIVATION_GELU_TANH:
      d->mlp_activation = model::MlpActivation::kGeluTanh;
      break;
    default:
      return FieldError(absl::StrCat(field_prefix, ".decoder.mlp_activation"),
                        absl::StrCat("unknown value ", proto.mlp_activation()));
  }
  d->sandwich_norms = proto.sandwich_norms();
  d->scale_embeddings = proto.scale_embeddings();
  for (const auto& [set, field] :
       {std::pair{proto.has_query_pre_attn_scalar(),
                  std::pair{"query_pre_attn_scalar", proto.query_pre_attn_scalar()}},
        std::pair{proto.has_rope_local_theta(),
                  std::pair{"rope_local_theta", proto.rope_local_theta()}}}) {
    if (!set) continue;
    AMPD_RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field_prefix, ".decoder.", field.first), field.second));
  }
  d->query_pre_attn_scalar = proto.query_pre_attn_scalar();
  if (proto.has_rope_local_theta()) d->rope_local_theta = proto.rope_local_theta();
  d->sliding_layers.assign(proto.sliding_layers().begin(), proto.sliding_layers().end());
  d->sliding_window = proto.sliding_window();
  if (proto.has_rope_scaling()) {
    AMPD_RETURN_IF_ERROR(
        RopeScalingFromProto(proto.rope_scaling(), field_prefix, &d->rope_scaling));
  }
  if (proto.has_lora()) {
    model::LoraSpec lora;
    lora.rank = proto.lora().rank();
    AMPD_RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field_prefix, ".decoder.lora.alpha"), proto.lora().alpha()));
    lora.alpha = proto.lora().alpha();
    if (proto.lora().target_modules_size() > 0) {
      lora.target_modules = LoraTargetsFromProto(proto.lora());
    }
    d->lora = std::move(lora);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelSpecFromProto(const v1::ModelSpec& proto, absl::string_view field_prefix,
                                model::ModelSpec* spec) {
  if (proto.has_decoder()) {
    if (proto.layers_size() > 0) {
      return FieldError(
          absl::StrCat(field_prefix, ".layers"),
          absl::StrCat("must be empty when decoder is set, got ", proto.layers_size(), " layers"));
    }
    if (proto.loss() != v1::LOSS_UNSPECIFIED && proto.loss() != v1::LOSS_CROSS_ENTROPY) {
      return FieldError(absl::StrCat(field_prefix, ".loss"),
                        "a decoder's loss is the token cross-entropy (leave it unset)");
    }
    model::DecoderSpec decoder;
    AMPD_RETURN_IF_ERROR(DecoderFromProto(proto.decoder(), field_prefix, &decoder));
    spec->kind = decoder;
    spec->loss = model::LossKind::kCrossEntropy;
  }
  if (proto.has_gpt()) {
    // Both set is the client's mistake, named here rather than left to
    // look like a layer-stack error.
    if (proto.layers_size() > 0) {
      return FieldError(
          absl::StrCat(field_prefix, ".layers"),
          absl::StrCat("must be empty when gpt is set, got ", proto.layers_size(), " layers"));
    }
    if (proto.loss() != v1::LOSS_UNSPECIFIED && proto.loss() != v1::LOSS_CROSS_ENTROPY) {
      return FieldError(absl::StrCat(field_prefix, ".loss"),
                        "a GPT's loss is the token cross-entropy (leave it unset)");
    }
    model::GptSpec gpt;
    AMPD_RETURN_IF_ERROR(GptFromProto(proto.gpt(), field_prefix, &gpt));
    spec->kind = gpt;
    spec->loss = model::LossKind::kCrossEntropy;
  }
  for (int i = 0; i < proto.layers_size(); ++i) {
    const v1::Layer& layer = proto.layers(i);
    const std::string field = absl::StrCat(field_prefix, ".layers[", i, "]");
    model::LayerSpec l;
    switch (layer.kind_case()) {
      case v1::Layer::kLinear:
        l.kind = model::LayerKind::kLinear;
        l.in_features = layer.linear().in_features();
        l.out_features = layer.linear().out_features();
        l.bias = layer.linear().has_bias() ? layer.linear().bias() : true;
        break;
      case v1::Layer::kRelu:
        l.kind = model::LayerKind::kReLU;
        break;
      case v1::Layer::kGelu:
        l.kind = model::LayerKind::kGELU;
        break;
      case v1::Layer::kTanh:
        l.kind = model::LayerKind::kTanh;
        break;
      case v1::Layer::kLayerNorm: {
        const v1::LayerNorm& ln = layer.layer_norm();
        l.kind = model::LayerKind::kLayerNorm;
        l.normalized_shape = ln.normalized_shape();
        if (ln.has_eps()) {
          AMPD_RETURN_IF_ERROR(CheckFinite(absl::StrCat(field, ".layer_norm.eps"), ln.eps()));
          l.eps = ln.eps();
        }
        if (ln.has_elementwise_affine()) l.elementwise_affine = ln.elementwise_affine();
        break;
      }
      case v1::Layer::kEmbedding:
        l.kind = model::LayerKind::kEmbedding;
        l.num_embeddings = layer.embedding().num_embeddings();
        l.embedding_dim = layer.embedding().embedding_dim();
        break;
      default:
        return FieldError(field, "no layer kind set");
    }
    spec->layers.push_back(l);
  }
  switch (proto.loss()) {
    case v1::LOSS_UNSPECIFIED:
      if (!model::IsSequenceModel(*spec)) spec->loss = model::LossKind::kMse;
      break;
    case v1::LOSS_MSE:
      spec->loss = model::LossKind::kMse;
      break;
    case v1::LOSS_CROSS_ENTROPY:
      spec->loss = model::LossKind::kCrossEntropy;
      break;
    default:
      return FieldError(absl::StrCat(field_prefix, ".loss"),
                        absl::StrCat("unknown value ", proto.loss()));
  }
  if (proto.has_loss_multiplier()) {
    if (absl::Status s =
            CheckFinite(absl::StrCat(field_prefix, ".loss_multiplier"), proto.loss_multiplier());
        !s.ok()) {
      return s;
    }
    spec->loss_multiplier = proto.loss_multiplier();
  }
  return absl::OkStatus();
}

namespace {

// A GPT's and a decoder's fields into their proto messages.
void GptToProto(const model::GptSpec& g, v1::Gpt* gpt) {
  gpt->set_vocab_size(g.vocab_size);
  gpt->set_context_length(g.context_length);
  gpt->set_d_model(g.d_model);
  gpt->set_n_layer(g.n_layer);
  gpt->set_n_head(g.n_head);
  gpt->set_mlp_ratio(g.mlp_ratio);
  gpt->set_layer_norm_eps(g.layer_norm_eps);
  gpt->set_tie_embeddings(g.tie_embeddings);
}

void DecoderToProto(const model::DecoderSpec& d, v1::Decoder* out) {
  out->set_vocab_size(d.vocab_size);
  out->set_hidden_size(d.hidden_size);
  out->set_intermediate_size(d.intermediate_size);
  out->set_num_hidden_layers(d.num_hidden_layers);
  out->set_num_attention_heads(d.num_attention_heads);
  out->set_num_key_value_heads(d.num_key_value_heads);
  out->set_head_dim(model::DecoderHeadDim(d));  // the effective width, default filled in
  out->set_rms_norm_eps(d.rms_norm_eps);
  out->set_rope_theta(d.rope_theta);
  out->set_max_position_embeddings(d.max_position_embeddings);
  out->set_tie_word_embeddings(d.tie_word_embeddings);
  out->set_initializer_range(d.initializer_range);
  out->set_qkv_bias(d.qkv_bias);
  out->set_o_bias(d.o_bias);
  out->set_qk_norm(d.qk_norm);
  out->set_norm_unit_offset(d.norm_unit_offset);
  out->set_mlp_activation(d.mlp_activation == model::MlpActivation::kGeluTanh
                              ? v1::MLP_ACTIVATION_GELU_TANH
                              : v1::MLP_ACTIVATION_SILU);
  out->set_sandwich_norms(d.sandwich_norms);
  out->set_scale_embeddings(d.scale_embeddings);
  if (d.query_pre_attn_scalar > 0.0f) out->set_query_pre_attn_scalar(d.query_pre_attn_scalar);
  for (const bool slides : d.sliding_layers) out->add_sliding_layers(slides);
  out->set_sliding_window(d.sliding_window);
  out->set_rope_local_theta(d.rope_local_theta);
  if (d.rope_scaling.type != model::RopeType::kDefault) {
    v1::RopeScaling* r = out->mutable_rope_scaling();
    r->set_rope_type(d.rope_scaling.type == model::RopeType::kLinear ? v1::ROPE_TYPE_LINEAR
                                                                     : v1::ROPE_TYPE_LLAMA3);
    r->set_factor(d.rope_scaling.factor);
    if (d.rope_scaling.type == model::RopeType::kLlama3) {
      r->set_low_freq_factor(d.rope_scaling.low_freq_factor);
      r->set_high_freq_factor(d.rope_scaling.high_freq_factor);
      r->set_original_max_position_embeddings(d.rope_scaling.original_max_position_embeddings);
    }
  }
  if (d.lora.has_value()) {
    v1::LoRA* lora = out->mutable_lora();
    lora->set_rank(d.lora->rank);
    lora->set_alpha(d.lora->alpha);
    for (const std::string& module : d.lora->target_modules) lora->add_target_modules(module);
  }
}

}  // namespace

v1::ModelSpec ModelSpecToProto(const model::ModelSpec& spec) {
  v1::ModelSpec proto;
  for (const model::LayerSpec& l : spec.layers) {
    v1::Layer* layer = proto.add_layers();
    switch (l.kind) {
      case model::LayerKind::kLinear:
        layer->mutable_linear()->set_in_features(l.in_features);
        layer->mutable_linear()->set_out_features(l.out_features);
        layer->mutable_linear()->set_bias(l.bias);
        break;
      case model::LayerKind::kReLU:
        layer->mutable_relu();
        break;
      case model::LayerKind::kGELU:
        layer->mutable_gelu();
        break;
      case model::LayerKind::kTanh:
        layer->mutable_tanh();
        break;
      case model::LayerKind::kLayerNorm:
        layer->mutable_layer_norm()->set_normalized_shape(l.normalized_shape);
        layer->mutable_layer_norm()->set_eps(l.eps);
        layer->mutable_layer_norm()->set_elementwise_affine(l.elementwise_affine);
        break;
      case model::LayerKind::kEmbedding:
        layer->mutable_embedding()->set_num_embeddings(l.num_embeddings);
        layer->mutable_embedding()->set_embedding_dim(l.embedding_dim);
        break;
    }
  }
  std::visit(Overloaded{[](const model::LayerStack&) {},
                        [&proto](const model::GptSpec& g) { GptToProto(g, proto.mutable_gpt()); },
                        [&proto](const model::DecoderSpec& d) {
                          DecoderToProto(d, proto.mutable_decoder());
                        }},
             spec.kind);
  proto.set_loss(spec.loss == model::LossKind::kCrossEntropy ? v1::LOSS_CROSS_ENTROPY
                                                             : v1::LOSS_MSE);
  proto.set_loss_multiplier(spec.loss_multiplier);
  return proto;
}

}  // namespace ampd::rpc
