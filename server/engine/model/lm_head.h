// The LM head fused with the token loss of the language models (the
// transformer's, every family's): over row chunks of the final norm's
// output h (N, C), with W the head (V, C),
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
//   one chunk (the usual case), any dtype: one GEMM into the gradient,
//     which forms alpha * sum (+ grad in fp32 with beta = 1) and rounds
//     once;
//   several chunks in fp16/bf16: each chunk's GEMM adds into an F32 sum
//     (beta = 0 for the first), which one Add puts into the gradient;
//   several chunks in fp32: each chunk's GEMM adds into the gradient.
// On the update's first micro-batch the gradient holds the zeros ZeroGrads
// left (a tied head's embedding gradient is added after, by the backward),
// so the first GEMM into it writes with beta = 0 instead of reading them:
// the same values without a (V, C) read, as the Linear weights' first
// micro-batch does.
// The two 16-bit forms differ only in how the fp32 sum over the rows is
// associated, so they agree to within the one rounding (a tested bound).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

// The most bytes of logits (and their gradient, in place) the LM head holds
// at once, whatever the batch: 256 MiB, so that the head's memory is bounded
// by a constant and never grows with B x T x V (a 64 x 256 batch over a
// 32k vocabulary in fp16 is 1 GiB of logits: four chunks). The bound trades
// memory against the head's weight gradient: a 16-bit head of several
// chunks adds each chunk's dW into an F32 (V, C) sum, read and written once
// a chunk, so the chunks must stay long: 2048 rows of GPT-2's vocabulary in
// bf16 (four chunks for 8 x 1024 tokens, some 1.2 GB of sum traffic, under
// 0.5 ms of an H100's step) and 880 rows of Qwen's 152k. A fixed number
// rather than a share of the device's memory, so that the CPU oracle splits
// a head exactly as a GPU does (the same sums in the same order), and the
// workspace a step needs is a function of the spec and the shape alone,
// which admission counts before any backend is asked. The CPU oracle also
// holds a 16-bit chunk widened to fp32 twice (kernels/cpu/gemm.cc), so its
// head holds at most 5 x 256 MiB. (It was 2 GiB, the whole (N, V) logits
// of most batches: 12 GB estimated for that 32k batch on the CPU.)
inline constexpr int64_t kLmHeadChunkBytes = int64_t{256} << 20;

// Rows per LM-head chunk for N rows of a vocab-V head: all N when
// N x V x (working dtype size) fits chunk_bytes; else ceil(N / k) for the
// fewest k chunks of at most chunk_bytes each (at least one row per
// chunk), so that the chunks are as even as they can be and only the last
// may be shorter. Every row's logits, loss term, log-prob and dh are
// computed row by row (and the CPU's loss adds its rows in order), so on a
// batch-invariant backend they are the same bits in any chunking (BLAS
// picks kernels by shape: there a row's logits may move in their last bits
// with the chunk's row count, as with the batch size); only the head's dW,
// a sum over the rows, is associated differently (within its one
// rounding, above).
int64_t LmHeadChunkRows(int64_t vocab, Precision precision, int64_t rows,
                        int64_t chunk_bytes = kLmHeadChunkBytes);

// The LM head's GEMMs over chunks of R = LmHeadChunkRows rows of width C
// (kernels::ScratchExtents, for the backend's ScratchBytes), folded into
// `e` (each field the larger of its own and the head's):
//   logits (R, C) x (C, V) -> (R, V)
//   with_grad: dh (R, V) x (V, C) -> (R, C); dW (V, R) x (R, C) -> (V, C)
// and the loss over V classes, R rows at a time. An evaluation (or a
// sampler's prefill, which runs no head) never has dlogits as an operand.
void AddLmHeadExtents(int64_t vocab, int64_t width, Precision precision, int64_t rows,
                      int64_t chunk_bytes, bool with_grad, kernels::ScratchExtents& e);

// A workspace's token loss: the step's LossFn and its per-token inputs on
// the device ((N) F32 each, empty when absent), set by every LoadBatch, and
// views of them for the head's current chunk.
struct TokenLossState {
  // One (N) F32 per-token tensor on the device, allocated on its first use
  // and kept with the workspace (its bytes are in the workspace's count),
  // the current chunk's view of it, and whether this batch carries it.
  struct Row {
    kernels::Tensor all;
    kernels::Tensor chunk;
    bool live = false;
  };
  LossFn loss_fn;
  Row weights, advantages, sampling_logprobs;
  Row logprobs;      // written by the head: each token's log-prob, when asked for
  Row token_losses;  // written by the head: what each token added to the loss, when asked for

  // Uploads `tokens` for a batch of `rows` tokens; what they do not carry
  // is marked absent (never read), its buffer kept for a later step.
  absl::Status Load(kernels::Backend& backend, const TokenLossInputs& tokens, int64_t rows);
  // The chunk [start, start + r)'s terms for CrossEntropyChunk: plain
  // cross-entropy for the model's own loss.
  absl::StatusOr<kernels::TokenLossTerms> ChunkTerms(int64_t start, int64_t r);
  // Whether the loss is a sum over the tokens (a token loss) rather than
  // the mean over the kept targets.
  bool summed() const { return loss_fn.kind != LossFnKind::kModel; }
};

// What every language model's workspace holds for its batch and its head
// (TransformerWorkspace derives from it): row-major (N, width) tensors,
// N = B*T.
struct LmWorkspace : Workspace {
  int64_t batch = 0;        // B
  int64_t seq = 0;          // T
  int64_t rows = 0;         // N = B*T
  int64_t chunk_rows = 0;   // rows per LM-head chunk
  int64_t kept = 0;         // targets other than kIgnoreIndex (LoadTokenBatch counts them)
  TokenLossState tokens;    // the token loss the next Loss trains on (LoadTokenBatch sets it)
  kernels::Tensor ids;      // (N) I32/I64 as the client sent them
  kernels::Tensor targets;  // (N) I32/I64
  kernels::Tensor ln_f;     // (N, C) the final norm's output, the head's input
  kernels::Tensor d_ln;     // (N, C) a norm's output gradient (Loss writes the final one's)
  kernels::Tensor logits;   // (chunk_rows, V) one LM-head chunk, then its gradient
  // (V, C) F32: a 16-bit head's gradient summed over its chunks before it
  // is added to the parameter gradient in one rounding; empty in fp32 and
  // when the head is one chunk, whose one GEMM adds into the gradient.
  kernels::Tensor head_grad;
};

// A language model's LoadBatch: (B, T) ids and targets, which must be the
// workspace's shape, into (N) device tensors of their own dtype, the
// targets other than kIgnoreIndex counted on the host (the mean needs no
// device read), and the token loss's inputs.
absl::Status LoadTokenBatch(kernels::Backend& backend, const HostTensor& inputs,
                            const HostTensor& targets, const TokenLossInputs& tokens,
                            LmWorkspace& ws);

// Element i of a host tensor of I32 or I64 ids or targets (checked by
// CheckBatchFitsModel: the dtype is one of the two, i is in range).
int64_t TokenIdAt(const HostTensor& ids, int64_t i);

// logits (R, V) = h (R, C) head^T: the LM head's GEMM, the one a
// training loss and a sampler run (row for row the same bits on a
// batch-invariant backend).
absl::Status LmLogits(kernels::Backend& b, const kernels::Tensor& h, const Parameter& head,
                      kernels::Tensor& logits);

// loss (1) F32 = the micro-batch's loss (times multiplier); with_grad: dh
// into ws.d_ln and the head's gradient as above, written when
// first_micro_batch (the update's first, its gradient just zeroed) and
// added to otherwise (an evaluation leaves every gradient).
absl::Status LmHeadLoss(kernels::Backend& b, LmWorkspace& ws, Parameter& head,
                        float head_grad_alpha, float multiplier, float grad_scale, bool with_grad,
                        bool first_micro_batch, kernels::Tensor& loss);

// Network::TokenLogprobs of a language model: the (N) F32 log-probs the last
// head wrote, when LoadTokenBatch asked for them.
absl::StatusOr<const kernels::Tensor*> TokenLogprobsOf(LmWorkspace& ws);

// Network::TokenLosses of a language model: the (N) F32 per-token losses
// (kernels::TokenLossTerms::token_losses) the last head wrote, when
// LoadTokenBatch asked for them.
absl::StatusOr<const kernels::Tensor*> TokenLossesOf(LmWorkspace& ws);

}  // namespace ampd::engine::model
