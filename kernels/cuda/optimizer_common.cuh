// What the fused optimizer kernels share: the per-parameter tile layout and
// the GradTransform read on the device (skip on found_inf, unscale, clip).
#pragma once

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {

// Each block updates one tile of kOptimizerTile consecutive elements of one
// parameter; a thread takes kOptimizerElemsPerThread of them, as groups of 4
// consecutive elements (one 16-byte fp32 load or store, one 8-byte 16-bit
// one) when the whole tile is in range and aligned, which keeps 2 x 4 loads
// of every stream in flight per thread. The last, partial tile of a
// parameter goes element by element.
constexpr int kOptimizerElemsPerThread = 8;
constexpr int kOptimizerVec = 4;
constexpr int64_t kOptimizerTile = int64_t{kThreads} * kOptimizerElemsPerThread;

// 4 consecutive elements as fp32, loaded or stored in one access (exact
// widening; stores round each element once, nearest-even, as FromFloat).
template <typename T>
struct Vec4;
template <>
struct Vec4<float> {
  static __device__ __forceinline__ void Load(const float* p, float (&v)[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  }
  static __device__ __forceinline__ void Store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <>
struct Vec4<__half> {
  static __device__ __forceinline__ void Load(const __half* p, float (&v)[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
  static __device__ __forceinline__ void Store(__half* p, const float (&v)[4]) {
    uint2 raw;
    *reinterpret_cast<__half2*>(&raw.x) = __floats2half2_rn(v[0], v[1]);
    *reinterpret_cast<__half2*>(&raw.y) = __floats2half2_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = raw;
  }
};
template <>
struct Vec4<__nv_bfloat16> {
  static __device__ __forceinline__ void Load(const __nv_bfloat16* p, float (&v)[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
  static __device__ __forceinline__ void Store(__nv_bfloat16* p, const float (&v)[4]) {
    uint2 raw;
    *reinterpret_cast<__nv_bfloat162*>(&raw.x) = __floats2bfloat162_rn(v[0], v[1]);
    *reinterpret_cast<__nv_bfloat162*>(&raw.y) = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = raw;
  }
};

// True when p (a tensor's base, element type T) allows Vec4 access at every
// tile start: tiles start at multiples of kOptimizerTile elements, so the
// base's alignment to 4 elements is what decides. nullptr passes.
template <typename T>
__device__ __forceinline__ bool Vec4Aligned(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kOptimizerVec)) == 0;
}

// Whether this block's tile of p takes the vector path: whole and aligned.
template <typename TGrad, typename TWork>
__device__ __forceinline__ bool VectorTile(const ParamSpan& p, int64_t begin) {
  return begin + kOptimizerTile <= p.n && Vec4Aligned(p.master) &&
         Vec4Aligned(static_cast<const TGrad*>(p.grad)) &&
         Vec4Aligned(static_cast<const TWork*>(p.working)) && Vec4Aligned(p.state0) &&
         Vec4Aligned(p.state1);
}

// Factor applied to every raw gradient element: inv_scale * clip_coef, with
// clip_coef = min(1, max_norm / (sqrt(norm_sq) + 1e-6)) as
// torch.nn.utils.clip_grad_norm_ computes it. Applied as (g * inv_scale) * clip
// so the rounding matches the two separate multiplications of the reference.
struct GradFactor {
  float inv_scale;
  float clip;
};

// True when the step must write nothing: found_inf is set, or an earlier op
// of this step raised a bit in the device error word (a bad embedding id or
// label, not reported to the host until the step's read). Both live in
// device memory and were written by earlier kernels on the same stream, so
// a plain load sees them; every block reads the same two words, L2 hits.
__device__ __forceinline__ bool SkipStep(const TransformArgs& t) {
  if (t.found_inf[0] != 0.0f) return true;
  return t.error_flags != nullptr && t.error_flags[0] != 0;
}

__device__ __forceinline__ GradFactor ReadGradFactor(const TransformArgs& t) {
  float clip = 1.0f;
  if (t.norm_sq != nullptr && t.max_grad_norm > 0.0f) {
    clip = fminf(1.0f, t.max_grad_norm / (sqrtf(t.norm_sq[0]) + 1e-6f));
  }
  return {t.inv_scale, clip};
}

// The body of every fused optimizer kernel around its per-element math: a
// skipped step returns before any write; otherwise find this block's
// parameter and tile and call tile(grad_tag, work_tag, param, begin, factor),
// specialised for the gradient's and working copy's dtypes once per block.
template <typename TileFn>
__device__ __forceinline__ void OptimizerBlock(const TensorChunk<ParamSpan>& chunk,
                                               const TransformArgs& transform, TileFn&& tile) {
  if (SkipStep(transform)) return;  // skipped step: write nothing
  const GradFactor factor = ReadGradFactor(transform);
  const int t = ChunkTensorOf(chunk, static_cast<int>(blockIdx.x));
  const ParamSpan& p = chunk.entry[t];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunk.block_start[t]) * kOptimizerTile;
  VisitFloat(p.grad_dtype, [&](auto grad_tag) {
    VisitFloat(p.working == nullptr ? DType::kF32 : p.working_dtype,
               [&](auto work_tag) { tile(grad_tag, work_tag, p, begin, factor); });
  });
}

// Launches `kernel` (an optimizer kernel taking (chunk, args, transform))
// once per chunk of parameters, all on `stream`.
template <typename Args>
cudaError_t LaunchOptimizerChunks(void (*kernel)(TensorChunk<ParamSpan>, Args, TransformArgs),
                                  const ParamSpan* params, int count, const Args& args,
                                  const TransformArgs& transform, cudaStream_t stream) {
  return ForEachChunk(params, count, kOptimizerTile, [&](const TensorChunk<ParamSpan>& chunk) {
    kernel<<<chunk.block_start[chunk.count], kThreads, 0, stream>>>(chunk, args, transform);
    return cudaGetLastError();
  });
}

}  // namespace ampd::kernels::cuda
