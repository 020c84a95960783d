// CudaBackend: the Backend interface on one GPU. This file is host code
// only: argument checks (kernels/op_checks.h, shared with the CPU oracle, so
// both refuse a bad call with the same InvalidArgument), memory through the
// device's caching pool, and dispatch to the launchers of the .cu files.
// Every op is enqueued on the backend's own stream; only CopyToHost,
// ReadScalars and Synchronize wait.
//
// Nothing a kernel reads or writes lives in host memory. The error word
// (bad embedding ids or labels) is an int in device memory that the
// optimizer consults on the device; it reaches the host inside the step's
// one read (ReadScalars gathers the scalars and the word into one device
// block and copies it with one DMA). Batches go up through a pinned upload
// arena with async copies, so an upload never waits for the stream; scratch
// for reductions is one grow-only buffer, so a step of a size seen before
// allocates nothing.
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm_lt.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/memory_pool.h"
#include "kernels/float16.h"
#include "kernels/op_checks.h"

namespace ampd::kernels::cuda {
namespace {

// cuBLAS's recommended workspace for Hopper; given from the pool so GEMMs
// never allocate behind the pool's back.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Scalars ReadScalars' device block and pinned landing area hold from the
// start: the step reads 3 (loss sum, found_inf, norm_sq); a longer list
// grows them once. Each holds one more slot for the error word.
constexpr size_t kStagingScalars = 16;

// Uploads up to this size go through the pinned arena (a memcpy on the host,
// then an async DMA that never waits for the stream); larger ones (whole
// state dicts, not batches) are copied from the caller's memory directly.
constexpr size_t kMaxStagedUploadBytes = size_t{64} << 20;
constexpr size_t kInitialUploadArenaBytes = size_t{1} << 20;
// The arena grows (doubling) until one step's uploads fit, up to this: two
// of the largest staged uploads still overlap their DMAs. Past it a long run
// of uploads (a state load's tensors of up to kMaxStagedUploadBytes) drains
// the stream and reuses the arena instead of pinning gigabytes of host
// memory, slowly, and keeping them for the backend's lifetime.
constexpr size_t kMaxUploadArenaBytes = 2 * kMaxStagedUploadBytes;
// ReadBack copies of more than this go straight into the caller's buffer
// (the driver stages pageable copies itself) rather than through the
// backend's pinned landing area, which would otherwise grow to the largest
// tensor ever exported (an embedding of hundreds of MB) and stay pinned.
constexpr size_t kMaxPinnedReadBackBytes = size_t{64} << 20;

// Makes the backend's device current for the rest of the scope.
#define AMPD_ENTER_DEVICE()                     \
  DeviceGuard ampd_device_guard_(ctx_->device); \
  AMPD_CUDA_RETURN_IF_ERROR(ampd_device_guard_.error())

// ---- memory -----------------------------------------------------------------
// What tensors of one backend share and what must outlive the backend while
// any of them lives: the stream (a freed block records its event there) and
// the live-bytes counter.
struct StreamContext {
  int device = 0;
  DevicePool* pool = nullptr;
  Stream stream;
  std::atomic<int64_t> bytes_in_use{0};

  ~StreamContext() {
    // Idle before destruction, so a later stream that happens to get the
    // same handle never mistakes a pending block for its own. The stream is
    // destroyed here, inside the guard, not after the body as a member
    // would be: by then another device may be current.
    DeviceGuard guard(device);
    if (stream.get() != nullptr) (void)cudaStreamSynchronize(stream.get());
    Stream released = std::move(stream);
  }
};

class PoolMemory final : public Memory {
 public:
  PoolMemory(std::shared_ptr<StreamContext> ctx, DevicePool::Block* block, size_t bytes)
      : ctx_(std::move(ctx)), block_(block), bytes_(bytes) {
    ctx_->bytes_in_use.fetch_add(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
  }
  ~PoolMemory() override {
    ctx_->bytes_in_use.fetch_sub(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
    ctx_->pool->Free(block_);
  }
  PoolMemory(const PoolMemory&) = delete;
  PoolMemory& operator=(const PoolMemory&) = delete;
  void* data() override { return block_->ptr; }
  size_t bytes() const override { return bytes_; }

 private:
  std::shared_ptr<StreamContext> ctx_;
  DevicePool::Block* block_;
  size_t bytes_;
};

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(int device,
                                                         const CudaBackendOptions& options) {
    DeviceGuard guard(device);
    AMPD_CUDA_RETURN_IF_ERROR(guard.error());
    // Waits (a step's one synchronisation) block the thread instead of
    // spinning: with one context CUDA's default spins, and a server with a
    // job worker per core waiting on the GPU at once would spin every core
    // away from the gRPC threads that feed it. Costs a wake-up (microseconds)
    // per wait. The flag is the device's, set again by every backend; a
    // runtime that will not change an active context's flags leaves them
    // (spinning works, only less well under load), so its error is dropped.
    if (cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
    backend->ctx_ = std::make_shared<StreamContext>();
    backend->ctx_->device = device;
    backend->ctx_->pool = &DevicePool::ForDevice(device);
    AMPD_ASSIGN_OR_RETURN(backend->ctx_->stream, Stream::Create());
    AMPD_ASSIGN_OR_RETURN(backend->cublas_, CublasHandle::Create());
    // Read once: cudaGetDeviceProperties costs a millisecond or more, and
    // admission asks for the capacity on every step.
    cudaDeviceProp props;
    AMPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device));
    backend->capacity_bytes_ = static_cast<int64_t>(props.totalGlobalMem);
    // The attention kernels' shared memory beyond 48 KiB is opted into once
    // here, never in a step.
    backend->attention_.max_dynamic_smem = static_cast<int>(props.sharedMemPerBlockOptin);
    backend->attention_.wmma_kernels = options.attention_wmma;
    AMPD_RETURN_IF_ERROR(ConfigureAttentionForward(backend->attention_));
    AMPD_RETURN_IF_ERROR(ConfigureAttentionBackward(backend->attention_));

    const cublasHandle_t h = backend->cublas_.get();
    AMPD_CUBLAS_RETURN_IF_ERROR(cublasSetStream(h, backend->stream()));
    // fp32 accumulation end to end: without this flag cuBLAS may reduce
    // split-K partial sums in the fp16/bf16 output type, rounding more than
    // once (PyTorch's allow_fp16_reduced_precision_reduction). Default math
    // otherwise: CUBLAS_COMPUTE_32F on fp32 inputs stays full fp32, no TF32.
    AMPD_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    AMPD_ASSIGN_OR_RETURN(
        backend->workspace_,
        backend->Allocate(DType::kF32, {static_cast<int64_t>(kCublasWorkspaceBytes / 4)}));
    AMPD_CUBLAS_RETURN_IF_ERROR(
        cublasSetWorkspace(h, backend->workspace_.data(), kCublasWorkspaceBytes));
    // cuBLASLt (the Linear ops' epilogues) shares the workspace: both
    // enqueue on the one stream, which orders their uses of it.
    if (options.gemm_epilogues) {
      AMPD_ASSIGN_OR_RETURN(
          backend->lt_, LtMatmul::Create(absl::StrCat("cuda:", device), backend->workspace_.data(),
                                         kCublasWorkspaceBytes));
    }
    AMPD_ASSIGN_OR_RETURN(backend->partials_,
                          backend->Allocate(DType::kF32, {kMaxReductionBlocks}));
    AMPD_ASSIGN_OR_RETURN(backend->error_word_, backend->Allocate(DType::kI32, {1}));
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(backend->error_word_.data(), 0, sizeof(int), backend->stream()));
    AMPD_RETURN_IF_ERROR(backend->ReserveScalarSlots(kStagingScalars));
    AMPD_ASSIGN_OR_RETURN(backend->upload_, PinnedHostBuffer::Create(kInitialUploadArenaBytes));
    // The workspace, scratch and slots are the backend's, not the caller's tensors.
    backend->internal_bytes_ = backend->ctx_->bytes_in_use.load();
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(backend->stream()));
    return std::unique_ptr<Backend>(std::move(backend));
  }

  NativeStream native_stream() override { return {stream(), ctx_->device}; }

  // GemmEpiloguePlans (cuda_backend.h).
  std::vector<std::string> EpiloguePlans() const {
    return lt_ != nullptr ? lt_->Describe() : std::vector<std::string>{};
  }

  ~CudaBackend() override {
    if (ctx_ == nullptr) return;
    // Everything is released inside the guard, in this body, rather than
    // by the member destructors after it, when the current device could be
    // another GPU's. The cuBLAS handles go before their workspace.
    DeviceGuard guard(ctx_->device);
    (void)cudaStreamSynchronize(stream());
    lt_.reset();
    { CublasHandle released = std::move(cublas_); }
    { Tensor released = std::move(workspace_); }
    { Tensor released = std::move(partials_); }
    { Tensor released = std::move(scratch_); }
    { Tensor released = std::move(error_word_); }
    { Tensor released = std::move(gathered_); }
    { PinnedHostBuffer released = std::move(staging_); }
    { PinnedHostBuffer released = std::move(upload_); }
    { PinnedHostBuffer released = std::move(readback_); }
    ctx_.reset();  // the stream too, unless a live tensor still holds it
  }

  std::string name() const override { return absl::StrCat("cuda:", ctx_->device); }

  // cuBLAS and cuBLASLt pick their kernel, tile and split-K by the shape
  // (M included), so a row's summation order changes with the batch. On,
  // every GEMM runs gemm_invariant.cu's fixed-order kernel instead and the
  // fused Linear ops take their separate-kernel paths (that GEMM into fp32,
  // then the bias/activation kernel); off, cuBLAS and cuBLASLt again. Only
  // a flag: no allocation, sync or device query, so it may be set between
  // any two ops.
  absl::Status SetBatchInvariant(bool on) override {
    batch_invariant_ = on;
    return absl::OkStatus();
  }

  absl::StatusOr<Tensor> Allocate(DType dtype, const Shape& shape) override {
    AMPD_RETURN_IF_ERROR(ValidateAllocate(shape));
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * SizeOf(dtype);
    AMPD_ENTER_DEVICE();
    AMPD_ASSIGN_OR_RETURN(auto* block, ctx_->pool->Allocate(bytes, stream()));
    allocations_.fetch_add(1, std::memory_order_relaxed);
    return Tensor(std::make_unique<PoolMemory>(ctx_, block, bytes), dtype, shape);
  }

  absl::Status CopyFromHost(const void* src, size_t bytes, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateCopyFromHost(src, bytes, dst));
    if (bytes == 0) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    if (bytes <= kMaxStagedUploadBytes) {
      // Batches: staged in the pinned arena, so the DMA is truly async. From
      // pageable memory the driver may wait for the stream before staging,
      // which would stall the second micro-batch's upload behind the first
      // one's compute.
      AMPD_ASSIGN_OR_RETURN(void* staged, StageUpload(src, bytes));
      AMPD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst.data(), staged, bytes, cudaMemcpyHostToDevice, stream()));
      return absl::OkStatus();
    }
    // Large copies (state loads) go straight from src. The copy is only
    // enqueued: from pageable memory the runtime usually returns once src
    // has been staged, but that is not guaranteed, so the contract in
    // backend.h is that src stays valid and unchanged until the next
    // synchronising call (Synchronize, CopyToHost, ReadScalars).
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data(), src, bytes, cudaMemcpyHostToDevice, stream()));
    return absl::OkStatus();
  }

  absl::Status CopyToHost(const Tensor& src, void* dst, size_t bytes) override {
    AMPD_RETURN_IF_ERROR(ValidateCopyToHost(src, dst, bytes));
    AMPD_ENTER_DEVICE();
    if (bytes > 0) {
      AMPD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src.data(), bytes, cudaMemcpyDeviceToHost, stream()));
    }
    return SyncAndTakeErrors();
  }

  absl::Status Copy(const Tensor& src, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateCopy(src, dst));
    if (src.nbytes() == 0 || src.data() == dst.data()) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
    return absl::OkStatus();
  }

  absl::Status CopyColumns(const Tensor& src, int64_t src_col, int64_t cols, Tensor& dst,
                           int64_t dst_col) override {
    AMPD_RETURN_IF_ERROR(ValidateCopyColumns(src, src_col, cols, dst, dst_col));
    if (src.dim(0) == 0 || cols == 0) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    const auto elem = static_cast<int64_t>(SizeOf(src.dtype()));
    return LaunchCopyColumns(static_cast<const unsigned char*>(src.data()) + src_col * elem,
                             src.dim(1) * elem,
                             static_cast<unsigned char*>(dst.data()) + dst_col * elem,
                             dst.dim(1) * elem, src.dim(0), cols * elem, elem, stream());
  }

  absl::Status Fill(Tensor& dst, float value) override {
    AMPD_RETURN_IF_ERROR(ValidateFill(dst));
    AMPD_ENTER_DEVICE();
    return LaunchFill(dst.data(), dst.dtype(), dst.numel(), value, stream());
  }

  absl::Status FillTensors(absl::Span<Tensor* const> dsts, float value) override {
    AMPD_RETURN_IF_ERROR(ValidateFillTensors(dsts));
    AMPD_ENTER_DEVICE();
    fill_spans_.clear();  // keeps its capacity: a step's zeroing allocates nothing
    for (Tensor* t : dsts) {
      if (t->numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t->data());
      const uintptr_t end = begin + t->nbytes();
      const uintptr_t base = begin & ~uintptr_t{15};
      FillSpan span;
      span.data = t->data();
      span.n = static_cast<int64_t>((end - base + 15) / 16);
      span.last_bytes = static_cast<uint32_t>(end - (base + 16 * (span.n - 1)));
      span.pattern = FillPattern(t->dtype(), value);
      fill_spans_.push_back(span);
    }
    return LaunchFillTensors(fill_spans_.data(), static_cast<int>(fill_spans_.size()), stream());
  }

  absl::Status FillRandom(Tensor& dst, const RandomFill& fill) override {
    AMPD_RETURN_IF_ERROR(ValidateFillRandom(dst, fill));
    AMPD_ENTER_DEVICE();
    return LaunchFillRandom(dst.data_as<float>(), dst.numel(), fill, stream());
  }

  absl::Status Cast(const Tensor& src, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateCast(src, dst));
    AMPD_ENTER_DEVICE();
    return LaunchCast(src.data(), src.dtype(), dst.data(), dst.dtype(), src.numel(), stream());
  }

  absl::Status Synchronize() override {
    AMPD_ENTER_DEVICE();
    return SyncAndTakeErrors();
  }

  absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                        absl::Span<const HostCopy> copies) override {
    // Everything is checked before the first copy is queued, so a bad call
    // enqueues nothing and leaves out untouched.
    AMPD_RETURN_IF_ERROR(ValidateReadBack(scalars, out.size(), copies));
    AMPD_ENTER_DEVICE();
    const size_t count = scalars.size();
    // Large copies go straight to their destination (pageable; the driver
    // stages them), the others side by side in readback_, 256-byte aligned.
    const auto direct = [](const HostCopy& c) { return c.bytes > kMaxPinnedReadBackBytes; };
    size_t copy_bytes = 0;
    for (const HostCopy& c : copies) {
      if (!direct(c)) copy_bytes += (c.bytes + 255) & ~size_t{255};
    }
    if (count > scalar_slots_ || copy_bytes > readback_.bytes()) {
      // Queued work may still target the old buffers; drain it first.
      AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
      if (count > scalar_slots_) AMPD_RETURN_IF_ERROR(ReserveScalarSlots(count));
      if (copy_bytes > readback_.bytes()) {
        readback_ = PinnedHostBuffer();
        AMPD_ASSIGN_OR_RETURN(readback_, PinnedHostBuffer::Create(copy_bytes));
      }
    }
    // The copies are queued into pinned memory: plain DMAs that stay
    // behind the step's kernels and share its one synchronisation.
    size_t offset = 0;
    for (const HostCopy& c : copies) {
      if (direct(c)) {
        // Into pageable memory: in stream order, done by the sync below.
        AMPD_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(c.dst, c.src->data(), c.bytes, cudaMemcpyDeviceToHost, stream()));
        continue;
      }
      if (c.bytes > 0) {
        AMPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(readback_.data()) + offset,
                                                  c.src->data(), c.bytes, cudaMemcpyDeviceToHost,
                                                  stream()));
      }
      offset += (c.bytes + 255) & ~size_t{255};
    }
    // Gather every scalar and the error word into one device block (one
    // kernel per kMaxGatherScalars scalars; the last one adds the word at
    // slot `count`), then one DMA into pinned memory: the synchronisation
    // below is the step's only host round trip.
    auto* gathered = gathered_.data_as<float>();
    size_t done = 0;
    do {
      GatherScalarsArgs args;
      args.count = static_cast<int>(std::min<size_t>(count - done, kMaxGatherScalars));
      for (int i = 0; i < args.count; ++i) args.src[i] = scalars[done + i]->data_as<float>();
      const bool last = done + static_cast<size_t>(args.count) == count;
      args.error_word = last ? error_word_.data_as<int>() : nullptr;
      AMPD_RETURN_IF_ERROR(LaunchGatherScalars(args, gathered + done, stream()));
      done += static_cast<size_t>(args.count);
    } while (done < count);
    AMPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        staging_.data(), gathered, (count + 1) * sizeof(float), cudaMemcpyDeviceToHost, stream()));
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    upload_used_ = 0;  // every queued upload has been read
    const auto* staged = static_cast<const float*>(staging_.data());
    for (size_t i = 0; i < count; ++i) out[i] = staged[i];
    offset = 0;
    for (const HostCopy& c : copies) {
      if (direct(c)) continue;  // already there
      if (c.bytes > 0) std::memcpy(c.dst, static_cast<char*>(readback_.data()) + offset, c.bytes);
      offset += (c.bytes + 255) & ~size_t{255};
    }
    int bits = 0;
    std::memcpy(&bits, staged + count, sizeof(bits));
    return TakeDeviceErrors(bits);
  }

  int64_t AllocationCount() const override { return allocations_.load(std::memory_order_relaxed); }
  int64_t BytesInUse() const override {
    return ctx_->bytes_in_use.load(std::memory_order_relaxed) - internal_bytes_;
  }
  int64_t MemoryCapacityBytes() const override { return capacity_bytes_; }

  // ---- dense algebra --------------------------------------------------------
  absl::Status AddScaled(const Tensor& x, float scale, Tensor& y) override {
    AMPD_RETURN_IF_ERROR(ValidateAdd(x, y));
    AMPD_ENTER_DEVICE();
    return LaunchAddScaled(x.data(), x.dtype(), scale, y.data(), y.dtype(), y.numel(), stream());
  }

  absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c) override {
    AMPD_RETURN_IF_ERROR(ValidateGemm(trans_a, trans_b, a, b, c));
    // op(a): (M, K), op(b): (K, N), c: (M, N); ValidateGemm has matched op(b)
    // and c to them and kept all three within cuBLAS's int.
    const int64_t m = trans_a ? a.dim(1) : a.dim(0);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    const int64_t n = trans_b ? b.dim(0) : b.dim(1);
    if (m == 0 || n == 0) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    if (k == 0) {  // empty sum: c = beta * c (beta == 0 never reads c, as BLAS)
      if (beta == 0.0f) return LaunchFill(c.data(), c.dtype(), c.numel(), 0.0f, stream());
      return LaunchScale(c.data(), c.dtype(), c.numel(), beta, stream());
    }
    if (batch_invariant_) {
      // One rounding of alpha * sum + beta * c for every c dtype and beta.
      return LaunchGemmInvariant(trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
                                 static_cast<int>(k), alpha, a.data(), static_cast<int>(a.dim(1)),
                                 b.data(), static_cast<int>(b.dim(1)), a.dtype(), beta, c.data(),
                                 c.dtype(), stream());
    }
    if (beta == 1.0f && c.dtype() != DType::kF32) {
      // Accumulating into a 16-bit c (a weight gradient's later
      // micro-batches, the LM head's gradient): on an H100 with cuBLAS 13,
      // beta == 1 with a 16-bit C takes kernels that round alpha op(a) op(b)
      // to C's type before adding C, two roundings where the contract has
      // one (measured: 4 to 12 ulps apart from the oracle where the sum and
      // C cancel; beta = 0.5 rounds once). So the sums go to fp32 scratch
      // and one kernel adds them to c with a single rounding.
      AMPD_ASSIGN_OR_RETURN(void* scratch, Scratch(static_cast<size_t>(m * n) * sizeof(float)));
      auto* sums = static_cast<float*>(scratch);  // (M, N) F32 = alpha op(a) op(b)
      AMPD_RETURN_IF_ERROR(GemmF32(trans_a, trans_b, alpha, a, b, m, n, k, sums));
      return LaunchAddScaled(sums, DType::kF32, 1.0f, c.data(), c.dtype(), m * n, stream());
    }
    return LaunchGemm(cublas_.get(), trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), alpha, a.data(), static_cast<int>(a.dim(1)), b.data(),
                      static_cast<int>(b.dim(1)), a.dtype(), beta, c.data(), c.dtype());
  }

  // ---- Linear layers: GEMMs with their epilogues ------------------------------
  // Each runs as one cuBLASLt matmul with the epilogue fused where lt_ has
  // an algorithm for the call (gemm_lt.h), else as the separate path: a
  // cuBLAS GEMM into fp32 and the epilogue's kernel, or Gemm then
  // BiasGrad. Both keep the contract in kernels/backend.h. Batch-invariant
  // mode always takes the separate path, its GEMM gemm_invariant.cu's
  // (the epilogue kernels are elementwise, so the bits stay row-local).
  absl::Status GemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                  const Tensor* bias, GemmActivation act, Tensor& c,
                                  Tensor* pre) override {
    AMPD_RETURN_IF_ERROR(ValidateGemmBiasActivation(trans_a, trans_b, a, b, bias, act, c, pre));
    // op(a): (M, K), op(b): (K, N), c and pre: (M, N), bias: (N).
    const int64_t m = c.dim(0);
    const int64_t n = c.dim(1);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    if (m == 0 || n == 0) return absl::OkStatus();
    const bool gelu = act == GemmActivation::kGELUTanh;
    if (bias == nullptr && !gelu) return Gemm(trans_a, trans_b, 1.0f, a, b, 0.0f, c);
    AMPD_ENTER_DEVICE();
    const DType dtype = c.dtype();
    // cuBLASLt's GELU is its own fp32 evaluation: F32 keeps the backend's
    // (ActivationForward's formula, as the separate ops computed it), and
    // the aux matrix's leading dimension must be a multiple of 8.
    const bool lt_gelu_ok = dtype != DType::kF32 && n % 8 == 0;
    if (UseLt() && k > 0 && bias != nullptr && (!gelu || lt_gelu_ok)) {
      LtMatmulArgs args = LtArgs(trans_a, trans_b, m, n, k, 1.0f, a, b, 0.0f, c);
      args.epilogue = gelu ? LtEpilogue::kGeluAuxBias : LtEpilogue::kBias;
      args.bias = const_cast<void*>(bias->data());  // read only (BIAS, GELU_AUX_BIAS)
      args.bias_dtype = bias->dtype();
      args.aux = gelu ? pre->data() : nullptr;
      AMPD_ASSIGN_OR_RETURN(const bool fused, lt_->Run(args, stream()));
      if (fused) return absl::OkStatus();
    }
    // The fp32 sums land where the epilogue kernel reads them: in place for
    // F32 (pre holds them for the GELU, c otherwise), else fp32 scratch.
    float* acc = nullptr;  // (M, N)
    if (dtype == DType::kF32) {
      acc = (gelu ? pre : &c)->data_as<float>();
    } else {
      AMPD_ASSIGN_OR_RETURN(void* scratch, Scratch(static_cast<size_t>(m * n) * sizeof(float)));
      acc = static_cast<float*>(scratch);
    }
    AMPD_RETURN_IF_ERROR(GemmF32(trans_a, trans_b, 1.0f, a, b, m, n, k, acc));
    return LaunchBiasActivation(acc, bias != nullptr ? bias->data() : nullptr, act,
                                gelu ? pre->data() : nullptr, c.data(), dtype, m, n, stream());
  }

  absl::Status GemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                            float beta, Tensor& c, BiasGradOf of, Tensor& dbias) override {
    AMPD_RETURN_IF_ERROR(ValidateGemmBiasGrad(trans_a, trans_b, a, b, c, of, dbias));
    // op(a): (M, K), op(b): (K, N), c: (M, N); dbias (M) for kA, (N) for kB.
    const int64_t m = c.dim(0);
    const int64_t n = c.dim(1);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    if (UseLt() && m > 0 && n > 0 && k > 0) {
      AMPD_ENTER_DEVICE();
      AMPD_ASSIGN_OR_RETURN(const bool fused,
                            FusedBiasGrad(trans_a, trans_b, a, b, beta, c, of, dbias, m, n, k));
      if (fused) return absl::OkStatus();
    }
    AMPD_RETURN_IF_ERROR(Gemm(trans_a, trans_b, 1.0f, a, b, beta, c));
    return BiasGrad(of == BiasGradOf::kA ? a : b, beta, dbias);  // dy stored (K, width)
  }

  absl::Status GemmActivationBackward(bool trans_a, bool trans_b, float alpha, const Tensor& a,
                                      const Tensor& b, GemmActivation act, const Tensor* pre,
                                      Tensor& c) override {
    AMPD_RETURN_IF_ERROR(ValidateGemmActivationBackward(trans_a, trans_b, a, b, act, pre, c));
    // op(a): (M, K), op(b): (K, N), c and pre: (M, N).
    const int64_t m = c.dim(0);
    const int64_t n = c.dim(1);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    if (m == 0 || n == 0) return absl::OkStatus();
    if (act == GemmActivation::kNone) return Gemm(trans_a, trans_b, alpha, a, b, 0.0f, c);
    AMPD_ENTER_DEVICE();
    const DType dtype = c.dtype();
    // DGELU for F16/BF16 only, as GELU_AUX_BIAS in GemmBiasActivation.
    if (UseLt() && k > 0 && dtype != DType::kF32 && n % 8 == 0) {
      LtMatmulArgs args = LtArgs(trans_a, trans_b, m, n, k, alpha, a, b, 0.0f, c);
      args.epilogue = LtEpilogue::kDGelu;
      args.aux = const_cast<void*>(pre->data());  // read only (DGELU)
      AMPD_ASSIGN_OR_RETURN(const bool fused, lt_->Run(args, stream()));
      if (fused) return absl::OkStatus();
    }
    // g = alpha op(a) op(b) in fp32 (in place in c for F32), then
    // c = g * gelu_tanh'(pre) rounded once.
    float* g = nullptr;  // (M, N)
    if (dtype == DType::kF32) {
      g = c.data_as<float>();
    } else {
      AMPD_ASSIGN_OR_RETURN(void* scratch, Scratch(static_cast<size_t>(m * n) * sizeof(float)));
      g = static_cast<float*>(scratch);
    }
    AMPD_RETURN_IF_ERROR(GemmF32(trans_a, trans_b, alpha, a, b, m, n, k, g));
    return LaunchActivationBackwardF32Grad(Activation::kGELUTanh, pre->data(), g, c.data(), dtype,
                                           m * n, stream());
  }

  absl::Status AddBias(const Tensor& bias, Tensor& y) override {
    AMPD_RETURN_IF_ERROR(ValidateAddBias(bias, y));
    AMPD_ENTER_DEVICE();
    return LaunchAddBias(bias.data(), bias.dtype(), y.data(), y.dtype(), y.dim(0), y.dim(1),
                         stream());
  }

  absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) override {
    AMPD_RETURN_IF_ERROR(ValidateBiasGrad(dy, dbias));
    AMPD_ENTER_DEVICE();
    const int64_t slabs = ColumnSumSlabs(dy.dim(0), dy.dim(1));
    float* partials = nullptr;  // (slabs, C) per-slab column sums, when the rows are split
    if (slabs > 1) {
      AMPD_ASSIGN_OR_RETURN(void* scratch,
                            Scratch(static_cast<size_t>(slabs * dy.dim(1)) * sizeof(float)));
      partials = static_cast<float*>(scratch);
    }
    return LaunchBiasGrad(dy.data(), dy.dtype(), dy.dim(0), dy.dim(1), beta, dbias.data(),
                          dbias.dtype(), partials, stream());
  }

  // ---- activations ----------------------------------------------------------
  absl::Status ActivationForward(Activation act, const Tensor& x, Tensor& y) override {
    AMPD_RETURN_IF_ERROR(ValidateActivationForward(act, x, y));
    AMPD_ENTER_DEVICE();
    return LaunchActivationForward(act, x.data(), y.data(), x.dtype(), x.numel(), stream());
  }

  absl::Status ActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                  Tensor& dx) override {
    AMPD_RETURN_IF_ERROR(ValidateActivationBackward(act, x, dy, dx));
    AMPD_ENTER_DEVICE();
    return LaunchActivationBackward(act, x.data(), dy.data(), dx.data(), x.dtype(), x.numel(),
                                    stream());
  }

  // ---- normalisation --------------------------------------------------------
  absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                                Tensor& y, Tensor& mean, Tensor& rstd) override {
    AMPD_RETURN_IF_ERROR(ValidateLayerNormForward(x, gamma, beta, y, mean, rstd));
    AMPD_ENTER_DEVICE();
    return LaunchLayerNormForward(x.data(), x.dtype(), gamma ? gamma->data() : nullptr, 0.0f,
                                  beta ? beta->data() : nullptr, x.dtype(), x.dim(0), x.dim(1), eps,
                                  y.data(), mean.data_as<float>(), rstd.data_as<float>(), stream(),
                                  NormRows::Plain(x.dim(1)));
  }

  absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                                 Tensor* dbeta) override {
    AMPD_RETURN_IF_ERROR(ValidateLayerNormBackward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta));
    AMPD_ENTER_DEVICE();
    const int64_t slabs = ColumnSumSlabs(x.dim(0), x.dim(1));
    float* partials = nullptr;  // (2, slabs, C) dgamma and dbeta sums, when the rows are split
    if (slabs > 1 && (dgamma != nullptr || dbeta != nullptr)) {
      AMPD_ASSIGN_OR_RETURN(void* scratch,
                            Scratch(static_cast<size_t>(2 * slabs * x.dim(1)) * sizeof(float)));
      partials = static_cast<float*>(scratch);
    }
    return LaunchLayerNormBackward(
        x.data(), x.dtype(), gamma ? gamma->data() : nullptr, x.dtype(), 0.0f,
        mean.data_as<float>(), rstd.data_as<float>(), dy.data(), dx.data(),
        dgamma ? dgamma->data() : nullptr, dgamma ? dgamma->dtype() : DType::kF32,
        dbeta ? dbeta->data() : nullptr, dbeta ? dbeta->dtype() : DType::kF32, x.dim(0), x.dim(1),
        partials, stream(), NormRows::Plain(x.dim(1)));
  }

  using Backend::RmsNormBackward;
  using Backend::RmsNormForward;
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, float weight_offset,
                              Tensor& y, Tensor& rstd) override {
    AMPD_RETURN_IF_ERROR(ValidateRmsNormForward(x, weight, y, rstd));
    AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "RmsNormForward"));
    AMPD_ENTER_DEVICE();
    return LaunchLayerNormForward(x.data(), x.dtype(), weight.data(), weight_offset, nullptr,
                                  x.dtype(), x.dim(0), x.dim(1), eps, y.data(), nullptr,
                                  rstd.data_as<float>(), stream(), NormRows::Plain(x.dim(1)));
  }

  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, float weight_offset,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx,
                               Tensor* dweight) override {
    AMPD_RETURN_IF_ERROR(ValidateRmsNormBackward(x, weight, rstd, dy, dx, dweight));
    AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "RmsNormBackward"));
    AMPD_ENTER_DEVICE();
    const int64_t slabs = ColumnSumSlabs(x.dim(0), x.dim(1));
    float* partials = nullptr;  // (2, slabs, C): dweight's sums (the second half unused)
    // A frozen weight (dweight null): the launcher runs only the dx kernel,
    // so no scratch is taken either.
    if (slabs > 1 && dweight != nullptr) {
      AMPD_ASSIGN_OR_RETURN(void* scratch,
                            Scratch(static_cast<size_t>(2 * slabs * x.dim(1)) * sizeof(float)));
      partials = static_cast<float*>(scratch);
    }
    return LaunchLayerNormBackward(
        x.data(), x.dtype(), weight.data(), x.dtype(), weight_offset, nullptr,
        rstd.data_as<float>(), dy.data(), dx.data(), dweight ? dweight->data() : nullptr,
        dweight ? dweight->dtype() : DType::kF32, nullptr, DType::kF32, x.dim(0), x.dim(1),
        partials, stream(), NormRows::Plain(x.dim(1)));
  }

  // The RMSNorm kernels over each head's columns: R x heads rows of D.
  using Backend::HeadRmsNormBackward;
  using Backend::HeadRmsNormForward;
  absl::Status HeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads, const Tensor& weight,
                                  float eps, float weight_offset, Tensor& y,
                                  Tensor& rstd) override {
    AMPD_RETURN_IF_ERROR(ValidateHeadRmsNormForward(x, col, heads, weight, y, rstd));
    AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "HeadRmsNormForward"));
    AMPD_ENTER_DEVICE();
    const int64_t d = weight.dim(0);
    return LaunchLayerNormForward(x.data(), x.dtype(), weight.data(), weight_offset, nullptr,
                                  x.dtype(), x.dim(0) * heads, d, eps, y.data(), nullptr,
                                  rstd.data_as<float>(), stream(), NormRows{heads, x.dim(1), col});
  }

  absl::Status HeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                   const Tensor& weight, float weight_offset, const Tensor& rstd,
                                   const Tensor& dy, Tensor& dx, Tensor* dweight) override {
    AMPD_RETURN_IF_ERROR(ValidateHeadRmsNormBackward(x, col, heads, weight, rstd, dy, dx, dweight));
    AMPD_RETURN_IF_ERROR(ValidateRmsNormOffset(weight_offset, "HeadRmsNormBackward"));
    AMPD_ENTER_DEVICE();
    const int64_t rows = x.dim(0) * heads;
    const int64_t d = weight.dim(0);
    const int64_t slabs = ColumnSumSlabs(rows, d);
    float* partials = nullptr;  // (2, slabs, D): dweight's sums (the second half unused)
    if (slabs > 1 && dweight != nullptr) {
      AMPD_ASSIGN_OR_RETURN(void* scratch,
                            Scratch(static_cast<size_t>(2 * slabs * d) * sizeof(float)));
      partials = static_cast<float*>(scratch);
    }
    return LaunchLayerNormBackward(x.data(), x.dtype(), weight.data(), x.dtype(), weight_offset,
                                   nullptr, rstd.data_as<float>(), dy.data(), dx.data(),
                                   dweight ? dweight->data() : nullptr,
                                   dweight ? dweight->dtype() : DType::kF32, nullptr, DType::kF32,
                                   rows, d, partials, stream(), NormRows{heads, x.dim(1), col});
  }

  // ---- grouped-query K/V heads --------------------------------------------------
  absl::Status ExpandKvHeads(const Tensor& src, int64_t heads, int64_t kv_heads,
                             Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(ValidateKvHeads("ExpandKvHeads", src, heads, kv_heads, dst));
    AMPD_ENTER_DEVICE();
    return LaunchKvHeads(true, src.data(), dst.data(), src.dtype(), src.dim(0) * src.dim(1), heads,
                         kv_heads, src.dim(2) / (heads + 2 * kv_heads), stream());
  }

  absl::Status ReduceKvHeads(const Tensor& dexpanded, int64_t heads, int64_t kv_heads,
                             Tensor& dsrc) override {
    AMPD_RETURN_IF_ERROR(ValidateKvHeads("ReduceKvHeads", dsrc, heads, kv_heads, dexpanded));
    AMPD_ENTER_DEVICE();
    return LaunchKvHeads(false, dexpanded.data(), dsrc.data(), dsrc.dtype(),
                         dsrc.dim(0) * dsrc.dim(1), heads, kv_heads,
                         dsrc.dim(2) / (heads + 2 * kv_heads), stream());
  }

  // ---- rotary position embeddings and SwiGLU ----------------------------------
  absl::Status Rope(Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                    const Tensor* positions, bool inverse) override {
    AMPD_RETURN_IF_ERROR(ValidateRope(x, heads, head_dim, inv_freq, positions));
    AMPD_ENTER_DEVICE();
    return LaunchRope(x.data(), x.dtype(), x.dim(0), x.dim(1), x.dim(2), heads, head_dim,
                      inv_freq.data_as<float>(), positions ? positions->data() : nullptr,
                      positions ? positions->dtype() : DType::kI64, inverse, stream());
  }

  absl::Status GatedMulForward(GluActivation act, const Tensor& gate, const Tensor& up,
                               Tensor& y) override {
    AMPD_RETURN_IF_ERROR(ValidateGluActivation(act, "GatedMulForward"));
    AMPD_RETURN_IF_ERROR(ValidateGatedMulForward(gate, up, y));
    AMPD_ENTER_DEVICE();
    return LaunchGatedMulForward(act, gate.data(), up.data(), y.data(), gate.dtype(), gate.numel(),
                                 stream());
  }

  absl::Status GatedMulBackward(GluActivation act, const Tensor& gate, const Tensor& up,
                                const Tensor& dy, Tensor& dgate, Tensor& dup) override {
    AMPD_RETURN_IF_ERROR(ValidateGluActivation(act, "GatedMulBackward"));
    AMPD_RETURN_IF_ERROR(ValidateGatedMulBackward(gate, up, dy, dgate, dup));
    AMPD_ENTER_DEVICE();
    return LaunchGatedMulBackward(act, gate.data(), up.data(), dy.data(), dgate.data(), dup.data(),
                                  gate.dtype(), gate.numel(), stream());
  }

  // ---- embedding ------------------------------------------------------------
  using Backend::EmbeddingBackward;
  using Backend::EmbeddingForward;
  absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, float scale,
                                Tensor& out) override {
    // Ids outside [0, V) are caught on the device (the error word), not
    // here: that would need the ids on the host.
    AMPD_RETURN_IF_ERROR(ValidateEmbeddingForward(ids, table, out));
    AMPD_RETURN_IF_ERROR(ValidateEmbeddingScale(scale, "EmbeddingForward"));
    AMPD_ENTER_DEVICE();
    return LaunchEmbeddingForward(ids.data(), ids.dtype(), ids.dim(0), table.data(), table.dtype(),
                                  table.dim(0), table.dim(1), scale, out.data(),
                                  error_word_.data_as<int>(), stream());
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, float scale,
                                 Tensor& dtable) override {
    AMPD_RETURN_IF_ERROR(ValidateEmbeddingBackward(ids, dout, dtable));
    AMPD_RETURN_IF_ERROR(ValidateEmbeddingScale(scale, "EmbeddingBackward"));
    if (ids.dim(0) == 0) return absl::OkStatus();  // nothing to scatter
    AMPD_ENTER_DEVICE();
    // Scratch for the deterministic sort-and-segment scatter (embedding.cu);
    // only rows of dtable that ids touch are read or written, whatever its
    // dtype, so no full-table copy.
    size_t scratch_bytes = 0;
    AMPD_RETURN_IF_ERROR(EmbeddingBackwardScratchBytes(ids.dim(0), dtable.dim(0), &scratch_bytes));
    void* scratch = nullptr;  // pool blocks are 256-byte aligned, as the sort needs
    if (scratch_bytes > 0) {
      AMPD_ASSIGN_OR_RETURN(scratch, Scratch(scratch_bytes));
    }
    return LaunchEmbeddingBackward(ids.data(), ids.dtype(), ids.dim(0), dout.data(), dout.dtype(),
                                   scale, dtable.data(), dtable.dtype(), dtable.dim(0),
                                   dtable.dim(1), scratch, scratch_bytes,
                                   error_word_.data_as<int>(), stream());
  }

  // ---- losses ---------------------------------------------------------------
  absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                       Tensor& loss, Tensor& dpred) override {
    AMPD_RETURN_IF_ERROR(ValidateMseLoss(pred, target, loss, dpred));
    AMPD_ENTER_DEVICE();
    return LaunchMseLoss(pred.data(), pred.dtype(), target.data_as<float>(), pred.numel(),
                         multiplier, grad_scale, loss.data_as<float>(), dpred.data(),
                         partials_.data_as<float>(), stream());
  }

  absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                                float grad_scale, Tensor& loss, Tensor& dlogits) override {
    // Labels outside [0, V) are caught on the device, as embedding ids are.
    AMPD_RETURN_IF_ERROR(ValidateCrossEntropyLoss(logits, labels, loss, dlogits));
    AMPD_ENTER_DEVICE();
    return LaunchCrossEntropy(logits.data(), logits.dtype(), labels.data(), labels.dtype(),
                              logits.dim(0), logits.dim(1), multiplier, grad_scale,
                              loss.data_as<float>(), dlogits.data(), partials_.data_as<float>(),
                              error_word_.data_as<int>(), stream());
  }

  using Backend::CrossEntropyChunk;
  absl::Status CrossEntropyChunk(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                 const TokenLossTerms& terms, float loss_scale, float grad_scale,
                                 Tensor& loss, Tensor& dlogits) override {
    // Bad labels are flagged on the device (the error word), as above.
    AMPD_RETURN_IF_ERROR(ValidateCrossEntropyChunk(logits, labels, terms, loss, dlogits));
    AMPD_ENTER_DEVICE();
    return LaunchCrossEntropyChunk(
        logits.data(), logits.dtype(), labels.data(), labels.dtype(), logits.dim(0), logits.dim(1),
        ignore_index, terms, loss_scale, grad_scale, loss.data_as<float>(), dlogits.data(),
        partials_.data_as<float>(), error_word_.data_as<int>(), stream());
  }
  absl::Status LabelLogprobs(const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                             float temperature, Tensor& logprobs) override {
    AMPD_RETURN_IF_ERROR(ValidateLabelLogprobs(logits, labels, temperature, logprobs));
    AMPD_ENTER_DEVICE();
    return LaunchLabelLogprobs(logits.data(), logits.dtype(), labels.data(), labels.dtype(),
                               logits.dim(0), logits.dim(1), ignore_index, temperature,
                               logprobs.data_as<float>(), partials_.data_as<float>(),
                               error_word_.data_as<int>(), stream());
  }

  // ---- causal self-attention ----------------------------------------------------
  // Fused kernels, one launch forward, two or three backward; the
  // backward's Delta (B, H, T) F32 lives in the grow-only scratch.
  using Backend::AttentionBackward;
  using Backend::AttentionDecode;
  using Backend::AttentionForward;
  absl::Status AttentionForward(const Tensor& qkv, int64_t n_head, const AttentionOptions& options,
                                Tensor& out, Tensor& lse) override {
    AMPD_RETURN_IF_ERROR(ValidateAttentionForward(qkv, n_head, out, lse));
    AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionForward"));
    AMPD_ENTER_DEVICE();
    return LaunchAttentionForward(qkv.data(), qkv.dtype(), qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3,
                                  n_head, options, out.data(), lse.data_as<float>(), attention_,
                                  stream());
  }

  absl::Status WriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                           const Tensor& positions, Tensor& k_cache, Tensor& v_cache) override {
    AMPD_RETURN_IF_ERROR(ValidateWriteKvRows(rows, k_col, v_col, positions, k_cache, v_cache));
    AMPD_ENTER_DEVICE();
    const auto elem = static_cast<int64_t>(SizeOf(rows.dtype()));
    // positions stay on the device (no sync to check them here): the
    // kernel skips a sequence whose position is out of range.
    return LaunchWriteKvRows(rows.data(), rows.dim(1) * elem, k_col * elem, v_col * elem,
                             positions.data(), positions.dtype(), rows.dim(0), k_cache.dim(1),
                             k_cache.dim(2) * elem, elem, k_cache.data(), v_cache.data(), stream());
  }

  absl::Status SampleTokens(const Tensor& logits, const Tensor& live, const SampleParams& params,
                            Tensor& tokens) override {
    AMPD_RETURN_IF_ERROR(ValidateSampleTokens(logits, live, params, tokens));
    AMPD_ENTER_DEVICE();
    const int64_t* keys = params.keys != nullptr ? params.keys->data_as<int64_t>() : nullptr;
    float* log_kept = params.log_kept != nullptr ? params.log_kept->data_as<float>() : nullptr;
    return LaunchSampleTokens(logits.data(), logits.dtype(), logits.dim(0), logits.dim(1),
                              live.data_as<int64_t>(), keys, params, tokens.data_as<int64_t>(),
                              log_kept, stream());
  }

  absl::Status AttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const Tensor& positions, int64_t heads, int64_t kv_heads,
                               const AttentionOptions& options, Tensor& out) override {
    AMPD_RETURN_IF_ERROR(
        ValidateAttentionDecode(q, k_cache, v_cache, positions, heads, kv_heads, out));
    AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionDecode"));
    AMPD_ENTER_DEVICE();
    // positions stay on the device (no sync to check them here): the
    // kernel turns one out of range into NaN rows, never a stray read.
    return LaunchAttentionDecode(q.data(), k_cache.data(), v_cache.data(), positions.data(),
                                 q.dtype(), positions.dtype(), q.dim(0), k_cache.dim(1), heads,
                                 kv_heads, q.dim(1) / heads, options, out.data(), attention_,
                                 stream());
  }
  absl::Status AttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                 const Tensor& lse, int64_t n_head, const AttentionOptions& options,
                                 Tensor& dqkv) override {
    AMPD_RETURN_IF_ERROR(ValidateAttentionBackward(qkv, out, dout, lse, n_head, dqkv));
    AMPD_RETURN_IF_ERROR(ValidateAttentionOptions(options, "AttentionBackward"));
    AMPD_ENTER_DEVICE();
    float* delta = nullptr;  // (B, n_head, T)
    if (lse.numel() > 0) {
      AMPD_ASSIGN_OR_RETURN(void* scratch,
                            Scratch(static_cast<size_t>(lse.numel()) * sizeof(float)));
      delta = static_cast<float*>(scratch);
    }
    return LaunchAttentionBackward(qkv.data(), out.data(), dout.data(), lse.data_as<float>(),
                                   qkv.dtype(), qkv.dim(0), qkv.dim(1), qkv.dim(2) / 3, n_head,
                                   options, dqkv.data(), delta, attention_, stream());
  }

  // ---- loss scaling and the optimizer -----------------------------------------
  using Backend::UnscaleAndCheck;
  absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                               Tensor& found_inf, Tensor* norm_sq, Tensor* max_abs) override {
    AMPD_RETURN_IF_ERROR(ValidateUnscaleAndCheck(grads, found_inf, norm_sq, max_abs));
    const std::vector<GradSpan> spans = ToGradSpans(grads.data(), grads.size());
    AMPD_ENTER_DEVICE();
    // One fp32 partial per block for the deterministic two-stage norm.
    const int64_t blocks = UnscaleAndCheckBlocks(spans.data(), static_cast<int>(spans.size()));
    float* partials = nullptr;  // (blocks)
    if (norm_sq != nullptr && blocks > 0) {
      AMPD_ASSIGN_OR_RETURN(void* scratch, Scratch(static_cast<size_t>(blocks) * sizeof(float)));
      partials = static_cast<float*>(scratch);
    }
    return LaunchUnscaleAndCheck(spans.data(), static_cast<int>(spans.size()), inv_scale, in_place,
                                 found_inf.data_as<float>(),
                                 norm_sq ? norm_sq->data_as<float>() : nullptr, partials,
                                 max_abs ? max_abs->data_as<float>() : nullptr, stream());
  }

  absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config, int64_t step,
                          const GradTransform& transform) override {
    AMPD_RETURN_IF_ERROR(ValidateAdamUpdate(params, step, transform));
    const TransformArgs targs = ToTransformArgs(transform);
    const std::vector<ParamSpan> spans = ToParamSpans(params, true, true);
    // Bias corrections in double on the host, as PyTorch computes them in
    // Python floats, then rounded once to fp32 (the CPU oracle does the same).
    const double bias_correction1 = 1.0 - std::pow(static_cast<double>(config.beta1), step);
    const double bias_correction2 = 1.0 - std::pow(static_cast<double>(config.beta2), step);
    AdamArgs args{};
    args.lr = config.lr;
    args.beta1 = config.beta1;
    args.beta2 = config.beta2;
    args.eps = config.eps;
    args.weight_decay = config.weight_decay;
    args.decoupled = config.decoupled_weight_decay;
    args.step_size = static_cast<float>(config.lr / bias_correction1);
    args.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    AMPD_ENTER_DEVICE();
    return LaunchAdamUpdate(spans.data(), static_cast<int>(spans.size()), args, targs, stream());
  }

  absl::Status SgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                         bool first_step, const GradTransform& transform) override {
    AMPD_RETURN_IF_ERROR(ValidateSgdUpdate(params, config, transform));
    const TransformArgs targs = ToTransformArgs(transform);
    const bool use_momentum = config.momentum != 0.0f;  // state0 was required exactly then
    const std::vector<ParamSpan> spans = ToParamSpans(params, use_momentum, false);
    SgdArgs args{};
    args.lr = config.lr;
    args.momentum = config.momentum;
    args.dampening = config.dampening;
    args.weight_decay = config.weight_decay;
    args.nesterov = config.nesterov;
    args.first_step = first_step;
    AMPD_ENTER_DEVICE();
    return LaunchSgdUpdate(spans.data(), static_cast<int>(spans.size()), args, targs, stream());
  }

  // ---- observability ----------------------------------------------------------
  absl::Status GradLog2Histogram(absl::Span<const Tensor* const> grads, Tensor& counts) override {
    AMPD_RETURN_IF_ERROR(ValidateGradLog2Histogram(grads, counts));
    const std::vector<GradSpan> spans = ToGradSpans(grads.data(), grads.size());
    AMPD_ENTER_DEVICE();
    return LaunchGradHistogram(spans.data(), static_cast<int>(spans.size()),
                               counts.data_as<int64_t>(), stream());
  }

 private:
  CudaBackend() = default;

  cudaStream_t stream() const { return ctx_->stream.get(); }

  // A cuBLASLt call in the row-major terms of the op: c (m, n) = alpha
  // op(a) op(b) + beta c; the caller sets the epilogue and its pointers.
  static LtMatmulArgs LtArgs(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                             float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
    LtMatmulArgs args;
    args.trans_a = trans_a;
    args.trans_b = trans_b;
    args.m = static_cast<int>(m);  // within int: the op's validation checked
    args.n = static_cast<int>(n);
    args.k = static_cast<int>(k);
    args.a = a.data();
    args.b = b.data();
    args.ab_dtype = a.dtype();
    args.c = c.data();
    args.c_dtype = c.dtype();
    args.alpha = alpha;
    args.beta = beta;
    return args;
  }

  // Whether a Linear op may try its cuBLASLt epilogue: not in
  // batch-invariant mode, whose GEMMs are all gemm_invariant.cu's.
  bool UseLt() const { return lt_ != nullptr && !batch_invariant_; }

  // out (m, n) F32 = alpha op(a) op(b), the unrounded sums (zeros for k == 0).
  absl::Status GemmF32(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                       int64_t m, int64_t n, int64_t k, float* out) {
    if (k == 0) return LaunchFill(out, DType::kF32, m * n, 0.0f, stream());
    if (batch_invariant_) {
      return LaunchGemmInvariant(trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
                                 static_cast<int>(k), alpha, a.data(), static_cast<int>(a.dim(1)),
                                 b.data(), static_cast<int>(b.dim(1)), a.dtype(), 0.0f, out,
                                 DType::kF32, stream());
    }
    return LaunchGemm(cublas_.get(), trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), alpha, a.data(), static_cast<int>(a.dim(1)), b.data(),
                      static_cast<int>(b.dim(1)), a.dtype(), 0.0f, out, DType::kF32);
  }

  // GemmBiasGrad as one cuBLASLt matmul with BGRADA/BGRADB, when that keeps
  // the contract's one rounding of sum + beta * dbias; false (nothing
  // enqueued) when it cannot. cuBLASLt writes the bias gradient without a
  // beta, in c's type unless told otherwise, so:
  // - an fp32 sum (asked for explicitly when c is 16-bit) goes straight
  //   into an F32 dbias when beta == 0, else into fp32 scratch, then into
  //   dbias with one rounding by Cast (beta 0) or AddScaled (beta 1);
  // - a sum in c's 16-bit type, where cuBLASLt takes no fp32 one, is used
  //   only when it is the final value: beta == 0 and dbias of c's dtype.
  absl::StatusOr<bool> FusedBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                     float beta, Tensor& c, BiasGradOf of, Tensor& dbias, int64_t m,
                                     int64_t n, int64_t k) {
    if (beta != 0.0f && beta != 1.0f) return false;
    // cuBLASLt with beta == 1 and a 16-bit c rounds the product before
    // adding c (see Gemm): Gemm's exact path, then BiasGrad.
    if (beta != 0.0f && c.dtype() != DType::kF32) return false;
    const int64_t width = dbias.numel();
    for (const DType sum_dtype : {DType::kF32, c.dtype()}) {
      const bool direct = beta == 0.0f && dbias.dtype() == sum_dtype;
      if (sum_dtype != DType::kF32 && !direct) continue;
      void* target = dbias.data();  // (width) of sum_dtype
      if (!direct) {
        AMPD_ASSIGN_OR_RETURN(target, Scratch(static_cast<size_t>(width) * sizeof(float)));
      }
      LtMatmulArgs args = LtArgs(trans_a, trans_b, m, n, k, 1.0f, a, b, beta, c);
      args.epilogue = of == BiasGradOf::kA ? LtEpilogue::kBGradA : LtEpilogue::kBGradB;
      args.bias = target;
      args.bias_dtype = sum_dtype;
      AMPD_ASSIGN_OR_RETURN(const bool fused, lt_->Run(args, stream()));
      if (!fused) continue;
      if (direct) return true;
      const auto* sums = static_cast<const float*>(target);  // (width) F32
      if (beta == 0.0f) {
        AMPD_RETURN_IF_ERROR(
            LaunchCast(sums, DType::kF32, dbias.data(), dbias.dtype(), width, stream()));
      } else {
        AMPD_RETURN_IF_ERROR(
            LaunchAddScaled(sums, DType::kF32, 1.0f, dbias.data(), dbias.dtype(), width, stream()));
      }
      return true;
    }
    return false;
  }

  // Grow-only device scratch for one op at a time (reduction partials, the
  // embedding sort): ops run in stream order, so the next op's use of the
  // same bytes starts after this one's kernels end. A larger request
  // replaces the buffer; the pool keeps the old block until the stream has
  // passed it. Only a shape larger than any seen before allocates.
  absl::StatusOr<void*> Scratch(size_t bytes) {
    if (scratch_.nbytes() < bytes) {
      const size_t old_bytes = scratch_.nbytes();
      scratch_ = Tensor();
      absl::StatusOr<Tensor> grown = Allocate(
          DType::kF32, {static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))});
      if (!grown.ok()) {
        internal_bytes_ -= static_cast<int64_t>(old_bytes);
        return grown.status();
      }
      scratch_ = *std::move(grown);
      internal_bytes_ += static_cast<int64_t>(scratch_.nbytes()) - static_cast<int64_t>(old_bytes);
    }
    return scratch_.data();
  }

  // ReadScalars' device block and pinned landing area for `count` scalars
  // plus the error word. Call with the stream idle (the old ones may be the
  // target of queued copies).
  absl::Status ReserveScalarSlots(size_t count) {
    const size_t old_bytes = gathered_.nbytes();
    AMPD_ASSIGN_OR_RETURN(Tensor gathered,
                          Allocate(DType::kF32, {static_cast<int64_t>(count + 1)}));
    AMPD_ASSIGN_OR_RETURN(PinnedHostBuffer staging,
                          PinnedHostBuffer::Create((count + 1) * sizeof(float)));
    gathered_ = std::move(gathered);
    staging_ = std::move(staging);
    internal_bytes_ += static_cast<int64_t>(gathered_.nbytes()) - static_cast<int64_t>(old_bytes);
    scalar_slots_ = count;
    return absl::OkStatus();
  }

  // Copies src into the pinned upload arena and returns where. The arena is
  // reused from the start after every synchronisation (all its DMAs have
  // then completed); when one step's uploads outgrow it, the stream is
  // drained once and the arena doubled, up to kMaxUploadArenaBytes, so
  // later steps of that size fit. (bytes <= kMaxStagedUploadBytes.)
  absl::StatusOr<void*> StageUpload(const void* src, size_t bytes) {
    if (upload_used_ + bytes > upload_.bytes()) {
      if (upload_used_ > 0) {
        AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
        upload_used_ = 0;
      }
      if (bytes > upload_.bytes()) {
        const size_t grown_bytes =
            std::max(bytes, std::min(2 * upload_.bytes(), kMaxUploadArenaBytes));
        upload_ = PinnedHostBuffer();
        AMPD_ASSIGN_OR_RETURN(upload_, PinnedHostBuffer::Create(grown_bytes));
      } else if (2 * upload_.bytes() <= kMaxUploadArenaBytes) {
        // Outgrown by several uploads together: double for the next step.
        const size_t grown_bytes = 2 * upload_.bytes();
        absl::StatusOr<PinnedHostBuffer> grown = PinnedHostBuffer::Create(grown_bytes);
        if (grown.ok()) upload_ = *std::move(grown);
      }
    }
    // 256-byte alignment keeps every DMA source aligned.
    void* at = static_cast<char*>(upload_.data()) + upload_used_;
    std::memcpy(at, src, bytes);
    upload_used_ += (bytes + 255) & ~size_t{255};
    return at;
  }

  // Waits for the stream with the error word's copy queued behind its work,
  // then reports the word's bits.
  absl::Status SyncAndTakeErrors() {
    int* word = reinterpret_cast<int*>(static_cast<float*>(staging_.data()) + scalar_slots_);
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(word, error_word_.data(), sizeof(int), cudaMemcpyDeviceToHost, stream()));
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    upload_used_ = 0;
    return TakeDeviceErrors(*word);
  }

  // Turns the error word's bits, read after a synchronisation, into a
  // Status, and clears the word on the device (queued: it runs before the
  // next op, and costs nothing when no bit was set).
  absl::Status TakeDeviceErrors(int bits) {
    if (bits == 0) return absl::OkStatus();
    AMPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(error_word_.data(), 0, sizeof(int), stream()));
    std::string what;
    if (bits & kErrorEmbeddingId) {
      what =
          "EmbeddingForward/EmbeddingBackward: ids held an id outside [0, V) (its output "
          "row was zeroed, its gradient dropped)";
    }
    if (bits & kErrorCrossEntropyLabel) {
      absl::StrAppend(&what, what.empty() ? "" : "; ",
                      "CrossEntropyLoss: labels held a label outside [0, V) (its row counted 0 "
                      "and got a zero gradient)");
    }
    if (bits & kErrorCrossEntropyChunkLabel) {
      absl::StrAppend(&what, what.empty() ? "" : "; ",
                      "CrossEntropyChunk: labels held a label outside [0, V) that is not "
                      "ignore_index (its row was ignored: no loss, a zero gradient)");
    }
    return absl::InvalidArgumentError(
        absl::StrCat(what, "; detected on the device, reported at the next synchronisation"));
  }

  // value rounded once to dtype (kernels/float16.h: the device's RNE
  // conversions, bit for bit), as the 32-bit word FillTensors replicates.
  static uint32_t FillPattern(DType dtype, float value) {
    switch (dtype) {
      case DType::kF16:
        return uint32_t{FloatToHalfBits(value)} * 0x10001u;
      case DType::kBF16:
        return uint32_t{FloatToBf16Bits(value)} * 0x10001u;
      default:
        return std::bit_cast<uint32_t>(value);
    }
  }

  // Launcher views of arguments the op_checks validation has accepted.
  static std::vector<GradSpan> ToGradSpans(const Tensor* const* grads, size_t count) {
    std::vector<GradSpan> spans;
    spans.reserve(count);
    for (size_t t = 0; t < count; ++t) {
      // The span's pointer is written only by in-place unscaling, whose
      // caller handed over mutable tensors.
      spans.push_back(
          GradSpan{const_cast<void*>(grads[t]->data()), grads[t]->dtype(), grads[t]->numel()});
    }
    return spans;
  }

  TransformArgs ToTransformArgs(const GradTransform& tr) {
    TransformArgs out;
    out.inv_scale = tr.inv_scale;
    out.found_inf = tr.found_inf->data_as<float>();
    out.norm_sq = tr.norm_sq ? tr.norm_sq->data_as<float>() : nullptr;
    out.max_grad_norm = tr.max_grad_norm;
    out.error_flags = error_word_.data_as<int>();
    return out;
  }

  // State buffers the optimizer does not use are passed as nullptr: they
  // were not validated, so they may be absent or of any shape.
  static std::vector<ParamSpan> ToParamSpans(absl::Span<const ParamRef> params, bool use_state0,
                                             bool use_state1) {
    std::vector<ParamSpan> spans;
    spans.reserve(params.size());
    for (const ParamRef& p : params) {
      ParamSpan s;
      s.master = p.master->data_as<float>();
      s.working = p.working ? p.working->data() : nullptr;
      s.working_dtype = p.working ? p.working->dtype() : DType::kF32;
      s.grad = p.grad->data();
      s.grad_dtype = p.grad->dtype();
      s.state0 = use_state0 ? p.state0->data_as<float>() : nullptr;
      s.state1 = use_state1 ? p.state1->data_as<float>() : nullptr;
      s.n = p.master->numel();
      spans.push_back(s);
    }
    return spans;
  }

  // Declared first: destroyed last, after every tensor member below.
  std::shared_ptr<StreamContext> ctx_;
  CublasHandle cublas_;
  std::unique_ptr<LtMatmul> lt_;  // cuBLASLt epilogue plans; null: epilogues off
  // SetBatchInvariant's mode. Set between ops by the job that owns the
  // backend; read by the GEMM ops.
  bool batch_invariant_ = false;
  Tensor workspace_;          // (8M) F32: cuBLAS and cuBLASLt workspace, 32 MiB
  Tensor partials_;           // (kMaxReductionBlocks) F32: loss reduction partial sums
  Tensor scratch_;            // grow-only op scratch (Scratch)
  Tensor error_word_;         // (1) I32: kError* bits the kernels raise, device memory
  Tensor gathered_;           // (scalar_slots_ + 1) F32: ReadScalars' device block
  PinnedHostBuffer staging_;  // (scalar_slots_ + 1) floats: ReadScalars' landing area
  size_t scalar_slots_ = 0;
  int64_t capacity_bytes_ = 0;       // the device's total memory, read at creation
  AttentionKernelConfig attention_;  // what the attention kernels may use, read at creation
  PinnedHostBuffer readback_;        // ReadBack's copies land here first
  PinnedHostBuffer upload_;          // pinned arena for CopyFromHost's staged uploads
  size_t upload_used_ = 0;           // bytes of upload_ handed out since the last synchronisation

  std::vector<FillSpan> fill_spans_;     // FillTensors' launcher view, reused
  std::atomic<int64_t> allocations_{0};  // successful Allocate calls
  int64_t internal_bytes_ = 0;
};

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver / no device: clear the (non-sticky) error so it does not
    // surface in an unrelated later call.
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", device, " requested but ", count, " CUDA device(s) are visible"));
  }
  return CudaBackend::Create(device, options);
}

std::vector<std::string> GemmEpiloguePlans(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->EpiloguePlans() : std::vector<std::string>{};
}

}  // namespace ampd::kernels::cuda
