// The declarative model a job trains: a sequence of layers and a loss, a
// GPT-2-style transformer or a Llama/Qwen/Gemma-family decoder (one variant,
// ModelSpec::kind), sent by the client (translated from protobuf by
// server/rpc) and validated here. No code is ever loaded from a client;
// weights come from the job's seed or a state dict. Both transformers are
// one model (model/transformer/), each spec a family of its parts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/batch_layout.h"
#include "codec/dtype.h"

namespace ampd::engine::model {

enum class Precision { kFp32, kFp16, kBf16 };

absl::string_view PrecisionName(Precision precision);  // "fp32", "fp16", "bf16"
// Dtype of the working copy, activations and gradients.
codec::DType WorkingDType(Precision precision);

enum class LayerKind { kLinear, kReLU, kGELU, kTanh, kLayerNorm, kEmbedding };

absl::string_view LayerKindName(LayerKind kind);  // "linear", "relu", ...

struct LayerSpec {
  LayerKind kind = LayerKind::kLinear;
  // Linear: y (N, out_features) = x (N, in_features) W^T + b.
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  // LayerNorm over the last dim.
  int64_t normalized_shape = 0;
  float eps = 1e-5f;
  bool elementwise_affine = true;
  // Embedding: ids (N) -> (N, embedding_dim). Only as the first layer.
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
};

enum class LossKind { kMse, kCrossEntropy };

// A GPT-2-style decoder-only transformer (Hugging Face GPT2Config's names in
// the comments): token and learned position embeddings, n_layer pre-LayerNorm
// blocks (ln_1, causal multi-head self-attention, residual; ln_2, MLP with
// tanh-approximated GELU, residual), a final LayerNorm and the LM head. Its
// loss is the mean token cross-entropy over targets other than kIgnoreIndex.
struct GptSpec {
  int64_t vocab_size = 0;      // vocab_size
  int64_t context_length = 0;  // n_positions: the longest sequence
  int64_t d_model = 0;         // n_embd
  int64_t n_layer = 0;         // n_layer
  int64_t n_head = 0;          // n_head; divides d_model
  int64_t mlp_ratio = 4;       // n_inner = mlp_ratio * d_model
  float layer_norm_eps = 1e-5f;
  bool tie_embeddings = true;  // the LM head reads wte (no lm_head.weight)
};

// LoRA adapters (Hu et al. 2021, as PEFT's LoraConfig) on a decoder's
// projections: each target W (out, in) is frozen and its output gains
// (alpha / rank) x A^T B^T with trainable A (rank, in) and B (out, rank).
// It lives in DecoderSpec rather than beside the model in JobConfig because
// it is a decoder-only property whose limits (rank <= min(in, out)) are the
// decoder's widths, and the model that builds the parameters reads it.
struct LoraSpec {
  int64_t rank = 0;    // r, 1 <= r <= min(in, out) of every target
  float alpha = 0.0f;  // lora_alpha, in (0, kMaxLoraAlpha]
  // Of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; each
  // at most once. PEFT's Llama default: the attention's four.
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
};

// The module names a LoraSpec may target, in a block's parameter order.
inline constexpr const char* kLoraModules[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};

// RoPE's frequency scaling, as Hugging Face names it in rope_scaling
// (transformers 4.x) or rope_parameters (5.x), "rope_type": kDefault keeps
// inv_freq = 1 / rope_theta^(2i / D); kLinear divides every frequency by
// factor; kLlama3 (Llama 3.1+) divides the low frequencies (wavelength >
// original_max_position_embeddings / low_freq_factor) by factor, keeps the
// high ones (wavelength < original / high_freq_factor) and blends linearly
// in between. Neither scales the attention (attention_factor 1).
enum class RopeType { kDefault, kLinear, kLlama3 };

// The gated MLP's gate activation: SwiGLU's silu, GeGLU's tanh-form gelu.
enum class MlpActivation { kSilu, kGeluTanh };

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  float factor = 1.0f;                           // linear, llama3: finite and >= 1
  float low_freq_factor = 0.0f;                  // llama3: finite and > 0
  float high_freq_factor = 0.0f;                 // llama3: finite and > low_freq_factor
  int64_t original_max_position_embeddings = 0;  // llama3: > 0
};

// Hugging Face's names of the rope types ("default", "linear", "llama3").
const char* RopeTypeName(RopeType type);

// The kLoraModules name a PEFT target_modules entry stands for: the name
// itself (q_proj) or its dotted suffix in Hugging Face's module tree
// (self_attn.q_proj, mlp.down_proj), which PEFT matches in every layer
// alike. Anything else comes back unchanged, for validation to refuse.
std::string LoraModuleOfPeftTarget(absl::string_view target);

// PEFT's target_modules="all-linear" for a decoder: every projection of
// kLoraModules (PEFT leaves out the LM head).
inline constexpr const char* kLoraAllLinear = "all-linear";

// A Llama/Qwen2/Qwen3-family decoder-only transformer, with the fields of
// Hugging Face's LlamaConfig / Qwen2Config / Qwen3Config: token embeddings (no position table),
// num_hidden_layers pre-RMSNorm blocks (input_layernorm, causal self-attention
// with rotary position embeddings and num_key_value_heads K/V heads shared by
// the query heads, residual; post_attention_layernorm, the SwiGLU MLP
// down(silu(gate(x)) * up(x)) without biases, residual), a final RMSNorm and
// the LM head. Its loss is the mean token cross-entropy over targets other
// than kIgnoreIndex. The block is assembled from parts, never from a family
// name: the biases as each family has them (Llama's and Qwen3's
// attention_bias sets both qkv_bias and o_bias; Qwen2 has qkv_bias only) and
// Qwen3's per-head q/k norm (qk_norm).
struct DecoderSpec {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // divides num_attention_heads
  // Each head's width; 0: hidden_size / num_attention_heads (Hugging Face's
  // default), which must then divide. Even (RoPE rotates pairs).
  int64_t head_dim = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;             // the default: no scaling
  int64_t max_position_embeddings = 0;  // the longest sequence
  bool tie_word_embeddings = false;     // the LM head reads embed_tokens
  float initializer_range = 0.02f;      // every Linear's and the embedding's N(0, this^2)
  bool qkv_bias = false;                // q_proj, k_proj, v_proj have biases
  bool o_bias = false;                  // o_proj has a bias
  // Qwen3's q_norm and k_norm: each q and each k head RMSNorm-ed on its own
  // (weights (head_dim) each, eps rms_norm_eps) after the projection and
  // before RoPE.
  bool qk_norm = false;
  // Gemma 3's parts. norm_unit_offset: every RMSNorm scales by 1 + w
  // (Gemma3RMSNorm, weights initialised to 0).
  bool norm_unit_offset = false;
  // The gated MLP's gate: silu (SwiGLU) or gelu's tanh form (GeGLU).
  MlpActivation mlp_activation = MlpActivation::kSilu;
  // The attention's and the MLP's outputs RMSNorm-ed before their residual
  // adds (post_attention_layernorm, post_feedforward_layernorm); the MLP's
  // input norm is then named pre_feedforward_layernorm.
  bool sandwich_norms = false;
  // x_0 = embed_tokens[ids] * sqrt(hidden_size) (in the working dtype).
  bool scale_embeddings = false;
  // The attention scale query_pre_attn_scalar^-1/2; 0: head_dim^-1/2.
  float query_pre_attn_scalar = 0.0f;
  // Layer i attends to its last sliding_window keys when sliding_layers[i],
  // its RoPE then of base rope_local_theta without scaling; empty: no layer
  // slides.
  std::vector<bool> sliding_layers = {};
  int64_t sliding_window = 0;
  float rope_local_theta = 10000.0f;
  // Set: a LoRA fine-tune of this decoder (base weights frozen).
  std::optional<LoraSpec> lora;
};

// The (out, in) of a decoder's projection named as kLoraModules; {0, 0}
// for another name.
std::pair<int64_t, int64_t> DecoderProjectionShape(const DecoderSpec& decoder,
                                                   const std::string& module);

// The adapters' parameters of a decoder with LoRA: per block and target,
// rank x (in + out); 0 without LoRA. Saturates at INT64_MAX.
int64_t LoraParameterCount(const DecoderSpec& decoder);

// Whether decoder layer l attends through a sliding window.
inline bool DecoderLayerSlides(const DecoderSpec& d, size_t l) {
  return l < d.sliding_layers.size() && d.sliding_layers[l];
}
// Whether any decoder layer slides.
inline bool SlidingLayers(const DecoderSpec& d) {
  for (const bool slides : d.sliding_layers) {
    if (slides) return true;
  }
  return false;
}
// The RMSNorms' weight offset: 1 for (1 + w), else 0.
inline float DecoderNormOffset(const DecoderSpec& d) { return d.norm_unit_offset ? 1.0f : 0.0f; }

// A decoder's head width: head_dim, or hidden_size / num_attention_heads
// when it is 0.
int64_t DecoderHeadDim(const DecoderSpec& decoder);

// The target value whose position carries no loss (PyTorch's ignore_index).
inline constexpr int64_t kIgnoreIndex = codec::kIgnoreTarget;

// A layer stack: ModelSpec's layers and loss (it has no fields of its own).
struct LayerStack {};

struct ModelSpec {
  // The layer stack; empty for a GPT or a decoder.
  std::vector<LayerSpec> layers;
  // The layer stack's loss; always kCrossEntropy for a GPT or a decoder.
  LossKind loss = LossKind::kMse;
  // Which model: the layer stack above, a GPT, or a decoder. Code that
  // depends on the kind visits this (or asks IsSequenceModel and the
  // helpers below); nothing else says which kind a spec is.
  std::variant<LayerStack, GptSpec, DecoderSpec> kind;
  // The job's own constant factor on the loss, applied before scaling (e.g.
  // 100, which on top of a scale of 65536 overflows fp16 gradients).
  float loss_multiplier = 1.0f;

  // The kind's own spec; nullptr when the spec is of another kind.
  const GptSpec* gpt() const { return std::get_if<GptSpec>(&kind); }
  GptSpec* gpt() { return std::get_if<GptSpec>(&kind); }
  const DecoderSpec* decoder() const { return std::get_if<DecoderSpec>(&kind); }
  DecoderSpec* decoder() { return std::get_if<DecoderSpec>(&kind); }
};

// A transformer's token shapes: its vocabulary and longest sequence
// (context_length, max_position_embeddings); zeros for a layer stack.
struct TokenShape {
  int64_t vocab_size = 0;
  int64_t max_positions = 0;
};
TokenShape TokenShapeOf(const ModelSpec& spec);

// A LoRA decoder's adapters; nullptr for any other model.
const LoraSpec* LoraOf(const ModelSpec& spec);

// The most parameters a model may have, per layer and in all: the backends'
// own cap on one tensor's elements, and small enough that every byte count
// derived from it (at most 20 bytes a parameter with AdamW) fits in int64.
// A spec above it is impossible (InvalidArgument); one below it may still be
// too large for the memory at hand, which admission reports separately.
inline constexpr int64_t kMaxParameters = int64_t{1} << 56;

// Bounds on a decoder's real-valued fields that would otherwise let a job be
// created that can never train. initializer_range is a standard deviation:
// Hugging Face's families use 0.02, and weights drawn with one above 1 make
// the activations of a deep stack overflow the 16-bit dtypes. lora_alpha
// scales the adapters' product by alpha / rank: PEFT configs use up to a
// few hundred; 2^16 leaves room for any of them, while 3.4e38 turned every
// gradient into inf.
inline constexpr float kMaxInitializerRange = 1.0f;
inline constexpr float kMaxLoraAlpha = 65536.0f;

// Checks that feature sizes chain from layer to layer, sizes are positive,
// Embedding comes first if at all, eps and loss_multiplier are finite and
// positive, and no layer nor the model has more than kMaxParameters; the
// message names the layer index and field ("layers[2].in_features"). For a
// GPT: layers empty, loss cross-entropy, every size positive, n_head
// dividing d_model, layer_norm_eps finite and > 0, and every derived size
// (mlp_ratio * d_model, 3 * d_model, each tensor and the total parameter
// count) at most kMaxParameters; the message names the field
// ("gpt.n_head"). For a decoder likewise: every size positive,
// num_key_value_heads dividing num_attention_heads, an even head width
// (hidden_size / num_attention_heads dividing when head_dim is 0),
// rms_norm_eps, rope_theta and initializer_range finite and > 0 (and
// initializer_range <= kMaxInitializerRange), every derived size and the
// total at most kMaxParameters ("decoder.head_dim"). rope_scaling's fields
// as its type needs them (linear and llama3 a factor >= 1; llama3 0 <
// low_freq_factor < high_freq_factor and original_max_position_embeddings
// > 0: "decoder.rope_scaling.factor"). With LoRA: rank >= 1 and <= min(in,
// out) of every target, alpha in (0, kMaxLoraAlpha], target_modules
// non-empty, known and without repeats
// ("decoder.lora.target_modules[1]").
absl::Status ValidateModelSpec(const ModelSpec& spec);

// Parameters of a GPT: embeddings, blocks, final LayerNorm and, when
// untied, the LM head; saturates at INT64_MAX when the count overflows.
int64_t GptParameterCount(const GptSpec& gpt);
// The same for a decoder: embeddings, blocks (two RMSNorms, q/k/v/o with
// their biases, q_norm and k_norm, gate/up/down), the final RMSNorm and an
// untied head.
int64_t DecoderParameterCount(const DecoderSpec& decoder);

// Parameter count of the model (weights and biases, and a LoRA decoder's
// adapters); saturates at INT64_MAX for a spec whose count overflows
// (ValidateModelSpec refuses those).
int64_t ParameterCount(const ModelSpec& spec);
// Of those, the ones a job holds frozen, in the working dtype only (a LoRA
// decoder's base: DecoderParameterCount); the others train. Saturating.
int64_t FrozenParameterCount(const ModelSpec& spec);

// For a valid layer-stack spec: the width of a float input row (the first Linear's
// in_features or LayerNorm's normalized_shape; 0 when the first layer is an
// Embedding, whose input is (N) ids), and the width the last layer produces
// (the MSE target width, or the class count for cross-entropy).
int64_t InputFeatures(const ModelSpec& spec);
int64_t OutputFeatures(const ModelSpec& spec);

// True for the transformers (GPT, decoder): token sequences in, the token
// cross-entropy out.
bool IsSequenceModel(const ModelSpec& spec);

// The most layer groups a GPT's per-layer loss scales use: the scaler's
// kMaxLayerScaleGroups (config/scaler_config.h; config/job_config.cc asserts
// they agree). A deeper GPT shares each scale among consecutive blocks.
inline constexpr int64_t kMaxGptScaleGroups = 32;

// The layer groups of a model's per-layer loss scales (amp/grad_scaler.h).
// A layer stack: each Linear starts one, holding it and the layers after it
// up to the next Linear; layers before the first Linear join group 0:
// max(1, Linear count). A GPT: one per block up to kMaxGptScaleGroups,
// min(n_layer, 32) (GptBlockScaleGroup). A decoder: the same over its
// num_hidden_layers.
int64_t LayerScaleGroups(const ModelSpec& spec);

// The group of GPT block `block` (0-based) of n_layer:
// floor(block * G / n_layer), G = min(n_layer, kMaxGptScaleGroups). Each
// group holds consecutive blocks, one each while n_layer <= 32, and the
// groups' sizes differ by at most one.
int64_t GptBlockScaleGroup(int64_t block, int64_t n_layer);

}  // namespace ampd::engine::model
