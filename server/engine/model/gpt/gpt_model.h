// GptModel: a GPT-2-style decoder-only transformer (GptSpec) as a Network.
//
// Forward, per micro-batch of B sequences of T tokens (N = B*T rows, C =
// d_model, H = mlp_ratio * C, V = vocab_size), in the working dtype with
// fp32 accumulation:
//   x_0 = wte[ids] + wpe[0..T)
//   per block l:  a = ln_1(x_l); qkv = a c_attn.W + b (Conv1D: W is (in, out))
//                 y = causal attention(qkv); r_l = x_l + y attn.c_proj.W + b
//                 m = ln_2(r_l); f = gelu_tanh(m c_fc.W + b)
//                 x_{l+1} = r_l + f mlp.c_proj.W + b
//   h = ln_f(x_L); logits = h W_head^T, W_head = wte (tied) or lm_head.weight
// The LM head is fused with the cross-entropy in Loss: per chunk of rows,
// logits -> (in place) dlogits -> dh and dW_head (model/lm_head.h, shared
// with the decoder). The (N, V) logits are one chunk while they fit
// kLmHeadChunkBytes (the head's weight gradient is then one GEMM, read and
// written once), and are split into equal row chunks beyond it, so that
// the head's memory never grows with B x T x V.
//
// State-dict names and layouts are Hugging Face GPT-2's
// (transformers.GPT2LMHeadModel), in this order, which is also the order of
// params() and of the Philox streams that initialise them:
//   transformer.wte.weight (V, C), transformer.wpe.weight (context, C),
//   transformer.h.{i}.ln_1.weight / .bias (C),
//   transformer.h.{i}.attn.c_attn.weight (C, 3C) / .bias (3C),
//   transformer.h.{i}.attn.c_proj.weight (C, C) / .bias (C),
//   transformer.h.{i}.ln_2.weight / .bias (C),
//   transformer.h.{i}.mlp.c_fc.weight (C, H) / .bias (H),
//   transformer.h.{i}.mlp.c_proj.weight (H, C) / .bias (C),
//   transformer.ln_f.weight / .bias (C), lm_head.weight (V, C) when untied.
// Per-layer loss scales: block l is layer group g(l) = GptBlockScaleGroup
// (l itself up to 32 blocks; deeper models share a group between
// consecutive blocks), the embeddings join group 0 and ln_f and an untied
// LM head the last group. Where backward leaves block l for block l - 1,
// the residual add that ends block l's backward also moves the residual
// gradient from S_g(l) to S_g(l-1) (AddScaled: scaled in fp32 before its one
// rounding, no extra pass); a tied head's weight gradient, formed at the
// last group's scale in Loss, is moved to group 0's (wte's) by its GEMM's
// alpha.
// Initialisation is nanoGPT's: every weight matrix and both embeddings
// N(0, 0.02), the two projections into the residual stream
// (attn.c_proj.weight, mlp.c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)),
// biases 0, LayerNorm weight 1 and bias 0.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/model/lm_head.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

struct GptWorkspace;
struct GptBlockBuffers;

// WorkspaceBytes of a GPT for inputs (B, T): per block the saved
// activations (ln_1 and ln_2 outputs, attention output and r_l: 4 N C;
// qkv 3 N C; fc pre- and post-activation 2 N H; all in the working dtype;
// the attention's log-sum-exp B n_head T F32; LayerNorm mean and rstd
// 4 N F32), the residual stream x_0..x_L and ln_f's output ((L + 2) N C),
// the backward's scratch (3 N C + 3 N C + N H; attention is fused and
// needs nothing T x T), one LM-head chunk of logits (LmHeadChunkRows x V),
// the LM head's F32 gradient sum (V C x 4: fp16/bf16 heads of more than
// one chunk only) and the ids and targets (2 N x 8). Overflow-checked;
// InvalidArgument when it overflows or the shape is not (B, T) with
// 1 <= T <= context_length.
absl::StatusOr<int64_t> GptWorkspaceBytes(const ModelSpec& spec, Precision precision,
                                          const kernels::Shape& input_shape,
                                          int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

// StepScratchExtents of a GPT for inputs (B, T) (validated as
// GptWorkspaceBytes validates them): per block the fused c_attn (N, C) x
// (C, 3C), c_proj (N, C) x (C, C), c_fc (N, C) x (C, H) and mlp c_proj
// (N, H) x (H, C) GEMMs and, with `backward`, their backward; the LM head
// per chunk (AddLmHeadExtents); the attention over T with head size
// C / n_head; the cross-entropy over V.
kernels::ScratchExtents GptScratchExtents(const ModelSpec& spec, Precision precision,
                                          const kernels::Shape& input_shape, bool backward = true,
                                          int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

class GptModel final : public Network {
 public:
  // Builds the parameters of a validated GPT spec and initialises them from
  // seed (see above), then casts the working copy. lm_head_chunk_bytes
  // bounds the LM head's chunks (kLmHeadChunkBytes; a test may split a
  // small head to compare its chunked and single-chunk sums).
  static absl::StatusOr<std::unique_ptr<GptModel>> Create(
      const ModelSpec& spec, Precision precision, uint64_t seed, kernels::Backend& backend,
      int64_t lm_head_chunk_bytes = kLmHeadChunkBytes);

  // ids and targets keep their I32/I64 dtype; the targets other than
  // kIgnoreIndex are counted here, on the host, for the loss's mean.
  using Network::LoadBatch;
  absl::Status LoadBatch(const HostTensor& inputs, const HostTensor& targets,
                         const TokenLossInputs& tokens, Workspace& ws) override;
  absl::Status Forward(Workspace& ws) override;
  absl::StatusOr<const kernels::Tensor*> TokenLogprobs(Workspace& ws) override;
  absl::StatusOr<const kernels::Tensor*> TokenLosses(Workspace& ws) override;
  // The fused LM head and cross-entropy (gpt_lm_head.cc): loss =
  // multiplier * mean over kept targets; dh (the gradient into ln_f's
  // output) and the head weight's gradient (+=, one rounding per
  // micro-batch) times grad_scale.
  absl::Status Loss(Workspace& ws, float grad_scale, kernels::Tensor& loss) override;
  // The head's logits and cross-entropy only: no dh, no head gradient.
  absl::Status EvalLoss(Workspace& ws, kernels::Tensor& loss) override;
  // Group entries (per-layer scales): dh into ln_f for the last group, and
  // the residual gradient dL/dx_l, at S_g(l-1), where block l - 1 starts a
  // new group.
  using Network::Backward;
  absl::Status Backward(Workspace& ws, bool first_micro_batch, const BackwardHooks& hooks) override;

  std::vector<int> ParamScaleGroups() const override;
  absl::Status SetGroupScales(absl::Span<const float> scales) override;

  // Accepts Hugging Face's variants of the names: without the
  // "transformer." prefix, the attn.bias / attn.masked_bias buffers (dropped)
  // and, for a tied model, lm_head.weight when it equals wte (dropped).
  absl::StatusOr<std::vector<std::string>> CanonicalNames(
      const codec::StateDict& state) const override;
  // {"format": "pt"}: transformers' from_pretrained requires it.
  void AnnotateExport(codec::StateDict& state) const override;

  // Sampling (gpt_sampling.cc; network.h): a KV cache of each layer's keys
  // and values, (S, max_len, C) each.
  absl::StatusOr<int64_t> DecodeStateBytes(int64_t sequences, int64_t max_len) const override;
  absl::Status Prefill(Workspace& ws, absl::Span<const int64_t> lengths,
                       DecodeState& state) override;
  absl::Status DecodeStep(absl::Span<const int64_t> tokens, absl::Span<const int64_t> positions,
                          DecodeState& state) override;
  const Parameter* LmHead() const override { return &params()[static_cast<size_t>(head_weight())]; }

 protected:
  absl::StatusOr<int64_t> BytesFor(const kernels::Shape& input_shape) const override;
  absl::StatusOr<std::unique_ptr<DecodeState>> MakeDecodeState(int64_t sequences,
                                                               int64_t max_len) override;
  absl::StatusOr<std::unique_ptr<Workspace>> NewWorkspace(
      const kernels::Shape& input_shape) override;

 private:
  // Indices into params() of one block's parameters.
  struct BlockParams {
    int ln_1_weight, ln_1_bias;
    int c_attn_weight, c_attn_bias;
    int attn_proj_weight, attn_proj_bias;
    int ln_2_weight, ln_2_bias;
    int c_fc_weight, c_fc_bias;
    int mlp_proj_weight, mlp_proj_bias;
    // All twelve, in the order above (and params()').
    std::array<int, 12> All() const {
      return {ln_1_weight, ln_1_bias, c_attn_weight, c_attn_bias, attn_proj_weight, attn_proj_bias,
              ln_2_weight, ln_2_bias, c_fc_weight,   c_fc_bias,   mlp_proj_weight,  mlp_proj_bias};
    }
  };

  GptModel(const ModelSpec& spec, Precision precision, kernels::Backend& backend,
           int64_t lm_head_chunk_bytes);
  // One block's attention (gpt_forward.cc): from its q|k|v rows (sv.qkv)
  // to sv.attn_y.
  using Attend = std::function<absl::Status(GptBlockBuffers& sv)>;
  // Block l's forward on sv's rows from x to x_next, `attend` running its
  // attention: Forward's code and the sampler's decode step's.
  absl::Status BlockForward(size_t l, const kernels::Tensor& x, GptBlockBuffers& sv,
                            const Attend& attend, kernels::Tensor& x_next);
  // Loss and EvalLoss: the head over row chunks, its backward only when
  // with_grad.
  absl::Status HeadLoss(Workspace& ws, float grad_scale, bool with_grad, kernels::Tensor& loss);
  // Backward's two branches of block l (gpt_backward.cc).
  absl::Status BackwardMlp(GptWorkspace& ws, size_t l, float beta);
  absl::Status BackwardAttention(GptWorkspace& ws, size_t l, float beta);
  const GptSpec& gpt() const { return *spec().gpt; }
  int head_weight() const { return gpt().tie_embeddings ? wte_ : lm_head_; }

  const int64_t lm_head_chunk_bytes_;
  int wte_ = -1;
  int wpe_ = -1;
  std::vector<BlockParams> blocks_;
  int ln_f_weight_ = -1;
  int ln_f_bias_ = -1;
  int lm_head_ = -1;  // -1 when tied
  // Per-layer scales: each block's group (GptBlockScaleGroup); the scale of
  // the residual add that ends block l's backward, S_g(l-1) / S_g(l) (1 for
  // block 0, within a group and without per-layer scales), and the alpha of
  // the LM head's weight-gradient GEMM, S_0 / S_{G-1} when tied (that
  // gradient is wte's, in group 0).
  std::vector<int> block_group_;
  std::vector<float> residual_grad_scale_;
  float head_grad_alpha_ = 1.0f;
};

}  // namespace ampd::engine::model
