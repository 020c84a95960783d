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
#include "absl/types/span.h"
#include "kernels/grad_histogram.h"
#include "kernels/tensor.h"

namespace ampd::kernels {

// kGELU is the exact form; kGELUTanh the tanh approximation GPT-2 was
// trained with (see ActivationForward).
enum class Activation : uint8_t { kReLU, kGELU, kTanh, kGELUTanh };

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
  // fp32 and the sum rounded once to c's dtype (F32 or a's dtype).
  // op(a): (M, K), op(b): (K, N), c: (M, N).
  virtual absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a,
                            const Tensor& b, float beta, Tensor& c) = 0;
  // y (N, C) += bias (C), broadcast over rows, in fp32 then rounded to y's dtype.
  virtual absl::Status AddBias(const Tensor& bias, Tensor& y) = 0;
  // dbias (C) = sum over rows of dy (N, C) + beta * dbias, accumulated in fp32.
  virtual absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) = 0;

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

  // ---- causal self-attention (GPT) ------------------------------------------
  // All float operands of one call share one dtype (F32, F16 or BF16). With
  // C = qkv.dim(2) / 3 and D = C / n_head (n_head must divide C), the
  // products run as a cuBLAS strided-batched GEMM in that dtype does: fp32
  // accumulation, each stored matrix rounded once to the dtype, and the
  // next product reads the rounded values. The CPU oracle mirrors every one
  // of those roundings, so backends agree up to summation order and libm.
  //
  // qkv (B, T, 3C): [q | k | v] along the last dim (Hugging Face GPT-2's
  //   c_attn output); head h of each is columns h*D .. h*D + D - 1.
  // att (B, n_head, T, T), written: first the scaled scores
  //   S = (q k^T) / sqrt(D) rounded to att's dtype, then in place the causal
  //   softmax P of S over keys s <= t with the row max subtracted before exp,
  //   rounded; P = 0 for keys after the query. Saved for the backward.
  // out (B, T, C), written: out[b, t, h*D + d] = sum_s P[b, h, t, s] v[b, s, h*D + d]
  //   with P as stored, accumulated in fp32 and rounded once.
  // att and out must not overlap qkv.
  virtual absl::Status AttentionForward(const Tensor& qkv, int64_t n_head, Tensor& att,
                                        Tensor& out) = 0;
  // qkv and att as AttentionForward read and wrote them; dout (B, T, C).
  // datt (B, n_head, T, T) is scratch, overwritten: it holds dP = dout v^T
  //   (rounded), then dS = P * (dP - sum_s P dP) (row sums in fp32 over the
  //   rounded dP, dS rounded; 0 for keys after the query).
  // dqkv (B, T, 3C), overwritten with [dq | dk | dv]:
  //   dv = P^T dout, dq = (dS k) / sqrt(D), dk = (dS^T q) / sqrt(D),
  //   each accumulated in fp32 and rounded once. Masked positions contribute
  //   nothing. datt and dqkv must not overlap the inputs or each other.
  virtual absl::Status AttentionBackward(const Tensor& qkv, const Tensor& att, const Tensor& dout,
                                         int64_t n_head, Tensor& datt, Tensor& dqkv) = 0;

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

  // ---- embedding ----------------------------------------------------------
  // ids (N) I32 or I64, each in [0, V); table (V, C); out (N, C) table's dtype.
  // An out-of-range id is InvalidArgument.
  virtual absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, Tensor& out) = 0;
  // dtable (V, C) += scatter of dout (N, C) by ids.
  virtual absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, Tensor& dtable) = 0;

  // ---- losses (computed in fp32) ------------------------------------------
  // loss (1) F32 = mean((pred - target)^2) over all elements, times multiplier.
  // dpred = grad_scale * dloss/dpred, rounded to pred's dtype (grad_scale is
  // the loss scale; the multiplier is already inside loss).
  // pred (N, C) any float dtype; target (N, C) F32.
  virtual absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier,
                               float grad_scale, Tensor& loss, Tensor& dpred) = 0;
  // loss (1) F32 = mean over rows of -log softmax(logits)[label], times
  // multiplier; logits (N, V) any float dtype; labels (N) I32 or I64 in [0, V).
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
  // dlogits may be the same tensor as logits (in place: a chunk's logits
  // become its gradient). A label outside [0, V) other than ignore_index is
  // InvalidArgument (CUDA: reported at the next ReadBack, its row zeroed and
  // counted 0).
  virtual absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels,
                                         int64_t ignore_index, float loss_scale, float grad_scale,
                                         Tensor& loss, Tensor& dlogits) = 0;

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
