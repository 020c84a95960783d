// Causal self-attention forward on cuBLAS plus one softmax kernel, with no
// scratch: the scores are written straight into att and normalised there.
// Per batch row b, one strided-batched GEMM over the heads computes
//   S_h = (q_h k_h^T) / sqrt(D)        (T, T) into att[b, h], fp32 accumulate
// where q_h, k_h are (T, D) column blocks of qkv (leading dimension 3C,
// head stride D); the causal softmax kernel turns each row of S into P in
// place (keys s <= t, row max subtracted; 0 after the query); a second
// strided-batched GEMM writes
//   out_h = P_h v_h                    (T, D) into out[b, :, h*D ...] (ld C)
// Each stored matrix is rounded once to the working dtype, as the CPU
// oracle (kernels/cpu/attention_forward.cc) mirrors. Nothing is allocated,
// nothing waits: 2 B GEMM launches and one kernel on the backend's stream.
#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// One warp per row of att (B * H * T rows of T): row r is query t = r % T.
template <typename T>
__global__ void causal_softmax_kernel(T* att, int64_t rows, int64_t seq) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * kAttentionRowsPerBlock;
  for (int64_t row = blockIdx.x * int64_t{kAttentionRowsPerBlock} + (threadIdx.x >> 5); row < rows;
       row += warps) {
    T* p = att + row * seq;
    const int64_t keys = row % seq + 1;
    float max = -INFINITY;
    for (int64_t j = lane; j < keys; j += 32) max = fmaxf(max, ToFloat(p[j]));
    max = WarpMax(max);
    float sum = 0.0f;
    for (int64_t j = lane; j < keys; j += 32) sum += expf(ToFloat(p[j]) - max);
    sum = WarpSum(sum);
    const float inv_sum = 1.0f / sum;
    // Each lane rewrites only the elements it read itself.
    for (int64_t j = lane; j < keys; j += 32)
      p[j] = FromFloat<T>(expf(ToFloat(p[j]) - max) * inv_sum);
    for (int64_t j = keys + lane; j < seq; j += 32) p[j] = FromFloat<T>(0.0f);
  }
}

template <typename T>
absl::Status Softmax(void* att, int64_t rows, int64_t seq, cudaStream_t stream) {
  causal_softmax_kernel<T>
      <<<AttentionRowBlocks(rows), kThreads, 0, stream>>>(static_cast<T*>(att), rows, seq);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchAttentionForward(cublasHandle_t handle, const void* qkv, DType dtype,
                                    int64_t batch, int64_t seq, int64_t channels, int64_t heads,
                                    void* att, void* out, cudaStream_t stream) {
  if (batch == 0 || seq == 0) return absl::OkStatus();
  const AttentionGeometry g(dtype, seq, channels, heads);
  for (int64_t b = 0; b < batch; ++b) {
    const void* q = g.Qkv(qkv, b, 0);
    const void* k = g.Qkv(qkv, b, 1);
    // S = scale * q k^T: (T, D) x (T, D)^T, per head.
    AMPD_RETURN_IF_ERROR(LaunchGemmStridedBatched(
        handle, false, true, g.t, g.t, g.d, g.scale, q, g.ld_qkv, g.head_stride, k, g.ld_qkv,
        g.head_stride, dtype, 0.0f, g.Att(att, b), g.t, g.att_stride, dtype, g.heads));
  }
  switch (dtype) {
    case DType::kF16:
      AMPD_RETURN_IF_ERROR(Softmax<__half>(att, batch * heads * seq, seq, stream));
      break;
    case DType::kBF16:
      AMPD_RETURN_IF_ERROR(Softmax<__nv_bfloat16>(att, batch * heads * seq, seq, stream));
      break;
    default:
      AMPD_RETURN_IF_ERROR(Softmax<float>(att, batch * heads * seq, seq, stream));
      break;
  }
  for (int64_t b = 0; b < batch; ++b) {
    // out_h = P v_h: (T, T) x (T, D), into columns h*D of out (ld C).
    AMPD_RETURN_IF_ERROR(
        LaunchGemmStridedBatched(handle, false, false, g.t, g.d, g.t, 1.0f, g.Att(att, b), g.t,
                                 g.att_stride, g.Qkv(qkv, b, 2), g.ld_qkv, g.head_stride, dtype,
                                 0.0f, g.Out(out, b), g.ld_out, g.head_stride, dtype, g.heads));
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
