// The arithmetic of one LoRA adapter (config/model_spec.h LoraSpec) on a
// decoder projection, on the backend's GEMMs alone.
//
// A projection y = x W^T (+ b) with frozen W (out, in), adapter A (r, in)
// and B (out, r), scale s = alpha / r, computes, as PEFT's lora.Linear does
// (dropout 0),
//   u = x A^T                (N, r)
//   y = x W^T + s u B^T      (N, out)                    (LoraForward)
// The adapter's term is added to the projection's output, not merged into
// W: in fp16/bf16 a merged W + s B A would round the adapter's small early
// updates away against W's magnitude. Backward, from dy (N, out):
//   dB = s dy^T u            (out, r)
//   du = s dy B              (N, r)
//   dA = du^T x              (r, in)
//   dx += du A               (N, in), after the frozen path's dx = dy W
// (LoraBackward): four GEMMs of N r (in + out) multiply-adds against the
// base's N in out, and no (out, in) weight gradient at all.
//
// The decoder's stacked q|k|v projection (transformer_model.h) runs the same
// functions on stacked operands: A = [A_q; A_k; A_v] (t r, in) and a
// block-diagonal B (Q + 2 KV, t r) whose block j holds target j's B_j, so
// one GEMM adds every target's term to its column block of the fused rows.
// The diagonal blocks of that B's gradient are target j's dB_j.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace ampd::engine::model {

// y (N, out) += scale * u B^T with u (N, r) = x (N, in) A^T, saved for the
// backward. a (r, in), b (out, r); every operand of one float dtype.
absl::Status LoraForward(kernels::Backend& backend, float scale, const kernels::Tensor& x,
                         const kernels::Tensor& a, const kernels::Tensor& b, kernels::Tensor& u,
                         kernels::Tensor& y);

// From dy (N, out) and what LoraForward read and saved (x, u):
//   db (out, r) = scale dy^T u + beta db
//   du (N, r)   = scale dy B                 (scratch, overwritten)
//   da (r, in)  = du^T x + beta da
//   dx (N, in) += du A
// beta 0 on a step's first micro-batch, 1 after (Network::Backward); each
// result rounded once to its dtype.
absl::Status LoraBackward(kernels::Backend& backend, float scale, const kernels::Tensor& x,
                          const kernels::Tensor& u, const kernels::Tensor& dy,
                          const kernels::Tensor& a, const kernels::Tensor& b, float beta,
                          kernels::Tensor& du, kernels::Tensor& da, kernels::Tensor& db,
                          kernels::Tensor& dx);

}  // namespace ampd::engine::model
