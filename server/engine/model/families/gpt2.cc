// GPT-2 (transformers.GPT2LMHeadModel) as parts of the one transformer:
// LayerNorm with bias, a learned position table (wpe), one fused q|k|v
// projection (c_attn) and every projection with a bias in Conv1D's (in,
// out) layout, the plain GELU-tanh MLP (c_fc, c_proj), a head tied to wte
// unless tie_embeddings is false, and nanoGPT's initialisation. The names
// and their order are Hugging Face's, which is also params()' and that of
// the Philox streams that initialise them:
//   transformer.wte.weight (V, C), transformer.wpe.weight (context, C),
//   transformer.h.{i}.ln_1.weight / .bias (C),
//   transformer.h.{i}.attn.c_attn.weight (C, 3C) / .bias (3C),
//   transformer.h.{i}.attn.c_proj.weight (C, C) / .bias (C),
//   transformer.h.{i}.ln_2.weight / .bias (C),
//   transformer.h.{i}.mlp.c_fc.weight (C, H) / .bias (H),
//   transformer.h.{i}.mlp.c_proj.weight (H, C) / .bias (C),
//   transformer.ln_f.weight / .bias (C), lm_head.weight (V, C) when untied.
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "server/engine/model/transformer/parts.h"

namespace ampd::engine::model {

namespace {

// nanoGPT's N(0, 0.02) for every weight matrix and both embeddings; the two
// projections into the residual stream (attn.c_proj, mlp.c_proj) N(0, 0.02
// / sqrt(2 n_layer)).
constexpr float kInitStddev = 0.02f;

// transformer.h.{i}.attn.bias / .attn.masked_bias: the causal mask buffers
// older GPT-2 checkpoints carry, in whatever dtype they were saved (F32,
// or U8 / BOOL in some transformers versions); the mask is not a parameter
// here.
bool IsMaskBuffer(absl::string_view name) {
  absl::ConsumePrefix(&name, "transformer.");
  return absl::StartsWith(name, "h.") &&
         (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias"));
}

}  // namespace

TransformerParts Gpt2Parts(const GptSpec& g) {
  TransformerParts p;
  p.vocab = g.vocab_size;
  p.hidden = g.d_model;
  p.intermediate = g.mlp_ratio * g.d_model;
  p.layers = g.n_layer;
  p.heads = g.n_head;
  p.kv_heads = g.n_head;
  p.head_dim = g.d_model / g.n_head;
  p.max_positions = g.context_length;
  p.norm = NormKind::kLayerNorm;
  p.norm_eps = g.layer_norm_eps;
  p.positions = PositionKind::kLearned;
  p.fused_qkv = true;
  p.layout = WeightLayout::kConv1D;
  p.qkv_bias = p.o_bias = p.mlp_bias = true;
  p.mlp = MlpKind::kGelu;
  p.tied_head = g.tie_embeddings;
  p.init_std = kInitStddev;
  p.residual_init_std =
      static_cast<float>(kInitStddev / std::sqrt(2.0 * static_cast<double>(g.n_layer)));
  TransformerNames& n = p.names;
  n.embed = "transformer.wte";
  n.positions = "transformer.wpe";
  n.layer = "transformer.h.";
  n.input_norm = "ln_1";
  n.qkv = "attn.c_attn";
  n.o = "attn.c_proj";
  n.post_norm = "ln_2";
  n.up = "mlp.c_fc";
  n.down = "mlp.c_proj";
  n.final_norm = "transformer.ln_f";
  n.optional_prefix = "transformer.";
  n.tie_field = "tie_embeddings";
  n.max_positions_field = "context_length";
  p.ignored = IsMaskBuffer;
  return p;
}

}  // namespace ampd::engine::model
