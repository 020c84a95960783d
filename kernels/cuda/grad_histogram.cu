// GradLog2Histogram over a list of tensors: bin 0 exact zeros, bin 1
// |g| < 2^-30, bin 2 + (e + 30) for |g| in [2^e, 2^(e+1)), e in [-30, 19],
// the last bin |g| >= 2^20 and every inf or NaN. The octave is read from the
// fp32 exponent bits (exact; no log2f rounding at powers of two). Counts
// gather in shared memory and go to the I64 histogram with one atomicAdd
// per bin per block.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kElemsPerThread = 8;
constexpr int64_t kTile = int64_t{kThreads} * kElemsPerThread;

__device__ __forceinline__ int Bin(float v) {
  const uint32_t bits = __float_as_uint(v) & 0x7fffffffu;
  if (bits == 0) return 0;
  if (bits >= 0x7f800000u) return kGradHistogramBins - 1;  // inf, NaN
  const int e = static_cast<int>(bits >> 23) - 127;        // floor(log2|v|); subnormals < -126
  if (e < kGradHistogramMinLog2) return 1;
  if (e >= kGradHistogramMaxLog2) return kGradHistogramBins - 1;
  return 2 + (e - kGradHistogramMinLog2);
}

__global__ void grad_histogram_kernel(const __grid_constant__ TensorChunk<GradSpan> chunk,
                                      unsigned long long* counts) {
  __shared__ unsigned int local[kGradHistogramBins];
  for (int b = threadIdx.x; b < kGradHistogramBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const GradSpan& g = chunk.entry[t];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kTile;
  for (int k = 0; k < kElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;
    if (i >= g.n) break;
    atomicAdd(&local[Bin(LoadAs(g.data, i, g.dtype))], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kGradHistogramBins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(counts + b, static_cast<unsigned long long>(local[b]));
  }
}

}  // namespace

absl::Status LaunchGradHistogram(const GradSpan* grads, int count, int64_t* counts,
                                 cudaStream_t stream) {
  // Counts are non-negative, so adding them as unsigned 64-bit is the same
  // two's-complement bit pattern as adding them as int64.
  auto* ucounts = reinterpret_cast<unsigned long long*>(counts);
  AMPD_CUDA_RETURN_IF_ERROR(
      ForEachChunk(grads, count, kTile, [&](const TensorChunk<GradSpan>& chunk) {
        grad_histogram_kernel<<<chunk.block_start[chunk.count], kThreads, 0, stream>>>(chunk,
                                                                                       ucounts);
        return cudaGetLastError();
      }));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
