// TransformerModel: the one decoder-only transformer, assembled from the
// parts a family gives it (parts.h; model/families/: GPT-2, and the Hugging
// Face decoders Llama, Qwen2, Qwen3 and Gemma 3), as a Network.
//
// Forward, per micro-batch of B sequences of T tokens (N = B*T rows, C =
// hidden, H query heads and K K/V heads of D columns, Q = H D, KV = K D, I
// the MLP's width, V vocabulary), in the working dtype with fp32
// accumulation. A projection's weight is Linear's (out, in), y = x W^T + b,
// or Conv1D's (in, out), y = x W + b (GPT-2): the GEMMs transpose as the
// layout says, nothing is copied.
//   x_0 = embed[ids] (* sqrt(C) with scale_embeddings) (+ wpe[0..T) with
//         learned positions: one bias of T*C over (B, T*C))
//   per block l:  a = norm(x_l)   (LayerNorm with bias, RMSNorm, or RMSNorm
//                                  by 1 + w)
//                 qkv (N, Q + 2 KV) = a W_qkv (+ b): one GEMM
//                 with qk_norm (Qwen3): each q and k head RMSNorm-ed over
//                   its D columns (Backend::HeadRmsNormForward)
//                 with RoPE: rotate-half on the H + K q and k heads
//                   (inv_freq from rope_frequencies.h; a sliding layer's
//                   from its local base)
//                 expand the K/V heads to H (skipped when K == H)
//                 y = causal attention (scale 1/sqrt(D), or
//                   query_pre_attn_scalar^-1/2; a sliding layer sees keys
//                   t - sliding_window < s <= t)
//                 r_l = x_l + y W_o (+ b_o)   (y W_o normed first with
//                                              sandwich norms)
//                 m = norm(r_l)
//                 gated MLP:  x_{l+1} = r_l + (act(m W_g) * (m W_u)) W_d
//                   (act silu or gelu_tanh; its output normed first with
//                   sandwich norms)
//                 GELU MLP:   x_{l+1} = r_l + gelu_tanh(m W_u + b) W_d + b
//                   (bias and GELU in the GEMM's epilogue)
//   h = norm(x_L); logits = h W_head^T, W_head = embed (tied) or lm_head.
// The q|k|v projection is one GEMM: GPT-2's c_attn is one parameter; the
// decoders' q, k and v are three (Hugging Face's names and shapes) whose
// rows, stacked, are one (Q + 2 KV, C) matrix, which the forward copies into
// one workspace matrix (and the biases into one vector); the backward forms
// the stacked weight gradient in one GEMM into a workspace matrix (starting
// from the parameters' gradients on later micro-batches, so each element is
// still rounded once per micro-batch) and copies its row blocks back. The
// copies cost (Q + 2 KV) C elements per block and pass, against the GEMMs'
// N times that. A sampler's decode step, whose N is its S sequences, would
// pay them per token: its decode state holds every block's stack instead,
// copied once at Prefill (transformer_sampling.cc).
// The LM head is fused with the cross-entropy in Loss (model/lm_head.h):
// per chunk of rows, logits -> (in place) dlogits -> dh and dW_head. The
// (N, V) logits are one chunk while they fit kLmHeadChunkBytes (the head's
// weight gradient is then one GEMM, read and written once), and are split
// into equal row chunks beyond it, so that the head's memory never grows
// with B x T x V.
//
// State-dict names, shapes and order are the family's (Hugging Face's):
// the embedding, the position table, per block its input norm (weight,
// bias), q|k|v or q, k, v (each weight then its bias), o, the q/k norms,
// the sandwich norms around the MLP's input norm, the MLP (gate, up, down,
// each weight then bias), then the final norm and an untied head. That is
// also params()' order and that of the Philox streams that initialise them
// (TransformerParts' init).
//
// With LoRA (a decoder's), every parameter above is frozen (held in the
// working dtype only, network.h's Parameter) and drawn as the full model's,
// so a seed gives the same base either way; after them come the adapters
// of each block's targets (lora.h), in kLoraModules order, in PEFT's names
// and shapes:
//   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (r, C),
//   ....lora_B.weight (Q, r), likewise k, v, o_proj and mlp.{gate,up,down}_proj;
// A as PEFT initialises it (kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(in))),
// B zeros, so the adapted model starts as the base. Only the adapters have
// masters, gradients and optimizer state; the backward forms the
// activations' gradients through the frozen weights and no weight gradient
// of theirs.
//
// Per-layer loss scales: block l is layer group g(l) = GptBlockScaleGroup
// (l itself up to 32 blocks; deeper models share a group between
// consecutive blocks), the embeddings join group 0 and the final norm and
// an untied LM head the last group. Where backward leaves block l for block
// l - 1, the residual add that ends block l's backward also moves the
// residual gradient from S_g(l) to S_g(l-1) (AddScaled: scaled in fp32
// before its one rounding, no extra pass); a tied head's weight gradient,
// formed at the last group's scale in Loss, is moved to group 0's by its
// GEMM's alpha.
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
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/parts.h"

namespace ampd::engine::model {

struct TransformerWorkspace;
struct BlockBuffers;
struct TransformerDecodeState;
struct QkvStack;

// WorkspaceBytes of a transformer for inputs (B, T): per block the saved
// activations (the two norm outputs and r_l: 3 N C; the fused q|k|v
// N (Q + 2 KV), its K/V-expanded copy N 3Q when K < H, the attention
// output N Q; the MLP's gate, up and their product 3 N I (gated) or its
// pre- and post-GELU 2 N I; all working dtype; the attention's
// log-sum-exp B H T and the norms' statistics, F32 (rstd N each, and mean
// N each for a LayerNorm); with qk_norm the q|k|v rows before the norm
// N (Q + 2 KV) and its rstd N (H + K) F32; with sandwich norms the branch
// outputs before them), the residual stream x_0..x_L and the final norm's
// output ((L + 2) N C, its statistics), the backward's scratch (3 N C, N Q
// unless Q == C (d_tmp holds it then), N (Q + 2 KV), N 3Q when K < H, 3 N I
// gated or N I), the stacked q/k/v
// weight and its gradient (2 (Q + 2 KV) C, and 2 (Q + 2 KV) for biases;
// none for a fused q|k|v parameter), RoPE's inv_freq (D/2 F32), one
// LM-head chunk of logits, the head's F32 gradient sum (fp16/bf16 heads of
// more than one chunk) and the ids and targets. Overflow-checked;
// InvalidArgument when it overflows or the shape is not (B, T) with 1 <= T
// <= the longest sequence (context_length, max_position_embeddings).
absl::StatusOr<int64_t> TransformerWorkspaceBytes(const ModelSpec& spec, Precision precision,
                                                  const kernels::Shape& input_shape,
                                                  int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

// StepScratchExtents of a transformer for inputs (B, T): the largest
// operands of its projections (N x max(Q + 2 KV, 3Q, I, C) activations,
// (Q + 2 KV) C, C Q and I C weights), the GELU MLP's activation backward
// (N I), the LM head's chunks and weight (AddLmHeadExtents), the attention
// over T with head size D, the cross-entropy over V; without `backward`,
// the forward's alone.
kernels::ScratchExtents TransformerScratchExtents(const ModelSpec& spec, Precision precision,
                                                  const kernels::Shape& input_shape,
                                                  bool backward = true,
                                                  int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

class TransformerModel final : public Network {
 public:
  // Builds the parameters of a validated transformer spec (a GPT or a
  // decoder, as its family's parts) and initialises them
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
  // The fused LM head and cross-entropy (transformer_lm_head.cc): loss =
  // multiplier * mean over kept targets; dh (the gradient into the final
  // norm's output) and the head weight's gradient (written on the first
  // micro-batch, += after; one rounding per micro-batch) times grad_scale.
  using Network::Loss;
  absl::Status Loss(Workspace& ws, float grad_scale, bool first_micro_batch,
                    kernels::Tensor& loss) override;
  absl::Status EvalLoss(Workspace& ws, kernels::Tensor& loss) override;
  using Network::Backward;
  absl::Status Backward(Workspace& ws, bool first_micro_batch, const BackwardHooks& hooks) override;

  std::vector<int> ParamScaleGroups() const override;
  absl::Status SetGroupScales(absl::Span<const float> scales) override;

  // Drops the buffers the family's checkpoints may carry (GPT-2's
  // attn.bias / attn.masked_bias, Llama's rotary_emb.inv_freq), adds the
  // prefix a family's name may lack ("transformer.") and, for a tied model,
  // drops lm_head.weight when it equals the embedding.
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
  // A norm's weight and bias (-1: RMSNorm has none).
  struct NormParams {
    int weight = -1, bias = -1;
  };
  // Indices into params() of one block's parameters; -1 for an absent one.
  struct BlockParams {
    NormParams input_norm;
    // With fused_qkv, q_weight and q_bias are the fused q|k|v's, and k and
    // v are -1.
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
    NormParams post_norm;
    int gate = -1;  // the gated MLP's
    int up = -1, up_bias = -1;
    int down = -1, down_bias = -1;
    std::array<Adapter, kModules> lora;
    // The present ones in params()' order, base then adapters.
    std::vector<int> All() const;
  };

  TransformerModel(const ModelSpec& spec, TransformerParts parts, Precision precision,
                   kernels::Backend& backend, int64_t lm_head_chunk_bytes);
  int head_weight() const { return parts_.tied_head ? embed_ : lm_head_; }
  absl::Status HeadLoss(Workspace& ws, float grad_scale, bool with_grad, bool first_micro_batch,
                        kernels::Tensor& loss);
  // Backward's two branches of block l (transformer_backward.cc).
  absl::Status BackwardMlp(TransformerWorkspace& ws, size_t l, float beta);
  absl::Status BackwardAttention(TransformerWorkspace& ws, size_t l, bool first_micro_batch,
                                 float beta);
  // A projection y (N, out) = x W (+ b) (its layout's transpose), `act`
  // in the GEMM's epilogue with pre_act its input (GELU's); its weight
  // gradient (with the bias's, beta) from dy and x when it trains; and dx
  // (N, in) = dy W^T (through act's derivative at pre_act when act is
  // set) times alpha, + beta_dx dx.
  absl::Status Project(const kernels::Tensor& x, const kernels::Tensor& weight,
                       const kernels::Tensor* bias, kernels::GemmActivation act, kernels::Tensor& y,
                       kernels::Tensor* pre_act);
  absl::Status ProjectionWeightGrad(const kernels::Tensor& x, const kernels::Tensor& dy, float beta,
                                    kernels::Tensor& weight_grad, kernels::Tensor* bias_grad);
  absl::Status ProjectionInputGrad(const kernels::Tensor& dy, const kernels::Tensor& weight,
                                   float beta, kernels::Tensor& dx);
  // A branch's output projection (o, or the MLP's down) backward from
  // d_res: with sandwich norms its output norm's (weight out_norm, input
  // pre_norm, statistic rstd) first, into d_branch; then, unless frozen, its
  // weight's and bias's gradients from its input x. Returns dL/d(its
  // output): d_res or d_branch.
  absl::StatusOr<const kernels::Tensor*> OutputBackward(TransformerWorkspace& ws,
                                                        const kernels::Tensor& pre_norm,
                                                        int out_norm, const kernels::Tensor& rstd,
                                                        const kernels::Tensor& x, int weight,
                                                        int bias, float beta);
  // Copies block p's q, k and v weights and biases (their values, or their
  // gradients when grads) into the stacked (Q + 2 KV, C) matrix and
  // (Q + 2 KV) vector (bias nullptr: none), or, to_params, the stacked ones
  // back into the gradients. Three separate q, k, v only.
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
  // Layer l's RoPE frequencies among a workspace's two (the sliding
  // layers' local ones, or the global).
  const kernels::Tensor& InvFreqOf(size_t l, const kernels::Tensor& global,
                                   const kernels::Tensor& local) const {
    return parts_.layer_slides(l) ? local : global;
  }
  // A norm of this model (LayerNorm or RMSNorm, its eps and weight offset),
  // forward and back; mean is a LayerNorm's only.
  absl::Status Norm(const kernels::Tensor& x, NormParams norm, kernels::Tensor& y,
                    kernels::Tensor& mean, kernels::Tensor& rstd);
  absl::Status NormBackward(const kernels::Tensor& x, NormParams norm, const kernels::Tensor& mean,
                            const kernels::Tensor& rstd, const kernels::Tensor& dy,
                            kernels::Tensor& dx);
  // Block l's forward on sv's rows from x to x_next, `attend` running its
  // attention: Forward's code and the sampler's decode step's.
  absl::Status BlockForward(size_t l, const kernels::Tensor& x, BlockBuffers& sv, QkvStack& stack,
                            bool restack, const Attend& attend, kernels::Tensor& x_next);
  // The q|k|v projection of block p on sv.ln_1 into sv.qkv: the fused
  // parameter, or the three stacked in stack (and LoRA's terms). restack
  // copies block p's weights and adapters into stack first (Forward's one
  // stack serves every block); without it stack already holds them (a
  // decode state's per-block stacks, filled at Prefill).
  absl::Status QkvForward(const BlockParams& p, BlockBuffers& sv, QkvStack& stack, bool restack);
  // Fills each of a decode state's per-block stacks from the blocks'
  // current weights (the Sample's: the job's, or a snapshot's swapped in).
  absl::Status StackDecodeWeights(std::vector<QkvStack>& stacks);
  // With qk_norm: block p's per-head RMSNorm of sv.qkv's q and k heads in
  // place (saving the rows before it in sv.qkv_pre when that is allocated),
  // and its backward on d_qkv (N, Q + 2 KV), in place. Nothing without.
  absl::Status QkNormForward(const BlockParams& p, BlockBuffers& sv);
  absl::Status QkNormBackward(const BlockParams& p, const BlockBuffers& sv, kernels::Tensor& d_qkv);
  // Parameter index's working value and gradient.
  const kernels::Tensor& Value(int index) const {
    return params()[static_cast<size_t>(index)].value();
  }
  kernels::Tensor& Grad(int index) { return params()[static_cast<size_t>(index)].grad; }
  // A frozen parameter's gradient is nullptr; a trainable one's its own.
  kernels::Tensor* GradOrNull(int index);
  const kernels::Tensor* ValueOrNull(int index) const {
    return index < 0 ? nullptr : &params()[static_cast<size_t>(index)].value();
  }
  bool lora() const { return parts_.lora.has_value(); }

  const TransformerParts parts_;
  const int64_t lm_head_chunk_bytes_;
  // x_0's scale: sqrt(hidden_size) rounded to the working dtype with
  // scale_embeddings (Gemma3TextScaledWordEmbedding), else 1.
  float embed_scale_ = 1.0f;
  int embed_ = -1;
  int positions_ = -1;  // the learned position table; -1 with RoPE
  std::vector<BlockParams> blocks_;
  // LoRA: alpha / r, and the targeted modules among q, k, v in order (their
  // slot in the stacked adapters).
  float lora_scale_ = 0.0f;
  std::vector<Module> qkv_targets_;
  NormParams norm_;
  int lm_head_ = -1;  // -1 when tied
  // Per-layer scales: each block's group (GptBlockScaleGroup); the scale of
  // the residual add that ends block l's backward, S_g(l-1) / S_g(l) (1 for
  // block 0, within a group and without per-layer scales), and the alpha of
  // the LM head's weight-gradient GEMM, S_0 / S_{G-1} when tied (that
  // gradient is the embedding's, in group 0).
  std::vector<int> block_group_;
  std::vector<float> residual_grad_scale_;
  float head_grad_alpha_ = 1.0f;
};

}  // namespace ampd::engine::model
