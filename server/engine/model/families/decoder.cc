// The Hugging Face decoders (LlamaForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, Gemma3ForCausalLM's text model) as parts of the one
// transformer. DecoderSpec is already a list of parts (config/model_spec.h;
// hf_config.cc maps each family's config.json onto it): RMSNorm (Gemma's by
// 1 + w), RoPE with its scaling and the sliding layers' local base, three
// q, k, v projections in Linear's (out, in) layout with the biases each
// family has, optional per-head q/k norm, the gated MLP (SwiGLU or GeGLU)
// without biases, optional sandwich norms and embedding scale, Hugging
// Face's _init_weights. The names and their order (params()', the Philox
// streams'):
//   model.embed_tokens.weight (V, C),
//   model.layers.{i}.input_layernorm.weight (C),
//   model.layers.{i}.self_attn.q_proj.weight (Q, C) [.bias (Q) with qkv_bias],
//   model.layers.{i}.self_attn.k_proj.weight (KV, C) [.bias (KV)],
//   model.layers.{i}.self_attn.v_proj.weight (KV, C) [.bias (KV)],
//   model.layers.{i}.self_attn.o_proj.weight (C, Q) [.bias (C) with o_bias],
//   [model.layers.{i}.self_attn.q_norm.weight (D), .k_norm.weight (D) with
//    qk_norm],
//   [model.layers.{i}.post_attention_layernorm.weight (C): the attention
//    output's norm, with sandwich_norms]
//   model.layers.{i}.post_attention_layernorm.weight (C): the MLP's input
//     norm (with sandwich_norms named pre_feedforward_layernorm),
//   model.layers.{i}.mlp.gate_proj.weight (I, C), .up_proj.weight (I, C),
//   model.layers.{i}.mlp.down_proj.weight (C, I),
//   [model.layers.{i}.post_feedforward_layernorm.weight (C) with sandwich_norms],
//   model.norm.weight (C), lm_head.weight (V, C) when untied.
#include "absl/strings/match.h"
#include "server/engine/model/transformer/parts.h"
#include "server/engine/model/transformer/rope_frequencies.h"

namespace ampd::engine::model {

namespace {

// model.layers.{i}.self_attn.rotary_emb.inv_freq: a buffer older Llama
// checkpoints saved; the frequencies come from rope_theta here.
bool IsRotaryBuffer(absl::string_view name) {
  return absl::StartsWith(name, "model.layers.") &&
         absl::EndsWith(name, ".self_attn.rotary_emb.inv_freq");
}

}  // namespace

TransformerParts DecoderParts(const DecoderSpec& s) {
  TransformerParts p;
  p.vocab = s.vocab_size;
  p.hidden = s.hidden_size;
  p.intermediate = s.intermediate_size;
  p.layers = s.num_hidden_layers;
  p.heads = s.num_attention_heads;
  p.kv_heads = s.num_key_value_heads;
  p.head_dim = DecoderHeadDim(s);
  p.max_positions = s.max_position_embeddings;
  p.norm = NormKind::kRmsNorm;
  p.norm_eps = s.rms_norm_eps;
  p.norm_offset = DecoderNormOffset(s);
  p.positions = PositionKind::kRope;
  p.inv_freq = RopeInverseFrequencies(s);
  if (SlidingLayers(s)) {
    // The sliding layers' RoPE: rope_local_theta, unscaled (Gemma 3's
    // rope_parameters["sliding_attention"], rope_local_base_freq in 4.x).
    DecoderSpec local = s;
    local.rope_theta = s.rope_local_theta;
    local.rope_scaling = RopeScaling{};
    p.inv_freq_local = RopeInverseFrequencies(local);
  }
  p.layout = WeightLayout::kLinear;
  p.qkv_bias = s.qkv_bias;
  p.o_bias = s.o_bias;
  p.qk_norm = s.qk_norm;
  p.sandwich_norms = s.sandwich_norms;
  p.mlp = MlpKind::kGated;
  p.gate = s.mlp_activation == MlpActivation::kGeluTanh ? kernels::GluActivation::kGELUTanh
                                                        : kernels::GluActivation::kSiLU;
  p.scale_embeddings = s.scale_embeddings;
  p.query_pre_attn_scalar = s.query_pre_attn_scalar;
  p.sliding_layers = s.sliding_layers;
  p.sliding_window = s.sliding_window;
  p.tied_head = s.tie_word_embeddings;
  p.init_std = p.residual_init_std = s.initializer_range;
  p.lora = s.lora;
  TransformerNames& n = p.names;
  n.embed = "model.embed_tokens";
  n.layer = "model.layers.";
  n.input_norm = "input_layernorm";
  n.q = "self_attn.q_proj";
  n.k = "self_attn.k_proj";
  n.v = "self_attn.v_proj";
  n.o = "self_attn.o_proj";
  n.q_norm = "self_attn.q_norm";
  n.k_norm = "self_attn.k_norm";
  n.attn_out_norm = "post_attention_layernorm";
  n.post_norm = s.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm";
  n.gate = "mlp.gate_proj";
  n.up = "mlp.up_proj";
  n.down = "mlp.down_proj";
  n.mlp_out_norm = "post_feedforward_layernorm";
  n.final_norm = "model.norm";
  n.tie_field = "tie_word_embeddings";
  n.max_positions_field = "max_position_embeddings";
  p.ignored = IsRotaryBuffer;
  return p;
}

}  // namespace ampd::engine::model
