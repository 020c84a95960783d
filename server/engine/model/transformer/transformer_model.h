// TransformerModel: a Llama/Qwen2-family decoder-only transformer (DecoderSpec)
// as a Network.
//
// Forward, per micro-batch of B sequences of T tokens (N = B*T rows, C =
// hidden_size, H query heads and K K/V heads of D = head_dim columns, Q =
// H D, KV = K D, I = intermediate_size, V = vocab_size), in the working
// dtype with fp32 accumulation. Linear weights are Hugging Face's (out, in):
// y = x W^T + b.
//   x_0 = embed_tokens[ids]
//   per block l:  a = rmsnorm(x_l) input_layernorm.weight
//                 qkv (N, Q + 2 KV) = a [Wq; Wk; Wv]^T + [bq; bk; bv]
//                 with qk_norm (Qwen3): each q head rmsnorm(.) q_norm.weight
//                   and each k head rmsnorm(.) k_norm.weight, over its D
//                   columns (Backend::HeadRmsNormForward)
//                 RoPE (rotate-half, position t, inv_freq from rope_theta
//                   and rope_scaling: rope_frequencies.h)
//                   on the H + K q and k heads at the start of each row
//                 expand the K/V heads to H (repeat_kv; skipped when K == H)
//                 y = causal attention (scale 1/sqrt(D)); r_l = x_l + y Wo^T (+ bo)
//                 m = rmsnorm(r_l) post_attention_layernorm.weight
//                 x_{l+1} = r_l + (silu(m Wg^T) * (m Wu^T)) Wd^T
//   h = rmsnorm(x_L) model.norm.weight; logits = h W_head^T, W_head =
//   embed_tokens (tied) or lm_head.weight.
// Gemma 3's parts change it as its DecoderSpec fields say: every rmsnorm
// scales by 1 + w (norm_unit_offset); silu becomes gelu's tanh form
// (mlp_activation); with sandwich_norms y Wo^T and the MLP's output pass
// through post_attention_layernorm and post_feedforward_layernorm before
// their residual adds, and m's norm is pre_feedforward_layernorm; x_0 is
// scaled by sqrt(C) in the working dtype (scale_embeddings); the attention
// scale is query_pre_attn_scalar^-1/2 when set; a sliding layer
// (sliding_layers) sees keys t - sliding_window < s <= t, its RoPE of base
// rope_local_theta unscaled.
// The q, k and v projections are three parameters (Hugging Face's names and
// shapes) whose rows, stacked, are one (Q + 2 KV, C) matrix: the forward
// copies them into one workspace matrix (and the biases into one vector) so
// that a single GEMM writes the fused q|k|v rows the RoPE, K/V expansion
// and attention ops read; the backward forms the stacked weight gradient
// in one GEMM into a workspace matrix (starting from the parameters'
// gradients on later micro-batches, so each element is still rounded once
// per micro-batch) and copies its row blocks back. The copies cost
// (Q + 2 KV) C elements per block and pass, against the GEMMs' N times that.
// The LM head is fused with the cross-entropy in Loss, over row chunks, as
// the GPT's is (model/lm_head.h, LmHeadChunkRows).
//
// State-dict names and layouts are Hugging Face's (LlamaForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM), in this order, which is also params()' and that of the
// Philox streams that initialise them:
//   model.embed_tokens.weight (V, C),
//   model.layers.{i}.input_layernorm.weight (C),
//   model.layers.{i}.self_attn.q_proj.weight (Q, C) [.bias (Q) with qkv_bias],
//   model.layers.{i}.self_attn.k_proj.weight (KV, C) [.bias (KV)],
//   model.layers.{i}.self_attn.v_proj.weight (KV, C) [.bias (KV)],
//   model.layers.{i}.self_attn.o_proj.weight (C, Q) [.bias (C) with o_bias],
//   [model.layers.{i}.self_attn.q_norm.weight (D), .k_norm.weight (D) with
//    qk_norm],
//   model.layers.{i}.post_attention_layernorm.weight (C),
//   [model.layers.{i}.pre_feedforward_layernorm.weight (C) with sandwich_norms]
//   model.layers.{i}.mlp.gate_proj.weight (I, C), .up_proj.weight (I, C),
//   model.layers.{i}.mlp.down_proj.weight (C, I),
//   [model.layers.{i}.post_feedforward_layernorm.weight (C) with sandwich_norms],
//   model.norm.weight (C), lm_head.weight (V, C) when untied.
// Initialisation is Hugging Face's _init_weights: every Linear weight and
// the embedding N(0, initializer_range^2), biases 0, RMSNorm weights (the
// per-head q_norm and k_norm too) 1, or 0 where they scale by 1 + w.
//
// With LoRA (DecoderSpec::lora), every parameter above is frozen (held in
// the working dtype only, network.h's Parameter) and drawn as the full
// model's, so a seed gives the same base either way; after them come the
// adapters of each block's targets (lora.h), in kLoraModules order,
// in PEFT's names and shapes:
//   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (r, C),
//   ....lora_B.weight (Q, r), likewise k, v, o_proj and mlp.{gate,up,down}_proj;
// A as PEFT initialises it (kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(in))),
// B zeros, so the adapted model starts as the base. Only the adapters have
// masters, gradients and optimizer state; the backward forms the
// activations' gradients through the frozen weights and no weight gradient
// of theirs.
// Per-layer loss scales as the GPT's: block l in group GptBlockScaleGroup(l),
// the embedding in group 0, the final norm and an untied head in the last.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

struct TransformerWorkspace;
struct BlockBuffers;
struct TransformerDecodeState;
struct QkvStack;

// WorkspaceBytes of a decoder for inputs (B, T): per block the saved
// activations (the two RMSNorm outputs and r_l: 3 N C; the fused q|k|v
// N (Q + 2 KV), its K/V-expanded copy N 3Q when K < H, the attention
// output N Q, gate, up and their SwiGLU product 3 N I, all working dtype;
// the attention's log-sum-exp B H T and two RMSNorm rstd N, F32; with
// qk_norm the q|k|v rows before the norm N (Q + 2 KV) and its rstd
// N (H + K) F32), the
// residual stream x_0..x_L and the final norm's output ((L + 2) N C, its
// rstd N F32), the backward's scratch (3 N C, N Q, N (Q + 2 KV), N 3Q when
// K < H, 3 N I), the stacked q/k/v weight and its gradient (2 (Q + 2 KV) C,
// and 2 (Q + 2 KV) for biases), RoPE's inv_freq (D/2 F32), one LM-head
// chunk of logits, the head's F32 gradient sum (fp16/bf16 heads of more
// than one chunk) and the ids and targets. Overflow-checked; InvalidArgument
// when it overflows or the shape is not (B, T) with 1 <= T <=
// max_position_embeddings.
absl::StatusOr<int64_t> TransformerWorkspaceBytes(const ModelSpec& spec, Precision precision,
                                              const kernels::Shape& input_shape,
                                              int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

// StepScratchExtents of a decoder for inputs (B, T): the largest operands
// of its projections (N x max(Q + 2 KV, 3Q, I, C) activations, (Q + 2 KV) C,
// C Q and I C weights), the LM head's chunks and weight (AddLmHeadExtents),
// the attention over T with head size D, the cross-entropy over V; without
// `backward`, the forward's alone.
kernels::ScratchExtents TransformerScratchExtents(const ModelSpec& spec, Precision precision,
                                              const kernels::Shape& input_shape,
                                              bool backward = true,
                                              int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

class TransformerModel final : public Network {
 public:
  // Builds the parameters of a validated decoder spec and initialises them
  // from seed (see above), then casts the working copy. `base` (LoRA only):
  // the frozen parameters are views of that shared base's tensors, every
  // one of which must be a parameter of the spec; the adapters are drawn
  // from the seed as always (their streams are their indices, the same
  // either way).
  static absl::StatusOr<std::unique_ptr<TransformerModel>> Create(
      const ModelSpec& spec, Precision precision, uint64_t seed, kernels::Backend& backend,
      int64_t lm_head_chunk_bytes = kLmHeadChunkBytes,
      std::shared_ptr<const FrozenBase> base = nullptr);

  using Network::LoadBatch;
  absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                         const TokenLossInputs& tokens, Workspace& ws) override;
  absl::Status Forward(Workspace& ws) override;
  absl::StatusOr<const kernels::Tensor*> TokenLogprobs(Workspace& ws) override;
  absl::StatusOr<const kernels::Tensor*> TokenLosses(Workspace& ws) override;
  // The fused LM head and cross-entropy, as GptModel::Loss.
  absl::Status Loss(Workspace& ws, float grad_scale, kernels::Tensor& loss) override;
  absl::Status EvalLoss(Workspace& ws, kernels::Tensor& loss) override;
  using Network::Backward;
  absl::Status Backward(Workspace& ws, bool first_micro_batch, const BackwardHooks& hooks) override;

  std::vector<int> ParamScaleGroups() const override;
  absl::Status SetGroupScales(absl::Span<const float> scales) override;

  // Drops the rotary inv_freq buffers some Llama checkpoints carry
  // (model.layers.{i}.self_attn.rotary_emb.inv_freq) and, for a tied model,
  // lm_head.weight when it equals model.embed_tokens.weight.
  absl::StatusOr<std::vector<std::string>> CanonicalNames(
      const codec::StateDict& state) const override;
  // {"format": "pt"}: transformers' from_pretrained requires it.
  void AnnotateExport(codec::StateDict& state) const override;
  std::vector<AdapterRef> Adapters() const override;

  // Sampling (transformer_sampling.cc; network.h): a KV cache of each layer's
  // K/V heads, (S, max_len, KV) each.
  absl::StatusOr<int64_t> DecodeStateBytes(int64_t sequences, int64_t max_len) const override;
  absl::Status Prefill(Workspace& ws, absl::Span<const int64_t> lengths,
                       DecodeState& state) override;
  absl::Status DecodeStep(absl::Span<const int64_t> tokens, absl::Span<const int64_t> positions,
                          DecodeState& state) override;
  const Parameter* LmHead() const override { return &params()[static_cast<size_t>(head_weight())]; }
  float AdapterScale() const override { return lora_scale_; }
  // {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r", "lora_alpha",
  // "target_modules", "lora_dropout": 0.0, "bias": "none", ...}: what
  // PeftModel.from_pretrained reads beside the adapter's weights.
  std::string AdapterConfigJson() const override;

 protected:
  absl::StatusOr<int64_t> BytesFor(const kernels::Shape& input_shape) const override;
  absl::StatusOr<std::unique_ptr<Workspace>> NewWorkspace(
      const kernels::Shape& input_shape) override;
  absl::StatusOr<std::unique_ptr<DecodeState>> MakeDecodeState(int64_t sequences,
                                                               int64_t max_len) override;

 private:
  // A projection's index in kLoraModules.
  enum Module { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kModules };
  // Indices into params() of a LoRA adapter's A and B; -1 when the module
  // is no target.
  struct Adapter {
    int a = -1, b = -1;
    bool present() const { return a >= 0; }
  };
  // Indices into params() of one block's parameters; -1 for an absent bias.
  struct BlockParams {
    int input_norm = -1;
    int q_weight = -1, q_bias = -1;
    int k_weight = -1, k_bias = -1;
    int v_weight = -1, v_bias = -1;
    int o_weight = -1, o_bias = -1;
    int q_norm = -1, k_norm = -1;  // -1 without qk_norm
    // With sandwich_norms, the attention output's norm
    // (post_attention_layernorm) and the MLP output's
    // (post_feedforward_layernorm); post_norm is then the MLP's input norm,
    // pre_feedforward_layernorm.
    int attn_out_norm = -1, mlp_out_norm = -1;
    int post_norm = -1;
    int gate = -1, up = -1, down = -1;
    std::array<Adapter, kModules> lora;
    // The present ones, base then adapters.
    std::vector<int> All() const;
  };

  TransformerModel(const ModelSpec& spec, Precision precision, kernels::Backend& backend,
               int64_t lm_head_chunk_bytes);
  const DecoderSpec& decoder() const { return *spec().decoder; }
  int head_weight() const { return decoder().tie_word_embeddings ? embed_ : lm_head_; }
  absl::Status HeadLoss(Workspace& ws, float grad_scale, bool with_grad, kernels::Tensor& loss);
  // Backward's two branches of block l (transformer_backward.cc).
  absl::Status BackwardMlp(TransformerWorkspace& ws, size_t l, float beta);
  absl::Status BackwardAttention(TransformerWorkspace& ws, size_t l, bool first_micro_batch,
                                 float beta);
  // Copies block p's q, k and v weights and biases (their values, or their
  // gradients when grads) into the stacked (Q + 2 KV, C) matrix and
  // (Q + 2 KV) vector (bias nullptr: none), or, to_params, the stacked ones
  // back into the gradients.
  absl::Status CopyQkv(const BlockParams& p, bool grads, bool to_params, kernels::Tensor& weight,
                       kernels::Tensor* bias);
  // LoRA (transformer_adapters.cc): block p's q/k/v adapters as the stacked A
  // (t r, C) and block-diagonal B (Q + 2 KV, t r) of lora.h, into
  // stack; their gradients from the parameters' into ws's stacked scratch
  // (to_params false) or back.
  absl::Status StackQkvAdapters(const BlockParams& p, QkvStack& stack);
  // Calls fn for each of block p's q/k/v adapters with where it sits in the
  // stacked matrices: A's rows [first, first + r) of (t r, C); B's rows
  // [offset, offset + width) and columns [first, first + r) of
  // (Q + 2 KV, t r).
  using StackedAdapterFn = absl::FunctionRef<absl::Status(const Adapter& adapter, int64_t first,
                                                          int64_t offset, int64_t width)>;
  absl::Status ForEachStackedAdapter(const BlockParams& p, StackedAdapterFn fn) const;
  absl::Status CopyQkvAdapterGrads(const BlockParams& p, bool to_params, TransformerWorkspace& ws);
  // y += the adapter's term of `module` (lora.h), saving its u.
  absl::Status AdapterForward(const Adapter& adapter, const kernels::Tensor& x, kernels::Tensor& u,
                              kernels::Tensor& y);
  // The adapter's gradients (beta) and its share of dx.
  absl::Status AdapterBackward(const Adapter& adapter, TransformerWorkspace& ws,
                               const kernels::Tensor& x, const kernels::Tensor& u,
                               const kernels::Tensor& dy, float beta, kernels::Tensor& dx);
  // Block l's attention (transformer_forward.cc): from its q|k|v rows
  // (sv.qkv, after the q/k norm and before RoPE) to sv.attn_y.
  using Attend = std::function<absl::Status(size_t l, BlockBuffers& sv)>;
  // Layer l's attention: the scale (query_pre_attn_scalar's, or the
  // default) and its sliding window, if it slides.
  kernels::AttentionOptions AttentionOptionsOf(size_t l) const;
  // The MLP's gate activation as the kernels name it.
  static kernels::GluActivation GateOf(const DecoderSpec& s) {
    return s.mlp_activation == MlpActivation::kGeluTanh ? kernels::GluActivation::kGELUTanh
                                                        : kernels::GluActivation::kSiLU;
  }
  // Layer l's RoPE frequencies among a workspace's two (the sliding
  // layers' local ones, or the global).
  const kernels::Tensor& InvFreqOf(size_t l, const kernels::Tensor& global,
                                   const kernels::Tensor& local) const {
    return DecoderLayerSlides(decoder(), l) ? local : global;
  }
  // An RMSNorm of this decoder (its weight offset, eps), forward and back.
  absl::Status Norm(const kernels::Tensor& x, int weight, kernels::Tensor& y,
                    kernels::Tensor& rstd);
  absl::Status NormBackward(const kernels::Tensor& x, int weight, const kernels::Tensor& rstd,
                            const kernels::Tensor& dy, kernels::Tensor& dx);
  // Block l's forward on sv's rows from x to x_next, `attend` running its
  // attention: Forward's code and the sampler's decode step's.
  absl::Status BlockForward(size_t l, const kernels::Tensor& x, BlockBuffers& sv,
                            QkvStack& stack, const Attend& attend, kernels::Tensor& x_next);
  // With qk_norm: block p's per-head RMSNorm of sv.qkv's q and k heads in
  // place (saving the rows before it in sv.qkv_pre when that is allocated),
  // and its backward on d_qkv (N, Q + 2 KV), in place. Nothing without.
  absl::Status QkNormForward(const BlockParams& p, BlockBuffers& sv);
  absl::Status QkNormBackward(const BlockParams& p, const BlockBuffers& sv,
                              kernels::Tensor& d_qkv);
  // A frozen parameter's gradient is nullptr; a trainable one's its own.
  kernels::Tensor* GradOrNull(int index);
  bool lora() const { return decoder().lora.has_value(); }

  const int64_t lm_head_chunk_bytes_;
  // RoPE's inv_freq (D/2) as Hugging Face computes it (RopeInverseFrequencies);
  // each workspace copies it to the backend.
  std::vector<float> inv_freq_;
  // The sliding layers' (rope_local_theta, no scaling); empty when none slides.
  std::vector<float> inv_freq_local_;
  // x_0's scale: sqrt(hidden_size) rounded to the working dtype with
  // scale_embeddings (Gemma3TextScaledWordEmbedding), else 1.
  float embed_scale_ = 1.0f;
  int embed_ = -1;
  std::vector<BlockParams> blocks_;
  // LoRA: alpha / r, and the targeted modules among q, k, v in order (their
  // slot in the stacked adapters).
  float lora_scale_ = 0.0f;
  std::vector<Module> qkv_targets_;
  int norm_ = -1;
  int lm_head_ = -1;  // -1 when tied
  // Per-layer scales, as GptModel's.
  std::vector<int> block_group_;
  std::vector<float> residual_grad_scale_;
  float head_grad_alpha_ = 1.0f;
};

}  // namespace ampd::engine::model
