// Fused Adam / AdamW step over a list of parameters, one launch per
// kChunkTensors parameters, 16-byte accesses on whole aligned tiles
// (optimizer_common.cuh). Per element, in fp32 (PyTorch's formulas):
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

// One element's update, in the order of the formulas above (the CPU
// oracle's order: --fmad=false keeps every product and sum rounded apart).
__device__ __forceinline__ void AdamElement(float raw_grad, float& w, float& m, float& v,
                                            const AdamArgs& a, GradFactor f) {
  float g = raw_grad * f.inv_scale * f.clip;
  if (a.weight_decay != 0.0f) {
    if (a.decoupled) {
      w = w * (1.0f - a.lr * a.weight_decay);
    } else {
      g = g + a.weight_decay * w;
    }
  }
  m = a.beta1 * m + (1.0f - a.beta1) * g;
  v = a.beta2 * v + (1.0f - a.beta2) * g * g;
  const float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
  w = w - a.step_size * (m / denom);
}

template <typename TGrad, typename TWork>
__device__ __forceinline__ void AdamTile(const ParamSpan& p, int64_t begin, const AdamArgs& a,
                                         GradFactor f) {
  const auto* grad = static_cast<const TGrad*>(p.grad);
  auto* working = static_cast<TWork*>(p.working);
  if (VectorTile<TGrad, TWork>(p, begin)) {
    // Thread t takes elements [4 (k kThreads + t), +4) of the tile: each
    // warp's accesses are contiguous, 16 bytes per thread for fp32.
#pragma unroll
    for (int k = 0; k < kOptimizerElemsPerThread / kOptimizerVec; ++k) {
      const int64_t i = begin + (int64_t{k} * kThreads + threadIdx.x) * kOptimizerVec;
      float g[4], w[4], m[4], v[4];
      Vec4<TGrad>::Load(grad + i, g);
      Vec4<float>::Load(p.master + i, w);
      Vec4<float>::Load(p.state0 + i, m);
      Vec4<float>::Load(p.state1 + i, v);
#pragma unroll
      for (int j = 0; j < kOptimizerVec; ++j) AdamElement(g[j], w[j], m[j], v[j], a, f);
      Vec4<float>::Store(p.state0 + i, m);
      Vec4<float>::Store(p.state1 + i, v);
      Vec4<float>::Store(p.master + i, w);
      if (working != nullptr) Vec4<TWork>::Store(working + i, w);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kOptimizerElemsPerThread; ++k) {
    const int64_t i = begin + k * kThreads + threadIdx.x;
    if (i >= p.n) break;
    float w = p.master[i], m = p.state0[i], v = p.state1[i];
    AdamElement(ToFloat(grad[i]), w, m, v, a, f);
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
