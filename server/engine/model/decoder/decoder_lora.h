// The arithmetic of one LoRA adapter (config/model_spec.h LoraSpec) on a
// decoder projection, on the backend's GEMMs alone.
//
// A projection y = x W^T with frozen W (out, in) and adapter A (r, in),
// B (out, r), scale s = alpha / r, computes y = x W_eff^T with
//   W_eff = W + s B A                                    (LoraMerge)
// so the decoder's GEMMs, its stacked q|k|v matrix (decoder_model.h)
// included, run unchanged on W_eff: the row blocks of the stacked matrix
// are contiguous, where the output's q, k and v column blocks are not, and
// the backend has no strided GEMM. Merging costs out x in x r multiply-adds
// per pass against the projection's N x out x in (N rows).
//
// Backward: with G = dL/dW_eff (out, in) = dy^T x, which the decoder's
// weight-gradient GEMM already forms, the chain rule through W_eff gives
//   dB (out, r) = s G A^T,  dA (r, in) = s B^T G          (LoraGrads)
// and dx = dy W_eff is the base's plus the adapter's path in one GEMM.
// Each result is one GEMM, fp32-accumulated and rounded once to its dtype
// (backend.h's Gemm), accumulating over micro-batches with beta = 1.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace ampd::engine::model {

// w_eff (out, in) += scale * b (out, r) @ a (r, in): w_eff holds W (a copy
// of the frozen weight, or a row block of the stacked q|k|v one) on entry.
// a, b and w_eff share one float dtype.
absl::Status LoraMerge(kernels::Backend& backend, float scale, const kernels::Tensor& a,
                       const kernels::Tensor& b, kernels::Tensor& w_eff);

// From g = dL/dW_eff (out, in):
//   db (out, r) = scale * g @ a^T + beta * db
//   da (r, in)  = scale * b^T @ g + beta * da
// beta 0 on a step's first micro-batch, 1 after (Network::Backward).
absl::Status LoraGrads(kernels::Backend& backend, float scale, const kernels::Tensor& g,
                       const kernels::Tensor& a, const kernels::Tensor& b, float beta,
                       kernels::Tensor& da, kernels::Tensor& db);

}  // namespace ampd::engine::model
