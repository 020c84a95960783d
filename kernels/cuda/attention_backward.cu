// Causal self-attention backward on cuBLAS plus one softmax-backward kernel,
// with datt as the only scratch (the caller's). Per batch row b, strided-
// batched GEMMs over the heads (fp32 accumulate, each result rounded once
// to the working dtype):
//   dv_h = P_h^T dout_h                      into dqkv[b, :, 2C + h*D ...]
//   dP_h = dout_h v_h^T                      into datt[b, h]
// then the kernel turns each row of dP into
//   dS = P * (dP - sum_s P dP)               in place in datt (0 after the query)
// and two more GEMMs finish
//   dq_h = (dS_h k_h) / sqrt(D)              into dqkv[b, :, h*D ...]
//   dk_h = (dS_h^T q_h) / sqrt(D)            into dqkv[b, :, C + h*D ...]
// The operation order and roundings are the CPU oracle's
// (kernels/cpu/attention_backward.cc). Masked positions hold P = 0 and
// dS = 0, so the full (T, T) products add nothing for them. No allocation,
// no synchronisation.
#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// One warp per row of att/datt (B * H * T rows of T): row r is query r % T.
template <typename T>
__global__ void causal_softmax_backward_kernel(const T* att, T* datt, int64_t rows, int64_t seq) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * kAttentionRowsPerBlock;
  for (int64_t row = blockIdx.x * int64_t{kAttentionRowsPerBlock} + (threadIdx.x >> 5); row < rows;
       row += warps) {
    const T* p = att + row * seq;
    T* g = datt + row * seq;
    const int64_t keys = row % seq + 1;
    float dot = 0.0f;
    for (int64_t j = lane; j < keys; j += 32) dot += ToFloat(p[j]) * ToFloat(g[j]);
    dot = WarpSum(dot);
    // Each lane rewrites only the elements it read itself.
    for (int64_t j = lane; j < keys; j += 32) {
      g[j] = FromFloat<T>(ToFloat(p[j]) * (ToFloat(g[j]) - dot));
    }
    for (int64_t j = keys + lane; j < seq; j += 32) g[j] = FromFloat<T>(0.0f);
  }
}

template <typename T>
absl::Status SoftmaxBackward(const void* att, void* datt, int64_t rows, int64_t seq,
                             cudaStream_t stream) {
  causal_softmax_backward_kernel<T><<<AttentionRowBlocks(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(att), static_cast<T*>(datt), rows, seq);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchAttentionBackward(cublasHandle_t handle, const void* qkv, const void* att,
                                     const void* dout, DType dtype, int64_t batch, int64_t seq,
                                     int64_t channels, int64_t heads, void* datt, void* dqkv,
                                     cudaStream_t stream) {
  if (batch == 0 || seq == 0) return absl::OkStatus();
  const AttentionGeometry g(dtype, seq, channels, heads);
  for (int64_t b = 0; b < batch; ++b) {
    const void* p = g.Att(att, b);
    const void* dout_b = g.Out(dout, b);
    // dv = P^T dout: (T, T)^T x (T, D).
    AMPD_RETURN_IF_ERROR(LaunchGemmStridedBatched(
        handle, true, false, g.t, g.d, g.t, 1.0f, p, g.t, g.att_stride, dout_b, g.ld_out,
        g.head_stride, dtype, 0.0f, g.Qkv(dqkv, b, 2), g.ld_qkv, g.head_stride, dtype, g.heads));
    // dP = dout v^T: (T, D) x (T, D)^T.
    AMPD_RETURN_IF_ERROR(LaunchGemmStridedBatched(
        handle, false, true, g.t, g.t, g.d, 1.0f, dout_b, g.ld_out, g.head_stride, g.Qkv(qkv, b, 2),
        g.ld_qkv, g.head_stride, dtype, 0.0f, g.Att(datt, b), g.t, g.att_stride, dtype, g.heads));
  }
  const int64_t rows = batch * heads * seq;
  switch (dtype) {
    case DType::kF16:
      AMPD_RETURN_IF_ERROR(SoftmaxBackward<__half>(att, datt, rows, seq, stream));
      break;
    case DType::kBF16:
      AMPD_RETURN_IF_ERROR(SoftmaxBackward<__nv_bfloat16>(att, datt, rows, seq, stream));
      break;
    default:
      AMPD_RETURN_IF_ERROR(SoftmaxBackward<float>(att, datt, rows, seq, stream));
      break;
  }
  for (int64_t b = 0; b < batch; ++b) {
    const void* ds = g.Att(static_cast<const void*>(datt), b);
    // dq = scale * dS k: (T, T) x (T, D).
    AMPD_RETURN_IF_ERROR(LaunchGemmStridedBatched(handle, false, false, g.t, g.d, g.t, g.scale, ds,
                                                  g.t, g.att_stride, g.Qkv(qkv, b, 1), g.ld_qkv,
                                                  g.head_stride, dtype, 0.0f, g.Qkv(dqkv, b, 0),
                                                  g.ld_qkv, g.head_stride, dtype, g.heads));
    // dk = scale * dS^T q: (T, T)^T x (T, D).
    AMPD_RETURN_IF_ERROR(LaunchGemmStridedBatched(handle, true, false, g.t, g.d, g.t, g.scale, ds,
                                                  g.t, g.att_stride, g.Qkv(qkv, b, 0), g.ld_qkv,
                                                  g.head_stride, dtype, 0.0f, g.Qkv(dqkv, b, 1),
                                                  g.ld_qkv, g.head_stride, dtype, g.heads));
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
