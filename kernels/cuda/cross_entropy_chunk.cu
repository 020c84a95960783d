// CrossEntropyChunk on the device: one block per row (grid-stride over rows),
// fully fused and with no host involvement:
//   1. every thread reads the row's label logit, then folds its share of the
//      row into a running (max, sum of exp(x - max)) pair (the online
//      softmax normaliser: one read of the logits instead of two);
//   2. the pairs are combined across the block in a fixed tree, so every
//      thread holds the row's max and sum;
//   3. each thread rewrites its own elements: grad_scale * (softmax - onehot)
//      rounded once to the dtype (in place when dlogits is logits: every read
//      of the row happened before the block's barrier in step 2);
//   4. thread 0 adds loss_scale * (log(sum) - (z[label] - max)) into loss[0]
//      with one fp32 atomicAdd.
// A row labelled ignore_index gets a zero gradient and adds nothing; a label
// outside [0, V) otherwise sets kErrorCrossEntropyChunkLabel in the
// backend's error word (reported at the step's read-back), and its row is
// treated as ignored. The loss is the CPU oracle's sum of the same per-row
// terms, added in the order the blocks finish.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kRowThreads = 512;  // V is ~50k for GPT-2: 512 threads keep each row short
constexpr int kRowWarps = kRowThreads / 32;
constexpr int64_t kMaxRowBlocks = int64_t{1} << 20;

// (m, s) with s = sum exp(x - m) over the elements folded in; m = -inf, s = 0
// for none.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  const float sa = a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m);
  const float sb = b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m);
  return {m, sa + sb};
}

// The block's combined pair, for every thread; fixed order (deterministic).
__device__ __forceinline__ MaxSum BlockMaxSum(MaxSum v) {
  __shared__ float warp_m[kRowWarps];
  __shared__ float warp_s[kRowWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, offset),
                       __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = Combine(v, other);
  }
  __syncthreads();  // the previous row's values may still be read
  if (lane == 0) {
    warp_m[warp] = v.m;
    warp_s[warp] = v.s;
  }
  __syncthreads();
  MaxSum total{warp_m[0], warp_s[0]};
  for (int w = 1; w < kRowWarps; ++w) total = Combine(total, {warp_m[w], warp_s[w]});
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_chunk_kernel(const T* logits, const void* labels, DType label_dtype, int64_t rows,
                               int64_t vocab, int64_t ignore_index, float loss_scale,
                               float grad_scale, T* dlogits, float* loss, int* error_flags) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = logits + row * vocab;
    T* dz = dlogits + row * vocab;
    const int64_t label = LoadIndex(labels, row, label_dtype);
    const bool ignored = label == ignore_index;
    if (ignored || label < 0 || label >= vocab) {
      if (!ignored && threadIdx.x == 0) atomicOr(error_flags, kErrorCrossEntropyChunkLabel);
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) dz[c] = FromFloat<T>(0.0f);
      continue;  // uniform across the block: no barrier is skipped by part of it
    }
    const float label_logit = ToFloat(z[label]);
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      const float x = ToFloat(z[c]);
      if (x > acc.m) {
        acc.s = (acc.m == -INFINITY ? 0.0f : acc.s * expf(acc.m - x)) + 1.0f;
        acc.m = x;
      } else if (x != -INFINITY) {  // exp(-inf) adds 0; -inf - -inf would be NaN
        acc.s += expf(x - acc.m);
      }
    }
    const MaxSum row_total = BlockMaxSum(acc);
    const float max = row_total.m;
    const float inv_sum = 1.0f / row_total.s;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      const float p = expf(ToFloat(z[c]) - max) * inv_sum;
      dz[c] = FromFloat<T>(grad_scale * (c == label ? p - 1.0f : p));
    }
    if (threadIdx.x == 0) {
      // log(sum) - (z[label] - max): no cancellation for large logits.
      atomicAdd(loss, loss_scale * (logf(row_total.s) - (label_logit - max)));
    }
  }
}

template <typename T>
absl::Status Launch(const void* logits, const void* labels, DType label_dtype, int64_t rows,
                    int64_t vocab, int64_t ignore_index, float loss_scale, float grad_scale,
                    float* loss, void* dlogits, int* error_flags, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(std::min(rows, kMaxRowBlocks));
  cross_entropy_chunk_kernel<T><<<blocks, kRowThreads, 0, stream>>>(
      static_cast<const T*>(logits), labels, label_dtype, rows, vocab, ignore_index, loss_scale,
      grad_scale, static_cast<T*>(dlogits), loss, error_flags);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchCrossEntropyChunk(const void* logits, DType dtype, const void* labels,
                                     DType label_dtype, int64_t rows, int64_t vocab,
                                     int64_t ignore_index, float loss_scale, float grad_scale,
                                     float* loss, void* dlogits, int* error_flags,
                                     cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  switch (dtype) {
    case DType::kF16:
      return Launch<__half>(logits, labels, label_dtype, rows, vocab, ignore_index, loss_scale,
                            grad_scale, loss, dlogits, error_flags, stream);
    case DType::kBF16:
      return Launch<__nv_bfloat16>(logits, labels, label_dtype, rows, vocab, ignore_index,
                                   loss_scale, grad_scale, loss, dlogits, error_flags, stream);
    default:
      return Launch<float>(logits, labels, label_dtype, rows, vocab, ignore_index, loss_scale,
                           grad_scale, loss, dlogits, error_flags, stream);
  }
}

}  // namespace ampd::kernels::cuda
