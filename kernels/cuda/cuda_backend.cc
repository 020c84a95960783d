// CudaBackend: the Backend interface on one GPU. This file is host code
// only: argument checks (the same InvalidArgument "<Op>: <operand> is ..."
// messages as the CPU oracle), memory through the device's caching pool,
// and dispatch to the launchers of the .cu files. Every op is enqueued on
// the backend's own stream; only CopyToHost, ReadScalars and Synchronize
// wait.
#include "kernels/cuda/cuda_backend.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_raii.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/memory_pool.h"

namespace ampd::kernels::cuda {
namespace {

// cuBLAS's recommended workspace for Hopper; given from the pool so GEMMs
// never allocate behind the pool's back.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Scalars the pinned staging buffer holds from the start: the step reads 3
// (loss sum, found_inf, norm_sq); a longer list grows it once.
constexpr size_t kStagingScalars = 16;

// ---- argument checks (messages match kernels/cpu) ----------------------------
absl::Status CheckHasMemory(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.empty() && t.numel() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but holds no memory"));
  }
  return absl::OkStatus();
}

absl::Status CheckFloat(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (!IsFloating(t.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected F32, F16 or BF16"));
  }
  return CheckHasMemory(op, name, t);
}

absl::Status CheckDType(absl::string_view op, absl::string_view name, const Tensor& t, DType want) {
  if (t.dtype() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected ", DTypeName(want)));
  }
  return CheckHasMemory(op, name, t);
}

absl::Status CheckIndex(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.dtype() != DType::kI32 && t.dtype() != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected I32 or I64"));
  }
  return CheckHasMemory(op, name, t);
}

absl::Status CheckRank(absl::string_view op, absl::string_view name, const Tensor& t,
                       int64_t rank) {
  if (t.rank() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected rank ", rank));
  }
  return absl::OkStatus();
}

absl::Status CheckSameShape(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.shape() != ref.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but ",
                                                   ref_name, " is ", ref.DebugString(),
                                                   "; shapes differ"));
  }
  return absl::OkStatus();
}

absl::Status CheckSameDType(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.dtype() != ref.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but ",
                                                   ref_name, " is ", ref.DebugString(),
                                                   "; dtypes differ"));
  }
  return absl::OkStatus();
}

absl::Status CheckSameNumel(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.numel() != ref.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but ",
                                                   ref_name, " is ", ref.DebugString(),
                                                   "; element counts differ"));
  }
  return absl::OkStatus();
}

absl::Status CheckScalarF32(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.dtype() != DType::kF32 || t.numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected one F32 element"));
  }
  return CheckHasMemory(op, name, t);
}

absl::Status CheckLength(absl::string_view op, absl::string_view name, const Tensor& t,
                         int64_t want, absl::string_view what) {
  if (t.rank() != 1 || t.dim(0) != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(),
                                                   "; expected (", want, ") to match ", what));
  }
  return absl::OkStatus();
}

absl::Status CheckActivation(absl::string_view op, Activation act) {
  switch (act) {
    case Activation::kReLU:
    case Activation::kGELU:
    case Activation::kTanh:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": act is ", static_cast<int>(act), "; expected ReLU, GELU or Tanh"));
}

#define AMPD_RETURN_IF_ERROR(expr)                                    \
  do {                                                                \
    if (absl::Status ampd_s_ = (expr); !ampd_s_.ok()) return ampd_s_; \
  } while (0)

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
  static absl::StatusOr<std::unique_ptr<Backend>> Create(int device) {
    DeviceGuard guard(device);
    AMPD_CUDA_RETURN_IF_ERROR(guard.error());
    auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
    backend->ctx_ = std::make_shared<StreamContext>();
    backend->ctx_->device = device;
    backend->ctx_->pool = &DevicePool::ForDevice(device);
    absl::StatusOr<Stream> stream = Stream::Create();
    if (!stream.ok()) return stream.status();
    backend->ctx_->stream = *std::move(stream);
    absl::StatusOr<CublasHandle> handle = CublasHandle::Create();
    if (!handle.ok()) return handle.status();
    backend->cublas_ = *std::move(handle);
    absl::StatusOr<MappedFlags> flags = MappedFlags::Create();
    if (!flags.ok()) return flags.status();
    backend->flags_ = *std::move(flags);

    const cublasHandle_t h = backend->cublas_.get();
    AMPD_CUBLAS_RETURN_IF_ERROR(cublasSetStream(h, backend->stream()));
    // fp32 accumulation end to end: without this flag cuBLAS may reduce
    // split-K partial sums in the fp16/bf16 output type, rounding more than
    // once (PyTorch's allow_fp16_reduced_precision_reduction). Default math
    // otherwise: CUBLAS_COMPUTE_32F on fp32 inputs stays full fp32, no TF32.
    AMPD_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    absl::StatusOr<Tensor> workspace =
        backend->Allocate(DType::kF32, {static_cast<int64_t>(kCublasWorkspaceBytes / 4)});
    if (!workspace.ok()) return workspace.status();
    backend->workspace_ = *std::move(workspace);
    AMPD_CUBLAS_RETURN_IF_ERROR(
        cublasSetWorkspace(h, backend->workspace_.data(), kCublasWorkspaceBytes));
    absl::StatusOr<Tensor> partials = backend->Allocate(DType::kF32, {kMaxReductionBlocks});
    if (!partials.ok()) return partials.status();
    backend->partials_ = *std::move(partials);
    absl::StatusOr<PinnedHostBuffer> staging =
        PinnedHostBuffer::Create(kStagingScalars * sizeof(float));
    if (!staging.ok()) return staging.status();
    backend->staging_ = *std::move(staging);
    // The workspace and scratch are the backend's, not the caller's tensors.
    backend->internal_bytes_ = backend->ctx_->bytes_in_use.load();
    return std::unique_ptr<Backend>(std::move(backend));
  }

  ~CudaBackend() override {
    if (ctx_ == nullptr) return;
    // Everything is released inside the guard, in this body, rather than
    // by the member destructors after it, when the current device could be
    // another GPU's. The cuBLAS handle goes before its workspace.
    DeviceGuard guard(ctx_->device);
    (void)cudaStreamSynchronize(stream());
    { CublasHandle released = std::move(cublas_); }
    { Tensor released = std::move(workspace_); }
    { Tensor released = std::move(partials_); }
    { PinnedHostBuffer released = std::move(staging_); }
    { MappedFlags released = std::move(flags_); }
    ctx_.reset();  // the stream too, unless a live tensor still holds it
  }

  std::string name() const override { return absl::StrCat("cuda:", ctx_->device); }

  absl::StatusOr<Tensor> Allocate(DType dtype, const Shape& shape) override {
    for (int64_t d : shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("Allocate: shape ", ShapeToString(shape), " has a negative dimension"));
      }
    }
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * SizeOf(dtype);
    AMPD_ENTER_DEVICE();
    absl::StatusOr<DevicePool::Block*> block = ctx_->pool->Allocate(bytes, stream());
    if (!block.ok()) return block.status();
    return Tensor(std::make_unique<PoolMemory>(ctx_, *block, bytes), dtype, shape);
  }

  absl::Status CopyFromHost(const void* src, size_t bytes, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(CheckHasMemory("CopyFromHost", "dst", dst));
    if (bytes != dst.nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat("CopyFromHost: dst is ", dst.DebugString(),
                                                     " (", dst.nbytes(), " bytes) but ", bytes,
                                                     " bytes were given"));
    }
    if (bytes == 0) return absl::OkStatus();
    if (src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
    AMPD_ENTER_DEVICE();
    // The copy is only enqueued. From pageable memory the runtime usually
    // returns once src has been staged, but that is not guaranteed (and from
    // pinned memory the DMA reads src later), so the contract in backend.h
    // is that src stays valid and unchanged until the next synchronising
    // call (Synchronize, CopyToHost, ReadScalars).
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data(), src, bytes, cudaMemcpyHostToDevice, stream()));
    return absl::OkStatus();
  }

  absl::Status CopyToHost(const Tensor& src, void* dst, size_t bytes) override {
    AMPD_RETURN_IF_ERROR(CheckHasMemory("CopyToHost", "src", src));
    if (bytes != src.nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat("CopyToHost: src is ", src.DebugString(), " (",
                                                     src.nbytes(), " bytes) but ", bytes,
                                                     " bytes were asked for"));
    }
    if (bytes > 0 && dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
    AMPD_ENTER_DEVICE();
    if (bytes > 0) {
      AMPD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src.data(), bytes, cudaMemcpyDeviceToHost, stream()));
    }
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    return TakeDeviceErrors();
  }

  absl::Status Copy(const Tensor& src, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(CheckHasMemory("Copy", "src", src));
    AMPD_RETURN_IF_ERROR(CheckHasMemory("Copy", "dst", dst));
    AMPD_RETURN_IF_ERROR(CheckSameDType("Copy", "dst", dst, "src", src));
    AMPD_RETURN_IF_ERROR(CheckSameNumel("Copy", "dst", dst, "src", src));
    if (src.nbytes() == 0 || src.data() == dst.data()) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    AMPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
    return absl::OkStatus();
  }

  absl::Status Fill(Tensor& dst, float value) override {
    AMPD_RETURN_IF_ERROR(CheckFloat("Fill", "dst", dst));
    AMPD_ENTER_DEVICE();
    return LaunchFill(dst.data(), dst.dtype(), dst.numel(), value, stream());
  }

  absl::Status Cast(const Tensor& src, Tensor& dst) override {
    AMPD_RETURN_IF_ERROR(CheckFloat("Cast", "src", src));
    AMPD_RETURN_IF_ERROR(CheckFloat("Cast", "dst", dst));
    AMPD_RETURN_IF_ERROR(CheckSameNumel("Cast", "dst", dst, "src", src));
    AMPD_ENTER_DEVICE();
    return LaunchCast(src.data(), src.dtype(), dst.data(), dst.dtype(), src.numel(), stream());
  }

  absl::Status Synchronize() override {
    AMPD_ENTER_DEVICE();
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    return TakeDeviceErrors();
  }

  absl::Status ReadScalars(absl::Span<const Tensor* const> scalars,
                           absl::Span<float> out) override {
    constexpr absl::string_view kOp = "ReadScalars";
    if (scalars.size() != out.size()) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": out has ", out.size(),
                                                     " elements but scalars has ", scalars.size()));
    }
    // Everything is checked before the first copy is queued, so a bad call
    // enqueues nothing and leaves out untouched.
    for (size_t i = 0; i < scalars.size(); ++i) {
      const std::string name = absl::StrCat("scalars[", i, "]");
      if (scalars[i] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " is null"));
      }
      AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, name, *scalars[i]));
    }
    AMPD_ENTER_DEVICE();
    const size_t bytes = scalars.size() * sizeof(float);
    if (bytes > staging_.bytes()) {
      // The old buffer may still be the target of copies a failed call
      // queued; drain them before it is freed.
      AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
      absl::StatusOr<PinnedHostBuffer> grown = PinnedHostBuffer::Create(bytes);
      if (!grown.ok()) return grown.status();
      staging_ = *std::move(grown);
    }
    // One small DMA per scalar into pinned memory: they stay queued behind
    // the step's kernels, and the single synchronisation below is the
    // step's only host round trip.
    auto* staged = static_cast<float*>(staging_.data());
    for (size_t i = 0; i < scalars.size(); ++i) {
      AMPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staged + i, scalars[i]->data(), sizeof(float),
                                                cudaMemcpyDeviceToHost, stream()));
    }
    AMPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    for (size_t i = 0; i < scalars.size(); ++i) out[i] = staged[i];
    return TakeDeviceErrors();
  }

  int64_t BytesInUse() const override {
    return ctx_->bytes_in_use.load(std::memory_order_relaxed) - internal_bytes_;
  }

  // ---- dense algebra --------------------------------------------------------
  absl::Status Add(const Tensor& x, Tensor& y) override {
    constexpr absl::string_view kOp = "Add";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "y", y));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "x", x, "y", y));
    AMPD_ENTER_DEVICE();
    return LaunchAdd(x.data(), x.dtype(), y.data(), y.dtype(), y.numel(), stream());
  }

  absl::Status Gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c) override {
    constexpr absl::string_view kOp = "Gemm";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "a", a));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "b", b));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "c", c));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "a", a, 2));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "b", b, 2));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "c", c, 2));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "b", b, "a", a));
    if (c.dtype() != DType::kF32 && c.dtype() != a.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat("Gemm: c is ", c.DebugString(), " but a is ",
                                                     a.DebugString(), "; c must be F32 or ",
                                                     DTypeName(a.dtype())));
    }
    // op(a): (M, K), op(b): (K, N), c: (M, N)
    const int64_t m = trans_a ? a.dim(1) : a.dim(0);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
    const int64_t n = trans_b ? b.dim(0) : b.dim(1);
    if (k != kb) {
      return absl::InvalidArgumentError(
          absl::StrCat("Gemm: b is ", b.DebugString(), (trans_b ? " (transposed)" : ""),
                       " but a is ", a.DebugString(), (trans_a ? " (transposed)" : ""),
                       "; inner dims differ (", k, " vs ", kb, ")"));
    }
    if (c.dim(0) != m || c.dim(1) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("Gemm: c is ", c.DebugString(), " but op(a) @ op(b) is (", m, ", ", n, ")"));
    }
    constexpr int64_t kMaxDim = 0x7fffffff;  // cuBLAS takes int dimensions
    if (m > kMaxDim || n > kMaxDim || k > kMaxDim) {
      return absl::InvalidArgumentError(absl::StrCat("Gemm: a ", a.DebugString(), " or b ",
                                                     b.DebugString(), " is too large for cuBLAS"));
    }
    if (m == 0 || n == 0) return absl::OkStatus();
    AMPD_ENTER_DEVICE();
    if (k == 0) {  // empty sum: c = beta * c (beta == 0 never reads c, as BLAS)
      if (beta == 0.0f) return LaunchFill(c.data(), c.dtype(), c.numel(), 0.0f, stream());
      return LaunchScale(c.data(), c.dtype(), c.numel(), beta, stream());
    }
    return LaunchGemm(cublas_.get(), trans_a, trans_b, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), alpha, a.data(), static_cast<int>(a.dim(1)), b.data(),
                      static_cast<int>(b.dim(1)), a.dtype(), beta, c.data(), c.dtype());
  }

  absl::Status AddBias(const Tensor& bias, Tensor& y) override {
    constexpr absl::string_view kOp = "AddBias";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "y", y));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "bias", bias));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "y", y, 2));
    AMPD_RETURN_IF_ERROR(CheckLength(kOp, "bias", bias, y.dim(1), "y's columns"));
    AMPD_ENTER_DEVICE();
    return LaunchAddBias(bias.data(), bias.dtype(), y.data(), y.dtype(), y.dim(0), y.dim(1),
                         stream());
  }

  absl::Status BiasGrad(const Tensor& dy, float beta, Tensor& dbias) override {
    constexpr absl::string_view kOp = "BiasGrad";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dy", dy));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dbias", dbias));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "dy", dy, 2));
    AMPD_RETURN_IF_ERROR(CheckLength(kOp, "dbias", dbias, dy.dim(1), "dy's columns"));
    AMPD_ENTER_DEVICE();
    const int64_t slabs = ColumnSumSlabs(dy.dim(0), dy.dim(1));
    Tensor partials;  // per-slab column sums, when the rows are split
    if (slabs > 1) {
      absl::StatusOr<Tensor> scratch = Allocate(DType::kF32, {slabs * dy.dim(1)});
      if (!scratch.ok()) return scratch.status();
      partials = *std::move(scratch);
    }
    return LaunchBiasGrad(dy.data(), dy.dtype(), dy.dim(0), dy.dim(1), beta, dbias.data(),
                          dbias.dtype(), slabs > 1 ? partials.data_as<float>() : nullptr, stream());
  }

  // ---- activations ----------------------------------------------------------
  absl::Status ActivationForward(Activation act, const Tensor& x, Tensor& y) override {
    constexpr absl::string_view kOp = "ActivationForward";
    AMPD_RETURN_IF_ERROR(CheckActivation(kOp, act));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "y", y));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "y", y, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "y", y, "x", x));
    AMPD_ENTER_DEVICE();
    return LaunchActivationForward(act, x.data(), y.data(), x.dtype(), x.numel(), stream());
  }

  absl::Status ActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                  Tensor& dx) override {
    constexpr absl::string_view kOp = "ActivationBackward";
    AMPD_RETURN_IF_ERROR(CheckActivation(kOp, act));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dy", dy));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dx", dx));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dy", dy, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dx", dx, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dy", dy, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dx", dx, "x", x));
    AMPD_ENTER_DEVICE();
    return LaunchActivationBackward(act, x.data(), dy.data(), dx.data(), x.dtype(), x.numel(),
                                    stream());
  }

  // ---- normalisation --------------------------------------------------------
  absl::Status LayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta, float eps,
                                Tensor& y, Tensor& mean, Tensor& rstd) override {
    constexpr absl::string_view kOp = "LayerNormForward";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "y", y, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "y", y, "x", x));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "y", y));
    AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "gamma", gamma, x));
    AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "beta", beta, x));
    AMPD_RETURN_IF_ERROR(CheckStat(kOp, "mean", mean, x));
    AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
    if (!(eps >= 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": eps is ", eps, "; expected >= 0"));
    }
    if (x.dim(1) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": x is ", x.DebugString(), "; cannot normalise zero columns"));
    }
    AMPD_ENTER_DEVICE();
    return LaunchLayerNormForward(x.data(), x.dtype(), gamma ? gamma->data() : nullptr,
                                  beta ? beta->data() : nullptr, x.dtype(), x.dim(0), x.dim(1), eps,
                                  y.data(), mean.data_as<float>(), rstd.data_as<float>(), stream());
  }

  absl::Status LayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor* dgamma,
                                 Tensor* dbeta) override {
    constexpr absl::string_view kOp = "LayerNormBackward";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dy", dy, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dy", dy, "x", x));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dy", dy));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dx", dx, "x", x));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dx", dx, "x", x));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dx", dx));
    AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "gamma", gamma, x));
    AMPD_RETURN_IF_ERROR(CheckStat(kOp, "mean", mean, x));
    AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
    AMPD_RETURN_IF_ERROR(CheckParamGrad(kOp, "dgamma", dgamma, x));
    AMPD_RETURN_IF_ERROR(CheckParamGrad(kOp, "dbeta", dbeta, x));
    if (dgamma != nullptr && gamma == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": dgamma is ", dgamma->DebugString(), " but gamma is null"));
    }
    AMPD_ENTER_DEVICE();
    const int64_t slabs = ColumnSumSlabs(x.dim(0), x.dim(1));
    Tensor partials;  // per-slab dgamma and dbeta column sums, when the rows are split
    if (slabs > 1 && (dgamma != nullptr || dbeta != nullptr)) {
      absl::StatusOr<Tensor> scratch = Allocate(DType::kF32, {2 * slabs * x.dim(1)});
      if (!scratch.ok()) return scratch.status();
      partials = *std::move(scratch);
    }
    return LaunchLayerNormBackward(
        x.data(), x.dtype(), gamma ? gamma->data() : nullptr, x.dtype(), mean.data_as<float>(),
        rstd.data_as<float>(), dy.data(), dx.data(), dgamma ? dgamma->data() : nullptr,
        dgamma ? dgamma->dtype() : DType::kF32, dbeta ? dbeta->data() : nullptr,
        dbeta ? dbeta->dtype() : DType::kF32, x.dim(0), x.dim(1),
        partials.empty() ? nullptr : partials.data_as<float>(), stream());
  }

  // ---- embedding ------------------------------------------------------------
  absl::Status EmbeddingForward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    constexpr absl::string_view kOp = "EmbeddingForward";
    AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "ids", ids));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "ids", ids, 1));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "table", table));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "table", table, 2));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "out", out, "table", table));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "out", out));
    if (out.rank() != 2 || out.dim(0) != ids.dim(0) || out.dim(1) != table.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": out is ", out.DebugString(), "; expected (", ids.dim(0), ", ", table.dim(1),
          ") from ids ", ids.DebugString(), " and table ", table.DebugString()));
    }
    AMPD_ENTER_DEVICE();
    return LaunchEmbeddingForward(ids.data(), ids.dtype(), ids.dim(0), table.data(), table.dtype(),
                                  table.dim(0), table.dim(1), out.data(), flags_.device_ptr(),
                                  stream());
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    constexpr absl::string_view kOp = "EmbeddingBackward";
    AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "ids", ids));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "ids", ids, 1));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dout", dout));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dtable", dtable));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "dtable", dtable, 2));
    if (dout.rank() != 2 || dout.dim(0) != ids.dim(0) || dout.dim(1) != dtable.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": dout is ", dout.DebugString(), "; expected (", ids.dim(0), ", ", dtable.dim(1),
          ") from ids ", ids.DebugString(), " and dtable ", dtable.DebugString()));
    }
    if (ids.dim(0) == 0) return absl::OkStatus();  // nothing to scatter
    AMPD_ENTER_DEVICE();
    // Scratch for the deterministic sort-and-segment scatter (embedding.cu);
    // only rows of dtable that ids touch are read or written, whatever its
    // dtype, so no full-table copy.
    size_t scratch_bytes = 0;
    AMPD_RETURN_IF_ERROR(EmbeddingBackwardScratchBytes(ids.dim(0), dtable.dim(0), &scratch_bytes));
    Tensor scratch;
    if (scratch_bytes > 0) {
      absl::StatusOr<Tensor> allocated = Allocate(
          DType::kF32, {static_cast<int64_t>((scratch_bytes + sizeof(float) - 1) / sizeof(float))});
      if (!allocated.ok()) return allocated.status();
      scratch = *std::move(allocated);
    }
    return LaunchEmbeddingBackward(
        ids.data(), ids.dtype(), ids.dim(0), dout.data(), dout.dtype(), dtable.data(),
        dtable.dtype(), dtable.dim(0), dtable.dim(1), scratch.empty() ? nullptr : scratch.data(),
        scratch.empty() ? 0 : scratch.nbytes(), flags_.device_ptr(), stream());
  }

  // ---- losses ---------------------------------------------------------------
  absl::Status MseLoss(const Tensor& pred, const Tensor& target, float multiplier, float grad_scale,
                       Tensor& loss, Tensor& dpred) override {
    constexpr absl::string_view kOp = "MseLoss";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "pred", pred));
    AMPD_RETURN_IF_ERROR(CheckDType(kOp, "target", target, DType::kF32));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "target", target, "pred", pred));
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dpred", dpred, "pred", pred));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dpred", dpred, "pred", pred));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dpred", dpred));
    AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "loss", loss));
    if (pred.numel() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": pred is ", pred.DebugString(), "; the mean of no elements"));
    }
    AMPD_ENTER_DEVICE();
    return LaunchMseLoss(pred.data(), pred.dtype(), target.data_as<float>(), pred.numel(),
                         multiplier, grad_scale, loss.data_as<float>(), dpred.data(),
                         partials_.data_as<float>(), stream());
  }

  absl::Status CrossEntropyLoss(const Tensor& logits, const Tensor& labels, float multiplier,
                                float grad_scale, Tensor& loss, Tensor& dlogits) override {
    constexpr absl::string_view kOp = "CrossEntropyLoss";
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "logits", logits));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "logits", logits, 2));
    AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "labels", labels));
    if (labels.rank() != 1 || labels.dim(0) != logits.dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": labels is ", labels.DebugString(),
                                                     "; expected (", logits.dim(0),
                                                     ") to match logits ", logits.DebugString()));
    }
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dlogits", dlogits, "logits", logits));
    AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dlogits", dlogits, "logits", logits));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dlogits", dlogits));
    AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "loss", loss));
    if (logits.dim(0) == 0 || logits.dim(1) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": logits is ", logits.DebugString(),
                                                     "; need at least one row and one class"));
    }
    AMPD_ENTER_DEVICE();
    return LaunchCrossEntropy(logits.data(), logits.dtype(), labels.data(), labels.dtype(),
                              logits.dim(0), logits.dim(1), multiplier, grad_scale,
                              loss.data_as<float>(), dlogits.data(), partials_.data_as<float>(),
                              flags_.device_ptr(), stream());
  }

  // ---- loss scaling and the optimizer -----------------------------------------
  absl::Status UnscaleAndCheck(absl::Span<Tensor* const> grads, float inv_scale, bool in_place,
                               Tensor& found_inf, Tensor* norm_sq) override {
    constexpr absl::string_view kOp = "UnscaleAndCheck";
    AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "found_inf", found_inf));
    if (norm_sq != nullptr) AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "norm_sq", *norm_sq));
    std::vector<GradSpan> spans;
    AMPD_RETURN_IF_ERROR(CollectGrads(kOp, grads.data(), grads.size(), spans));
    AMPD_ENTER_DEVICE();
    // One fp32 partial per block for the deterministic two-stage norm.
    const int64_t blocks = UnscaleAndCheckBlocks(spans.data(), static_cast<int>(spans.size()));
    Tensor partials;
    if (norm_sq != nullptr && blocks > 0) {
      absl::StatusOr<Tensor> scratch = Allocate(DType::kF32, {blocks});
      if (!scratch.ok()) return scratch.status();
      partials = *std::move(scratch);
    }
    return LaunchUnscaleAndCheck(spans.data(), static_cast<int>(spans.size()), inv_scale, in_place,
                                 found_inf.data_as<float>(),
                                 norm_sq ? norm_sq->data_as<float>() : nullptr,
                                 partials.empty() ? nullptr : partials.data_as<float>(), stream());
  }

  absl::Status AdamUpdate(absl::Span<const ParamRef> params, const AdamConfig& config, int64_t step,
                          const GradTransform& transform) override {
    constexpr absl::string_view kOp = "AdamUpdate";
    if (step < 1) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": step is ", step, "; expected >= 1"));
    }
    TransformArgs targs;
    AMPD_RETURN_IF_ERROR(CheckTransform(kOp, transform, targs));
    targs.error_flags = flags_.device_ptr();
    std::vector<ParamSpan> spans;
    spans.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      AMPD_RETURN_IF_ERROR(CheckParam(kOp, i, params[i], true, true));
      spans.push_back(ToSpan(params[i], true, true));
    }
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
    constexpr absl::string_view kOp = "SgdUpdate";
    TransformArgs targs;
    AMPD_RETURN_IF_ERROR(CheckTransform(kOp, transform, targs));
    targs.error_flags = flags_.device_ptr();
    const bool use_momentum = config.momentum != 0.0f;
    std::vector<ParamSpan> spans;
    spans.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      AMPD_RETURN_IF_ERROR(CheckParam(kOp, i, params[i], use_momentum, false));
      spans.push_back(ToSpan(params[i], use_momentum, false));
    }
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
    constexpr absl::string_view kOp = "GradLog2Histogram";
    AMPD_RETURN_IF_ERROR(CheckDType(kOp, "counts", counts, DType::kI64));
    if (counts.rank() != 1 || counts.dim(0) != kGradHistogramBins) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": counts is ", counts.DebugString(),
                                                     "; expected I64(", kGradHistogramBins, ")"));
    }
    std::vector<GradSpan> spans;
    AMPD_RETURN_IF_ERROR(CollectGrads(kOp, grads.data(), grads.size(), spans));
    AMPD_ENTER_DEVICE();
    return LaunchGradHistogram(spans.data(), static_cast<int>(spans.size()),
                               counts.data_as<int64_t>(), stream());
  }

 private:
  CudaBackend() = default;

  cudaStream_t stream() const { return ctx_->stream.get(); }

  // Turns the bits the kernels set in the mapped error word into a Status;
  // call only after the stream has been synchronised.
  absl::Status TakeDeviceErrors() {
    const int bits = flags_.TakeHostValue();
    if (bits == 0) return absl::OkStatus();
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
    return absl::InvalidArgumentError(
        absl::StrCat(what, "; detected on the device, reported at the next synchronisation"));
  }

  static absl::Status CheckAffine(absl::string_view op, absl::string_view name, const Tensor* p,
                                  const Tensor& x) {
    if (p == nullptr) return absl::OkStatus();
    AMPD_RETURN_IF_ERROR(CheckSameDType(op, name, *p, "x", x));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(op, name, *p));
    return CheckLength(op, name, *p, x.dim(1), "x's columns");
  }

  static absl::Status CheckStat(absl::string_view op, absl::string_view name, const Tensor& t,
                                const Tensor& x) {
    AMPD_RETURN_IF_ERROR(CheckDType(op, name, t, DType::kF32));
    if (t.numel() != x.dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(),
                                                     "; expected ", x.dim(0),
                                                     " elements, one per row of x"));
    }
    return absl::OkStatus();
  }

  static absl::Status CheckParamGrad(absl::string_view op, absl::string_view name, const Tensor* p,
                                     const Tensor& x) {
    if (p == nullptr) return absl::OkStatus();
    AMPD_RETURN_IF_ERROR(CheckFloat(op, name, *p));
    return CheckLength(op, name, *p, x.dim(1), "x's columns");
  }

  static absl::Status CollectGrads(absl::string_view op, const Tensor* const* grads, size_t count,
                                   std::vector<GradSpan>& spans) {
    spans.reserve(count);
    for (size_t t = 0; t < count; ++t) {
      const std::string name = absl::StrCat("grads[", t, "]");
      if (grads[t] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
      }
      AMPD_RETURN_IF_ERROR(CheckFloat(op, name, *grads[t]));
      // The span's pointer is written only by in-place unscaling, whose
      // caller handed over mutable tensors.
      spans.push_back(
          GradSpan{const_cast<void*>(grads[t]->data()), grads[t]->dtype(), grads[t]->numel()});
    }
    return absl::OkStatus();
  }

  static absl::Status CheckTransform(absl::string_view op, const GradTransform& tr,
                                     TransformArgs& out) {
    if (tr.found_inf == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": transform.found_inf is null"));
    }
    AMPD_RETURN_IF_ERROR(CheckScalarF32(op, "transform.found_inf", *tr.found_inf));
    if (tr.norm_sq != nullptr) {
      AMPD_RETURN_IF_ERROR(CheckScalarF32(op, "transform.norm_sq", *tr.norm_sq));
    }
    out.inv_scale = tr.inv_scale;
    out.found_inf = tr.found_inf->data_as<float>();
    out.norm_sq = tr.norm_sq ? tr.norm_sq->data_as<float>() : nullptr;
    out.max_grad_norm = tr.max_grad_norm;
    return absl::OkStatus();
  }

  static absl::Status CheckParam(absl::string_view op, size_t index, const ParamRef& p,
                                 bool need_state0, bool need_state1) {
    const std::string prefix = absl::StrCat("params[", index, "].");
    if (p.master == nullptr || p.grad == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", prefix, (p.master == nullptr ? "master" : "grad"), " is null"));
    }
    const Tensor& master = *p.master;
    AMPD_RETURN_IF_ERROR(CheckDType(op, prefix + "master", master, DType::kF32));
    AMPD_RETURN_IF_ERROR(CheckFloat(op, prefix + "grad", *p.grad));
    AMPD_RETURN_IF_ERROR(CheckSameNumel(op, prefix + "grad", *p.grad, prefix + "master", master));
    if (p.working != nullptr) {
      AMPD_RETURN_IF_ERROR(CheckFloat(op, prefix + "working", *p.working));
      AMPD_RETURN_IF_ERROR(
          CheckSameNumel(op, prefix + "working", *p.working, prefix + "master", master));
    }
    const struct {
      Tensor* t;
      bool needed;
      const char* name;
    } states[] = {{p.state0, need_state0, "state0"}, {p.state1, need_state1, "state1"}};
    for (const auto& st : states) {
      if (!st.needed) continue;  // an unused buffer is not touched, so not checked
      if (st.t == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": ", prefix, st.name, " is null"));
      }
      AMPD_RETURN_IF_ERROR(CheckDType(op, prefix + st.name, *st.t, DType::kF32));
      AMPD_RETURN_IF_ERROR(CheckSameNumel(op, prefix + st.name, *st.t, prefix + "master", master));
    }
    return absl::OkStatus();
  }

  static ParamSpan ToSpan(const ParamRef& p, bool use_state0, bool use_state1) {
    ParamSpan s;
    s.master = p.master->data_as<float>();
    s.working = p.working ? p.working->data() : nullptr;
    s.working_dtype = p.working ? p.working->dtype() : DType::kF32;
    s.grad = p.grad->data();
    s.grad_dtype = p.grad->dtype();
    s.state0 = use_state0 ? p.state0->data_as<float>() : nullptr;
    s.state1 = use_state1 ? p.state1->data_as<float>() : nullptr;
    s.n = p.master->numel();
    return s;
  }

  // Declared first: destroyed last, after every tensor member below.
  std::shared_ptr<StreamContext> ctx_;
  CublasHandle cublas_;
  MappedFlags flags_;
  Tensor workspace_;          // (8M) F32: cuBLAS workspace, 32 MiB
  Tensor partials_;           // (kMaxReductionBlocks) F32: loss reduction partial sums
  PinnedHostBuffer staging_;  // ReadScalars' landing area, >= kStagingScalars floats
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

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", device, " requested but ", count, " CUDA device(s) are visible"));
  }
  return CudaBackend::Create(device);
}

}  // namespace ampd::kernels::cuda
