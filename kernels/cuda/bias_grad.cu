// BiasGrad: dbias (C) = sum over rows of dy (N, C) + beta * dbias, summed in
// fp32 and rounded once. Block (x, y) covers 32 column groups of row slab
// y: the 32 x-threads read consecutive groups (coalesced), the 16 y-threads
// split the slab's rows, and a fixed-order shared-memory reduction forms
// the slab's partial per column. A group is one column, or N columns read
// as one 16-byte vector when C is a multiple of N and dy is aligned: each
// column's rows are still summed in the same order, so both give the same
// bits. With one slab the block finishes the column itself; with several
// (ColumnSumSlabs, a function of the shape only) each writes its partial
// to scratch and a second kernel adds the slabs in order 0..S-1. Every
// order is fixed, so the result is deterministic.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kColsPerBlock = static_cast<int>(kColumnSumColsPerBlock);
constexpr int kRowSplit = 16;

// beta == 0 must not read dbias: it may hold garbage (even NaN).
__device__ __forceinline__ void FinishColumn(float total, float beta, void* dbias,
                                             DType dbias_dtype, int64_t c) {
  if (beta != 0.0f) total += beta * LoadAs(dbias, c, dbias_dtype);
  StoreAs(dbias, c, dbias_dtype, total);
}

// N columns per thread (1, or a 16-byte vector's worth with cols % N == 0).
template <typename T, int N>
__global__ void bias_grad_kernel(const T* dy, int64_t rows, int64_t cols, int64_t rows_per_slab,
                                 float beta, void* dbias, DType dbias_dtype, float* partials) {
  // dy (rows, cols); dbias (cols); partials (gridDim.y, cols) when gridDim.y > 1
  __shared__ float partial[kRowSplit][N][kColsPerBlock];  // [y][column in group][x]
  const int64_t c0 = (blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x) * N;
  const int64_t r_begin = blockIdx.y * rows_per_slab;
  const int64_t r_end = r_begin + rows_per_slab < rows ? r_begin + rows_per_slab : rows;
  float sum[N] = {};
  if (c0 < cols) {
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRowSplit) {
      const Vec<T, N> v = LoadVec<N>(dy, r * cols + c0);
#pragma unroll
      for (int j = 0; j < N; ++j) sum[j] += ToFloat(v.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) partial[threadIdx.y][j][threadIdx.x] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float total = 0.0f;
      for (int k = 0; k < kRowSplit; ++k) total += partial[k][j][threadIdx.x];
      if (gridDim.y == 1) {
        FinishColumn(total, beta, dbias, dbias_dtype, c0 + j);
      } else {
        partials[blockIdx.y * cols + c0 + j] = total;
      }
    }
  }
}

__global__ void bias_grad_finalize_kernel(const float* partials, int64_t slabs, int64_t cols,
                                          float beta, void* dbias, DType dbias_dtype) {
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < cols;
       c += int64_t{gridDim.x} * blockDim.x) {
    float total = 0.0f;
    for (int64_t s = 0; s < slabs; ++s) total += partials[s * cols + c];  // coalesced over c
    FinishColumn(total, beta, dbias, dbias_dtype, c);
  }
}

template <typename T, int N>
absl::Status LaunchColumns(const T* dy, int64_t rows, int64_t cols, int64_t rows_per_slab,
                           int64_t slabs, float beta, void* dbias, DType dbias_dtype,
                           float* partials, cudaStream_t stream) {
  const int64_t groups = (cols + N - 1) / N;
  const dim3 block(kColsPerBlock, kRowSplit);
  const dim3 grid(static_cast<unsigned>((groups + kColsPerBlock - 1) / kColsPerBlock),
                  static_cast<unsigned>(slabs));
  bias_grad_kernel<T, N><<<grid, block, 0, stream>>>(dy, rows, cols, rows_per_slab, beta, dbias,
                                                     dbias_dtype, partials);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchBiasGrad(const void* dy, DType dy_dtype, int64_t rows, int64_t cols, float beta,
                            void* dbias, DType dbias_dtype, float* partials, cudaStream_t stream) {
  if (cols == 0) return absl::OkStatus();
  const int64_t rows_per_slab = ColumnSumRowsPerSlab(rows, cols);
  const int64_t slabs = ColumnSumSlabs(rows, cols);
  if (slabs > 1 && partials == nullptr) {
    return absl::InternalError("LaunchBiasGrad: several row slabs but no partials scratch");
  }
  const absl::Status summed = DispatchFloat(dy_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* d = static_cast<const T*>(dy);
    if (cols % N == 0 && VecAligned<N>(d)) {
      return LaunchColumns<T, N>(d, rows, cols, rows_per_slab, slabs, beta, dbias, dbias_dtype,
                                 partials, stream);
    }
    return LaunchColumns<T, 1>(d, rows, cols, rows_per_slab, slabs, beta, dbias, dbias_dtype,
                               partials, stream);
  });
  if (!summed.ok() || slabs == 1) return summed;
  bias_grad_finalize_kernel<<<GridFor(cols), kThreads, 0, stream>>>(partials, slabs, cols, beta,
                                                                    dbias, dbias_dtype);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
