// The decode step of causal attention against a KV cache (the contract in
// kernels/backend.h): sequence s's one new query row at t = positions[s],
// per query head h, over the cached keys and values 0 .. t of kv head
// h / G (G = H / Hkv). One launch; no allocation, no synchronisation.
//
// Each call runs the decode twin of the forward kernel that
// LaunchAttentionForward (attention_forward.cu) would pick for the same
// dtype, D, alignment and config, built from that kernel's own steps, so a
// decoded row has the bits the forward writes for row t:
//
// Register-tile twin (fp16/bf16, D = 64 or 128, 16-byte aligned operands,
// the register-tile forward configured, no attention_wmma): a CTA of one
// warp per (s, kv head, strip of up to 16 of the group's query heads). The
// strip's rows are the group's query heads, all at position t (a forward
// strip's rows are 16 positions of one head; an mma row's result depends on
// its own A row alone, and the softmax step is per row, so which rows share
// a strip does not change a row's bits). Per key block kb = 0 .. t / 64, K
// and V rows k0 .. min(k0 + 63, t) of the cache are loaded into shared
// memory by 16-byte loads, rows after t zero-filled (never read); then the
// forward's FlashScores, FlashSoftmaxBlock (the diagonal block being the
// query's own, t / 64) and AccTimesRows (attention_flash.cuh), and the
// forward's StoreStrip of O / l. What differs from the forward is only
// where K and V come from and that keys after t are zeros instead of the
// sequence's later keys: both are masked to P = 0 exactly, so only the
// sign of an exactly zero output can differ.
//
// Generic twin (everything else, and every sliding-window call, as the
// forward takes its generic kernel for those): a warp per (s, h) running the generic
// forward's GenericAttentionRowSlice (attention_generic_row.cuh) over the
// cache rows, slice by slice of 128 channels.
//
// With attention_wmma set, fp16/bf16 D = 64/128 forwards take the wmma
// kernel, which has no twin here: the decode takes the register-tile twin
// and agrees with that forward to fp tolerance only.
//
// Positions are device data: one outside [0, T_max) cannot be reported,
// so its rows are written as NaN and no cache row is read for it.
#include <cstdint>

#include "common/status_macros.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_flash.cuh"
#include "kernels/cuda/attention_generic_row.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// One call's shape (the op checks keep H D, Hkv D and T_max within int).
struct DecodeShape {
  int64_t seqs = 0;   // S
  int heads = 0;      // H
  int kv_heads = 0;   // Hkv
  int group = 0;      // G = H / Hkv
  int d = 0;          // D
  int t_max = 0;      // T_max
  int64_t kv_ld = 0;  // Hkv D: one cache row
  float scale = 0;    // AttentionScaleOf(options, D)
  int window = 0;     // options.window
  DType pos_dtype = DType::kI32;
};

inline constexpr int kDecodeStripRows = 16;  // query heads per register-tile warp

// Query position t of sequence s, or -1 where it lies outside [0, T_max).
__device__ __forceinline__ int DecodePosition(const void* positions, int64_t s,
                                              const DecodeShape& g) {
  const int64_t t = LoadIndex(positions, s, g.pos_dtype);
  return t >= 0 && t < g.t_max ? static_cast<int>(t) : -1;
}

// ---- register-tile twin ------------------------------------------------------

template <typename T, int D>
__global__ void __launch_bounds__(32)
    attention_decode_flash_kernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache, const void* __restrict__ positions,
                                  T* __restrict__ out, DecodeShape g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  static_assert(sizeof(T) == 2, "fp16/bf16 tiles");
  constexpr int kLd = FlashTile<D>::kLd;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // [Q strip (16, D) | K tile (64, D) | V tile (64, D)], rows padded to kLd;
  // 39 KiB at D = 128, within the static 48 KiB (no opt-in to configure).
  constexpr int kTileElems = kAttnTile * kLd;
  __shared__ __align__(128) unsigned char smem[(kDecodeStripRows * kLd + 2 * kTileElems) * 2];
  T* qs = reinterpret_cast<T*>(smem);  // the strip's Q, later its output
  T* ks = qs + kDecodeStripRows * kLd;
  T* vs = ks + kTileElems;
  const int lane = static_cast<int>(threadIdx.x);

  const int strips = (g.group + kDecodeStripRows - 1) / kDecodeStripRows;
  const int64_t cta = blockIdx.x;  // ((s Hkv) + kv head) strips + strip
  const int strip = static_cast<int>(cta % strips);
  const int kvh = static_cast<int>((cta / strips) % g.kv_heads);
  const int64_t s = cta / strips / g.kv_heads;
  const int h0 = kvh * g.group + strip * kDecodeStripRows;  // the strip's first query head
  const int rows = min(kDecodeStripRows, g.group - strip * kDecodeStripRows);
  T* dst = out + (s * g.heads + h0) * D;  // (rows, D), contiguous heads
  const int t = DecodePosition(positions, s, g);
  if (t < 0) {
    for (int i = lane; i < rows * D; i += 32) dst[i] = FromFloat<T>(NAN);
    return;
  }

  // Q strip (16, D): the group's heads h0 .. h0 + rows - 1, the rest zeros.
  const T* q_src = q + (s * g.heads + h0) * D;
  for (int i = lane; i < kDecodeStripRows * kChunks; i += 32) {
    const int r = i / kChunks;
    const int ch = i % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows) v = *reinterpret_cast<const uint4*>(q_src + r * D + ch * 8);
    *reinterpret_cast<uint4*>(qs + r * kLd + ch * 8) = v;
  }
  const T* k_seq = k_cache + s * g.t_max * g.kv_ld + static_cast<int64_t>(kvh) * D;
  const T* v_seq = v_cache + s * g.t_max * g.kv_ld + static_cast<int64_t>(kvh) * D;

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  }
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  const int q_abs[2] = {t, t};  // every row of the strip sits at t
  uint32_t qf[D / 16][4];
  const int last = t / kAttnTile;  // the query's own (diagonal) block
  for (int kb = 0; kb <= last; ++kb) {
    const int k0 = kb * kAttnTile;
    __syncwarp();  // every lane is done with the previous block's tiles
    LoadAttnTile<T, D>(ks, k_seq + k0 * g.kv_ld, g.kv_ld, min(kAttnTile, t + 1 - k0));
    LoadAttnTile<T, D>(vs, v_seq + k0 * g.kv_ld, g.kv_ld, min(kAttnTile, t + 1 - k0));
    __syncwarp();  // the tiles (and Q) are in shared memory for every lane
    if (kb == 0) FlashLoadQ<T, D>(qf, qs, lane);
    float sc[8][4];
    FlashScores<T, D>(sc, qf, ks, lane);
    FlashSoftmaxBlock<D>(sc, o, m, l, g.scale, kb == last, k0, q_abs, lane);
    AccTimesRows<T, D, 4>(o, sc, vs, 0, lane);
  }
  // out = O / l rounded once, staged through Q's strip (read at kb = 0 only).
  StoreStrip<T, D>(
      o, [&l](int half, float x) { return x / l[half]; }, qs, dst, D, rows, lane);
#endif
}

// ---- generic twin --------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(32 * kAttnGenericWarps)
    attention_decode_generic_kernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                                    const T* __restrict__ v_cache,
                                    const void* __restrict__ positions, T* __restrict__ out,
                                    DecodeShape g) {
  __shared__ float p_sh[kAttnGenericWarps][kAttnTile];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t sh = static_cast<int64_t>(blockIdx.x) * kAttnGenericWarps + warp;  // (s, h)
  if (sh >= g.seqs * g.heads) return;  // whole warps only: no CTA-wide barrier below
  const int64_t s = sh / g.heads;
  const int h = static_cast<int>(sh % g.heads);
  T* o = out + sh * g.d;  // (D) of (s, h)
  const int t = DecodePosition(positions, s, g);
  if (t < 0) {
    for (int d = lane; d < g.d; d += 32) o[d] = FromFloat<T>(NAN);
    return;
  }
  const T* q_row = q + sh * g.d;
  const int64_t kv_col = static_cast<int64_t>(h / g.group) * g.d;
  const T* k_seq = k_cache + s * g.t_max * g.kv_ld + kv_col;
  const T* v_seq = v_cache + s * g.t_max * g.kv_ld + kv_col;
  for (int d0 = 0; d0 < g.d; d0 += kAttnGenericSlice) {
    float acc[kAttnGenericChannels];
    float m, l;
    const int first = g.window > 0 && t >= g.window ? t - g.window + 1 : 0;
    GenericAttentionRowSlice(q_row, k_seq, v_seq, g.kv_ld, t, first, d0, g.d, g.scale, p_sh[warp],
                             lane, acc, m, l);
#pragma unroll
    for (int c = 0; c < kAttnGenericChannels; ++c) {
      const int d = d0 + lane + 32 * c;
      if (d < g.d) o[d] = FromFloat<T>(acc[c] / l);
    }
  }
}

// ---- launch ---------------------------------------------------------------------

template <typename T, int D>
absl::Status LaunchFlash(const void* q, const void* k_cache, const void* v_cache,
                         const void* positions, void* out, const DecodeShape& g,
                         cudaStream_t stream) {
  const int64_t strips = (g.group + kDecodeStripRows - 1) / kDecodeStripRows;
  const int64_t ctas = g.seqs * g.kv_heads * strips;
  if (ctas > 0x7fffffff) {
    return absl::InvalidArgumentError("AttentionDecode: too many (sequence, kv head) pairs");
  }
  attention_decode_flash_kernel<T, D><<<static_cast<unsigned>(ctas), 32, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
      positions, static_cast<T*>(out), g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchGeneric(const void* q, const void* k_cache, const void* v_cache,
                           const void* positions, void* out, const DecodeShape& g,
                           cudaStream_t stream) {
  const int64_t ctas = (g.seqs * g.heads + kAttnGenericWarps - 1) / kAttnGenericWarps;
  if (ctas > 0x7fffffff) {
    return absl::InvalidArgumentError("AttentionDecode: too many (sequence, head) pairs");
  }
  attention_decode_generic_kernel<T>
      <<<static_cast<unsigned>(ctas), 32 * kAttnGenericWarps, 0, stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
          positions, static_cast<T*>(out), g);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

// The twin of Launch16 in attention_forward.cu: the register-tile order
// where the forward would take the register-tile kernel, else the generic.
template <typename T>
absl::Status Launch16(const void* q, const void* k_cache, const void* v_cache,
                      const void* positions, void* out, const DecodeShape& g,
                      const AttentionKernelConfig& config, cudaStream_t stream) {
  const bool aligned =
      Aligned16(q) && Aligned16(k_cache) && Aligned16(v_cache) && Aligned16(out) && g.window == 0;
  if (aligned && AttentionFlashForwardApplies(g.d, config)) {
    // With attention_wmma the forward takes its wmma kernel, which has no
    // decode twin: the register-tile order is the nearer (tensor cores).
    return g.d == 64 ? LaunchFlash<T, 64>(q, k_cache, v_cache, positions, out, g, stream)
                     : LaunchFlash<T, 128>(q, k_cache, v_cache, positions, out, g, stream);
  }
  return LaunchGeneric<T>(q, k_cache, v_cache, positions, out, g, stream);
}

}  // namespace

absl::Status LaunchAttentionDecode(const void* q, const void* k_cache, const void* v_cache,
                                   const void* positions, DType dtype, DType pos_dtype,
                                   int64_t seqs, int64_t t_max, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, const AttentionOptions& options, void* out,
                                   const AttentionKernelConfig& config, cudaStream_t stream) {
  if (seqs == 0) return absl::OkStatus();
  DecodeShape g;
  g.seqs = seqs;
  g.heads = static_cast<int>(heads);
  g.kv_heads = static_cast<int>(kv_heads);
  g.group = static_cast<int>(heads / kv_heads);
  g.d = static_cast<int>(head_dim);
  g.t_max = static_cast<int>(t_max);
  g.kv_ld = kv_heads * head_dim;
  g.scale = AttentionScaleOf(options, head_dim);
  g.window = static_cast<int>(options.window);
  g.pos_dtype = pos_dtype;
  switch (dtype) {
    case DType::kF16:
      return Launch16<__half>(q, k_cache, v_cache, positions, out, g, config, stream);
    case DType::kBF16:
      return Launch16<__nv_bfloat16>(q, k_cache, v_cache, positions, out, g, config, stream);
    default:
      return LaunchGeneric<float>(q, k_cache, v_cache, positions, out, g, stream);
  }
}

}  // namespace ampd::kernels::cuda
