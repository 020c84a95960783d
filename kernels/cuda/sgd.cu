// Fused SGD step over a list of parameters (PyTorch's torch.optim.SGD):
//   g = grad * inv_scale * clip_coef;  g = g + wd * w
//   momentum != 0: buf = first_step ? g : momentum buf + (1 - dampening) g
//                  g = nesterov ? g + momentum buf : buf
//   w = w - lr g;  working = round(w)
// Skipped entirely (no writes) when found_inf[0] != 0 or the backend's
// error word is set (a bad id/label earlier in the step), both read on the
// device from device memory.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/optimizer_common.cuh"

namespace ampd::kernels::cuda {
namespace {

template <typename TGrad, typename TWork>
__device__ __forceinline__ void SgdTile(const ParamSpan& p, int64_t begin, const SgdArgs& a,
                                        GradFactor f) {
  const auto* grad = static_cast<const TGrad*>(p.grad);
  auto* working = static_cast<TWork*>(p.working);
#pragma unroll
  for (int k = 0; k < kOptimizerElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;
    if (i >= p.n) break;
    float g = ToFloat(grad[i]) * f.inv_scale * f.clip;
    float w = p.master[i];
    if (a.weight_decay != 0.0f) g = g + a.weight_decay * w;
    if (a.momentum != 0.0f) {
      const float buf = a.first_step ? g : a.momentum * p.state0[i] + (1.0f - a.dampening) * g;
      p.state0[i] = buf;
      g = a.nesterov ? g + a.momentum * buf : buf;
    }
    w = w - a.lr * g;
    p.master[i] = w;
    if (working != nullptr) working[i] = FromFloat<TWork>(w);
  }
}

__global__ void sgd_kernel(const __grid_constant__ TensorChunk<ParamSpan> chunk, const SgdArgs args,
                           const TransformArgs transform) {
  OptimizerBlock(
      chunk, transform,
      [&](auto grad_tag, auto work_tag, const ParamSpan& p, int64_t begin, GradFactor factor) {
        SgdTile<decltype(grad_tag), decltype(work_tag)>(p, begin, args, factor);
      });
}

}  // namespace

absl::Status LaunchSgdUpdate(const ParamSpan* params, int count, const SgdArgs& args,
                             const TransformArgs& transform, cudaStream_t stream) {
  AMPD_CUDA_RETURN_IF_ERROR(
      LaunchOptimizerChunks(sgd_kernel, params, count, args, transform, stream));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
