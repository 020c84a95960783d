// LayerNorm and RMSNorm backward (PyTorch's LayerNorm formula), with xhat = (x - mean) * rstd and
// g = dy * gamma (dy when not affine; dy * (gamma_offset + gamma) for an
// RMSNorm with an offset, Gemma's 1 + w, whose dgamma is the same sum):
//   dx     = rstd * (g - sum(g) * (1/C) - xhat * (sum(g * xhat) * (1/C)))
//                                                             one warp per row
//   dgamma += sum over rows of dy * xhat                      column kernel
//   dbeta  += sum over rows of dy
// (the CPU oracle's operation order: it multiplies by 1/C). RMSNorm is
// mean == nullptr: mean 0 and no sum(g) term, as in the CPU oracle. The column sums
// are formed in fp32 per row slab (see ColumnSumSlabs in launchers.h), the
// slabs added in a fixed order, added to the old value and rounded once:
// deterministic. Neither dgamma nor dbeta given (LayerNorm without affine,
// a frozen RMSNorm weight): no column kernel runs, only dx's. The column
// kernels run before the dx kernel, so dx may alias x or dy. Templates per dtype; rows of a
// multiple of the vector width move 16 bytes per access, in orders of addition that give the
// element-by-element loops' bits (ForEachOwnColumn, and each column's rows
// in the same order). The rows lie where NormRows says (launchers.h): a
// plain tensor's, or the heads of fused q|k|v rows for the per-head
// RMSNorm, whose weight gradient sums every row's heads as rows.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kColsPerBlock = static_cast<int>(kColumnSumColsPerBlock);
constexpr int kRowSplit = 16;

// The scale gamma_offset + gamma in fp32 (Gemma's RMSNorm: 1 + w); gamma
// itself without an offset, as the CPU oracle (OffsetWeight) forms it.
__device__ __forceinline__ float OffsetGamma(float offset, float gamma) {
  return offset == 0.0f ? gamma : offset + gamma;
}

template <typename T>
__global__ void layernorm_backward_dx_kernel(const T* x, const T* gamma, float gamma_offset,
                                             const float* mean, const float* rstd, const T* dy,
                                             T* dx, int64_t rows, int64_t cols, float inv_cols,
                                             bool vectorized, NormRows at) {
  // x, dy, dx: rows of cols at `at`; gamma: (cols) or nullptr; mean, rstd: (rows).
  // The row sums go through ForEachOwnColumn (each lane's order of
  // additions kept, 16-byte loads when vectorized); the output is
  // elementwise.
  constexpr int N = VecWidth<T>();
  __shared__ float stage[kWarpsPerBlock][2 * 32 * N];  // x's and dy's tiles
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + warp;
  if (row >= rows) return;  // the whole warp: rows are per warp
  const T* xr = x + at.Start(row, cols);
  const T* dyr = dy + at.Start(row, cols);
  T* dxr = dx + at.Start(row, cols);
  const bool centre = mean != nullptr;  // false: RMSNorm
  const float mu = centre ? mean[row] : 0.0f;
  const float rs = rstd[row];
  float sum_g = 0.0f;
  float sum_gx = 0.0f;
  ForEachOwnColumn<N>(xr, dyr, cols, vectorized, stage[warp], [&](int64_t c, float xv, float gv) {
    const float xhat = (xv - mu) * rs;
    float g = gv;
    if (gamma != nullptr) g = g * OffsetGamma(gamma_offset, ToFloat(gamma[c]));
    sum_g += g;
    sum_gx += g * xhat;
  });
  const float total_g = WarpSum(sum_g);  // every lane takes part, whatever centre
  const float mean_g = centre ? total_g * inv_cols : 0.0f;
  const float mean_gx = WarpSum(sum_gx) * inv_cols;
  // Each lane re-reads and then writes only its own columns, so dx may
  // alias x or dy.
  if (vectorized) {
    for (int64_t c = lane * int64_t{N}; c < cols; c += 32 * N) {
      const Vec<T, N> xs = LoadVec<N>(xr, c);
      const Vec<T, N> gs = LoadVec<N>(dyr, c);
      Vec<T, N> gamma_v;
      if (gamma != nullptr) gamma_v = LoadVec<N>(gamma, c);
      Vec<T, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float xhat = (ToFloat(xs.v[j]) - mu) * rs;
        float g = ToFloat(gs.v[j]);
        if (gamma != nullptr) g = g * OffsetGamma(gamma_offset, ToFloat(gamma_v.v[j]));
        out.v[j] = FromFloat<T>(rs * (g - mean_g - xhat * mean_gx));
      }
      StoreVec<N>(dxr, c, out);
    }
  } else {
    for (int64_t c = lane; c < cols; c += 32) {
      const float xhat = (ToFloat(xr[c]) - mu) * rs;
      float g = ToFloat(dyr[c]);
      if (gamma != nullptr) g = g * OffsetGamma(gamma_offset, ToFloat(gamma[c]));
      dxr[c] = FromFloat<T>(rs * (g - mean_g - xhat * mean_gx));
    }
  }
}

// p (cols) += total, rounded once to p's dtype; p may be nullptr.
__device__ __forceinline__ void AccumulateColumn(void* p, DType dtype, int64_t c, float total) {
  if (p != nullptr) StoreAs(p, c, dtype, LoadAs(p, c, dtype) + total);
}

// N columns per thread: 1, or a 16-byte vector's worth of x and dy when
// cols % N == 0 and both are aligned. Each column's rows are summed in the
// same order either way, so both give the same bits.
template <typename T, int N>
__global__ void layernorm_backward_params_kernel(const T* x, const float* mean, const float* rstd,
                                                 const T* dy, int64_t rows_per_slab, void* dgamma,
                                                 DType dgamma_dtype, void* dbeta, DType dbeta_dtype,
                                                 int64_t rows, int64_t cols, float* partials,
                                                 NormRows at) {
  // partials (2, gridDim.y, cols) when gridDim.y > 1: dgamma's slabs, then dbeta's
  __shared__ float partial_gamma[kRowSplit][N][kColsPerBlock];  // [y][column in group][x]
  __shared__ float partial_beta[kRowSplit][N][kColsPerBlock];
  const int64_t c0 = (blockIdx.x * int64_t{kColsPerBlock} + threadIdx.x) * N;
  const int64_t r_begin = blockIdx.y * rows_per_slab;
  const int64_t r_end = r_begin + rows_per_slab < rows ? r_begin + rows_per_slab : rows;
  float sum_gamma[N] = {};
  float sum_beta[N] = {};
  if (c0 < cols) {
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kRowSplit) {
      const Vec<T, N> gs = LoadVec<N>(dy, at.Start(r, cols) + c0);
      const Vec<T, N> xs = LoadVec<N>(x, at.Start(r, cols) + c0);
      const float mu = mean != nullptr ? mean[r] : 0.0f;
      const float rs = rstd[r];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float g = ToFloat(gs.v[j]);
        sum_gamma[j] += g * ((ToFloat(xs.v[j]) - mu) * rs);
        sum_beta[j] += g;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    partial_gamma[threadIdx.y][j][threadIdx.x] = sum_gamma[j];
    partial_beta[threadIdx.y][j][threadIdx.x] = sum_beta[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float total_gamma = 0.0f;
      float total_beta = 0.0f;
      for (int k = 0; k < kRowSplit; ++k) {
        total_gamma += partial_gamma[k][j][threadIdx.x];
        total_beta += partial_beta[k][j][threadIdx.x];
      }
      const int64_t c = c0 + j;
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

template <typename T, int N>
absl::Status LaunchParams(const T* x, const float* mean, const float* rstd, const T* dy,
                          int64_t rows_per_slab, int64_t slabs, void* dgamma, DType dgamma_dtype,
                          void* dbeta, DType dbeta_dtype, int64_t rows, int64_t cols,
                          float* partials, cudaStream_t stream, NormRows at) {
  const int64_t groups = (cols + N - 1) / N;
  const dim3 grid(static_cast<unsigned>((groups + kColsPerBlock - 1) / kColsPerBlock),
                  static_cast<unsigned>(slabs));
  layernorm_backward_params_kernel<T, N><<<grid, dim3(kColsPerBlock, kRowSplit), 0, stream>>>(
      x, mean, rstd, dy, rows_per_slab, dgamma, dgamma_dtype, dbeta, dbeta_dtype, rows, cols,
      partials, at);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchLayerNormBackward(const void* x, DType dtype, const void* gamma,
                                     DType gamma_dtype, float gamma_offset, const float* mean,
                                     const float* rstd, const void* dy, void* dx, void* dgamma,
                                     DType dgamma_dtype, void* dbeta, DType dbeta_dtype,
                                     int64_t rows, int64_t cols, float* partials,
                                     cudaStream_t stream, NormRows at) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  if (gamma != nullptr && gamma_dtype != dtype) {
    return absl::InternalError("LaunchLayerNormBackward: gamma must have x's dtype");
  }
  // Parameter gradients first: they read x and dy, which dx may overwrite.
  if (dgamma != nullptr || dbeta != nullptr) {
    const int64_t rows_per_slab = ColumnSumRowsPerSlab(rows, cols);
    const int64_t slabs = ColumnSumSlabs(rows, cols);
    if (slabs > 1 && partials == nullptr) {
      return absl::InternalError(
          "LaunchLayerNormBackward: several row slabs but no partials scratch");
    }
    const absl::Status summed = DispatchFloat(dtype, [&](auto tag) {
      using T = decltype(tag);
      constexpr int N = VecWidth<T>();
      const T* xt = static_cast<const T*>(x);
      const T* dyt = static_cast<const T*>(dy);
      if (cols % N == 0 && at.StartsAligned(N) && VecAligned<N>(xt) && VecAligned<N>(dyt)) {
        return LaunchParams<T, N>(xt, mean, rstd, dyt, rows_per_slab, slabs, dgamma, dgamma_dtype,
                                  dbeta, dbeta_dtype, rows, cols, partials, stream, at);
      }
      return LaunchParams<T, 1>(xt, mean, rstd, dyt, rows_per_slab, slabs, dgamma, dgamma_dtype,
                                dbeta, dbeta_dtype, rows, cols, partials, stream, at);
    });
    if (!summed.ok()) return summed;
    if (slabs > 1) {
      layernorm_backward_params_finalize_kernel<<<GridFor(cols), kThreads, 0, stream>>>(
          partials, slabs, cols, dgamma, dgamma_dtype, dbeta, dbeta_dtype);
      AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    }
  }
  // 1/C rounded once here, as the CPU oracle computes it.
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const auto row_grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* xt = static_cast<const T*>(x);
    const T* gt = static_cast<const T*>(gamma);
    const T* dyt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    const bool vectorized = cols % N == 0 && at.StartsAligned(N) && VecAligned<N>(xt) &&
                            VecAligned<N>(gt) && VecAligned<N>(dyt) && VecAligned<N>(dxt);
    layernorm_backward_dx_kernel<T><<<row_grid, kThreads, 0, stream>>>(
        xt, gt, gamma_offset, mean, rstd, dyt, dxt, rows, cols, inv_cols, vectorized, at);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
