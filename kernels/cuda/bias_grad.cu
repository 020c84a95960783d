// BiasGrad: dbias (C) = sum over rows of dy (N, C) + beta * dbias, summed in
// fp32 and rounded once. Block (x, y) covers 32 columns of row slab y: the
// 32 x-threads read consecutive columns (coalesced), the 16 y-threads split
// the slab's rows, and a fixed-order shared-memory reduction forms the
// slab's partial. With one slab the block finishes the column itself; with
// several (ColumnSumSlabs, a function of the shape only) each writes its
// partial to scratch and a second kernel adds the slabs in order 0..S-1.
// Every order is fixed, so the result is deterministic.
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

__global__ void bias_grad_kernel(const void* dy, DType dy_dtype, int64_t rows, int64_t cols,
                                 int64_t rows_per_slab, float beta, void* dbias, DType dbias_dtype,
                                 float* partials) {
  // dy (rows, cols); dbias (cols); partials (gridDim.y, cols) when gridDim.y > 1
  __shared__ float partial[kRowSplit][kColsPerBlock];
  const int64_t c = blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x;
  const int64_t r_begin = blockIdx.y * rows_per_slab;
  const int64_t r_end = r_begin + rows_per_slab < rows ? r_begin + rows_per_slab : rows;
  float sum = 0.0f;
  if (c < cols) {
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRowSplit) {
      sum += LoadAs(dy, r * cols + c, dy_dtype);
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < kRowSplit; ++k) total += partial[k][threadIdx.x];
    if (gridDim.y == 1) {
      FinishColumn(total, beta, dbias, dbias_dtype, c);
    } else {
      partials[blockIdx.y * cols + c] = total;
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

}  // namespace

absl::Status LaunchBiasGrad(const void* dy, DType dy_dtype, int64_t rows, int64_t cols, float beta,
                            void* dbias, DType dbias_dtype, float* partials, cudaStream_t stream) {
  if (cols == 0) return absl::OkStatus();
  const int64_t rows_per_slab = ColumnSumRowsPerSlab(rows, cols);
  const int64_t slabs = ColumnSumSlabs(rows, cols);
  if (slabs > 1 && partials == nullptr) {
    return absl::InternalError("LaunchBiasGrad: several row slabs but no partials scratch");
  }
  const dim3 block(kColsPerBlock, kRowSplit);
  const dim3 grid(static_cast<unsigned>((cols + kColsPerBlock - 1) / kColsPerBlock),
                  static_cast<unsigned>(slabs));
  bias_grad_kernel<<<grid, block, 0, stream>>>(dy, dy_dtype, rows, cols, rows_per_slab, beta, dbias,
                                               dbias_dtype, partials);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  if (slabs == 1) return absl::OkStatus();
  bias_grad_finalize_kernel<<<GridFor(cols), kThreads, 0, stream>>>(partials, slabs, cols, beta,
                                                                    dbias, dbias_dtype);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
