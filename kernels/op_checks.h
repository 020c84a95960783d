// Argument validation for every Backend op, written once for all backends.
// Each backend calls the op's Validate* function before touching memory, so
// a bad call is refused with the same InvalidArgument message whichever
// device runs it ("<Op>: <operand> is <dtype(shape)>; expected ..."); the
// engine passes that message to the client unchanged, and the CUDA tests
// compare it word for word with the CPU oracle's.
//
// Only what can be decided from dtypes, shapes, pointers and scalar
// arguments lives here. Checks that need the data (ids and labels inside
// [0, V)) are each backend's own: the CPU backend reads them on the host,
// the CUDA backend flags them on the device and reports at the next
// synchronisation. Device independent: no CUDA headers, host C++17.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace ampd::kernels {

// ---- generic checks -----------------------------------------------------------
// Each names the op and the operand, so a message points at the bad argument.

// A tensor with elements must own memory (a default-constructed Tensor has none).
absl::Status CheckHasMemory(absl::string_view op, absl::string_view name, const Tensor& t);
// F32, F16 or BF16, with memory.
absl::Status CheckFloat(absl::string_view op, absl::string_view name, const Tensor& t);
// Exactly `want`, with memory.
absl::Status CheckDType(absl::string_view op, absl::string_view name, const Tensor& t, DType want);
// I32 or I64 (ids, labels), with memory.
absl::Status CheckIndex(absl::string_view op, absl::string_view name, const Tensor& t);
absl::Status CheckRank(absl::string_view op, absl::string_view name, const Tensor& t, int64_t rank);
absl::Status CheckSameShape(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref);
absl::Status CheckSameDType(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref);
absl::Status CheckSameNumel(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref);
// A one-element F32 tensor of any rank (loss, found_inf, norm_sq), with memory.
absl::Status CheckScalarF32(absl::string_view op, absl::string_view name, const Tensor& t);

// ---- one per Backend op ---------------------------------------------------------
// Same arguments as the op (minus the plain float scalars no rule looks
// at), same order of checks on every backend, so the first error reported
// is the same too.

// ---- memory
// No negative dimension, and a byte count far from int64 overflow.
absl::Status ValidateAllocate(const Shape& shape);
// bytes == dst.nbytes(); src may be null only when there is nothing to copy.
absl::Status ValidateCopyFromHost(const void* src, size_t bytes, const Tensor& dst);
absl::Status ValidateCopyToHost(const Tensor& src, const void* dst, size_t bytes);
absl::Status ValidateCopy(const Tensor& src, const Tensor& dst);
// src and dst 2-D, one dtype (any), the same rows, with memory; cols >= 0,
// src_col and dst_col >= 0 with the block inside each; dst overlapping no
// byte of src.
absl::Status ValidateCopyColumns(const Tensor& src, int64_t src_col, int64_t cols,
                                 const Tensor& dst, int64_t dst_col);
absl::Status ValidateFill(const Tensor& dst);
// Each dsts[i] non-null, float, with memory.
absl::Status ValidateFillTensors(absl::Span<Tensor* const> dsts);
// dst F32 with memory; the distribution's parameters in range; the draw
// indices offset .. offset + numel - 1 within uint64.
absl::Status ValidateFillRandom(const Tensor& dst, const RandomFill& fill);
absl::Status ValidateCast(const Tensor& src, const Tensor& dst);
// out_size is out.size(); every scalars[i] is checked before any is read.
absl::Status ValidateReadBack(absl::Span<const Tensor* const> scalars, size_t out_size,
                              absl::Span<const HostCopy> copies);

// ---- dense algebra
absl::Status ValidateAdd(const Tensor& x, const Tensor& y);
// Also refuses dims beyond int: BLAS and cuBLAS both take int dimensions.
absl::Status ValidateGemm(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                          const Tensor& c);
absl::Status ValidateAddBias(const Tensor& bias, const Tensor& y);
// The Linear ops: Gemm's rules on a, b and c (named after the op), then c
// of a's dtype (except GemmBiasGrad, whose c may be F32 as Gemm's), the
// bias, pre or dbias per the op's comment in backend.h, and no output
// overlapping an input or another output.
absl::Status ValidateGemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a,
                                        const Tensor& b, const Tensor* bias, GemmActivation act,
                                        const Tensor& c, const Tensor* pre);
absl::Status ValidateGemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                  const Tensor& c, BiasGradOf of, const Tensor& dbias);
absl::Status ValidateGemmActivationBackward(bool trans_a, bool trans_b, const Tensor& a,
                                            const Tensor& b, GemmActivation act, const Tensor* pre,
                                            const Tensor& c);
absl::Status ValidateBiasGrad(const Tensor& dy, const Tensor& dbias);

// ---- activations
absl::Status ValidateActivationForward(Activation act, const Tensor& x, const Tensor& y);
absl::Status ValidateActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                        const Tensor& dx);

// ---- causal self-attention
// qkv (B, T, 3C) float with C a positive multiple of n_head (n_head >= 1)
// and T, 3C and n_head within int; out (B, T, C) of qkv's dtype and lse
// (B, n_head, T) F32, neither overlapping qkv nor each other.
absl::Status ValidateAttentionForward(const Tensor& qkv, int64_t n_head, const Tensor& out,
                                      const Tensor& lse);
// qkv as above; out and dout (B, T, C) and dqkv qkv's shape, all of qkv's
// dtype; lse (B, n_head, T) F32; dqkv overlaps no other operand.
absl::Status ValidateAttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                       const Tensor& lse, int64_t n_head, const Tensor& dqkv);
// options.window >= 0 (within int: the kernels' positions are ints) and a
// set options.scale finite and > 0.
absl::Status ValidateAttentionOptions(const AttentionOptions& options, const char* op);

// q float (S, H D) with D >= 1 and H D within int; kv_heads >= 1 dividing
// heads >= 1 (both at most 2^20); k_cache and v_cache q's dtype and
// (S, T_max, Hkv D) with T_max within int; positions I32 or I64 (S); out
// q's dtype and shape, overlapping no input. Position values are the
// backend's to check (they may live on a device).
absl::Status ValidateAttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     const Tensor& positions, int64_t heads, int64_t kv_heads,
                                     const Tensor& out);
// rows 2-D (S, R) with memory; k_cache and v_cache rows' dtype, (S, T_max,
// W) both, T_max >= 1; k_col and v_col >= 0 with each W-column block inside
// R; positions I32 or I64 (S); neither cache overlapping rows, positions
// or the other cache. Position values are the backend's to check.
absl::Status ValidateWriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                                 const Tensor& positions, const Tensor& k_cache,
                                 const Tensor& v_cache);
// logits float (S, V) with V >= 1 and V < 2^31; live I64 (S); tokens I64
// (S) overlapping neither input; log_kept (when given) F32 (S) overlapping
// no other operand; temperature finite and >= 0, top_k >= 0, top_p in
// (0, 1].
absl::Status ValidateSampleTokens(const Tensor& logits, const Tensor& live,
                                  const SampleParams& params, const Tensor& tokens);

// ---- grouped-query K/V heads
// compact float (B, T, (H + 2 Hkv) D) with D >= 1, kv_heads >= 1 dividing
// heads >= 1; expanded compact's dtype and (B, T, 3 H D); no overlap.
absl::Status ValidateKvHeads(absl::string_view op, const Tensor& compact, int64_t heads,
                             int64_t kv_heads, const Tensor& expanded);

// ---- normalisation
absl::Status ValidateLayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta,
                                      const Tensor& y, const Tensor& mean, const Tensor& rstd);
absl::Status ValidateLayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                       const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                       const Tensor* dgamma, const Tensor* dbeta);

// x float (N, C), C >= 1; weight (C) x's dtype; y x's dtype and shape (may
// be x); rstd (N) F32.
absl::Status ValidateRmsNormForward(const Tensor& x, const Tensor& weight, const Tensor& y,
                                    const Tensor& rstd);
// dy and dx x's dtype and shape (dx may be x or dy); dweight, when given,
// (C) any float.
absl::Status ValidateRmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                     const Tensor& dy, const Tensor& dx, const Tensor* dweight);
// The (offset + w) scale's offset: finite.
absl::Status ValidateRmsNormOffset(float weight_offset, const char* op);
// x float (R, W); weight (D) x's dtype, D >= 1; heads >= 1 with
// col >= 0 and col + heads * D <= W; y x's dtype and shape (may be x);
// rstd (R, heads) F32.
absl::Status ValidateHeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads,
                                        const Tensor& weight, const Tensor& y, const Tensor& rstd);
// The forward's checks with dy and dx x's dtype and shape (dx may be x or
// dy); dweight, when given, (D) any float.
absl::Status ValidateHeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                         const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                                         const Tensor& dx, const Tensor* dweight);

// ---- rotary position embeddings
// x float (B, T, W); heads >= 0, head_dim even >= 2, heads * head_dim <= W;
// inv_freq F32 (head_dim / 2); positions, when given, I32 or I64 (B, T).
absl::Status ValidateRope(const Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                          const Tensor* positions);

// ---- the gated MLP (SwiGLU, GeGLU)
// gate, up, y one float dtype and shape.
absl::Status ValidateGatedMulForward(const Tensor& gate, const Tensor& up, const Tensor& y);
// dy, dgate, dup gate's dtype and shape; dgate and dup overlap no input or
// each other.
absl::Status ValidateGatedMulBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                      const Tensor& dgate, const Tensor& dup);
// act one of GluActivation's values.
absl::Status ValidateGluActivation(GluActivation act, const char* op);

// ---- embedding (the ids' range is the backend's to check)
// The rows' scale: finite.
absl::Status ValidateEmbeddingScale(float scale, const char* op);
absl::Status ValidateEmbeddingForward(const Tensor& ids, const Tensor& table, const Tensor& out);
absl::Status ValidateEmbeddingBackward(const Tensor& ids, const Tensor& dout, const Tensor& dtable);

// ---- losses (the labels' range is the backend's to check)
absl::Status ValidateMseLoss(const Tensor& pred, const Tensor& target, const Tensor& loss,
                             const Tensor& dpred);
absl::Status ValidateCrossEntropyLoss(const Tensor& logits, const Tensor& labels,
                                      const Tensor& loss, const Tensor& dlogits);
// logits (N, V) float with V >= 1 (N may be 0: an empty chunk); labels (N)
// I32 or I64; dlogits logits' dtype and shape, either logits itself or
// disjoint from it; loss a one-element F32.
absl::Status ValidateCrossEntropyChunk(const Tensor& logits, const Tensor& labels,
                                       const TokenLossTerms& terms, const Tensor& loss,
                                       const Tensor& dlogits);
// logits (N, V) float with V >= 1; labels (N) I32 or I64; logprobs (N) F32
// overlapping neither; temperature finite and > 0.
absl::Status ValidateLabelLogprobs(const Tensor& logits, const Tensor& labels, float temperature,
                                   const Tensor& logprobs);

// ---- loss scaling and the optimizer
absl::Status ValidateUnscaleAndCheck(absl::Span<Tensor* const> grads, const Tensor& found_inf,
                                     const Tensor* norm_sq, const Tensor* max_abs = nullptr);
// The transform's scalars, then every ParamRef: master F32; grad float of
// master's element count; working (optional) float of the same count;
// state0/state1 F32 of the same count when the optimizer needs them (an
// unneeded state buffer is never touched, so it is not checked). Everything
// is validated before anything is written.
absl::Status ValidateOptimizerParams(absl::string_view op, absl::Span<const ParamRef> params,
                                     bool needs_state0, bool needs_state1,
                                     const GradTransform& transform);
// step >= 1, then ValidateOptimizerParams with both moments required.
absl::Status ValidateAdamUpdate(absl::Span<const ParamRef> params, int64_t step,
                                const GradTransform& transform);
// state0 (the momentum buffer) is required exactly when config.momentum != 0.
absl::Status ValidateSgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                               const GradTransform& transform);

// ---- observability
absl::Status ValidateGradLog2Histogram(absl::Span<const Tensor* const> grads, const Tensor& counts);

}  // namespace ampd::kernels
