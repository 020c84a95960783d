// LayerNorm backward (PyTorch's formula), with xhat = (x - mean) * rstd and
// g = dy * gamma (dy when not affine):
//   dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))      one warp per row
//   dgamma += sum over rows of dy * xhat                        column kernel
//   dbeta  += sum over rows of dy
// The column sums are formed in fp32, added to the old value and rounded
// once; a fixed-order block reduction keeps them deterministic.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kColsPerBlock = 32;
constexpr int kRowSplit = 16;

__global__ void layernorm_backward_dx_kernel(const void* x, DType dtype, const void* gamma,
                                             DType gamma_dtype, const float* mean,
                                             const float* rstd, const void* dy, void* dx,
                                             int64_t rows, int64_t cols) {
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
  const float mean_g = WarpSum(sum_g) / static_cast<float>(cols);
  const float mean_gx = WarpSum(sum_gx) / static_cast<float>(cols);
  for (int64_t c = lane; c < cols; c += 32) {
    const float xhat = (LoadAs(x, base + c, dtype) - mu) * rs;
    float g = LoadAs(dy, base + c, dtype);
    if (gamma != nullptr) g = g * LoadAs(gamma, c, gamma_dtype);
    StoreAs(dx, base + c, dtype, rs * (g - mean_g - xhat * mean_gx));
  }
}

__global__ void layernorm_backward_params_kernel(const void* x, DType dtype, const float* mean,
                                                 const float* rstd, const void* dy, void* dgamma,
                                                 DType dgamma_dtype, void* dbeta, DType dbeta_dtype,
                                                 int64_t rows, int64_t cols) {
  __shared__ float partial_gamma[kRowSplit][kColsPerBlock];
  __shared__ float partial_beta[kRowSplit][kColsPerBlock];
  const int64_t c = blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x;
  float sum_gamma = 0.0f;
  float sum_beta = 0.0f;
  if (c < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kRowSplit) {
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
    if (dgamma != nullptr) {
      StoreAs(dgamma, c, dgamma_dtype, LoadAs(dgamma, c, dgamma_dtype) + total_gamma);
    }
    if (dbeta != nullptr) {
      StoreAs(dbeta, c, dbeta_dtype, LoadAs(dbeta, c, dbeta_dtype) + total_beta);
    }
  }
}

}  // namespace

absl::Status LaunchLayerNormBackward(const void* x, DType dtype, const void* gamma,
                                     DType gamma_dtype, const float* mean, const float* rstd,
                                     const void* dy, void* dx, void* dgamma, DType dgamma_dtype,
                                     void* dbeta, DType dbeta_dtype, int64_t rows, int64_t cols,
                                     cudaStream_t stream) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const auto row_grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  layernorm_backward_dx_kernel<<<row_grid, kThreads, 0, stream>>>(x, dtype, gamma, gamma_dtype,
                                                                  mean, rstd, dy, dx, rows, cols);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  if (dgamma == nullptr && dbeta == nullptr) return absl::OkStatus();
  const auto col_grid = static_cast<unsigned>((cols + kColsPerBlock - 1) / kColsPerBlock);
  layernorm_backward_params_kernel<<<col_grid, dim3(kColsPerBlock, kRowSplit), 0, stream>>>(
      x, dtype, mean, rstd, dy, dgamma, dgamma_dtype, dbeta, dbeta_dtype, rows, cols);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
