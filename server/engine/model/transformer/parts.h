// TransformerParts: the one transformer block's parts and a family's names
// for its tensors. TransformerModel (transformer_model.h) reads only these;
// a family (model/families/) is a small file that maps its spec onto them
// (GPT-2's GptSpec, the Hugging Face decoders' DecoderSpec). A part no
// family had before is a new field here, a branch in the model, and a
// kernel if it needs one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

// LayerNorm with weight and bias (GPT-2), or RMSNorm with a weight (Llama;
// Gemma's scales by 1 + w: norm_offset 1).
enum class NormKind { kLayerNorm, kRmsNorm };
// A learned position table added to x_0 (GPT-2's wpe), or RoPE on q and k.
enum class PositionKind { kLearned, kRope };
// The MLP: down(gelu_tanh(up(x) + b) + b) with biases (GPT-2's c_fc,
// c_proj), or the gated down(act(gate(x)) * up(x)) (SwiGLU, GeGLU).
enum class MlpKind { kGelu, kGated };
// How a projection's weight is stored: Hugging Face's Linear (out, in), y
// = x W^T; or GPT-2's Conv1D (in, out), y = x W. The GEMMs transpose
// accordingly; nothing is copied.
enum class WeightLayout { kLinear, kConv1D };

// The names of a family's tensors (Hugging Face's), without ".weight" /
// ".bias". A block's are `layer` + i + "." + the part's name.
struct TransformerNames {
  std::string embed;      // model.embed_tokens
  std::string positions;  // transformer.wpe (learned positions only)
  std::string layer;      // "model.layers."
  std::string input_norm, post_norm;
  std::string qkv;  // the fused q|k|v projection (fused_qkv); else q, k, v
  std::string q, k, v, o;
  std::string q_norm, k_norm;
  // With sandwich norms: the attention output's and the MLP output's norms
  // (the MLP's input norm is then post_norm's name, pre_feedforward_layernorm).
  std::string attn_out_norm, mlp_out_norm;
  std::string gate, up, down;  // kGelu: up is c_fc, down c_proj
  std::string final_norm;
  std::string lm_head = "lm_head";
  // A prefix a checkpoint may leave out ("transformer." of GPT-2's
  // GPT2Model exports); empty: none.
  std::string optional_prefix;
  // The spec's field that ties the head (for messages).
  std::string tie_field;
  // The spec's field that bounds T (for messages).
  std::string max_positions_field;
};

// A checkpoint's tensor this family's model does not hold and drops: a
// buffer such as GPT-2's attn.bias causal mask or Llama's rotary inv_freq.
using IgnoredTensorFn = bool (*)(absl::string_view name);

struct TransformerParts {
  // Widths: C hidden, H query heads and K K/V heads of D columns, I the
  // MLP's, V vocabulary, the longest sequence.
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, max_positions = 0;

  NormKind norm = NormKind::kRmsNorm;
  float norm_eps = 1e-6f;
  float norm_offset = 0.0f;  // 1: RMSNorm scales by 1 + w
  PositionKind positions = PositionKind::kRope;
  // RoPE's inv_freq (D/2) (rope_frequencies.h), and the sliding layers'
  // (empty when none slides); empty for learned positions.
  std::vector<float> inv_freq, inv_freq_local;
  // One (C, Q + 2 KV) q|k|v parameter (GPT-2's c_attn), or three.
  bool fused_qkv = false;
  WeightLayout layout = WeightLayout::kLinear;
  bool qkv_bias = false, o_bias = false, mlp_bias = false;
  bool qk_norm = false;
  bool sandwich_norms = false;
  MlpKind mlp = MlpKind::kGated;
  kernels::GluActivation gate = kernels::GluActivation::kSiLU;  // kGated only
  bool scale_embeddings = false;       // x_0 scaled by sqrt(C) in the working dtype
  float query_pre_attn_scalar = 0.0f;  // 0: scale D^-1/2
  std::vector<bool> sliding_layers;
  int64_t sliding_window = 0;
  bool tied_head = false;

  // Initialisation: every projection weight and the embeddings
  // N(0, init_std^2), the two projections into the residual stream (o and
  // down) N(0, residual_init_std^2) (nanoGPT's 1/sqrt(2 n_layer) for GPT-2;
  // init_std for Hugging Face's _init_weights), biases 0, norm weights 1 -
  // norm_offset, LayerNorm biases 0.
  float init_std = 0.02f;
  float residual_init_std = 0.02f;

  // A LoRA fine-tune (decoders only), nullopt without.
  std::optional<LoraSpec> lora;

  TransformerNames names;
  IgnoredTensorFn ignored = nullptr;

  // Derived widths: Q = H D, KV = K D.
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
  bool layer_norm() const { return norm == NormKind::kLayerNorm; }
  bool learned_positions() const { return positions == PositionKind::kLearned; }
  bool gated() const { return mlp == MlpKind::kGated; }
  bool grouped() const { return kv_heads < heads; }
  bool layer_slides(size_t l) const { return l < sliding_layers.size() && sliding_layers[l]; }
  bool any_slides() const { return !inv_freq_local.empty(); }
};

// The families (model/families/): a valid GptSpec's or DecoderSpec's parts.
TransformerParts Gpt2Parts(const GptSpec& gpt);
TransformerParts DecoderParts(const DecoderSpec& decoder);

// The parts of a valid transformer spec (a GPT or a decoder); nullopt for a
// layer stack.
std::optional<TransformerParts> TransformerPartsOf(const ModelSpec& spec);

}  // namespace ampd::engine::model
