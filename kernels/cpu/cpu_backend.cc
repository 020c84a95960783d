// The CPU backend object: host memory (64-byte aligned, counted for
// BytesInUse), the byte copies, and the forwarding of every other Backend
// virtual to the file that implements its op (kernels/cpu/<op>.cc, the twin
// of kernels/cuda/<op>.cu). Ops run synchronously: the calling thread and
// the backend's thread pool finish an op before it returns, so Synchronize
// has nothing to wait for.
#include "kernels/cpu/cpu_backend.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/op_checks.h"

namespace ampd::kernels {
namespace {

// 64 bytes: one cache line, and the widest SIMD load (AVX-512) stays aligned.
constexpr size_t kAlignment = 64;
// Tensors of at least kHugeMin bytes are placed on 2 MiB boundaries and
// offered to transparent huge pages: first touching a 100M-parameter model
// in 4 KiB pages costs a page fault per 4 KiB, which dominated CreateJob.
// Their size is rounded up to whole huge pages (at most 1/8 more memory).
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugeMin = 8 * kHugePage;

// glibc serves allocations below its mmap threshold from heap arenas that
// keep freed memory, and by default raises that threshold (up to 32 MiB)
// each time a larger block is freed: released workspaces and scratch would
// then stay in the process's resident memory, outside anything admission
// counts. A fixed threshold keeps every block of 256 KiB or more mapped on
// its own, so freeing it gives it back. Process-wide and once.
void FixMmapThreshold() {
  static std::once_flag once;
  std::call_once(once, [] { (void)mallopt(M_MMAP_THRESHOLD, 256 * 1024); });
}

bool Is16Bit(DType dtype) { return dtype == DType::kF16 || dtype == DType::kBF16; }

// Shared between the backend and every block it handed out, so a tensor
// that outlives its backend still decrements a live counter.
using ByteCounter = std::shared_ptr<std::atomic<int64_t>>;

class HostMemory final : public Memory {
 public:
  HostMemory(void* data, size_t bytes, ByteCounter counter)
      : data_(data), bytes_(bytes), counter_(std::move(counter)) {
    counter_->fetch_add(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
  }
  ~HostMemory() override {
    counter_->fetch_sub(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
    std::free(data_);
  }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_;
  size_t bytes_;
  ByteCounter counter_;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads)
      : bytes_in_use_(std::make_shared<std::atomic<int64_t>>(0)), pool_(threads) {
    FixMmapThreshold();
  }

  std::string name() const override { return "cpu"; }

  absl::StatusOr<Tensor> Allocate(DType dtype, const Shape& shape) override {
    AMPD_RETURN_IF_ERROR(ValidateAllocate(shape));
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * SizeOf(dtype);
    // aligned_alloc wants a multiple of the alignment; a zero-element tensor
    // still gets one line so data() is non-null and the tensor is not empty().
    const size_t align = bytes >= kHugeMin ? kHugePage : kAlignment;
    const size_t rounded = bytes == 0 ? align : (bytes + align - 1) / align * align;
    void* data = std::aligned_alloc(align, rounded);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("Allocate: cannot allocate ", bytes,
                                                       " bytes for ", DTypeName(dtype),
                                                       ShapeToString(shape)));
    }
    // Advice only: where THP is off the pages stay 4 KiB.
    if (align == kHugePage) (void)madvise(data, rounded, MADV_HUGEPAGE);
    allocations_.fetch_add(1, std::memory_order_relaxed);
    return Tensor(std::make_unique<HostMemory>(data, bytes, bytes_in_use_), dtype, shape);
  }

  absl::Status CopyFromHost(const void* src, size_t bytes, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateCopyFromHost(src, bytes, dst));
    if (bytes != 0) std::memcpy(dst.data(), src, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyToHost(const Tensor& src, void* dst, size_t bytes) override {
    AMPD_RETURN_IF_ERROR(ValidateCopyToHost(src, dst, bytes));
    if (bytes != 0) std::memcpy(dst, src.data(), bytes);
    return absl::OkStatus();
  }

  absl::Status Copy(const Tensor& src, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateCopy(src, dst));
    // memmove: src and dst may be the same tensor.
    if (src.nbytes() != 0) std::memmove(dst.data(), src.data(), src.nbytes());
    return absl::OkStatus();
  }
  absl::Status CopyColumns(const Tensor& src, int64_t src_col, int64_t cols, Tensor& dst,
                           int64_t dst_col) override {
    return cpu::CopyColumns(pool_, src, src_col, cols, dst, dst_col);
  }

  absl::Status Fill(Tensor& dst, float value) override { return cpu::Fill(pool_, dst, value); }
  absl::Status FillTensors(absl::Span<Tensor* const> dsts, float value) override {
    return cpu::FillTensors(pool_, dsts, value);
  }
  absl::Status FillRandom(Tensor& dst, const RandomFill& fill) override {
    return cpu::FillRandom(pool_, dst, fill);
  }
  absl::Status Cast(const Tensor& src, Tensor& dst) override { return cpu::Cast(pool_, src, dst); }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                        absl::Span<const HostCopy> copies) override {
    return cpu::ReadBack(scalars, out, copies);
  }

  int64_t BytesInUse() const override { return bytes_in_use_->load(std::memory_order_relaxed); }
  int64_t AllocationCount() const override { return allocations_.load(std::memory_order_relaxed); }
  int64_t MemoryCapacityBytes() const override {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : 0;
  }

  // Every buffer below is fp32. Per backend (the pool's scratch,
  // ThreadPool::ScratchSlot): a 16-bit GEMM's widened operands and its
  // fp32 result (gemm.cc), the batch-invariant GEMM's packed op(b)
  // (gemm_invariant.cc), and the fused GEMMs' sums, one buffer each for
  // GemmBiasActivation and GemmActivationBackward, at most the largest
  // result of each; OpenBLAS's packed panels (below). Per thread of the pool (the caller included):
  // a head's rows in the attention forward (3 T D + D + the key block) and backward (7 T D + 3 T +
  // D), and a row of logits in the cross-entropy (V); on the caller, the loss's per-row values (N).
  // Tensors of 16 MiB or more are rounded up to 2 MiB pages: at most 1/8 more. And what running any
  // step brings in beside them: the pool threads' stacks and malloc arenas, OpenBLAS's small
  // panels, the batch's copies on the way in (2-3 MiB measured on two cores for a 4 x 1024-token
  // GPT step), counted as 8 MiB plus 256 KiB a thread.
  int64_t ScratchBytes(const ScratchExtents& e, int64_t tensor_bytes) const override {
    constexpr int64_t kRunningBytes = int64_t{8} << 20;
    constexpr int64_t kThreadBytes = int64_t{256} << 10;
    constexpr int64_t kBlasPanelDepth = 512;
    const int64_t threads = pool_.threads();
    int64_t floats = 0;
    auto add = [&floats](int64_t n) { floats = SaturatingAdd(floats, n); };
    if (Is16Bit(e.dtype)) {
      add(e.gemm_a);
      add(e.gemm_b);
      add(e.gemm_c);
    }
    // The fused GEMMs' fp32 sums, one slot each (cpu_parallel.h).
    add(e.bias_activation_c);
    add(e.activation_backward_c);
    // Batch-invariant GEMMs pack op(b) into panels of N rounded up to 32
    // columns (the AVX-512 tile's width): at most twice op(b) where
    // N >= 32; a narrower product's padding (31 K floats, under 1 MiB for
    // K <= 8192) fits in the running allowance below.
    if (gemm_order_ == cpu::GemmOrder::kBatchInvariant) add(SaturatingMul(2, e.gemm_b));
    // OpenBLAS packs op(a) (in its column-major terms, op(b)) into its
    // per-thread buffers as (min(K, its Q), M) panels, Q some 384 (512
    // here, an upper bound), M split over the threads: a language model's
    // LM-head weight gradient, M = V and K = the chunk's R rows, touches
    // 4 x min(R, Q) x V bytes of them (measured: 33 MB for 256 rows of a
    // 32k vocabulary), far past the running allowance below. M is at most the rows (the blocks'
    // GEMMs) or the classes (the head's weight gradient; ScratchExtents).
    if (gemm_order_ == cpu::GemmOrder::kBlas) {
      add(std::min(e.gemm_a, SaturatingMul(kBlasPanelDepth, std::max(e.rows, e.classes))));
    }
    if (e.attention_seq > 0) {
      const int64_t td = SaturatingMul(e.attention_seq, e.head_dim);
      add(SaturatingMul(threads,
                        SaturatingAdd(SaturatingMul(10, td),
                                      SaturatingAdd(SaturatingMul(3, e.attention_seq),
                                                    2 * e.head_dim + kAttentionKeyBlock))));
    }
    if (e.classes > 0) {
      add(SaturatingMul(threads, e.classes));
      add(e.rows);
    }
    const int64_t running = kRunningBytes + threads * kThreadBytes;
    return SaturatingAdd(SaturatingAdd(SaturatingMul(floats, 4), tensor_bytes / 8), running);
  }

  void ReleaseScratch() override { pool_.ReleaseScratch(); }

  absl::Status SetBatchInvariant(bool on) override {
    gemm_order_ = on ? cpu::GemmOrder::kBatchInvariant : cpu::GemmOrder::kBlas;
    return absl::OkStatus();
  }

  absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c) override {
    return cpu::Gemm(pool_, gemm_order_, trans_a, trans_b, alpha, a, b, beta, c);
  }
  absl::Status AddScaled(const Tensor& x, float scale, Tensor& y) override {
    return cpu::AddScaled(pool_, x, scale, y);
  }
  absl::Status GemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                  const Tensor* bias, GemmActivation act, Tensor& c,
                                  Tensor* pre) override {
    return cpu::GemmBiasActivation(pool_, gemm_order_, trans_a, trans_b, a, b, bias, act, c, pre);
  }
  absl::Status GemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                            float beta, Tensor& c, BiasGradOf of, Tensor& dbias) override {
    return cpu::GemmBiasGrad(pool_, gemm_order_, trans_a, trans_b, a, b, beta, c, of, dbias);
  }
  absl::Status GemmActivationBackward(bool trans_a, bool trans_b, float alpha, const Tensor& a,
                                      const Tensor& b, GemmActivation act, const Tensor* pre,
                                      Tensor& c) override {
    return cpu::GemmActivationBackward(pool_, gemm_order_, trans_a, trans_b, alpha, a, b, act, pre,
                                       c);
  }
  absl::Status AddBias(const Tensor& bias, Tensor& y) override {
    return cpu::AddBias(pool_, bias, y);
  }
  absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) override {
    return cpu::BiasGrad(pool_, dy, beta, dbias);
  }

  absl::Status ActivationForward(Activation act, const Tensor& x, Tensor& y) override {
    return cpu::ActivationForward(pool_, act, x, y);
  }
  absl::Status ActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                  Tensor& dx) override {
    return cpu::ActivationBackward(pool_, act, x, dy, dx);
  }

  using Backend::AttentionBackward;
  using Backend::AttentionDecode;
  using Backend::AttentionForward;
  absl::Status AttentionForward(const Tensor& qkv, int64_t n_head, const AttentionOptions& options,
                                Tensor& out, Tensor& lse) override {
    return cpu::AttentionForward(pool_, qkv, n_head, options, out, lse);
  }
  absl::Status AttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                 const Tensor& lse, int64_t n_head, const AttentionOptions& options,
                                 Tensor& dqkv) override {
    return cpu::AttentionBackward(pool_, qkv, out, dout, lse, n_head, options, dqkv);
  }
  absl::Status AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& positions, int64_t heads, int64_t kv_heads,
                               const AttentionOptions& options, Tensor& out) override {
    return cpu::AttentionDecode(pool_, q, k_cache, v_cache, positions, heads, kv_heads, options,
                                out);
  }

  absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                           const Tensor& positions, Tensor& k_cache, Tensor& v_cache) override {
    return cpu::WriteKvRows(rows, k_col, v_col, positions, k_cache, v_cache);
  }

  absl::Status SampleTokens(const Tensor& logits, const Tensor& live, const SampleParams& params,
                            Tensor& tokens) override {
    return cpu::SampleTokens(pool_, logits, live, params, tokens);
  }
  // Per pool thread (the caller included): a row widened to float (4 bytes
  // an id), its order (8) and its float64 weights (8), kept thread_local
  // between calls as the cross-entropy's rows are.
  int64_t SampleScratchBytes(int64_t rows, int64_t vocab) const override {
    (void)rows;
    return SaturatingMul(SaturatingMul(pool_.threads(), vocab), 20);
  }

  absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                                Tensor& y, Tensor& mean, Tensor& rstd) override {
    return cpu::LayerNormForward(x, gamma, beta, eps, y, mean, rstd);
  }
  absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                                 Tensor* dbeta) override {
    return cpu::LayerNormBackward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
  }

  using Backend::RmsNormBackward;
  using Backend::RmsNormForward;
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                              Tensor& y, Tensor& rstd) override {
    return cpu::RmsNormForward(x, weight, eps, weight_offset, y, rstd);
  }
  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx,
                               Tensor* dweight) override {
    return cpu::RmsNormBackward(x, weight, weight_offset, rstd, dy, dx, dweight);
  }
  using Backend::HeadRmsNormBackward;
  using Backend::HeadRmsNormForward;
  absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                  float eps, float weight_offset, Tensor& y,
                                  Tensor& rstd) override {
    return cpu::HeadRmsNormForward(x, col, heads, weight, eps, weight_offset, y, rstd);
  }
  absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                   const Tensor& weight, float weight_offset, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dx, Tensor* dweight) override {
    return cpu::HeadRmsNormBackward(x, col, heads, weight, weight_offset, rstd, dy, dx, dweight);
  }

  absl::Status ExpandKvHeads(const Tensor& src, int64_t heads, int64_t kv_heads,
                             Tensor& dst) override {
    return cpu::ExpandKvHeads(pool_, src, heads, kv_heads, dst);
  }
  absl::Status ReduceKvHeads(const Tensor& dexpanded, int64_t heads, int64_t kv_heads,
                             Tensor& dsrc) override {
    return cpu::ReduceKvHeads(pool_, dexpanded, heads, kv_heads, dsrc);
  }

  absl::Status Rope(Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                    const Tensor* positions, bool inverse) override {
    return cpu::Rope(pool_, x, heads, head_dim, inv_freq, positions, inverse);
  }

  absl::Status GatedMulForward(GluActivation act, const Tensor& gate, const Tensor& up,
                               Tensor& y) override {
    return cpu::GatedMulForward(pool_, act, gate, up, y);
  }
  absl::Status GatedMulBackward(GluActivation act, const Tensor& gate, const Tensor& up,
                                const Tensor& dy, Tensor& dgate, Tensor& dup) override {
    return cpu::GatedMulBackward(pool_, act, gate, up, dy, dgate, dup);
  }

  using Backend::EmbeddingBackward;
  using Backend::EmbeddingForward;
  absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale,
                                Tensor& out) override {
    return cpu::EmbeddingForward(ids, table, scale, out);
  }
  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale,
                                 Tensor& dtable) override {
    return cpu::EmbeddingBackward(ids, dout, scale, dtable);
  }

  absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                       Tensor& loss, Tensor& dpred) override {
    return cpu::MseLoss(pred, target, multiplier, grad_scale, loss, dpred);
  }
  absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                                float grad_scale, Tensor& loss, Tensor& dlogits) override {
    return cpu::CrossEntropyLoss(logits, labels, multiplier, grad_scale, loss, dlogits);
  }

  using Backend::CrossEntropyChunk;
  absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                 const TokenLossTerms& terms, float loss_scale, float grad_scale,
                                 Tensor& loss, Tensor& dlogits) override {
    return cpu::CrossEntropyChunk(pool_, logits, labels, ignore_index, terms, loss_scale,
                                  grad_scale, loss, dlogits);
  }
  absl::Status LabelLogprobs(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                             float temperature, Tensor& logprobs) override {
    return cpu::LabelLogprobs(pool_, logits, labels, ignore_index, temperature, logprobs);
  }

  using Backend::UnscaleAndCheck;
  absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                               Tensor& found_inf, Tensor* norm_sq, Tensor* max_abs) override {
    return cpu::UnscaleAndCheck(grads, inv_scale, in_place, found_inf, norm_sq, max_abs);
  }
  absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config, int64_t step,
                          const GradTransform& transform) override {
    return cpu::AdamUpdate(pool_, params, config, step, transform);
  }
  absl::Status SgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                         bool first_step, const GradTransform& transform) override {
    return cpu::SgdUpdate(pool_, params, config, first_step, transform);
  }

  absl::Status GradLog2Histogram(absl::Span<const Tensor* const> grads, Tensor& counts) override {
    return cpu::GradLog2Histogram(pool_, grads, counts);
  }

 private:
  ByteCounter bytes_in_use_;
  cpu::ThreadPool pool_;  // started once; the ops that split their work use it
  // SetBatchInvariant's mode. Set between ops by the job that owns the
  // backend (its ops run one at a time), read by every GEMM op.
  cpu::GemmOrder gemm_order_ = cpu::GemmOrder::kBlas;

  std::atomic<int64_t> allocations_{0};  // successful Allocate calls
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend() {
  return std::make_unique<CpuBackend>(cpu::ThreadPool::DefaultThreads());
}
std::unique_ptr<Backend> CreateCpuBackend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace ampd::kernels
