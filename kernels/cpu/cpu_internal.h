// Shared plumbing of the CPU backend, private to kernels/cpu: per-dtype
// element access (load as fp32, store with one RNE rounding), the dtype
// dispatch that turns a runtime DType into a compile-time tag, the id range
// check that reads ids on the host, and the op entry points, one per file
// named after the op as its CUDA twin is (cpu_backend.cc forwards the
// Backend virtuals to them).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_parallel.h"
#include "kernels/dtype.h"
#include "kernels/float16.h"
#include "kernels/op_checks.h"
#include "kernels/tensor.h"

namespace ampd::kernels::cpu {

// ---- element access ---------------------------------------------------------
// One tag per float dtype. Storage is what the tensor holds (raw bits for the
// 16-bit types); Load widens exactly; Store rounds once, nearest-even. Kernels
// are templates over the tag, so the inner loops have no per-element branch
// on the dtype and no indirect call.
struct F32Tag {
  using Storage = float;
  static constexpr DType kDType = DType::kF32;
  static float Load(Storage v) { return v; }
  static Storage Store(float v) { return v; }
};
struct F16Tag {
  using Storage = uint16_t;
  static constexpr DType kDType = DType::kF16;
  static float Load(Storage v) { return HalfBitsToFloat(v); }
  static Storage Store(float v) { return FloatToHalfBits(v); }
};
struct BF16Tag {
  using Storage = uint16_t;
  static constexpr DType kDType = DType::kBF16;
  static float Load(Storage v) { return Bf16BitsToFloat(v); }
  static Storage Store(float v) { return FloatToBf16Bits(v); }
};

template <typename Tag>
const typename Tag::Storage* Ptr(const Tensor& t) {
  return t.data_as<typename Tag::Storage>();
}
template <typename Tag>
typename Tag::Storage* Ptr(Tensor& t) {
  return t.data_as<typename Tag::Storage>();
}

// Calls fn(Tag{}) for a float dtype. Callers validate first; a non-float
// dtype reaching here is a bug in this backend, reported as Internal.
template <typename Fn>
absl::Status VisitFloat(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return std::forward<Fn>(fn)(F32Tag{});
    case DType::kF16:
      return std::forward<Fn>(fn)(F16Tag{});
    case DType::kBF16:
      return std::forward<Fn>(fn)(BF16Tag{});
    case DType::kI32:
    case DType::kI64:
    case DType::kU8:
    case DType::kBool:
      break;
  }
  return absl::InternalError(
      absl::StrCat("cpu backend: float op dispatched on ", DTypeName(dtype)));
}

// Index tensors (I32 or I64) read as int64.
inline int64_t LoadIndex(const Tensor& ids, int64_t i) {
  return ids.dtype() == DType::kI32 ? static_cast<int64_t>(ids.data_as<int32_t>()[i])
                                    : ids.data_as<int64_t>()[i];
}

// ---- reductions --------------------------------------------------------------
// fp32 sum in a fixed order: runs of kChunk elements are summed sequentially
// and each run's total is added to the grand total. The rounding error grows
// with kChunk + n / kChunk instead of n (a sequential sum of a million
// squares would lose several digits), while staying fp32 and deterministic,
// close to the two-level tree a GPU reduction uses.
class ChunkedSum {
 public:
  static constexpr int kChunk = 1024;
  void Add(float v) {
    partial_ += v;
    if (++count_ == kChunk) {
      total_ += partial_;
      partial_ = 0.0f;
      count_ = 0;
    }
  }
  float Total() const { return total_ + partial_; }

 private:
  float total_ = 0.0f;
  float partial_ = 0.0f;
  int count_ = 0;
};

// ---- argument checks --------------------------------------------------------
// The dtype and shape rules of every op live in kernels/op_checks.h, shared
// with the CUDA backend. What stays here needs the data on the host.

// Every id in [0, limit); checked before an op writes anything, so a bad
// batch leaves the outputs untouched.
inline absl::Status CheckIdsInRange(absl::string_view op, absl::string_view name, const Tensor& ids,
                                    int64_t limit) {
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t id = LoadIndex(ids, i);
    if (id < 0 || id >= limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", name, "[", i, "] = ", id, " is outside [0, ", limit, ")"));
    }
  }
  return absl::OkStatus();
}

// ---- ops (one file per op, named as its CUDA twin in kernels/cuda) --------
// The ops that take a ThreadPool split their work over it (cpu_parallel.h).
// fill.cc
absl::Status Fill(ThreadPool& pool, Tensor& dst, float value);
absl::Status FillTensors(ThreadPool& pool, absl::Span<Tensor* const> dsts, float value);
// fill_random.cc
absl::Status FillRandom(ThreadPool& pool, Tensor& dst, const RandomFill& fill);
// cast.cc
absl::Status Cast(ThreadPool& pool, const Tensor& src, Tensor& dst);
// copy_columns.cc
absl::Status CopyColumns(ThreadPool& pool, const Tensor& src, int64_t src_col, int64_t cols,
                         Tensor& dst, int64_t dst_col);
// read_back.cc
absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                      absl::Span<const HostCopy> copies);
// add.cc
absl::Status AddScaled(ThreadPool& pool, const Tensor& x, float scale, Tensor& y);
// How the GEMMs form their fp32 sums: OpenBLAS's cblas_sgemm (fastest, its
// order over K depends on the shape), or gemm_invariant.cc's one fixed order
// per element (Backend::SetBatchInvariant). The backend holds the mode and
// passes it to every GEMM op.
enum class GemmOrder : uint8_t { kBlas, kBatchInvariant };
// gemm.cc
absl::Status Gemm(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b, float alpha,
                  const Tensor& a, const Tensor& b, float beta, Tensor& c);
// out (M, N) F32 = alpha op(a) @ op(b): Gemm's fp32 sums before any
// rounding or beta term (zeros when K == 0); the epilogue ops' first step.
// The caller has validated the operands and owns out.
void GemmF32(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b, float alpha,
             const Tensor& a, const Tensor& b, float* out);
// gemm_invariant.cc: out (M, N) = alpha * op(a) @ op(b) + beta * out over
// fp32 operands laid out as cblas_sgemm takes them (row-major, leading
// dimensions lda and ldb, out's is N), in the fixed per-element order that
// file describes; beta == 0 never reads out.
// `isa` picks its tile code (kBest: the widest the CPU has); every choice
// computes the same bits, which tests check on each the CPU supports.
enum class InvariantGemmIsa : uint8_t { kBest, kAvx512, kAvx2, kSse2 };
bool CpuSupports(InvariantGemmIsa isa);
void GemmInvariantF32(ThreadPool& pool, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                      float alpha, const float* pa, int64_t lda, const float* pb, int64_t ldb,
                      float beta, float* out, InvariantGemmIsa isa = InvariantGemmIsa::kBest);
// gemm_bias_activation.cc
absl::Status GemmBiasActivation(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                                const Tensor& a, const Tensor& b, const Tensor* bias,
                                GemmActivation act, Tensor& c, Tensor* pre);
// gemm_bias_grad.cc
absl::Status GemmBiasGrad(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                          const Tensor& a, const Tensor& b, float beta, Tensor& c, BiasGradOf of,
                          Tensor& dbias);
// gemm_activation_backward.cc
absl::Status GemmActivationBackward(ThreadPool& pool, GemmOrder order, bool trans_a, bool trans_b,
                                    float alpha, const Tensor& a, const Tensor& b,
                                    GemmActivation act, const Tensor* pre, Tensor& c);
// add_bias.cc
absl::Status AddBias(ThreadPool& pool, const Tensor& bias, Tensor& y);
// bias_grad.cc
absl::Status BiasGrad(ThreadPool& pool, const Tensor& dy, float beta, Tensor& dbias);
// activation.cc
absl::Status ActivationForward(ThreadPool& pool, Activation act, const Tensor& x, Tensor& y);
absl::Status ActivationBackward(ThreadPool& pool, Activation act, const Tensor& x, const Tensor& dy,
                                Tensor& dx);
// attention_forward.cc
absl::Status AttentionForward(ThreadPool& pool, const Tensor& qkv, int64_t n_head,
                              const AttentionOptions& options, Tensor& out, Tensor& lse);
// attention_backward.cc
absl::Status AttentionBackward(ThreadPool& pool, const Tensor& qkv, const Tensor& out,
                               const Tensor& dout, const Tensor& lse, int64_t n_head,
                               const AttentionOptions& options, Tensor& dqkv);
// attention_decode.cc
absl::Status AttentionDecode(ThreadPool& pool, const Tensor& q, const Tensor& k_cache,
                             const Tensor& v_cache, const Tensor& positions, int64_t heads,
                             int64_t kv_heads, const AttentionOptions& options, Tensor& out);
// write_kv_rows.cc
absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col, const Tensor& positions,
                         Tensor& k_cache, Tensor& v_cache);
// sample_tokens.cc
absl::Status SampleTokens(ThreadPool& pool, const Tensor& logits, const Tensor& live,
                          const SampleParams& params, Tensor& tokens);
// An RMSNorm's scale offset + w in fp32; w itself without an offset (0 + -0
// would be +0, a sign of zero the plain norms never changed).
inline float OffsetWeight(float offset, float w) { return offset == 0.0f ? w : offset + w; }
// layernorm_forward.cc (LayerNorm and RMSNorm)
absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                              Tensor& y, Tensor& mean, Tensor& rstd);
// layernorm_backward.cc (LayerNorm and RMSNorm)
absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                               Tensor* dbeta);
absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                            Tensor& y, Tensor& rstd);
absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                             const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dweight);
// RMSNorm per head, the same code over the heads' columns (NormRows).
absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                float eps, float weight_offset, Tensor& y, Tensor& rstd);
absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                 float weight_offset, const Tensor& rstd, const Tensor& dy,
                                 Tensor& dx, Tensor* dweight);

// The rows the norms normalise, `count` rows of `width` elements each:
// row i starts at element (i / per_row) * stride + offset + (i % per_row)
// * width of x (and of y, dy, dx alike), and its statistics sit at index
// i. A plain (N, C) tensor is N rows of C, per_row 1, stride C, offset 0;
// the heads of a per-head norm are per_row heads of D from column offset
// of rows of stride W, their statistics (R, heads).
struct NormRows {
  int64_t count = 0;
  int64_t width = 0;
  int64_t per_row = 1;
  int64_t stride = 0;
  int64_t offset = 0;
  static NormRows Plain(const Tensor& x) { return {x.dim(0), x.dim(1), 1, x.dim(1), 0}; }
  static NormRows Heads(const Tensor& x, int64_t col, int64_t heads, int64_t head_dim) {
    return {x.dim(0) * heads, head_dim, heads, x.dim(1), col};
  }
  int64_t Start(int64_t i) const { return (i / per_row) * stride + offset + (i % per_row) * width; }
};
// kv_heads.cc
absl::Status ExpandKvHeads(ThreadPool& pool, const Tensor& src, int64_t heads, int64_t kv_heads,
                           Tensor& dst);
absl::Status ReduceKvHeads(ThreadPool& pool, const Tensor& dexpanded, int64_t heads,
                           int64_t kv_heads, Tensor& dsrc);
// rope.cc
absl::Status Rope(ThreadPool& pool, Tensor& x, int64_t heads, int64_t head_dim,
                  const Tensor& inv_freq, const Tensor* positions, bool inverse);
// gated_mul.cc
absl::Status GatedMulForward(ThreadPool& pool, GluActivation act, const Tensor& gate,
                             const Tensor& up, Tensor& y);
absl::Status GatedMulBackward(ThreadPool& pool, GluActivation act, const Tensor& gate,
                              const Tensor& up, const Tensor& dy, Tensor& dgate, Tensor& dup);
// embedding.cc
absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale, Tensor& out);
absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale, Tensor& dtable);
// mse_loss.cc
absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                     Tensor& loss, Tensor& dpred);
// cross_entropy.cc
absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                              float grad_scale, Tensor& loss, Tensor& dlogits);
// cross_entropy_chunk.cc
absl::Status CrossEntropyChunk(ThreadPool& pool, const Tensor& logits, const Tensor& labels,
                               int64_t ignore_index, const TokenLossTerms& terms, float loss_scale,
                               float grad_scale, Tensor& loss, Tensor& dlogits);
absl::Status LabelLogprobs(ThreadPool& pool, const Tensor& logits, const Tensor& labels,
                           int64_t ignore_index, float temperature, Tensor& logprobs);
// unscale_check.cc
absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                             Tensor& found_inf, Tensor* norm_sq, Tensor* max_abs);
// adam.cc
absl::Status AdamUpdate(ThreadPool& pool, absl::Span<const ParamRef> params,
                        const AdamConfig& config, int64_t step, const GradTransform& transform);
// sgd.cc
absl::Status SgdUpdate(ThreadPool& pool, absl::Span<const ParamRef> params, const SgdConfig& config,
                       bool first_step, const GradTransform& transform);
// grad_histogram.cc
absl::Status GradLog2Histogram(ThreadPool& pool, absl::Span<const Tensor* const> grads,
                               Tensor& counts);

}  // namespace ampd::kernels::cpu
