// Fused causal self-attention forward: the blockwise online softmax of
// kernels/backend.h in one launch, nothing of size T x T in memory.
//
// fp16/bf16 calls with D = 64 or 128 and 16-byte aligned operands take the
// register-tile kernel (attention_flash_forward.cu) by default; the wmma
// kernel here when the backend was created with attention_wmma.
//
// wmma kernel (fp16/bf16, D = 64 or 128): a CTA per (query tile of
// 64 rows, (b, h)); key blocks of 64 (the contract's kAttentionKeyBlock,
// aligned with the query tiles, so every query of a tile ends in the tile's
// own block and none visits a block wholly after it). Per key block, with
// K and V staged in shared memory by 16-byte loads, each warp computes its
// 16 queries' scores with wmma (fp32 accumulators), stages them through
// shared memory for the row-wise online softmax (lanes 2r and 2r + 1 own
// row r, 32 keys each), writes P rounded to the dtype, rescales its fp32
// output rows by alpha and adds P V onto them with wmma. Tiles are visited
// heaviest first (the last query tile has the most key blocks).
//
// Generic kernel (fp32, other head sizes, unaligned views, devices with
// too little shared memory, and every sliding-window call: the tensor-core
// kernels' tiles know only the causal diagonal): a warp per query row, lanes over the block's
// 64 keys (two each) for the scores and over channels (4 each, a slice of
// 128 per grid z) for the output, each dot product and sum in the CPU
// oracle's order; the row's arithmetic is GenericAttentionRowSlice
// (attention_generic_row.cuh), shared with the generic decode.
//
// A query row's result depends only on its own q and keys 0 .. t (rows and
// keys past T are zero-filled, masked keys get P = 0 exactly), so a prefix
// of a sequence gives the longer sequence's rows bit for bit.
#include <mma.h>

#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/attention_generic_row.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

// ---- tensor cores ----------------------------------------------------------

template <int D>
struct ForwardSmem {
  using L = AttnMmaLayout<D>;
  static constexpr int kQ = 0;  // (64, D) 16-bit tiles
  static constexpr int kK = kQ + L::kTileBytes;
  static constexpr int kV = kK + L::kTileBytes;
  static constexpr int kS = kV + L::kTileBytes;                // (64, 64) fp32 scores
  static constexpr int kP = kS + kAttnTile * L::kLdScore * 4;  // (64, 64) 16-bit P
  static constexpr int kO = kP + 4 * L::kStripBytes;           // (64, D) fp32 output
  static constexpr int kBytes = kO + kAttnTile * L::kLdAcc * 4;
  static_assert(kS % 128 == 0 && kP % 128 == 0 && kO % 128 == 0, "tiles start on 128 bytes");
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_forward_mma_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                                 float* __restrict__ lse, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using L = AttnMmaLayout<D>;
  using S = ForwardSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + S::kQ);
  T* ks = reinterpret_cast<T*>(smem + S::kK);
  T* vs = reinterpret_cast<T*>(smem + S::kV);
  float* ss = reinterpret_cast<float*>(smem + S::kS);
  T* ps = reinterpret_cast<T*>(smem + S::kP);
  float* os = reinterpret_cast<float*>(smem + S::kO);

  const int warp = threadIdx.x >> 5;
  const AttnLane me = AttnLaneOf(threadIdx.x & 31);
  const int tile = g.Tiles() - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  const int q0 = tile * kAttnTile;
  const int64_t ld = 3 * g.c;  // qkv's row
  const int strip = warp * 16;
  const int my_row = strip + me.row;  // within the tile
  const int q_abs = q0 + my_row;
  float* s_row = ss + my_row * L::kLdScore + me.half * 32;
  T* p_row = ps + my_row * L::kLdProb + me.half * 32;
  float* o_row = os + my_row * L::kLdAcc + me.half * (D / 2);

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    LoadAttnTile<T, D>(qs, base + q0 * ld, ld, min(kAttnTile, g.t - q0));
    for (int i = 0; i < D / 2; ++i) o_row[i] = 0.0f;
    float m = -INFINITY;
    float l = 0.0f;

    for (int kb = 0; kb <= tile; ++kb) {
      const int k0 = kb * kAttnTile;
      const int k_valid = min(kAttnTile, g.t - k0);
      __syncthreads();  // every warp is done with the previous K and V
      LoadAttnTile<T, D>(ks, base + g.c + k0 * ld, ld, k_valid);
      LoadAttnTile<T, D>(vs, base + 2 * g.c + k0 * ld, ld, k_valid);
      __syncthreads();

      // S strip (16, 64) = q strip (16, D) k^T (D, 64).
      {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
        for (int n = 0; n < 4; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::load_matrix_sync(a, qs + strip * L::kLdTile + kk * 16, L::kLdTile);
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bt;
            wmma::load_matrix_sync(bt, ks + n * 16 * L::kLdTile + kk * 16, L::kLdTile);
            wmma::mma_sync(acc[n], a, bt, acc[n]);
          }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          wmma::store_matrix_sync(ss + strip * L::kLdScore + n * 16, acc[n], L::kLdScore,
                                  wmma::mem_row_major);
        }
      }
      __syncwarp();

      // The online softmax of this lane's half row.
      const int key0 = k0 + me.half * 32;
      float block_max = -INFINITY;
      for (int j = 0; j < 32; ++j) {
        const float x = key0 + j <= q_abs ? s_row[j] * g.scale : -INFINITY;
        s_row[j] = x;
        block_max = fmaxf(block_max, x);
      }
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
      const float m_new = fmaxf(m, block_max);
      const float alpha = expf(m - m_new);
      float half_sum = 0.0f;
      for (int j = 0; j < 32; ++j) {
        const float p = expf(s_row[j] - m_new);  // masked: exp(-inf) = 0
        half_sum += p;
        p_row[j] = FromFloat<T>(p);
      }
      l = l * alpha + SumOfHalves(half_sum, me.half);
      m = m_new;
      for (int i = 0; i < D / 2; ++i) o_row[i] *= alpha;
      __syncwarp();

      // O strip (16, D) += P strip (16, 64) v (64, D).
      {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[D / 16];
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          wmma::load_matrix_sync(acc[n], os + strip * L::kLdAcc + n * 16, L::kLdAcc,
                                 wmma::mem_row_major);
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::load_matrix_sync(a, ps + strip * L::kLdProb + kk * 16, L::kLdProb);
#pragma unroll
          for (int n = 0; n < D / 16; ++n) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bv;
            wmma::load_matrix_sync(bv, vs + kk * 16 * L::kLdTile + n * 16, L::kLdTile);
            wmma::mma_sync(acc[n], a, bv, acc[n]);
          }
        }
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
          wmma::store_matrix_sync(os + strip * L::kLdAcc + n * 16, acc[n], L::kLdAcc,
                                  wmma::mem_row_major);
        }
      }
      __syncwarp();
    }

    if (q_abs < g.t) {
      T* dst = out + g.Token(b, q_abs) * g.c + static_cast<int64_t>(h) * D + me.half * (D / 2);
      StoreAttnRow(dst, o_row, D / 2, [l](float x) { return x / l; });
      if (me.half == 0) lse[bh * g.t + q_abs] = m + logf(l);
    }
  }
#endif
}

// ---- generic ----------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(32 * kAttnGenericWarps)
    attention_forward_generic_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                                     float* __restrict__ lse, AttnShape g) {
  __shared__ float p_sh[kAttnGenericWarps][kAttnTile];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int groups = (g.t + kAttnGenericWarps - 1) / kAttnGenericWarps;
  const int t = (groups - 1 - static_cast<int>(blockIdx.x)) * kAttnGenericWarps + warp;
  if (t >= g.t) return;  // whole warps only: no CTA-wide barrier below
  const int64_t ld = 3 * g.c;
  float* p = p_sh[warp];

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int64_t h = bh % g.heads;
    const T* base = qkv + g.Token(b, 0) * ld + h * g.d;
    const T* q = base + t * ld;
    for (int d0 = static_cast<int>(blockIdx.z) * kAttnGenericSlice; d0 < g.d;
         d0 += static_cast<int>(gridDim.z) * kAttnGenericSlice) {
      float acc[kAttnGenericChannels];
      float m, l;
      GenericAttentionRowSlice(q, base + g.c, base + 2 * g.c, ld, t, g.FirstKey(t), d0, g.d,
                               g.scale, p, lane, acc, m, l);
      T* o = out + g.Token(b, t) * g.c + h * g.d;
#pragma unroll
      for (int c = 0; c < kAttnGenericChannels; ++c) {
        const int d = d0 + lane + 32 * c;
        if (d < g.d) o[d] = FromFloat<T>(acc[c] / l);
      }
      if (d0 == 0 && lane == 0) lse[bh * g.t + t] = m + logf(l);
    }
  }
}

// ---- launch -------------------------------------------------------------------

template <typename T, int D>
cudaError_t ConfigureMma(int max_smem) {
  if (ForwardSmem<D>::kBytes > max_smem) return cudaSuccess;
  return cudaFuncSetAttribute(attention_forward_mma_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, ForwardSmem<D>::kBytes);
}

template <typename T, int D>
absl::Status LaunchMma(const void* qkv, void* out, float* lse, const AttnShape& g,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.Tiles()), AttnGridY(g.bh));
  attention_forward_mma_kernel<T, D><<<grid, kAttnMmaThreads, ForwardSmem<D>::kBytes, stream>>>(
      static_cast<const T*>(qkv), static_cast<T*>(out), lse, g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchGeneric(const void* qkv, void* out, float* lse, const AttnShape& g,
                           cudaStream_t stream) {
  const int groups = (g.t + kAttnGenericWarps - 1) / kAttnGenericWarps;
  const int slices = (g.d + kAttnGenericSlice - 1) / kAttnGenericSlice;
  const dim3 grid(static_cast<unsigned>(groups), AttnGridY(g.bh),
                  static_cast<unsigned>(std::min(slices, 65535)));
  attention_forward_generic_kernel<T><<<grid, 32 * kAttnGenericWarps, 0, stream>>>(
      static_cast<const T*>(qkv), static_cast<T*>(out), lse, g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

// A tensor-core kernel for D in {64, 128}, when the device gave it its
// shared memory and the tensors allow 16-byte access: the register-tile
// one (attention_flash_forward.cu) unless the config asks for the wmma one
// here; else (and for a sliding window) the generic one.
template <typename T>
absl::Status Launch16(const void* qkv, DType dtype, void* out, float* lse, const AttnShape& g,
                      const AttentionKernelConfig& config, cudaStream_t stream) {
  const bool aligned = Aligned16(qkv) && Aligned16(out) && g.window == 0;
  if (aligned && !config.wmma_kernels && AttentionFlashForwardApplies(g.d, config)) {
    return LaunchAttentionForwardFlash(qkv, dtype, g, out, lse, stream);
  }
  if (aligned && g.d == 64 && ForwardSmem<64>::kBytes <= config.max_dynamic_smem) {
    return LaunchMma<T, 64>(qkv, out, lse, g, stream);
  }
  if (aligned && g.d == 128 && ForwardSmem<128>::kBytes <= config.max_dynamic_smem) {
    return LaunchMma<T, 128>(qkv, out, lse, g, stream);
  }
  return LaunchGeneric<T>(qkv, out, lse, g, stream);
}

}  // namespace

absl::Status ConfigureAttentionForward(const AttentionKernelConfig& config) {
  AMPD_RETURN_IF_ERROR(ConfigureAttentionFlashForward(config));
  const int max_smem = config.max_dynamic_smem;
  AMPD_CUDA_RETURN_IF_ERROR((ConfigureMma<__half, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((ConfigureMma<__half, 128>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((ConfigureMma<__nv_bfloat16, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((ConfigureMma<__nv_bfloat16, 128>(max_smem)));
  return absl::OkStatus();
}

absl::Status LaunchAttentionForward(const void* qkv, DType dtype, int64_t batch, int64_t seq,
                                    int64_t channels, int64_t heads,
                                    const AttentionOptions& options, void* out, float* lse,
                                    const AttentionKernelConfig& config, cudaStream_t stream) {
  if (batch == 0 || seq == 0) return absl::OkStatus();
  const AttnShape g = MakeAttnShape(batch, seq, channels, heads, options);
  switch (dtype) {
    case DType::kF16:
      return Launch16<__half>(qkv, dtype, out, lse, g, config, stream);
    case DType::kBF16:
      return Launch16<__nv_bfloat16>(qkv, dtype, out, lse, g, config, stream);
    default:
      return LaunchGeneric<float>(qkv, out, lse, g, stream);
  }
}

}  // namespace ampd::kernels::cuda
