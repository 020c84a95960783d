// Host entry points of the CUDA kernels, one per op file (fill.cu, cast.cu,
// ...). They take raw device pointers already checked by cuda_backend.cc,
// enqueue on `stream`, and report launch failures as Status with the file
// and line of the launch. Included by .cu files: C++17 only.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace ampd::kernels::cuda {

// Bits the kernels OR (atomicOr) into the backend's error word, an int in
// device memory: the optimizer reads it on the device, and the host gets it
// with the step's one read (GatherScalars), never through mapped memory.
inline constexpr int kErrorEmbeddingId = 1;
inline constexpr int kErrorCrossEntropyLabel = 2;
inline constexpr int kErrorCrossEntropyChunkLabel = 4;  // a label neither in [0, V) nor ignored

// Partial sums of the two-stage (deterministic) loss reductions.
inline constexpr int kMaxReductionBlocks = 1024;

// Row slabs of the column-sum kernels (BiasGrad, LayerNorm's dgamma/dbeta).
// Only ceil(C / 32) column blocks would leave most SMs idle for narrow,
// tall inputs; gridDim.y slabs of rows each write a partial per column to
// scratch, and a second pass adds the slabs in a fixed order. The count
// depends on the shape only (never on the device), so results are
// reproducible run to run and across GPUs. 1 means a single pass and no
// scratch.
inline constexpr int64_t kColumnSumColsPerBlock = 32;
inline constexpr int64_t kColumnSumMinRowsPerSlab = 64;
inline constexpr int64_t kColumnSumTargetBlocks = 1024;
inline int64_t ColumnSumRowsPerSlab(int64_t rows, int64_t cols) {
  const int64_t col_blocks = (cols + kColumnSumColsPerBlock - 1) / kColumnSumColsPerBlock;
  const int64_t wanted =
      (kColumnSumTargetBlocks + col_blocks - 1) / std::max<int64_t>(1, col_blocks);
  const int64_t by_rows = (rows + kColumnSumMinRowsPerSlab - 1) / kColumnSumMinRowsPerSlab;
  const int64_t slabs = std::max<int64_t>(1, std::min(wanted, by_rows));
  return std::max<int64_t>(1, (rows + slabs - 1) / slabs);
}
inline int64_t ColumnSumSlabs(int64_t rows, int64_t cols) {
  const int64_t per_slab = ColumnSumRowsPerSlab(rows, cols);
  return std::max<int64_t>(1, (rows + per_slab - 1) / per_slab);
}

// One tensor of a multi-tensor op (UnscaleAndCheck, GradLog2Histogram).
struct GradSpan {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t n = 0;
};

// One tensor of FillTensors, as 16-byte slots: slot s covers the bytes
// [floor16(data) + 16 s, + 16), and the n slots end with the tensor, whose
// last byte is byte last_bytes - 1 of slot n - 1. A slot wholly inside the
// tensor is one 16-byte store; the one or two it only partly covers are
// written 2 bytes at a time (elements are 2 or 4 bytes, aligned to their
// size), so the bytes beside a view are never touched. 24 bytes.
struct FillSpan {
  void* data = nullptr;
  int64_t n = 0;
  uint32_t pattern = 0;     // the stored element's bits, twice over for a 16-bit dtype
  uint32_t last_bytes = 0;  // 1..16
};
// Tensors per FillTensors launch: a chunk of 128 FillSpans is 3.5 KiB,
// inside the 4 KiB of kernel parameters, and holds the LayerNorm, embedding
// and head gradients of a GPT of up to 31 blocks.
inline constexpr int kFillTensorsPerLaunch = 128;

// One parameter of a fused optimizer launch.
struct ParamSpan {
  float* master = nullptr;
  void* working = nullptr;  // nullptr: no working copy (fp32 job)
  const void* grad = nullptr;
  float* state0 = nullptr;  // m, or the momentum buffer (may be nullptr for SGD)
  float* state1 = nullptr;  // v
  int64_t n = 0;
  DType grad_dtype = DType::kF32;
  DType working_dtype = DType::kF16;
};

// GradTransform as the kernels read it.
struct TransformArgs {
  float inv_scale = 1.0f;
  const float* found_inf = nullptr;  // (1), required
  const float* norm_sq = nullptr;    // (1) or nullptr
  float max_grad_norm = 0.0f;
  // The backend's device error word (or nullptr). A bad id or label found
  // earlier in the step is only reported at the next synchronisation; the
  // optimizer reads the word first and skips the update, so a step with
  // invalid input never reaches the weights. It is device memory: each
  // block's read is an L2 hit, not a round trip over PCIe.
  const int* error_flags = nullptr;
};

// What GatherScalars copies: up to kMaxGatherScalars one-element F32
// tensors, then the error word. Passed by value as a kernel parameter.
inline constexpr int kMaxGatherScalars = 16;
struct GatherScalarsArgs {
  const float* src[kMaxGatherScalars] = {};
  int count = 0;
  const int* error_word = nullptr;
};

struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
  float step_size;              // lr / (1 - beta1^step), computed on the host in double
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

struct SgdArgs {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first_step;
};

absl::Status LaunchFill(void* dst, DType dtype, int64_t n, float value, cudaStream_t stream);
// Every byte of spans[0, count) set to its pattern: one launch per
// kFillTensorsPerLaunch spans.
absl::Status LaunchFillTensors(const FillSpan* spans, int count, cudaStream_t stream);
// dst (n) F32 = Philox draws offset .. offset + n - 1 (kernels/philox.h).
absl::Status LaunchFillRandom(float* dst, int64_t n, const RandomFill& fill, cudaStream_t stream);
// y = alpha * y (used for GEMM with K == 0).
absl::Status LaunchScale(void* y, DType dtype, int64_t n, float alpha, cudaStream_t stream);
absl::Status LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                        cudaStream_t stream);

// Row-major GEMM on cuBLAS (gemm.cc). c (m, n) = alpha op(a) op(b) + beta c.
absl::Status LaunchGemm(cublasHandle_t handle, bool trans_a, bool trans_b, int m, int n, int k,
                        float alpha, const void* a, int lda, const void* b, int ldb, DType ab_dtype,
                        float beta, void* c, DType c_dtype);

// The batch-invariant GEMM (gemm_invariant.cu): c (m, n) = alpha op(a)
// op(b) + beta c with each element's sum over K in one order fixed by K
// alone (F32: the CPU oracle's order, bit for bit; F16/BF16: tensor-core
// steps of 16 from 0). c is F32 or ab_dtype, rounded once; beta == 0 never
// reads c. m, n, k > 0; lda, ldb the stored row lengths.
absl::Status LaunchGemmInvariant(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                 const void* a, int lda, const void* b, int ldb, DType ab_dtype,
                                 float beta, void* c, DType c_dtype, cudaStream_t stream);

// Row-major strided-batched GEMM on cuBLAS (gemm.cc): for i in [0, batch),
// C_i (m, n) = alpha op(A_i) op(B_i) + beta C_i with X_i = X + i * stride_x
// elements; lda, ldb, ldc are the row lengths (elements) of the stored
// matrices, so a matrix may be a column block of a wider row-major tensor.
absl::Status LaunchGemmStridedBatched(cublasHandle_t handle, bool trans_a, bool trans_b, int m,
                                      int n, int k, float alpha, const void* a, int lda,
                                      int64_t stride_a, const void* b, int ldb, int64_t stride_b,
                                      DType ab_dtype, float beta, void* c, int ldc,
                                      int64_t stride_c, DType c_dtype, int batch);

// y (n) = scale * (y + x (n)) in fp32, rounded once to y_dtype.
absl::Status LaunchAddScaled(const void* x, DType x_dtype, float scale, void* y, DType y_dtype,
                             int64_t n, cudaStream_t stream);
absl::Status LaunchAddBias(const void* bias, DType bias_dtype, void* y, DType y_dtype, int64_t rows,
                           int64_t cols, cudaStream_t stream);
// partials: ColumnSumSlabs(rows, cols) * cols floats of scratch when that
// count is > 1, else unused (may be nullptr).
absl::Status LaunchBiasGrad(const void* dy, DType dy_dtype, int64_t rows, int64_t cols, float beta,
                            void* dbias, DType dbias_dtype, float* partials, cudaStream_t stream);

absl::Status LaunchActivationForward(Activation act, const void* x, void* y, DType dtype, int64_t n,
                                     cudaStream_t stream);
absl::Status LaunchActivationBackward(Activation act, const void* x, const void* dy, void* dx,
                                      DType dtype, int64_t n, cudaStream_t stream);
// The same with dy (n) F32 (dx may be dy when dtype is F32): a GEMM's
// unrounded sums times the derivative, rounded once to dtype.
absl::Status LaunchActivationBackwardF32Grad(Activation act, const void* x, const float* dy,
                                             void* dx, DType dtype, int64_t n, cudaStream_t stream);

// GemmBiasActivation's epilogue after a GEMM into fp32 (gemm_bias_activation.cu):
// p = acc + bias (cols) in fp32; pre = p (act GELUTanh only) and c =
// act(p), each (rows, cols) of dtype, rounded once. For F32, acc may be c
// (kNone) or pre (GELUTanh).
absl::Status LaunchBiasActivation(const float* acc, const void* bias, GemmActivation act, void* pre,
                                  void* c, DType dtype, int64_t rows, int64_t cols,
                                  cudaStream_t stream);

// Fused causal self-attention (attention_forward.cu, attention_backward.cu,
// attention_backward_mma.cu, attention_flash_forward.cu,
// attention_flash_backward.cu); every float operand of dtype. qkv (batch,
// seq, 3 channels), out and dout (batch, seq, channels), lse (batch, heads,
// seq) F32.
struct AttentionKernelConfig {
  // The device's opt-in dynamic shared memory per block: a tensor-core
  // kernel needing more is never configured nor launched (the generic
  // kernels run instead).
  int max_dynamic_smem = 0;
  // Which tensor-core kernels take fp16/bf16 calls with D = 64 or 128:
  // false, the register-tile ones (mma.sync, S, P and the accumulators in
  // registers); true, the wmma ones that stage S, P and O through shared
  // memory. Both meet the same contract; tests compare them.
  bool wmma_kernels = false;
};
// Raise the tensor-core kernels' dynamic shared memory limits on the
// current device; once, at backend creation (cudaFuncSetAttribute is not
// for the step).
absl::Status ConfigureAttentionForward(const AttentionKernelConfig& config);
absl::Status ConfigureAttentionBackward(const AttentionKernelConfig& config);
// options: the score scale and sliding window (kernels/attention_params.h);
// a windowed call takes the generic kernels.
absl::Status LaunchAttentionForward(const void* qkv, DType dtype, int64_t batch, int64_t seq,
                                    int64_t channels, int64_t heads,
                                    const AttentionOptions& options, void* out, float* lse,
                                    const AttentionKernelConfig& config, cudaStream_t stream);
// The decode step against a KV cache (attention_decode.cu): q and out
// (seqs, heads head_dim), k_cache and v_cache (seqs, t_max, kv_heads
// head_dim), every float operand of dtype; positions (seqs) of pos_dtype
// (I32 or I64) on the device, read by the kernel (a position outside
// [0, t_max) gives NaN rows). The forward kernel whose order it follows is
// chosen as LaunchAttentionForward chooses with the same config.
absl::Status LaunchAttentionDecode(const void* q, const void* k_cache, const void* v_cache,
                                   const void* positions, DType dtype, DType pos_dtype,
                                   int64_t seqs, int64_t t_max, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, const AttentionOptions& options, void* out,
                                   const AttentionKernelConfig& config, cudaStream_t stream);
// delta: batch * heads * seq floats of scratch (Delta of the contract).
absl::Status LaunchAttentionBackward(const void* qkv, const void* out, const void* dout,
                                     const float* lse, DType dtype, int64_t batch, int64_t seq,
                                     int64_t channels, int64_t heads,
                                     const AttentionOptions& options, void* dqkv, float* delta,
                                     const AttentionKernelConfig& config, cudaStream_t stream);

#if defined(__CUDACC__)
#define AMPD_NORM_ROWS_HD __host__ __device__
#else
#define AMPD_NORM_ROWS_HD
#endif
// Where the norms' rows of `cols` elements lie in x (and y, dy, dx alike):
// row i starts at element (i / per_row) * stride + offset + (i % per_row)
// * cols; its statistics sit at index i. A plain (rows, cols) tensor is
// Plain(cols); the heads of a per-head RMSNorm (HeadRmsNorm) are per_row
// heads of D = cols columns from column offset of rows of stride W, their
// statistics (R, heads).
struct NormRows {
  int64_t per_row = 1;
  int64_t stride = 0;
  int64_t offset = 0;
  static NormRows Plain(int64_t cols) { return {1, cols, 0}; }
  AMPD_NORM_ROWS_HD int64_t Start(int64_t i, int64_t cols) const {
    // A plain tensor's rows skip the 64-bit division (the column-sum
    // kernels ask once per row per thread).
    if (per_row == 1) return i * stride + offset;
    return (i / per_row) * stride + offset + (i % per_row) * cols;
  }
  // Every row starts at a multiple of n elements (given cols % n == 0).
  bool StartsAligned(int64_t n) const { return stride % n == 0 && offset % n == 0; }
};
#undef AMPD_NORM_ROWS_HD

// LayerNorm, or RMSNorm where mean is nullptr (no centring, no beta), over
// `rows` rows of `cols` at `at`.
// gamma_offset: the scale is gamma_offset + gamma in fp32 (Gemma's RMSNorm:
// 1); 0 uses gamma itself.
absl::Status LaunchLayerNormForward(const void* x, DType dtype, const void* gamma,
                                    float gamma_offset, const void* beta, DType param_dtype,
                                    int64_t rows, int64_t cols, float eps, void* y, float* mean,
                                    float* rstd, cudaStream_t stream, NormRows at);
// partials: 2 * ColumnSumSlabs(rows, cols) * cols floats of scratch when
// that count is > 1 and dgamma or dbeta is given, else unused. mean nullptr:
// RMSNorm's backward (mean 0, no sum(g) term; dbeta nullptr). dgamma and
// dbeta both nullptr: only the dx kernel runs (a frozen RMSNorm weight, a
// LayerNorm without affine). Rows at `at`, as the forward's.
absl::Status LaunchLayerNormBackward(const void* x, DType dtype, const void* gamma,
                                     DType gamma_dtype, float gamma_offset, const float* mean,
                                     const float* rstd, const void* dy, void* dx, void* dgamma,
                                     DType dgamma_dtype, void* dbeta, DType dbeta_dtype,
                                     int64_t rows, int64_t cols, float* partials,
                                     cudaStream_t stream, NormRows at);

// src and dst: the first byte of the block in row 0 of each; rows of
// src_stride and dst_stride bytes; block_bytes copied per row (all
// multiples of elem_bytes, which is 1, 2, 4 or 8). The regions must not
// overlap.
absl::Status LaunchCopyColumns(const void* src, int64_t src_stride, void* dst, int64_t dst_stride,
                               int64_t rows, int64_t block_bytes, int64_t elem_bytes,
                               cudaStream_t stream);
// The decode step's K/V rows into a layer's caches (WriteKvRows): rows
// (seqs, row_bytes / elem_bytes) of fused rows; the key block starts at
// byte k_byte of a row, the value block at v_byte, each width_bytes wide;
// caches (seqs, t_max, width); positions (seqs) of pos_dtype on the
// device (a sequence whose position is outside [0, t_max) is skipped).
absl::Status LaunchWriteKvRows(const void* rows, int64_t row_bytes, int64_t k_byte, int64_t v_byte,
                               const void* positions, DType pos_dtype, int64_t seqs, int64_t t_max,
                               int64_t width_bytes, int64_t elem_bytes, void* k_cache,
                               void* v_cache, cudaStream_t stream);
// One token per row of logits (rows, vocab) of dtype (SampleTokens): live
// and tokens (rows) I64 on the device, keys (rows, 2) I64 on the device or
// nullptr (params.keys' data; params.keys itself is not read), log_kept
// (rows) F32 on the device or nullptr (params.log_kept's data); one block
// per row.
absl::Status LaunchSampleTokens(const void* logits, DType dtype, int64_t rows, int64_t vocab,
                                const int64_t* live, const int64_t* keys,
                                const SampleParams& params, int64_t* tokens, float* log_kept,
                                cudaStream_t stream);
// expand: in (rows, (heads + 2 kv_heads) head_dim) -> out (rows, 3 heads
// head_dim); else the reduction from out's shape back to in's.
absl::Status LaunchKvHeads(bool expand, const void* in, void* out, DType dtype, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);
// x (batch, seq, width) in place; positions (batch * seq) of position_dtype
// or nullptr (position = t).
absl::Status LaunchRope(void* x, DType dtype, int64_t batch, int64_t seq, int64_t width,
                        int64_t heads, int64_t head_dim, const float* inv_freq,
                        const void* positions, DType position_dtype, bool inverse,
                        cudaStream_t stream);
// The gated MLP's act(gate) * up and its backward (gated_mul.cu).
absl::Status LaunchGatedMulForward(GluActivation act, const void* gate, const void* up, void* y,
                                   DType dtype, int64_t n, cudaStream_t stream);
absl::Status LaunchGatedMulBackward(GluActivation act, const void* gate, const void* up,
                                    const void* dy, void* dgate, void* dup, DType dtype, int64_t n,
                                    cudaStream_t stream);

// out = table[ids] * scale (scale 1: the bytes; else in fp32, rounded once).
absl::Status LaunchEmbeddingForward(const void* ids, DType id_dtype, int64_t n, const void* table,
                                    DType dtype, int64_t vocab, int64_t cols, float scale,
                                    void* out, int* error_flags, cudaStream_t stream);
// dtable (vocab, cols) += scatter of dout (n, cols) * scale, deterministic:
// each touched row becomes round(old + (c1 + c2 + ...)) with its
// contributions (round(dout * scale) in dout's dtype) summed in fp32 in
// batch order, as the CPU oracle does. Needs `scratch` of
// EmbeddingBackwardScratchBytes(n, vocab) bytes (256-byte aligned).
absl::Status EmbeddingBackwardScratchBytes(int64_t n, int64_t vocab, size_t* bytes);
absl::Status LaunchEmbeddingBackward(const void* ids, DType id_dtype, int64_t n, const void* dout,
                                     DType dout_dtype, float scale, void* dtable,
                                     DType dtable_dtype, int64_t vocab, int64_t cols, void* scratch,
                                     size_t scratch_bytes, int* error_flags, cudaStream_t stream);

// partials: kMaxReductionBlocks floats of scratch.
absl::Status LaunchMseLoss(const void* pred, DType dtype, const float* target, int64_t n,
                           float multiplier, float grad_scale, float* loss, void* dpred,
                           float* partials, cudaStream_t stream);
absl::Status LaunchCrossEntropy(const void* logits, DType dtype, const void* labels,
                                DType label_dtype, int64_t rows, int64_t vocab, float multiplier,
                                float grad_scale, float* loss, void* dlogits, float* partials,
                                int* error_flags, cudaStream_t stream);

// loss (1) += the sum of loss_scale * each kept row's loss, added in a
// fixed order through partials ((kMaxReductionBlocks) F32); dlogits
// (may be logits) written; a bad label sets kErrorCrossEntropyChunkLabel.
// With token-loss terms (TokenLossTerms, pointers to device (rows) F32),
// each kept row's term replaces its loss and its coefficient scales its
// gradient; terms.logprobs, when given, gets each row's logp.
absl::Status LaunchCrossEntropyChunk(const void* logits, DType dtype, const void* labels,
                                     DType label_dtype, int64_t rows, int64_t vocab,
                                     int64_t ignore_index, const TokenLossTerms& terms,
                                     float loss_scale, float grad_scale, float* loss, void* dlogits,
                                     float* partials, int* error_flags, cudaStream_t stream);
// logprobs (rows) F32 = the log-probs LaunchCrossEntropyChunk writes to
// terms.logprobs at `temperature` (the same row engine, no gradient, no
// loss; partials as above, scratch); a bad label sets
// kErrorCrossEntropyChunkLabel and its row gets 0.
absl::Status LaunchLabelLogprobs(const void* logits, DType dtype, const void* labels,
                                 DType label_dtype, int64_t rows, int64_t vocab,
                                 int64_t ignore_index, float temperature, float* logprobs,
                                 float* partials, int* error_flags, cudaStream_t stream);

// norm_sq (if not null) += sum of (g * inv_scale)^2, two-stage: each block
// writes its partial to `partials` (UnscaleAndCheckBlocks(grads, count)
// floats of scratch; unused when norm_sq is null), then one block adds them
// in a fixed order, so the norm is bitwise reproducible. max_abs (if not
// null) = max(max_abs, max |g * inv_scale|), NaNs ignored: each block's max
// goes in with one atomicMax on the float's bits (monotonic for values >= 0),
// which is exact in any order.
int64_t UnscaleAndCheckBlocks(const GradSpan* grads, int count);
absl::Status LaunchUnscaleAndCheck(const GradSpan* grads, int count, float inv_scale, bool in_place,
                                   float* found_inf, float* norm_sq, float* partials,
                                   float* max_abs, cudaStream_t stream);
absl::Status LaunchAdamUpdate(const ParamSpan* params, int count, const AdamArgs& args,
                              const TransformArgs& transform, cudaStream_t stream);
absl::Status LaunchSgdUpdate(const ParamSpan* params, int count, const SgdArgs& args,
                             const TransformArgs& transform, cudaStream_t stream);
// out (args.count + 1) F32 on the device: out[i] = *args.src[i], then the
// error word's bits (read back with a bit cast, not a conversion).
absl::Status LaunchGatherScalars(const GatherScalarsArgs& args, float* out, cudaStream_t stream);

// counts: kGradHistogramBins int64 on the device, incremented.
absl::Status LaunchGradHistogram(const GradSpan* grads, int count, int64_t* counts,
                                 cudaStream_t stream);

}  // namespace ampd::kernels::cuda
