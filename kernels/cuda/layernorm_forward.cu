// LayerNorm forward over the last dim: one warp per row. Statistics in fp32
// with two passes (mean, then the mean of squared deviations) rather than
// E[x^2] - E[x]^2, which cancels catastrophically for rows with a large mean.
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C  (biased, as PyTorch)
//   rstd = 1 / sqrt(var + eps)   (exact sqrt and division, not rsqrtf)
//   y = (x - mean) * rstd * gamma + beta
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

__global__ void layernorm_forward_kernel(const void* x, DType dtype, const void* gamma,
                                         const void* beta, DType param_dtype, int64_t rows,
                                         int64_t cols, float eps, void* y, float* mean,
                                         float* rstd) {
  // x, y: (rows, cols); gamma, beta: (cols) or nullptr; mean, rstd: (rows)
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * cols;
  float sum = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) sum += LoadAs(x, base + c, dtype);
  const float mu = WarpSum(sum) / static_cast<float>(cols);
  float sq = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) {
    const float d = LoadAs(x, base + c, dtype) - mu;
    sq += d * d;
  }
  const float var = WarpSum(sq) / static_cast<float>(cols);
  const float rs = 1.0f / sqrtf(var + eps);
  for (int64_t c = lane; c < cols; c += 32) {
    float v = (LoadAs(x, base + c, dtype) - mu) * rs;
    if (gamma != nullptr) v = v * LoadAs(gamma, c, param_dtype);
    if (beta != nullptr) v = v + LoadAs(beta, c, param_dtype);
    StoreAs(y, base + c, dtype, v);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

}  // namespace

absl::Status LaunchLayerNormForward(const void* x, DType dtype, const void* gamma, const void* beta,
                                    DType param_dtype, int64_t rows, int64_t cols, float eps,
                                    void* y, float* mean, float* rstd, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const auto grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  layernorm_forward_kernel<<<grid, kThreads, 0, stream>>>(x, dtype, gamma, beta, param_dtype, rows,
                                                          cols, eps, y, mean, rstd);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
