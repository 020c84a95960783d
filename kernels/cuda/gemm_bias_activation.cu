// GemmBiasActivation's epilogue kernel, for the calls cuBLASLt's BIAS or
// GELU_AUX_BIAS epilogue does not take (F32 GELU, shapes or alignments
// without an algorithm): the GEMM has left its unrounded fp32 sums in acc,
// and one pass forms p = acc + bias in fp32, stores pre = p and
// c = act(p), each rounded once: the contract of kernels/backend.h, the
// CPU oracle's operations (gemm_bias_activation.cc) in its order.
#include "kernels/cuda/activation_math.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

template <typename T>
__device__ __forceinline__ void Finish(float p, GemmActivation act, T* pre, T* c, int64_t i) {
  if (act == GemmActivation::kGELUTanh) {
    pre[i] = FromFloat<T>(p);
    c[i] = FromFloat<T>(GeluTanh(p));
  } else {
    c[i] = FromFloat<T>(p);
  }
}

template <typename T>
__global__ void bias_activation_kernel(const float* acc, const T* bias, GemmActivation act, T* pre,
                                       T* c, int64_t rows, int64_t cols, bool vectorized) {
  // acc (rows, cols) F32; bias (cols) or nullptr; pre (rows, cols) when act
  // is GELUTanh; c (rows, cols). For F32, acc is c (kNone) or pre (GELU):
  // each element is read before it is written. Vectors of N need cols % N
  // == 0, so none straddles a row and bias is read as a vector too.
  constexpr int N = VecWidth<T>();
  const int64_t n = rows * cols;
  GridStride<N>(
      n, vectorized,
      [&](int64_t i) {
        const Vec<float, N> sums = LoadVec<N>(acc, i);
        const int64_t col = i % cols;
        Vec<T, N> b;
        if (bias != nullptr) b = LoadVec<N>(bias, col);
        Vec<T, N> pre_out;
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float p = bias != nullptr ? sums.v[j] + ToFloat(b.v[j]) : sums.v[j];
          if (act == GemmActivation::kGELUTanh) {
            pre_out.v[j] = FromFloat<T>(p);
            out.v[j] = FromFloat<T>(GeluTanh(p));
          } else {
            out.v[j] = FromFloat<T>(p);
          }
        }
        if (act == GemmActivation::kGELUTanh) StoreVec<N>(pre, i, pre_out);
        StoreVec<N>(c, i, out);
      },
      [&](int64_t i) {
        const float p = bias != nullptr ? acc[i] + ToFloat(bias[i % cols]) : acc[i];
        Finish(p, act, pre, c, i);
      });
}

}  // namespace

absl::Status LaunchBiasActivation(const float* acc, const void* bias, GemmActivation act, void* pre,
                                  void* c, DType dtype, int64_t rows, int64_t cols,
                                  cudaStream_t stream) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  return DispatchFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = VecWidth<T>();
    const T* bt = static_cast<const T*>(bias);
    T* pt = static_cast<T*>(pre);
    T* ct = static_cast<T*>(c);
    const bool vectorized = cols % N == 0 && VecAligned<N>(acc) && VecAligned<N>(bt) &&
                            VecAligned<N>(pt) && VecAligned<N>(ct);
    bias_activation_kernel<T><<<GridForVec<N>(rows * cols, vectorized), kThreads, 0, stream>>>(
        acc, bt, act, pt, ct, rows, cols, vectorized);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
