// LayerNorm and RMSNorm forward over the last dim: one warp per row. Statistics in fp32
// with two passes (mean, then the mean of squared deviations) rather than
// E[x^2] - E[x]^2, which cancels catastrophically for rows with a large mean.
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C  (biased, as PyTorch)
//   rstd = 1 / sqrt(var + eps)   (exact sqrt and division, not rsqrtf)
//   y = (x - mean) * rstd * gamma + beta
// (gamma_offset + gamma where an RMSNorm has an offset: Gemma's 1 + w)
// RMSNorm (mean == nullptr) skips the first pass: mean 0, no beta, so the
// second pass sums x^2, as the CPU oracle does. The rows lie where NormRows
// says (launchers.h): a plain tensor's, or each head of a fused q|k|v row
// for the per-head RMSNorm (Qwen3's q_norm, k_norm), the same kernel.
// A template per dtype. Rows whose length is a multiple of the vector width
// (and aligned operands) move 16 bytes per access: the sums through
// ForEachOwnColumn, which keeps each lane's order of additions, so the
// statistics have the bits of the element-by-element loop; the output
// pass is elementwise.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

// The scale gamma_offset + gamma in fp32 (Gemma's RMSNorm: 1 + w); gamma
// itself without an offset, as the CPU oracle (OffsetWeight) forms it.
__device__ __forceinline__ float OffsetGamma(float offset, float gamma) {
  return offset == 0.0f ? gamma : offset + gamma;
}

template <typename T>
__device__ __forceinline__ float Normalise(float x, float mu, float rs, const T* gamma,
                                           float gamma_offset, const T* beta, int64_t c) {
  float v = (x - mu) * rs;
  if (gamma != nullptr) v = v * OffsetGamma(gamma_offset, ToFloat(gamma[c]));
  if (beta != nullptr) v = v + ToFloat(beta[c]);
  return v;
}

template <typename T>
__global__ void layernorm_forward_kernel(const T* x, const T* gamma, float gamma_offset,
                                         const T* beta, int64_t rows, int64_t cols, float eps, T* y,
                                         float* mean, float* rstd, bool vectorized, NormRows at) {
  // x, y: rows of cols at `at`; gamma, beta: (cols) or nullptr; mean, rstd: (rows)
  constexpr int N = VecWidth<T>();
  __shared__ float stage[kWarpsPerBlock][32 * N];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + warp;
  if (row >= rows) return;  // the whole warp: rows are per warp
  const T* xr = x + at.Start(row, cols);
  T* yr = y + at.Start(row, cols);
  float mu = 0.0f;        // RMSNorm: no centring
  if (mean != nullptr) {  // the same for the whole warp
    float sum = 0.0f;
    ForEachOwnColumn<N>(xr, cols, vectorized, stage[warp], [&](int64_t, float v) { sum += v; });
    mu = WarpSum(sum) / static_cast<float>(cols);
  }
  float sq = 0.0f;
  ForEachOwnColumn<N>(xr, cols, vectorized, stage[warp], [&](int64_t, float v) {
    const float d = v - mu;
    sq += d * d;
  });
  const float var = WarpSum(sq) / static_cast<float>(cols);
  const float rs = 1.0f / sqrtf(var + eps);
  // Each lane reads and then writes only its own columns, so y may alias x.
  if (vectorized) {
    for (int64_t c = lane * int64_t{N}; c < cols; c += 32 * N) {
      const Vec<T, N> in = LoadVec<N>(xr, c);
      Vec<T, N> g;
      Vec<T, N> b;
      if (gamma != nullptr) g = LoadVec<N>(gamma, c);
      if (beta != nullptr) b = LoadVec<N>(beta, c);
      Vec<T, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float v = (ToFloat(in.v[j]) - mu) * rs;
        if (gamma != nullptr) v = v * OffsetGamma(gamma_offset, ToFloat(g.v[j]));
        if (beta != nullptr) v = v + ToFloat(b.v[j]);
        out.v[j] = FromFloat<T>(v);
      }
      StoreVec<N>(yr, c, out);
    }
  } else {
    for (int64_t c = lane; c < cols; c += 32) {
      yr[c] = FromFloat<T>(Normalise(ToFloat(xr[c]), mu, rs, gamma, gamma_offset, beta, c));
    }
  }
  if (lane == 0) {
    if (mean != nullptr) mean[row] = mu;
    rstd[row] = rs;
  }
}

}  // namespace

absl::Status LaunchLayerNormForward(const void* x, DType dtype, const void* gamma,
                                    float gamma_offset, const void* beta, DType param_dtype,
                                    int64_t rows, int64_t cols, float eps, void* y, float* mean,
                                    float* rstd, cudaStream_t stream, NormRows at) {
  if (rows == 0) return absl::OkStatus();
  if ((gamma != nullptr || beta != nullptr) && param_dtype != dtype) {
    return absl::InternalError("LaunchLayerNormForward: gamma and beta must have x's dtype");
  }
  const auto grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* xt = static_cast<const T*>(x);
    const T* gt = static_cast<const T*>(gamma);
    const T* bt = static_cast<const T*>(beta);
    T* yt = static_cast<T*>(y);
    const bool vectorized = cols % N == 0 && at.StartsAligned(N) && VecAligned<N>(xt) &&
                            VecAligned<N>(gt) && VecAligned<N>(bt) && VecAligned<N>(yt);
    layernorm_forward_kernel<T><<<grid, kThreads, 0, stream>>>(xt, gt, gamma_offset, bt, rows, cols,
                                                               eps, yt, mean, rstd, vectorized, at);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
