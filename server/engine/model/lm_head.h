// The LM head fused with the token loss, shared by the language models
// (the GPT, the decoder): over row chunks of the final norm's output h
// (N, C), with W the head (V, C),
//   logits (r, V) = h W^T
//   CrossEntropyChunk: loss += the chunk's terms; logits <- dlogits (in place)
//   dh (r, C) = dlogits W
//   dW (V, C) += alpha dlogits^T h (wte's gradient when the head is tied,
//                                   moved to its layer group's scale by alpha)
// The model's own loss averages over the kept targets (loss_scale =
// multiplier / kept, grad_scale = S * multiplier / kept); a token loss
// (TokenLossState, the step's LossFn) sums over them (loss_scale =
// multiplier, grad_scale = S * multiplier) with each chunk's per-token
// inputs. The rounding contract of dW is one rounding per micro-batch, as
// every other weight gradient gets, however many chunks the head takes:
//   one chunk (the usual case), any dtype: one GEMM with beta = 1 into the
//     gradient, which forms alpha * sum + grad in fp32 and rounds once;
//   several chunks in fp16/bf16: each chunk's GEMM adds into an F32 sum
//     (beta = 0 for the first), which one Add puts into the gradient;
//   several chunks in fp32: each chunk's GEMM adds into the gradient.
// The two 16-bit forms differ only in how the fp32 sum over the rows is
// associated, so they agree to within the one rounding (a tested bound).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

// A workspace's token loss: the step's LossFn and its per-token inputs on
// the device ((N) F32 each, empty when absent), set by every LoadBatch, and
// views of them for the head's current chunk.
struct TokenLossState {
  LossFn loss_fn;
  kernels::Tensor weights, advantages, sampling_logprobs;
  kernels::Tensor chunk_weights, chunk_advantages, chunk_sampling_logprobs;
  // (N) F32 each token's log-prob, written by the head when LoadBatch asked
  // for it (empty otherwise), and its chunk's view.
  kernels::Tensor logprobs, chunk_logprobs;

  // Uploads `tokens` for a batch of `rows` tokens (or empties what it does
  // not carry, so no previous step's input is read), and keeps a logprobs
  // buffer when they ask for one.
  absl::Status Load(kernels::Backend& backend, const TokenLossInputs& tokens, int64_t rows);
  // The chunk [start, start + r)'s terms for CrossEntropyChunk: plain
  // cross-entropy for the model's own loss.
  absl::StatusOr<kernels::TokenLossTerms> ChunkTerms(int64_t start, int64_t r);
  // Whether the loss is a sum over the tokens (a token loss) rather than
  // the mean over the kept targets.
  bool summed() const { return loss_fn.kind != LossFnKind::kModel; }
};

// A language model's LoadBatch: (B, T) ids and targets, which must be
// `shape`, into (N) device tensors of their own dtype, the targets other
// than kIgnoreIndex counted on the host (the mean needs no device read),
// and the token loss's inputs.
absl::Status LoadTokenBatch(kernels::Backend& backend, const HostTensor& inputs,
                            const HostTensor& targets, const TokenLossInputs& tokens,
                            const kernels::Shape& shape, kernels::Tensor& ids,
                            kernels::Tensor& device_targets, int64_t& kept, TokenLossState& state);

// What a language model's workspace holds for its head.
struct LmHeadBuffers {
  int64_t rows = 0;                          // N
  int64_t chunk_rows = 0;                    // rows per chunk
  int64_t kept = 0;                          // targets other than kIgnoreIndex
  const kernels::Tensor* hidden = nullptr;   // (N, C) the final norm's output
  kernels::Tensor* d_hidden = nullptr;       // (N, C) its gradient, written
  const kernels::Tensor* targets = nullptr;  // (N) I32/I64
  kernels::Tensor* logits = nullptr;         // (chunk_rows, V) one chunk, then its gradient
  kernels::Tensor* head_grad = nullptr;      // (V, C) F32 sum over 16-bit chunks, or empty
  TokenLossState* tokens = nullptr;
};

// loss (1) F32 = the micro-batch's loss (times multiplier); with_grad: dh
// and the head's gradient as above (an evaluation leaves every gradient).
absl::Status LmHeadLoss(kernels::Backend& b, const LmHeadBuffers& ws, Parameter& head,
                        float head_grad_alpha, float multiplier, float grad_scale, bool with_grad,
                        kernels::Tensor& loss);

}  // namespace ampd::engine::model
