// BiasGrad: dbias (C) = sum over rows of dy (N, C) + beta * dbias, summed in
// fp32 and rounded once. One block per 32 columns: the 32 x-threads read
// consecutive columns (coalesced), the 16 y-threads split the rows, and a
// fixed-order shared-memory reduction makes the result deterministic.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kColsPerBlock = 32;
constexpr int kRowSplit = 16;

__global__ void bias_grad_kernel(const void* dy, DType dy_dtype, int64_t rows, int64_t cols,
                                 float beta, void* dbias, DType dbias_dtype) {
  __shared__ float partial[kRowSplit][kColsPerBlock];
  const int64_t c = blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x;
  float sum = 0.0f;
  if (c < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowSplit)
      sum += LoadAs(dy, r * cols + c, dy_dtype);
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < kRowSplit; ++k) total += partial[k][threadIdx.x];
    // beta == 0 must not read dbias: it may hold garbage (even NaN).
    if (beta != 0.0f) total += beta * LoadAs(dbias, c, dbias_dtype);
    StoreAs(dbias, c, dbias_dtype, total);
  }
}

}  // namespace

absl::Status LaunchBiasGrad(const void* dy, DType dy_dtype, int64_t rows, int64_t cols, float beta,
                            void* dbias, DType dbias_dtype, cudaStream_t stream) {
  if (cols == 0) return absl::OkStatus();
  const dim3 block(kColsPerBlock, kRowSplit);
  const auto grid = static_cast<unsigned>((cols + kColsPerBlock - 1) / kColsPerBlock);
  bias_grad_kernel<<<grid, block, 0, stream>>>(dy, dy_dtype, rows, cols, beta, dbias, dbias_dtype);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
