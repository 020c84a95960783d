// Backend: every op ampd runs, declared once and implemented per device
// (kernels/cpu is the bit-faithful reference, kernels/cuda the GPU).
//
// Conventions every implementation follows, so that the CPU backend can be
// the oracle the others are compared with:
// - Tensors are row-major. Float math is done in fp32 and each result is
//   rounded once, round-to-nearest-even, to the output tensor's dtype.
// - Ops check dtypes and shapes and return InvalidArgument naming the operand;
//   they never abort. Device errors become Internal with file and line.
// - Scalars the step depends on (loss, found_inf, the squared grad norm) stay
//   in one-element F32 tensors on the device, so the optimizer can decide to
//   skip without a host round trip; the engine reads them once per step.
// - Ops run in order on the backend's stream; CopyToHost and ReadScalars
//   wait for them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/grad_histogram.h"
#include "kernels/attention_params.h"
#include "kernels/tensor.h"
#include "kernels/token_loss.h"

namespace ampd::kernels {

// kGELU is the exact form; kGELUTanh the tanh approximation GPT-2 was
// trained with (see ActivationForward).
enum class Activation : uint8_t { kReLU, kGELU, kTanh, kGELUTanh };

// What a Linear layer's GEMM applies in its epilogue (GemmBiasActivation,
// GemmActivationBackward): nothing, or GELU's tanh form (GPT-2's MLP; the
// formula of Activation::kGELUTanh).
enum class GemmActivation : uint8_t { kNone, kGELUTanh };

// The gate's activation of a gated MLP (GatedMulForward): SiLU (SwiGLU,
// Llama/Qwen) or GELU's tanh form (GeGLU, Gemma's gelu_pytorch_tanh).
enum class GluActivation : uint8_t { kSiLU, kGELUTanh };

// The operand of a weight-gradient GEMM that holds the output gradient dy,
// whose sum over K is the bias gradient (GemmBiasGrad).
enum class BiasGradOf : uint8_t { kA, kB };

// A device-to-host copy that rides along with ReadBack's scalars.
struct HostCopy {
  const Tensor* src = nullptr;  // any dtype
  void* dst = nullptr;          // bytes of host memory
  size_t bytes = 0;             // == src->nbytes()
};

// One parameter as the fused optimizer sees it.
struct ParamRef {
  Tensor* master;      // F32, the weights the optimizer updates
  Tensor* working;     // F16/BF16 copy recast after the update; nullptr for fp32 jobs
  const Tensor* grad;  // scaled gradient, working dtype (F32 for fp32 jobs), master's shape
  Tensor* state0;      // F32: Adam's exp_avg (m) or SGD's momentum; nullptr for plain SGD
  Tensor* state1;      // F32: Adam's exp_avg_sq (v); nullptr for SGD
};

// What CrossEntropyChunk's kept rows are trained on beyond plain token
// cross-entropy (kernels/token_loss.h has the formulas). Per-row inputs are
// (N) F32 on the backend's device, N the chunk's rows; an input the kind
// does not read must be null.
struct TokenLossTerms {
  TokenLossKind kind = TokenLossKind::kCrossEntropy;
  const Tensor* weights = nullptr;            // kCrossEntropy, optional (null: every weight 1)
  const Tensor* advantages = nullptr;         // every kind but kCrossEntropy: required
  const Tensor* sampling_logprobs = nullptr;  // every kind but kCrossEntropy: required
  // kPpo, kCispo: r is clipped to [clip_low, clip_high] (kPpo: 0 <= clip_low
  // <= 1 <= clip_high; kCispo: 0 <= clip_low <= clip_high; both finite).
  float clip_low = 0.8f;
  float clip_high = 1.2f;
  float beta = 0.05f;  // kDro: the quadratic penalty's weight, finite and >= 0
  // Finite and > 0: every kept row's logp is log_softmax(logits / temperature)
  // (each logit divided in fp32, as PyTorch's logits / T), a sampler's
  // log-probs at its temperature; the gradient carries the 1 / temperature
  // of the division. 1 (the default) divides nothing: the bits of a call
  // without it.
  float temperature = 1.0f;
  Tensor* logprobs = nullptr;  // optional output (N) F32: each kept row's logp, 0 when ignored
  // Optional output (N) F32: what each kept row adds to loss (loss_scale *
  // its term), 0 when ignored.
  Tensor* token_losses = nullptr;
};

enum class RandomDistribution : uint8_t { kUniform, kNormal };

// A counter-based random fill (Philox4x32-10, kernels/philox.h): element i of
// dst is draw offset + i of stream `stream` under key `seed`, a pure function
// of those three numbers, so every backend writes the same bits whatever its
// thread count, and a tensor can be filled in pieces (offset). Uniform draw d
// comes from word d % 4 of Philox block d / 4, normal draw d from half
// d % 2 of block d / 2 (Box-Muller).
struct RandomFill {
  RandomDistribution distribution = RandomDistribution::kUniform;
  float lo = 0.0f;  // uniform: values in [lo, hi), lo <= hi, both finite; lo == hi gives lo
  float hi = 1.0f;
  float mean = 0.0f;  // normal: N(mean, stddev^2), both finite, stddev >= 0
  float stddev = 1.0f;
  uint64_t seed = 0;
  uint64_t stream = 0;  // one per tensor, so tensors of one seed are independent
  uint64_t offset = 0;  // offset + dst.numel() must not exceed 2^64 - 1
};

// PyTorch's torch.optim.Adam / AdamW formulas (eps outside the square root,
// bias correction; AdamW decays the weights directly, Adam adds wd * w to g).
struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  // true: AdamW, false: Adam
};

// PyTorch's torch.optim.SGD formulas.
struct SgdConfig {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// What the fused update does with the gradient before the optimizer math:
//   g = grad * inv_scale * clip_coef,  clip_coef = min(1, max_norm / (sqrt(norm_sq) + 1e-6))
// (torch.nn.utils.clip_grad_norm_'s coefficient) when norm_sq is given and
// max_grad_norm > 0, and the whole update (weights, state, working copy) is
// skipped when found_inf[0] != 0. Both scalars are read on the device.
struct GradTransform {
  float inv_scale = 1.0f;
  const Tensor* found_inf = nullptr;  // (1) F32, required
  const Tensor* norm_sq = nullptr;    // (1) F32 squared L2 norm of unscaled grads, or nullptr
  float max_grad_norm = 0.0f;         // <= 0: no clipping
};

// A sampler's per-token draw (Backend::SampleTokens): softmax(logits /
// temperature) over the top_k most likely tokens (0, or any top_k >= V:
// all), then the smallest set of the most likely whose probability reaches
// top_p; row r of a step draws with u = philox::Unit53 of Philox block
// (key, stream, counter = step) (kernels/philox.h), where (key, stream) is
// row r of `keys` when given, else (seed, r).
struct SampleParams {
  float temperature = 1.0f;  // finite, >= 0; 0: the most likely token
  int64_t top_k = 0;         // >= 0; 0 or >= V: no top-k truncation
  float top_p = 1.0f;        // in (0, 1]; 1: no nucleus truncation
  uint64_t seed = 0;
  uint64_t step = 0;
  int64_t ignore_index = -100;  // the token of a row that is not live
  // Or nullptr: (S, 2) I64 on the device, row r's Philox key and stream
  // (each read as the uint64 of its bits), so that a row's draws need not
  // depend on its position in the call.
  const Tensor* keys = nullptr;
  // Or nullptr: (S) F32 on the device, each row's log of the kept mass
  // (Backend::SampleTokens).
  Tensor* log_kept = nullptr;
};

// What a step's ops run on beyond their tensors, for Backend::ScratchBytes
// (model::StepScratchExtents gives them for a model and a batch shape).
struct ScratchExtents {
  DType dtype = DType::kF32;  // the GEMMs' operand dtype (the working dtype)
  int64_t gemm_a = 0;         // the most elements of a GEMM's first operand
  int64_t gemm_b = 0;         // ... of its second operand
  int64_t gemm_c = 0;         // ... of its result
  // The most elements of a fused GEMM's result, whose fp32 sums a backend
  // may hold: GemmBiasActivation's (a forward's), GemmActivationBackward's
  // (a backward's; 0 for a call without one).
  int64_t bias_activation_c = 0;
  int64_t activation_backward_c = 0;
  int64_t attention_seq = 0;  // T of a fused attention (0: none)
  int64_t head_dim = 0;       // its head size
  int64_t classes = 0;        // V of a cross-entropy (0: none)
  int64_t rows = 0;           // the loss's rows
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual std::string name() const = 0;

  // The queue a collective library that runs beside the backend's own ops
  // (NCCL) must enqueue on: a CUDA backend's cudaStream_t and device. A host
  // backend has none (stream nullptr): its tensors are host memory and its
  // ops are done when they return.
  struct NativeStream {
    void* stream = nullptr;
    int device = -1;
  };
  virtual NativeStream native_stream() { return {}; }

  // ---- memory -------------------------------------------------------------
  // Contents are unspecified; Fill before reading.
  virtual absl::StatusOr<Tensor> Allocate(DType dtype, const Shape& shape) = 0;
  // Copies bytes == dst.nbytes() from host memory into dst. The copy may
  // only be enqueued (CUDA: an async copy on the backend's stream, which for
  // pinned src reads it later): src must stay valid and unchanged until the
  // next synchronising call (Synchronize, CopyToHost or ReadScalars), or
  // the caller synchronises itself before reusing it.
  virtual absl::Status CopyFromHost(const void* src, size_t bytes, Tensor& dst) = 0;
  // Waits for queued work, then copies dst.nbytes() == bytes out.
  virtual absl::Status CopyToHost(const Tensor& src, void* dst, size_t bytes) = 0;
  // Same dtype and element count.
  virtual absl::Status Copy(const Tensor& src, Tensor& dst) = 0;
  // A block of columns from one matrix into another: src (R, Cs) and dst
  // (R, Cd), both 2-D, one dtype (any: a byte copy, no rounding), the same
  // R; dst[:, dst_col : dst_col + cols] = src[:, src_col : src_col + cols],
  // every other element of dst untouched. cols == 0 copies nothing. src and
  // dst must not share bytes (a copy between two column blocks of one
  // tensor goes through a second tensor). Why: the decoder's fused q|k|v
  // rows hold q, k and v as column blocks, and LoRA adapters on them need
  // blocks copied in and out (a block-diagonal adapter matrix assembled
  // from the per-projection adapters, the diagonal blocks of its gradient
  // taken back out); the backend has no strided GEMM that could read a
  // block in place.
  virtual absl::Status CopyColumns(const Tensor& src, int64_t src_col, int64_t cols, Tensor& dst,
                                   int64_t dst_col) = 0;
  virtual absl::Status Fill(Tensor& dst, float value) = 0;  // float dtypes
  // Fill over a list: every element of every dsts[i] (float dtypes, any mix,
  // none null) set to value rounded once to its dtype, in one pass over the
  // list (CUDA: one launch per kFillTensorsPerLaunch tensors, 128), for the
  // gradients a step zeroes at its start. InvalidArgument naming dsts[i],
  // with nothing written.
  virtual absl::Status FillTensors(absl::Span<Tensor* const> dsts, float value) = 0;
  // dst F32 filled per RandomFill; used to initialise weights on the device.
  virtual absl::Status FillRandom(Tensor& dst, const RandomFill& fill) = 0;
  // Between float dtypes, element counts equal; rounds RNE to dst's dtype.
  virtual absl::Status Cast(const Tensor& src, Tensor& dst) = 0;
  // Blocks until every queued op has finished.
  virtual absl::Status Synchronize() = 0;
  // The step's one host read: waits for queued work once, then out[i] =
  // *scalars[i] and each copy's src bytes land in its dst. Each scalars[i]
  // is a one-element F32 tensor, out.size() == scalars.size(), and each
  // copy's bytes == src->nbytes(); otherwise InvalidArgument naming
  // scalars[i], out or copies[i], with nothing read. Reading k scalars and
  // copies costs one round trip, not k. A device-side error raised by an
  // earlier op (a bad id or label) is reported here, after out and the
  // copies were written.
  virtual absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                                absl::Span<const HostCopy> copies) = 0;
  absl::Status ReadScalars(absl::Span<const Tensor* const> scalars, absl::Span<float> out) {
    return ReadBack(scalars, out, {});
  }
  // Bytes this backend holds in live tensors (for the memory gauge/limits).
  virtual int64_t BytesInUse() const = 0;
  // Tensors Allocate has handed out so far (successful calls): a warm
  // training step, whose buffers are cached, adds none.
  virtual int64_t AllocationCount() const = 0;
  // Memory the device has in all (host RAM for the CPU backend, the GPU's
  // global memory for CUDA); 0 when it cannot be read.
  virtual int64_t MemoryCapacityBytes() const = 0;
  // Bytes the backend holds beyond the tensors it is given to run a step of
  // these extents whose workspace tensors total `tensor_bytes`: the ops'
  // own scratch, kept between steps for reuse until ReleaseScratch, and the
  // rounding its allocator adds to those tensors. Admission adds it to the
  // step's workspace estimate. The CPU oracle widens 16-bit GEMM operands
  // and results to fp32 and sums fused GEMMs in fp32 (per backend), holds
  // per-thread attention and cross-entropy rows, and places large tensors
  // on 2 MiB pages; a backend with none of that returns 0.
  virtual int64_t ScratchBytes(const ScratchExtents& extents, int64_t tensor_bytes) const {
    (void)extents;
    (void)tensor_bytes;
    return 0;
  }
  // Frees the scratch ScratchBytes counts (an idle job's release).
  virtual void ReleaseScratch() {}

  // ---- modes ----------------------------------------------------------------
  // Batch-invariant GEMMs, a mode of this backend instance (each job owns
  // its backend), off until set. When on, every GEMM (Gemm and the fused
  // Gemm* ops below) computes each output element with one fixed summation
  // order over K that depends on neither M, nor the row's position in the
  // call, nor the thread count: a row's bits are the same whether it is
  // computed alone or among any other rows, so a sequence's log-probs
  // sampled alone equal those its training forward computed in a batch.
  // Everything else the GEMM contracts say still holds (fp32 accumulation,
  // alpha and beta, one rounding to c's dtype). Off: the backend picks its
  // fastest GEMM, whose order may change with the shape (OpenBLAS takes a
  // GEMV path for M == 1 and other kernels for other small M; cuBLAS and
  // cuBLASLt pick a kernel and a split-K by shape). The CPU backend's order
  // is in kernels/cpu/gemm_invariant.cc; CUDA's in
  // kernels/cuda/gemm_invariant.cu (F32 the same order as the CPU's, bit
  // for bit; F16/BF16 tensor-core steps of 16 over K, so equal to the CPU
  // within fp32 rounding), where the Linear ops also give up their fused
  // cuBLASLt epilogues for the separate, row-local kernels. Setting it
  // allocates, synchronizes and queries nothing. Unimplemented where the
  // backend cannot pin its order (turning it off is then a no-op that
  // succeeds: the mode was never on).
  virtual absl::Status SetBatchInvariant(bool on) {
    if (!on) return absl::OkStatus();
    return absl::UnimplementedError(
        absl::StrCat("batch_invariant: batch-invariant GEMMs are not available on ", name()));
  }

  // ---- dense algebra ------------------------------------------------------
  // y = scale * (y + x) elementwise, same shape; x and y any float dtypes
  // (they may differ). The sum and the product are formed in fp32 and
  // rounded once to y's dtype: for a power-of-two scale the product is
  // exact, so a 16-bit y gets the scaled sum's one rounding, and a sum
  // that 16 bits would flush or overflow unscaled keeps its bits. Used for
  // residual connections, for summing per-micro-batch losses on the device,
  // and where a GPT's backward carries the residual gradient from one
  // block's loss scale to the next's (per-layer scales) in the same pass.
  virtual absl::Status AddScaled(const Tensor& x, float scale, Tensor& y) = 0;
  // y += x: AddScaled with scale 1 (bit for bit a plain sum).
  absl::Status Add(const Tensor& x, Tensor& y) { return AddScaled(x, 1.0f, y); }
  // c = alpha * op(a) @ op(b) + beta * c, op(x) = x^T when trans_x.
  // a, b: 2-D, both F32, both F16 or both BF16; products are accumulated in
  // fp32 and the sum rounded once to c's dtype (F32 or a's dtype). (CUDA
  // computes a 16-bit c with beta == 1 as an fp32 GEMM into scratch plus
  // one add: cuBLAS's own beta == 1 kernels round twice.)
  // op(a): (M, K), op(b): (K, N), c: (M, N).
  virtual absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a,
                            const Tensor& b, float beta, Tensor& c) = 0;
  // y (N, C) += bias (C), broadcast over rows, in fp32 then rounded to y's dtype.
  virtual absl::Status AddBias(const Tensor& bias, Tensor& y) = 0;
  // dbias (C) = sum over rows of dy (N, C) + beta * dbias, accumulated in fp32.
  virtual absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) = 0;

  // ---- Linear layers: GEMMs with their epilogues ------------------------------
  // A Linear's bias, its activation and its bias gradient ride in the GEMM
  // instead of separate passes over the (M, N) output. op(x) = x^T when
  // trans_x; op(a): (M, K), op(b): (K, N). Products are accumulated in fp32
  // (never TF32 for F32 operands) and every stored element is rounded once,
  // round-to-nearest-even, to its tensor's dtype.
  //
  // c (M, N) = act(p) rounded once, p = op(a) @ op(b) + bias: the bias (N)
  // is added to each row's fp32 sums before any rounding, and the
  // activation is evaluated on that fp32 p (not on a rounded copy).
  // pre (M, N) = p rounded once: the pre-activation the backward's
  // derivative reads; required when act is kGELUTanh, nullptr when kNone.
  // bias may be nullptr (no bias). a, b, bias, c and pre share one float
  // dtype; c and pre overlap no operand and not each other.
  // CUDA runs this as one cuBLASLt matmul with a BIAS or GELU_AUX_BIAS
  // epilogue where cuBLASLt has an algorithm for the call, else as a GEMM
  // into fp32 scratch and one epilogue kernel; for F32 operands the GELU is
  // always the backend's own kernel (the formula of ActivationForward), for
  // F16/BF16 cuBLASLt's epilogue evaluates it with its own fp32 tanh, so
  // the two may differ from the CPU by an ulp of the dtype. cuBLASLt does
  // not promise where its epilogue rounds: on an H100 (cuBLAS 13.0) some
  // of its kernels rounded a 16-bit output's sum to the dtype before
  // adding the bias, so CUDA may differ from the oracle by that rounding
  // too (half an ulp of |op(a) @ op(b)|), where the bias cancels the sum.
  virtual absl::Status GemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a,
                                          const Tensor& b, const Tensor* bias, GemmActivation act,
                                          Tensor& c, Tensor* pre) = 0;
  // A Linear's weight and bias gradients in one call:
  //   c = op(a) @ op(b) + beta * c    (Gemm with alpha 1; c F32 or a's dtype)
  //   dbias = (fp32 sum over K of the dy operand) + beta * dbias, rounded once
  // with the dy operand stored (K, width), i.e. BiasGrad(dy, beta, dbias):
  //   of == kB: dy = b, trans_b false, dbias (N)
  //   of == kA: dy = a, trans_a true,  dbias (M)
  // dbias any float dtype. Beta 1 accumulates micro-batches, one rounding
  // per element. CUDA fuses the sum into the GEMM (cuBLASLt BGRADA/BGRADB)
  // where cuBLASLt has an algorithm and the contract's one rounding can be
  // kept, else runs Gemm then BiasGrad.
  virtual absl::Status GemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                    float beta, Tensor& c, BiasGradOf of, Tensor& dbias) = 0;
  // The input gradient through a Linear and its activation:
  //   c (M, N) = g * act'(pre) rounded once, g = alpha * op(a) @ op(b) in fp32
  // with act' the derivative ActivationBackward uses (kGELUTanh's), read at
  // the stored pre (M, N); kNone: c = g rounded (pre nullptr). a, b, c and
  // pre share one float dtype; c overlaps no operand. CUDA uses cuBLASLt's
  // DGELU epilogue for F16/BF16 where it has an algorithm, else a GEMM into
  // fp32 scratch and one kernel (always for F32, as above).
  virtual absl::Status GemmActivationBackward(bool trans_a, bool trans_b, float alpha,
                                              const Tensor& a, const Tensor& b, GemmActivation act,
                                              const Tensor* pre, Tensor& c) = 0;

  // ---- activations (same dtype and shape in and out) ----------------------
  // GELU is the exact form x Phi(x), PyTorch's default (approximate='none'),
  // with Phi(x) = 0.5 erfc(-x / sqrt 2): accurate in the negative tail,
  // where 0.5 (1 + erf(x / sqrt 2)) cancels.
  // GELUTanh is PyTorch's approximate='tanh' (GPT-2's gelu_new), in its
  // operation order: u = sqrt(2/pi) (x + 0.044715 x^3), y = 0.5 x (1 + tanh u);
  // the backward is its exact derivative
  //   0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
  virtual absl::Status ActivationForward(Activation act, const Tensor& x, Tensor& y) = 0;
  // dx = dy * act'(x); x is the forward input.
  virtual absl::Status ActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                          Tensor& dx) = 0;

  // ---- causal self-attention --------------------------------------------------
  // Fused ("flash") attention: nothing of size T x T is ever stored. With
  // C = qkv.dim(2) / 3, D = C / n_head (n_head must divide C), scale =
  // AttentionScaleOf(options, D) and the window W = options.window
  // (kernels/attention_params.h: 0, or a sliding window of W keys), query
  // t sees keys first(t) .. t with first(t) = AttentionFirstKey(t, W) (0
  // without a window). Each query row t of head h (batch row b) is
  // computed as follows; every step is fixed, so a backend is reproducible
  // bit for bit run to run, and backends differ only in the order of fp32
  // sums (the dot products, the sums inside one key block) and in exp/log's
  // last bits.
  //   Keys are visited in blocks of kAttentionKeyBlock (Bk) keys whose
  //   boundaries are absolute positions (block j holds keys [j Bk, (j+1) Bk)),
  //   in increasing j, from the block of the first visible key, first(t) /
  //   Bk, up to and including the query's own block t / Bk; keys outside
  //   first(t) .. t inside those blocks are masked (they add nothing).
  //   Blocks before the first's or after the query's are never visited (a
  //   backend that runs a whole tile of queries through a block one of them
  //   does not see adds exact zeros for that row and leaves its m, l and
  //   acc as they were).
  //   Per block, in fp32 (nothing below is rounded to the working dtype
  //   unless said):
  //     S_s   = (q_t . k_s) * scale            the dot product in fp32, not rounded
  //     m'    = max(m, max_s S_s)              m starts at -inf
  //     P_s   = exp(S_s - m')
  //     alpha = exp(m - m')
  //     l     = l * alpha + sum_s P_s          l starts at 0; the fp32 P
  //     acc_d = acc_d * alpha + sum_s round(P_s) v_s,d
  //   where round() rounds P to the working dtype, as the tensor-core
  //   product P.V needs its operands in it (a no-op for F32), and the
  //   block's products are added onto the rescaled acc in fp32. (The CPU
  //   oracle's order: dot products over the channels in order, the block's
  //   P summed in two sequential halves of Bk / 2 keys, then added; products
  //   added in key order. CUDA's register-tile kernels: dot products and
  //   the block's products in the tensor cores' order, the block's P as
  //   four partial sums over interleaved keys (keys j with j / 2 % 4 = i,
  //   in order), added (0 + 1) + (2 + 3).) Then, once:
  //     out_t,d = acc_d / l  rounded to the working dtype;  lse_t = m + log(l).
  // A row's result depends only on q_t and keys first(t) .. t: not on T, B,
  // the other rows, nor how many queries a call holds. The first t rows of a
  // call at sequence length t are, bit for bit, rows 0 .. t-1 of a call at
  // any longer T with the same prefix (what a KV-cached decode relies on),
  // up to the sign of an exactly zero output. A non-finite v of a key
  // inside a query's last block may reach that query even when the key is
  // after it (0 * inf in the product); finite inputs never do.
  //
  // qkv (B, T, 3C): [q | k | v] along the last dim (Hugging Face GPT-2's
  //   c_attn output); head h of each is columns h*D .. h*D + D - 1.
  // out (B, T, C) qkv's dtype, written: head h in columns h*D ...
  // lse (B, n_head, T) F32, written: each row's log-sum-exp of S, saved for
  //   the backward.
  // out and lse must not overlap qkv or each other. options.window >= 0 and
  // a set options.scale finite and > 0, else InvalidArgument.
  virtual absl::Status AttentionForward(const Tensor& qkv, int64_t n_head,
                                        const AttentionOptions& options, Tensor& out,
                                        Tensor& lse) = 0;
  // Plain causal attention with the scale 1/sqrt(D) (GPT-2, Llama, Qwen).
  absl::Status AttentionForward(const Tensor& qkv, int64_t n_head, Tensor& out, Tensor& lse) {
    return AttentionForward(qkv, n_head, AttentionOptions{}, out, lse);
  }
  // The backward of that forward, recomputing P from lse (no T x T input
  // or scratch). qkv, out and lse as AttentionForward read and wrote them
  // with the same options; dout (B, T, C). Per (b, h), in fp32, over the
  // same pairs first(t) <= s <= t:
  //   Delta_t = sum_d dout_t,d * out_t,d      (fp32 over the stored values)
  //   S_ts    = (q_t . k_s) * scale           as in the forward
  //   P_ts    = exp(S_ts - lse_t)
  //   dP_ts   = dout_t . v_s                  fp32, not rounded
  //   dS_ts   = P_ts * (dP_ts - Delta_t)
  // P and dS are rounded to the working dtype before the products that
  // read them (tensor-core operands; no-ops for F32):
  //   dv_s = sum_t round(P_ts) dout_t
  //   dk_s = (sum_t round(dS_ts) q_t) * scale
  //   dq_t = (sum_s round(dS_ts) k_s) * scale
  // each accumulated in fp32 (over t, respectively s, in increasing order
  // of key or query block) and rounded once into dqkv (B, T, 3C) =
  // [dq | dk | dv], overwritten. Deterministic: every sum has a fixed
  // order and no backend uses atomics for it, so the result is the same
  // bits run to run. Scratch (Delta, (B, n_head, T) F32) is the backend's.
  // dqkv must not overlap an input.
  virtual absl::Status AttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                         const Tensor& lse, int64_t n_head,
                                         const AttentionOptions& options, Tensor& dqkv) = 0;
  absl::Status AttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                 const Tensor& lse, int64_t n_head, Tensor& dqkv) {
    return AttentionBackward(qkv, out, dout, lse, n_head, AttentionOptions{}, dqkv);
  }

  // The decode step of sampling with a KV cache: one new query row per
  // sequence against that sequence's cached keys and values.
  // q (S, H D): sequence s's new query row (already rotated where the
  //   model uses RoPE), head h in columns h D .. h D + D - 1.
  // k_cache, v_cache (S, T_max, Hkv D): sequence s's keys and values at
  //   positions 0 .. positions[s], the current token's included; positions
  //   after positions[s] are never read (they may hold anything), nor,
  //   under a window, blocks wholly before the first visible key's.
  // positions (S) I32 or I64, on the backend's device: row s's query
  //   position t = positions[s], 0 <= t < T_max.
  // heads H >= 1, kv_heads Hkv dividing H: query head h reads kv head
  //   h / (H / Hkv) (grouped-query attention; Hkv = H is plain multi-head).
  // out (S, H D), written. Every float tensor one dtype (F32, F16, BF16);
  //   out overlaps no input. S = 0 does nothing.
  // Contract: out[s, head h] is, bit for bit, the row t = positions[s] of
  // head h that AttentionForward on this backend writes when that row's q
  // is q[s, h] and its keys and values 0 .. t are the cache's (the kv heads
  // expanded to H as ExpandKvHeads does), with the same options (scale and
  // window, first(t) .. t visible): the same key blocks at absolute
  // positions and the same sums in the same order. The CPU backend shares
  // the row's code with its forward. The CUDA backend runs, for each call,
  // the decode twin of the forward kernel the same dtype, D and alignment
  // would take: for F16/BF16 with D = 64 or 128 and 16-byte aligned q,
  // caches and out, the register-tile kernel's order (unless the backend
  // was created with attention_wmma, whose wmma forward has no twin: the
  // decode then agrees with it to fp tolerance only); otherwise the generic
  // kernel's. So the equality holds on CUDA when the forward's qkv and out
  // are 16-byte aligned too, up to the sign of an exactly zero output.
  // The CPU backend refuses a position outside [0, T_max). On CUDA the
  // positions are device data that the op cannot check without a sync, so
  // the caller, who writes them and knows them on the host, must keep them
  // in range; the kernel writes NaN rows for one outside it (it reads no
  // cache row for it) rather than report an error.
  virtual absl::Status AttentionDecode(const Tensor& q, const Tensor& k_cache,
                                       const Tensor& v_cache, const Tensor& positions,
                                       int64_t heads, int64_t kv_heads,
                                       const AttentionOptions& options, Tensor& out) = 0;
  absl::Status AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& positions, int64_t heads, int64_t kv_heads,
                               Tensor& out) {
    return AttentionDecode(q, k_cache, v_cache, positions, heads, kv_heads, AttentionOptions{},
                           out);
  }

  // The decode step's new keys and values into a KV cache, every sequence
  // at its own position, one call per layer: rows (S, R) the layer's fused
  // rows (q | k | v in column blocks); k_cache, v_cache (S, T_max, W),
  // rows' dtype (any: a byte copy, no rounding); positions (S) I32 or I64
  // on the backend's device;
  //   k_cache[s, positions[s], :] = rows[s, k_col : k_col + W]
  //   v_cache[s, positions[s], :] = rows[s, v_col : v_col + W]
  // every other cache row untouched: the bytes S x 2 CopyColumns calls of
  // one row each would write, in one pass (CUDA: one launch). The CPU
  // backend refuses a position outside [0, T_max) with nothing written; on
  // CUDA the positions are device data the op cannot check without a sync,
  // so the caller keeps them in range, and the kernel writes nothing for a
  // sequence whose position is outside it.
  virtual absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                                   const Tensor& positions, Tensor& k_cache, Tensor& v_cache) = 0;

  // ---- grouped-query attention's shared K/V heads ----------------------------
  // Hugging Face's repeat_kv on a fused row: src (B, T, (H + 2 Hkv) D) =
  // [q | k | v] with H query heads and Hkv K/V heads (Hkv divides H, D =
  // src.dim(2) / (H + 2 Hkv)); dst (B, T, 3 H D) = [q | k' | v'] where
  // query head h's k' and v' are kv head h / (H / Hkv)'s: a copy, no
  // rounding, so the attention above runs unchanged on dst.
  virtual absl::Status ExpandKvHeads(const Tensor& src, int64_t heads, int64_t kv_heads,
                                     Tensor& dst) = 0;
  // Its backward: dsrc's q part is dexpanded's; kv head g's dk and dv are
  // the sums over its query heads h = g G .. g G + G - 1 (G = H / Hkv), in
  // that order in fp32, rounded once. dsrc overwritten, overlapping nothing.
  virtual absl::Status ReduceKvHeads(const Tensor& dexpanded, int64_t heads, int64_t kv_heads,
                                     Tensor& dsrc) = 0;

  // ---- normalisation ------------------------------------------------------
  // ---- normalisation ------------------------------------------------------
  // x, y: (N, C) working dtype; gamma, beta: (C) working dtype or nullptr
  // (no affine); mean, rstd: (N) F32 saved for backward. Statistics in fp32.
  virtual absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta,
                                        float eps, Tensor& y, Tensor& mean, Tensor& rstd) = 0;
  // dx (N, C) is overwritten; dgamma, dbeta (C) get += (accumulated in fp32,
  // then rounded to their dtype); pass nullptr when not affine.
  virtual absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                         const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                         Tensor* dgamma, Tensor* dbeta) = 0;

  // RMSNorm (Llama/Qwen2 families), LayerNorm without the centring and the
  // bias: in fp32, rstd = 1 / sqrt(sum(x^2) / C + eps) (exact sqrt and
  // division), y = x * rstd * (weight_offset + weight) rounded once. x, y:
  // (N, C) working dtype; weight (C) x's dtype; rstd (N) F32 saved for the
  // backward. weight_offset is 0 for Llama's RMSNorm (the sum is then the
  // weight, bit for bit) and 1 for Gemma's, whose checkpoints store w with
  // the scale 1 + w (Gemma3RMSNorm, also in fp32). (Hugging Face's
  // LlamaRMSNorm rounds x * rstd to the dtype before multiplying by the
  // weight, a second rounding in fp16/bf16 that ampd does not make; in fp32
  // the two agree to the order of the sum.)
  virtual absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps,
                                      float weight_offset, Tensor& y, Tensor& rstd) = 0;
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                              Tensor& rstd) {
    return RmsNormForward(x, weight, eps, 0.0f, y, rstd);
  }
  // xhat = x * rstd, g = dy * (weight_offset + weight), in fp32:
  //   dx = rstd * (g - xhat * (sum(g * xhat) * (1/C)))   overwritten
  //   dweight += sum over rows of dy * xhat               fp32, rounded once
  // (the offset is a constant: d(offset + w)/dw = 1). dweight nullptr: the
  // weight is frozen (a LoRA fine-tune's base), no weight gradient is
  // formed and only dx is written, with the same bits as with a dweight.
  virtual absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                                       const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                       Tensor* dweight) = 0;
  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dy, Tensor& dx, Tensor* dweight) {
    return RmsNormBackward(x, weight, 0.0f, rstd, dy, dx, dweight);
  }
  // RMSNorm per head (Qwen3's q_norm and k_norm, Gemma 3's with the offset
  // 1): RmsNormForward's arithmetic over each of `heads` consecutive heads
  // of D = weight.dim(0) columns starting at column `col` of every row of x
  // (R, W): head h of row r is the columns [col + h D, col + (h + 1) D),
  // normalised on its own, every head by the same weight (D) with
  // RmsNormForward's weight_offset. y (R, W), x's dtype and shape, may be
  // x; only those columns of y are written. rstd (R, heads) F32 for the
  // backward. (The q and k heads of a fused q|k|v row: one call for the q
  // heads with q_norm, one for the k heads with k_norm.)
  virtual absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads,
                                          const Tensor& weight, float eps, float weight_offset,
                                          Tensor& y, Tensor& rstd) = 0;
  absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                  float eps, Tensor& y, Tensor& rstd) {
    return HeadRmsNormForward(x, col, heads, weight, eps, 0.0f, y, rstd);
  }
  // RmsNormBackward's arithmetic per head over the same columns: dx's
  // columns of those heads overwritten (dx may be dy, in place; its other
  // columns untouched), dweight (D) += the sum over every row's heads of
  // dy * xhat, in fp32, rounded once; nullptr: frozen, dx alone.
  virtual absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                           const Tensor& weight, float weight_offset,
                                           const Tensor& rstd, const Tensor& dy, Tensor& dx,
                                           Tensor* dweight) = 0;
  absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                   const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                                   Tensor& dx, Tensor* dweight) {
    return HeadRmsNormBackward(x, col, heads, weight, 0.0f, rstd, dy, dx, dweight);
  }

  // ---- rotary position embeddings (Llama/Qwen2 families) --------------------
  // In place on x (B, T, W): the first `heads` heads of head_dim (D, even)
  // columns each, W >= heads * D (the q and k heads at the start of a
  // fused q|k|v row; later columns untouched). Row (b, t) sits at position
  // p = positions[b, t] (I32 or I64) or p = t when positions is null.
  // Hugging Face's rotate-half form, for i in [0, D/2), in fp32:
  //   angle = float(p) * inv_freq[i]     (one fp32 product, as HF's fp32 matmul)
  //   c = cos(angle), s = sin(angle)     (fp32; HF rounds them to a 16-bit
  //                                       dtype first, ampd does not)
  //   y_i = x_i c - x_{i+D/2} s,  y_{i+D/2} = x_{i+D/2} c + x_i s
  // each rounded once. inverse: the transpose rotation (y_i = x_i c +
  // x_{i+D/2} s, y_{i+D/2} = x_{i+D/2} c - x_i s), the backward of the
  // forward. inv_freq (D/2) F32 is the caller's (1 / theta^(2i / D)).
  virtual absl::Status Rope(Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                            const Tensor* positions, bool inverse) = 0;

  // ---- gated MLP: SwiGLU (Llama/Qwen) and GeGLU (Gemma) ----------------------
  // y = act(gate) * up, in fp32, rounded once. gate, up, y: the same float
  // dtype and shape; y may be gate or up. (Hugging Face rounds act(gate) to
  // the dtype before the product; ampd rounds once.)
  //   kSiLU:     act(g) = g * s with s = 1 / (1 + exp(-g))
  //   kGELUTanh: act(g) = GELUTanh's formula (ActivationForward's, in its
  //              operation order)
  virtual absl::Status GatedMulForward(GluActivation act, const Tensor& gate, const Tensor& up,
                                       Tensor& y) = 0;
  // dgate = (dy * up) * act'(g), dup = dy * act(g), each in fp32 and
  // rounded once; dgate and dup overlap no input.
  //   kSiLU:     act'(g) = s * (1 + g * (1 - s))
  //   kGELUTanh: act'(g) = ActivationBackward's exact derivative
  virtual absl::Status GatedMulBackward(GluActivation act, const Tensor& gate, const Tensor& up,
                                        const Tensor& dy, Tensor& dgate, Tensor& dup) = 0;
  absl::Status SiluMulForward(const Tensor& gate, const Tensor& up, Tensor& y) {
    return GatedMulForward(GluActivation::kSiLU, gate, up, y);
  }
  absl::Status SiluMulBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                               Tensor& dgate, Tensor& dup) {
    return GatedMulBackward(GluActivation::kSiLU, gate, up, dy, dgate, dup);
  }

  // ---- embedding ----------------------------------------------------------
  // ids (N) I32 or I64, each in [0, V); table (V, C); out (N, C) table's dtype.
  // An out-of-range id is InvalidArgument. out = table[ids] * scale, the
  // product in fp32 rounded once to the dtype (scale 1: the rows' bytes;
  // Gemma scales by sqrt(hidden_size), which the caller rounds to the
  // working dtype first, as Gemma3TextScaledWordEmbedding does). scale
  // finite, else InvalidArgument.
  virtual absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale,
                                        Tensor& out) = 0;
  absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, Tensor& out) {
    return EmbeddingForward(ids, table, 1.0f, out);
  }
  // dtable (V, C) += scatter of dout (N, C) * scale by ids: each row's
  // contribution round(dout * scale) (the product's gradient in dout's
  // dtype, as the forward's multiply has it; dout itself at scale 1),
  // summed in fp32 in batch order, added to the old value, rounded once.
  virtual absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale,
                                         Tensor& dtable) = 0;
  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
    return EmbeddingBackward(ids, dout, 1.0f, dtable);
  }

  // ---- losses (computed in fp32) ------------------------------------------
  // loss (1) F32 = mean((pred - target)^2) over all elements, times multiplier.
  // dpred = grad_scale * dloss/dpred, rounded to pred's dtype (grad_scale is
  // the loss scale; the multiplier is already inside loss).
  // pred (N, C) any float dtype; target (N, C) F32.
  virtual absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier,
                               float grad_scale, Tensor& loss, Tensor& dpred) = 0;
  // loss (1) F32 = mean over rows of -log softmax(logits)[label], times
  // multiplier; logits (N, V) any float dtype; labels (N) I32 or I64 in [0, V).
  // Per row, in fp32: max, sum = sum of exp(z - max), row loss = log(sum) -
  // (z[label] - max); dlogits = ((multiplier * (1/N)) * (exp(z - max) *
  // (1/sum) - onehot)) * grad_scale, rounded once (dlogits may be logits).
  // The order in which a row's sum is added is each backend's own, fixed
  // by the row alone (its values, length and dtype: never by the device,
  // the grid or where the row sits in memory), so results repeat bit for
  // bit; backends agree to the rounding of expf and of that sum, not bit
  // for bit. The CPU adds in column order (ChunkedSum); CUDA per thread,
  // then by a fixed tree (kernels/cuda/cross_entropy_rows.cuh).
  virtual absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels,
                                        float multiplier, float grad_scale, Tensor& loss,
                                        Tensor& dlogits) = 0;

  // Token cross-entropy over one chunk of rows, for language models whose
  // loss is the mean over many rows computed chunk by chunk (an LM head
  // that never holds every row's logits at once), with PyTorch's
  // ignore_index. logits (N, V) F32, F16 or BF16; labels (N) I32 or I64,
  // each in [0, V) or equal to ignore_index (that row is ignored).
  //   loss (1) F32 += loss_scale * (-log softmax(logits_i)[label_i]) for each
  //     kept row i in turn (fp32, max-subtracted; nothing added for ignored
  //     rows), so successive chunks accumulate into one loss;
  //   dlogits (N, V) logits' dtype, written: grad_scale * (softmax(logits_i)
  //     - onehot(label_i)) for kept rows (one fp32 product, one rounding),
  //     0 for ignored rows.
  // The caller folds the mean into the scales (loss_scale = multiplier /
  // kept_total, grad_scale = loss scale * multiplier / kept_total).
  // A row's max and sum are CrossEntropyLoss's, in the same per-backend
  // order; the rows' terms are added to loss in order on the CPU and as
  // rows finish on CUDA.
  // dlogits may be the same tensor as logits (in place: a chunk's logits
  // become its gradient). A label outside [0, V) other than ignore_index is
  // InvalidArgument (CUDA: reported at the next ReadBack, its row zeroed and
  // counted 0).
  //
  // With `terms`, each kept row i is trained on a per-token loss instead
  // (kernels/token_loss.h: Tinker's cross_entropy, importance_sampling,
  // ppo, cispo and dro): with logp_i = -(the row loss above) and
  // TokenLossTerm's term_i and coef_i,
  //   loss += loss_scale * term_i;
  //   dlogits_i = (grad_scale * coef_i) * (softmax - onehot), one rounding;
  //   terms.logprobs[i] = logp_i (0 for ignored rows), when given;
  //   terms.token_losses[i] = loss_scale * term_i (0 for ignored rows), when
  //     given: the very value added to loss.
  // Plain cross-entropy is the default terms (weight 1: term_i is the row
  // loss and coef_i 1, so the bits are those of the call without terms).
  // With terms.temperature T != 1 every row above reads logits_i / T (each
  // element divided once in fp32) in place of logits_i, and dlogits_i =
  // ((grad_scale * coef_i) / T) * (softmax(logits_i / T) - onehot): the
  // chain rule's 1 / T folded into the row's scale, one rounding as before.
  virtual absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels,
                                         int64_t ignore_index, const TokenLossTerms& terms,
                                         float loss_scale, float grad_scale, Tensor& loss,
                                         Tensor& dlogits) = 0;
  absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                 float loss_scale, float grad_scale, Tensor& loss,
                                 Tensor& dlogits) {
    return CrossEntropyChunk(logits, labels, ignore_index, TokenLossTerms{}, loss_scale, grad_scale,
                             loss, dlogits);
  }

  // logprobs (N) F32 = what CrossEntropyChunk writes to terms.logprobs for
  // the same logits, labels, ignore_index and terms.temperature, bit for
  // bit (the same row code), with no loss and no gradient: logits are only
  // read. For a sampler, which needs its drawn tokens' log-probs at
  // temperature 1 and at its own temperature from one set of logits.
  // temperature finite and > 0; labels as CrossEntropyChunk's (a bad one is
  // InvalidArgument; CUDA: reported at the next ReadBack, its row 0).
  virtual absl::Status LabelLogprobs(const Tensor& logits, const Tensor& labels,
                                     int64_t ignore_index, float temperature, Tensor& logprobs) = 0;

  // ---- sampling --------------------------------------------------------------
  // One token per row of logits (S, V) (F32, F16 or BF16) drawn on the
  // device (SampleParams): tokens (S) I64 gets row r's token where
  // live[r] != 0 (live (S) I64, on the device), params.ignore_index where
  // live[r] == 0, so tokens can serve as CrossEntropyChunk's labels as they
  // are. Per live row, with z the logits widened exactly to float and all
  // arithmetic in float64, inv_t = 1 / temperature:
  //   temperature 0: the most likely token, the lowest id among ties.
  //   untruncated (top_k 0, top_p 1): w_i = exp(z_i inv_t - max(z)
  //     inv_t); the first id i, in id order, with u sum(w) < w_0 + .. + w_i
  //     (V - 1 if none).
  //   (top_k >= V keeps every token: it is untruncated when top_p is 1.)
  //   truncated (0 < top_k < V, or top_p < 1): the tokens ordered most likely first (ties by id, a
  //     total order); the first keep = top_k of them (all when top_k is
  //     0 or >= V); w_j = exp(z_j inv_t - z_top inv_t) in that order; the nucleus is
  //     the shortest prefix whose sum of w_j / sum(w) reaches top_p (the
  //     whole keep when top_p is 1); the token is the first of the nucleus,
  //     in that order, whose cumulative w exceeds u times the nucleus's w.
  // The CPU backend sums each w in the order given (sequentially, as the
  // sampler always did on the host). CUDA sums in a fixed order of its own
  // (kernels/cuda/sample_tokens.cu: per-thread runs then a fixed tree), so
  // its tokens equal the CPU's except where u lands within a float64
  // rounding of a cumulative boundary (in theory about 1e-15 of draws) or
  // where exp differs by its last bit in the same place; temperature 0
  // agrees exactly. NaN logits give an unspecified (in-range) token.
  // params.log_kept, when given, (S) F32 gets each live row's log of the
  // probability mass softmax(logits / temperature) puts on the tokens the
  // draw kept: log(nucleus's sum(w) / the whole row's sum(w)) in float64,
  // rounded once; exactly 0 where nothing is truncated (untruncated, or a
  // nucleus of the whole row) and at temperature 0; 0 for rows not live. The drawn
  // token's probability under the distribution it was drawn from is its
  // softmax(logits / temperature) probability over exp(log_kept).
  // Refused: temperature < 0 or not finite, top_k < 0, top_p outside
  // (0, 1], keys not (S, 2) I64, log_kept not (S) F32, mismatched shapes or
  // dtypes, tokens or log_kept overlapping an input or each other.
  virtual absl::Status SampleTokens(const Tensor& logits, const Tensor& live,
                                    const SampleParams& params, Tensor& tokens) = 0;
  // Bytes SampleTokens holds beside its tensors for (rows, vocab) logits
  // (the CPU: each pool thread's widened row, order and weights; CUDA:
  // none), for a sampler's admission, which adds it to the step's scratch.
  virtual int64_t SampleScratchBytes(int64_t rows, int64_t vocab) const {
    (void)rows;
    (void)vocab;
    return 0;
  }

  // ---- loss scaling and the optimizer -------------------------------------
  // One pass over every gradient tensor: found_inf (1) F32 is set to 1 if any
  // unscaled element g * inv_scale is inf or NaN (never cleared: the caller
  // zeroes it per step). Testing the product rather than the stored g also
  // catches an inv_scale of inf (loss scale 0) or one that overflows a finite
  // g, so the fused update, which computes the same product, never sees a
  // non-finite gradient on a step it applies;
  // norm_sq, when given, gets += sum((g * inv_scale)^2) in fp32; max_abs,
  // when given, gets max(max_abs, max |g * inv_scale|) over the elements
  // (NaNs ignored, inf kept; exact, so any reduction order gives the same
  // value), which the adaptive loss scaler reads without another pass; when
  // in_place, each element is replaced by g * inv_scale rounded to its dtype.
  // In-place unscaling is for F32 gradients: an fp16 gradient unscaled in
  // fp16 would underflow exactly as the loss scale was there to prevent, so
  // fp16 jobs check here and unscale inside the fused optimizer instead.
  virtual absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale,
                                       bool in_place, Tensor& found_inf, Tensor* norm_sq,
                                       Tensor* max_abs) = 0;
  absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                               Tensor& found_inf, Tensor* norm_sq) {
    return UnscaleAndCheck(grads, inv_scale, in_place, found_inf, norm_sq, nullptr);
  }

  // Fused per parameter: read grad, transform it (GradTransform), update
  // master and state in fp32, write the working copy; skip all of it on
  // found_inf. step is the 1-based count of applied steps this update would
  // make (bias correction).
  virtual absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config,
                                  int64_t step, const GradTransform& transform) = 0;
  // first_step: the momentum buffer is initialised to g (PyTorch's rule).
  virtual absl::Status SgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                                 bool first_step, const GradTransform& transform) = 0;

  // ---- observability ------------------------------------------------------
  // counts (kGradHistogramBins) I64 += histogram of log2|g| over every
  // element of grads: bin 0 counts exact zeros, bin 1 values below 2^-30,
  // bins 2.. one power of two each from [2^-30, 2^-29) up to [2^19, 2^20),
  // the last bin |g| >= 2^20 and every inf or NaN.
  virtual absl::Status GradLog2Histogram(absl::Span<const Tensor* const> grads, Tensor& counts) = 0;
};

}  // namespace ampd::kernels
