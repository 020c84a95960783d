// The register-tile forward of the fused causal attention (fp16/bf16,
// D = 64 or 128; the contract of kernels/backend.h): a CTA per (query tile
// of 64, (b, h)), 4 warps of 16 queries each, key blocks of 64 (the
// contract's kAttentionKeyBlock, aligned with the query tiles, so every
// query of a tile ends in the tile's own block) visited in increasing
// order. Per key block, with K and V double-buffered in shared memory by
// cp.async (the next block loads while this one is computed):
//   S (16 x 64 per warp, fp32 registers) = Q K^T by mma.sync, Q's
//     fragments loaded once by ldmatrix, K's by ldmatrix per block;
//   S *= scale; keys after the query (the diagonal block only) -> -inf;
//   the row max over the quad of lanes holding the row, m', alpha,
//   P = exp(S - m') in place; l = l alpha + the block's P sum (each lane's
//   16 keys in key order, then (lanes 0 + 1) + (lanes 2 + 3) of the quad);
//   O (16 x D fp32 registers) *= alpha, then O += round(P) V with P
//   packed straight from S's registers as the A operand and V's
//   fragments by ldmatrix.trans.
// (The steps are attention_flash.cuh's FlashScores, FlashSoftmaxBlock and
// AccTimesRows, which the decode twin in attention_decode.cu runs too.)
// No barrier between the two products; two per block around the K/V
// buffers. out = O / l rounded once (staged through shared memory for
// 16-byte stores), lse = m + log(l). Tiles run heaviest (last) first.
//
// A row's result depends only on its q and keys 0 .. t: the products'
// rows are independent, keys and queries past T are zero-filled, and
// masked keys give P = 0 exactly; so a prefix of a sequence gives the
// longer sequence's rows bit for bit.
#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/cuda_status.h"

namespace ampd::kernels::cuda {
namespace {

template <int D>
struct FlashForwardSmem {
  static constexpr int kTile = FlashTile<D>::kBytes;
  // Q, then K and V of two key blocks: [Q | K0 | V0 | K1 | V1].
  static constexpr int kBytes = 5 * kTile;
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnMmaThreads)
    attention_forward_flash_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                                   float* __restrict__ lse, AttnShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kLd = FlashTile<D>::kLd;
  constexpr int kTileElems = kAttnTile * kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  // Key block kb's K at kvs + (kb & 1) * 2 kTileElems, its V one tile later.
  T* kvs = qs + kTileElems;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int tile = g.Tiles() - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  const int q0 = tile * kAttnTile;
  const int strip = warp * 16;
  // This lane's two rows of the strip: half 0 and half 1 (8 rows below).
  const int row_in_strip = mma::AccElement(lane, 0).row;
  int q_abs[2];
  q_abs[0] = q0 + strip + row_in_strip;
  q_abs[1] = q_abs[0] + 8;
  const int64_t ld = 3 * g.c;  // qkv's row
  const int q_valid = min(kAttnTile, g.t - q0);

  for (int64_t bh = blockIdx.y; bh < g.bh; bh += gridDim.y) {
    const int64_t b = bh / g.heads;
    const int h = static_cast<int>(bh % g.heads);
    const T* base = qkv + g.Token(b, 0) * ld + static_cast<int64_t>(h) * D;
    __syncthreads();  // the previous (b, h)'s tiles are no longer read
    AsyncLoadTile<T, D>(qs, base + q0 * ld, ld, q_valid);
    AsyncLoadTile<T, D>(kvs, base + g.c, ld, min(kAttnTile, g.t));
    AsyncLoadTile<T, D>(kvs + kTileElems, base + 2 * g.c, ld, min(kAttnTile, g.t));
    CpAsyncCommit();

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    }
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    uint32_t qf[D / 16][4];  // the strip's Q as A fragments, one per k-step

    for (int kb = 0; kb <= tile; ++kb) {
      if (kb < tile) {  // the next block loads while this one is computed
        const int k1 = (kb + 1) * kAttnTile;
        T* next = kvs + ((kb + 1) & 1) * 2 * kTileElems;
        const int valid = min(kAttnTile, g.t - k1);
        AsyncLoadTile<T, D>(next, base + g.c + k1 * ld, ld, valid);
        AsyncLoadTile<T, D>(next + kTileElems, base + 2 * g.c + k1 * ld, ld, valid);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();  // block kb (and Q) landed for every thread's copies
      const T* ks = kvs + (kb & 1) * 2 * kTileElems;
      const T* vs = ks + kTileElems;
      if (kb == 0) FlashLoadQ<T, D>(qf, qs + strip * kLd, lane);

      // S (16 x 64) = Q K^T.
      float s[8][4];
      FlashScores<T, D>(s, qf, ks, lane);

      // The online softmax step: S -> P in place, m, l, O *= alpha.
      FlashSoftmaxBlock<D>(s, o, m, l, g.scale, kb == tile, kb * kAttnTile, q_abs, lane);

      // O (16 x D) += round(P) (16 x 64) V (64 x D).
      AccTimesRows<T, D, 4>(o, s, vs, 0, lane);
      __syncthreads();  // every warp is done with block kb's buffers before they refill
    }

    // out = O / l, rounded once, through this warp's own rows of Q's tile
    // (only this warp read them, at kb = 0).
    T* dst = out + g.Token(b, q0 + strip) * g.c + static_cast<int64_t>(h) * D;
    StoreStrip<T, D>(
        o, [&l](int half, float x) { return x / l[half]; }, qs + strip * kLd, dst, g.c,
        q_valid - strip, lane);
    if ((lane & 3) == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (q_abs[half] < g.t) lse[bh * g.t + q_abs[half]] = m[half] + logf(l[half]);
      }
    }
  }
#endif
}

template <typename T, int D>
cudaError_t Configure(int max_smem) {
  constexpr int kBytes = FlashForwardSmem<D>::kBytes;
  if (kBytes > max_smem) return cudaSuccess;
  return cudaFuncSetAttribute(attention_forward_flash_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
}

template <typename T, int D>
absl::Status Launch(const void* qkv, void* out, float* lse, const AttnShape& g,
                    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.Tiles()), AttnGridY(g.bh));
  attention_forward_flash_kernel<T, D>
      <<<grid, kAttnMmaThreads, FlashForwardSmem<D>::kBytes, stream>>>(
          static_cast<const T*>(qkv), static_cast<T*>(out), lse, g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchForHeadSize(const void* qkv, void* out, float* lse, const AttnShape& g,
                               cudaStream_t stream) {
  return g.d == 64 ? Launch<T, 64>(qkv, out, lse, g, stream)
                   : Launch<T, 128>(qkv, out, lse, g, stream);
}

}  // namespace

bool AttentionFlashForwardApplies(int d, const AttentionKernelConfig& config) {
  if (d == 64) return FlashForwardSmem<64>::kBytes <= config.max_dynamic_smem;
  if (d == 128) return FlashForwardSmem<128>::kBytes <= config.max_dynamic_smem;
  return false;
}

absl::Status LaunchAttentionForwardFlash(const void* qkv, DType dtype, const AttnShape& g,
                                         void* out, float* lse, cudaStream_t stream) {
  if (dtype == DType::kF16) return LaunchForHeadSize<__half>(qkv, out, lse, g, stream);
  return LaunchForHeadSize<__nv_bfloat16>(qkv, out, lse, g, stream);
}

absl::Status ConfigureAttentionFlashForward(const AttentionKernelConfig& config) {
  const int max_smem = config.max_dynamic_smem;
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__half, 128>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 64>(max_smem)));
  AMPD_CUDA_RETURN_IF_ERROR((Configure<__nv_bfloat16, 128>(max_smem)));
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
