// Fused Adam / AdamW step over a list of parameters, one launch per
// kChunkTensors parameters. Per element, in fp32 (PyTorch's formulas):
//   g = grad * inv_scale * clip_coef
//   AdamW: w = w * (1 - lr * wd)          Adam: g = g + wd * w
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   w = w - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   working = round(w) to the working dtype
// Every block first reads found_inf[0] and the backend's error word (an int
// in device memory: an L2 hit, not a PCIe round trip) and returns when
// either is set (overflow, or a bad id/label earlier in the
// step), so a skipped step is one tiny kernel with no host round trip and no
// write at all. Traffic per element with fp16 grads and a working copy:
// reads grad 2 + w 4 + m 4 + v 4, writes w 4 + m 4 + v 4 + working 2 = 28 B.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/optimizer_common.cuh"

namespace ampd::kernels::cuda {
namespace {

template <typename TGrad, typename TWork>
__device__ __forceinline__ void AdamTile(const ParamSpan& p, int64_t begin, const AdamArgs& a,
                                         GradFactor f) {
  const auto* grad = static_cast<const TGrad*>(p.grad);
  auto* working = static_cast<TWork*>(p.working);
  const float decay = 1.0f - a.lr * a.weight_decay;
#pragma unroll
  for (int k = 0; k < kOptimizerElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;
    if (i >= p.n) break;
    float g = ToFloat(grad[i]) * f.inv_scale * f.clip;
    float w = p.master[i];
    if (a.weight_decay != 0.0f) {
      if (a.decoupled) {
        w = w * decay;
      } else {
        g = g + a.weight_decay * w;
      }
    }
    const float m = a.beta1 * p.state0[i] + (1.0f - a.beta1) * g;
    const float v = a.beta2 * p.state1[i] + (1.0f - a.beta2) * g * g;
    const float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
    w = w - a.step_size * (m / denom);
    p.state0[i] = m;
    p.state1[i] = v;
    p.master[i] = w;
    if (working != nullptr) working[i] = FromFloat<TWork>(w);
  }
}

__global__ void adam_kernel(const __grid_constant__ TensorChunk<ParamSpan> chunk,
                            const AdamArgs args, const TransformArgs transform) {
  OptimizerBlock(
      chunk, transform,
      [&](auto grad_tag, auto work_tag, const ParamSpan& p, int64_t begin, GradFactor factor) {
        AdamTile<decltype(grad_tag), decltype(work_tag)>(p, begin, args, factor);
      });
}

}  // namespace

absl::Status LaunchAdamUpdate(const ParamSpan* params, int count, const AdamArgs& args,
                              const TransformArgs& transform, cudaStream_t stream) {
  AMPD_CUDA_RETURN_IF_ERROR(
      LaunchOptimizerChunks(adam_kernel, params, count, args, transform, stream));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
