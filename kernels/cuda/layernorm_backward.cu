// LayerNorm backward (PyTorch's formula), with xhat = (x - mean) * rstd and
// g = dy * gamma (dy when not affine):
//   dx     = rstd * (g - sum(g) * (1/C) - xhat * (sum(g * xhat) * (1/C)))
//                                                             one warp per row
//   dgamma += sum over rows of dy * xhat                      column kernel
//   dbeta  += sum over rows of dy
// (the CPU oracle's operation order: it multiplies by 1/C). The column sums
// are formed in fp32 per row slab (see ColumnSumSlabs in launchers.h), the
// slabs added in a fixed order, added to the old value and rounded once:
// deterministic. The column kernels run before the dx kernel, so dx may
// alias x or dy.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kColsPerBlock = static_cast<int>(kColumnSumColsPerBlock);
constexpr int kRowSplit = 16;

__global__ void layernorm_backward_dx_kernel(const void* x, DType dtype, const void* gamma,
                                             DType gamma_dtype, const float* mean,
                                             const float* rstd, const void* dy, void* dx,
                                             int64_t rows, int64_t cols, float inv_cols) {
  // x, dy, dx: (rows, cols); gamma: (cols) or nullptr; mean, rstd: (rows)
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float mu = mean[row];
  const float rs = rstd[row];
  float sum_g = 0.0f;
  float sum_gx = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) {
    const float xhat = (LoadAs(x, base + c, dtype) - mu) * rs;
    float g = LoadAs(dy, base + c, dtype);
    if (gamma != nullptr) g = g * LoadAs(gamma, c, gamma_dtype);
    sum_g += g;
    sum_gx += g * xhat;
  }
  const float mean_g = WarpSum(sum_g) * inv_cols;
  const float mean_gx = WarpSum(sum_gx) * inv_cols;
  // Each lane re-reads and then writes only its own columns, so dx may
  // alias x or dy.
  for (int64_t c = lane; c < cols; c += 32) {
    const float xhat = (LoadAs(x, base + c, dtype) - mu) * rs;
    float g = LoadAs(dy, base + c, dtype);
    if (gamma != nullptr) g = g * LoadAs(gamma, c, gamma_dtype);
    StoreAs(dx, base + c, dtype, rs * (g - mean_g - xhat * mean_gx));
  }
}

// p (cols) += total, rounded once to p's dtype; p may be nullptr.
__device__ __forceinline__ void AccumulateColumn(void* p, DType dtype, int64_t c, float total) {
  if (p != nullptr) StoreAs(p, c, dtype, LoadAs(p, c, dtype) + total);
}

__global__ void layernorm_backward_params_kernel(const void* x, DType dtype, const float* mean,
                                                 const float* rstd, const void* dy,
                                                 int64_t rows_per_slab, void* dgamma,
                                                 DType dgamma_dtype, void* dbeta, DType dbeta_dtype,
                                                 int64_t rows, int64_t cols, float* partials) {
  // partials (2, gridDim.y, cols) when gridDim.y > 1: dgamma's slabs, then dbeta's
  __shared__ float partial_gamma[kRowSplit][kColsPerBlock];
  __shared__ float partial_beta[kRowSplit][kColsPerBlock];
  const int64_t c = blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x;
  const int64_t r_begin = blockIdx.y * rows_per_slab;
  const int64_t r_end = r_begin + rows_per_slab < rows ? r_begin + rows_per_slab : rows;
  float sum_gamma = 0.0f;
  float sum_beta = 0.0f;
  if (c < cols) {
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRowSplit) {
      const float g = LoadAs(dy, r * cols + c, dtype);
      sum_gamma += g * ((LoadAs(x, r * cols + c, dtype) - mean[r]) * rstd[r]);
      sum_beta += g;
    }
  }
  partial_gamma[threadIdx.y][threadIdx.x] = sum_gamma;
  partial_beta[threadIdx.y][threadIdx.x] = sum_beta;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total_gamma = 0.0f;
    float total_beta = 0.0f;
    for (int k = 0; k < kRowSplit; ++k) {
      total_gamma += partial_gamma[k][threadIdx.x];
      total_beta += partial_beta[k][threadIdx.x];
    }
    if (gridDim.y == 1) {
      AccumulateColumn(dgamma, dgamma_dtype, c, total_gamma);
      AccumulateColumn(dbeta, dbeta_dtype, c, total_beta);
    } else {
      const int64_t slab_base = blockIdx.y * cols;
      partials[slab_base + c] = total_gamma;
      partials[int64_t{gridDim.y} * cols + slab_base + c] = total_beta;
    }
  }
}

__global__ void layernorm_backward_params_finalize_kernel(const float* partials, int64_t slabs,
                                                          int64_t cols, void* dgamma,
                                                          DType dgamma_dtype, void* dbeta,
                                                          DType dbeta_dtype) {
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < cols;
       c += int64_t{gridDim.x} * blockDim.x) {
    float total_gamma = 0.0f;
    float total_beta = 0.0f;
    for (int64_t s = 0; s < slabs; ++s) {  // slab order: fixed
      total_gamma += partials[s * cols + c];
      total_beta += partials[(slabs + s) * cols + c];
    }
    AccumulateColumn(dgamma, dgamma_dtype, c, total_gamma);
    AccumulateColumn(dbeta, dbeta_dtype, c, total_beta);
  }
}

}  // namespace

absl::Status LaunchLayerNormBackward(const void* x, DType dtype, const void* gamma,
                                     DType gamma_dtype, const float* mean, const float* rstd,
                                     const void* dy, void* dx, void* dgamma, DType dgamma_dtype,
                                     void* dbeta, DType dbeta_dtype, int64_t rows, int64_t cols,
                                     float* partials, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  // Parameter gradients first: they read x and dy, which dx may overwrite.
  if (dgamma != nullptr || dbeta != nullptr) {
    const int64_t rows_per_slab = ColumnSumRowsPerSlab(rows, cols);
    const int64_t slabs = ColumnSumSlabs(rows, cols);
    if (slabs > 1 && partials == nullptr) {
      return absl::InternalError(
          "LaunchLayerNormBackward: several row slabs but no partials scratch");
    }
    const dim3 grid(static_cast<unsigned>((cols + kColsPerBlock - 1) / kColsPerBlock),
                    static_cast<unsigned>(slabs));
    layernorm_backward_params_kernel<<<grid, dim3(kColsPerBlock, kRowSplit), 0, stream>>>(
        x, dtype, mean, rstd, dy, rows_per_slab, dgamma, dgamma_dtype, dbeta, dbeta_dtype, rows,
        cols, partials);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    if (slabs > 1) {
      layernorm_backward_params_finalize_kernel<<<GridFor(cols), kThreads, 0, stream>>>(
          partials, slabs, cols, dgamma, dgamma_dtype, dbeta, dbeta_dtype);
      AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    }
  }
  // 1/C rounded once here, as the CPU oracle computes it.
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const auto row_grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  layernorm_backward_dx_kernel<<<row_grid, kThreads, 0, stream>>>(
      x, dtype, gamma, gamma_dtype, mean, rstd, dy, dx, rows, cols, inv_cols);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
