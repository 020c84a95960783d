// The batch-invariant GEMM (Backend::SetBatchInvariant): c (M, N) =
// alpha * op(a) @ op(b) + beta * c with every output element's sum over K
// formed in one fixed order that depends only on K, never on M, N, the
// element's position or the grid, so a row's bits are the same computed
// alone (a sampling step, M = 1) or among any other rows (the training
// forward). cuBLAS and cuBLASLt, by contrast, pick a kernel and a split-K
// by shape. No split-K here: one thread (or one warp's tensor-core
// fragment) owns an element's whole sum.
//
// F32 operands: SIMT, and exactly the CPU oracle's order
// (kernels/cpu/gemm_invariant.cc), each multiply and add rounded on its own
// (__fmul_rn/__fadd_rn: never an FMA, never TF32):
//   s = 0; for each chunk [k0, k0 + 256) of K, in order:
//     p = 0; for l in the chunk, in order: p = p + a[m][l] * b[l][n]
//     s = s + p
//   out = alpha * s, or alpha * s + beta * c
// so an F32 invariant GEMM is bit for bit the CPU backend's.
//
// F16/BF16 operands: tensor cores (WMMA 16x16x16, fp32 accumulators). An
// element's accumulator starts at 0 and takes one mma per 16-long step of
// K, steps in order from 0, the K tail zero-filled; every launch shape
// issues the same mma instruction (the fragment layouts follow only the
// transposes), so the per-element sequence is a function of K alone and
// the two block shapes below give the same bits. The products inside an
// mma are summed by the hardware in its own fixed way, so this path
// matches the CPU oracle to fp32 rounding, not bit for bit. The finished
// alpha * s (+ beta * c) is rounded once to c's dtype (F32 or the
// operands'), as Backend::Gemm's contract says.
//
// Rows and columns past M and N are zero-filled in shared memory and never
// stored. Operand tiles move in 16-byte vectors when the operand's base and
// row length allow, and the next K tile is fetched into registers while
// the current one is multiplied.
#include <mma.h>

#include <type_traits>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

// ---- operand tiles ----------------------------------------------------------
// A (ROWS, COLS) tile of a row-major matrix with row length ld, at (row0,
// col0) of a (rows, cols) matrix, moved in vectors of V elements: Fetch
// reads this thread's share into registers (zeros outside the matrix), Put
// writes it to shared memory with row length LD, transposed (element (r, c)
// at s[c * LD + r]) when kTranspose.
template <typename T, int ROWS, int COLS, int NT>
struct TileLoader {
  static constexpr int V = 16 / static_cast<int>(sizeof(T));
  static_assert(COLS % V == 0, "a tile row is whole vectors");
  static constexpr int kChunks = ROWS * COLS / V;
  static_assert(kChunks % NT == 0, "every thread moves the same number of vectors");
  static constexpr int kPerThread = kChunks / NT;

  Vec<T, V> regs[kPerThread];

  __device__ __forceinline__ void Fetch(const T* g, int64_t ld, int row0, int col0, int rows,
                                        int cols, bool vectorized) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int chunk = static_cast<int>(threadIdx.x) + i * NT;
      const int r = chunk / (COLS / V);
      const int cc = (chunk % (COLS / V)) * V;
      const int gr = row0 + r;
      const int gc = col0 + cc;
      if (vectorized && gr < rows && gc + V <= cols) {
        regs[i] = LoadVec<V>(g, static_cast<int64_t>(gr) * ld + gc);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          regs[i].v[j] = gr < rows && gc + j < cols ? g[static_cast<int64_t>(gr) * ld + gc + j]
                                                    : FromFloat<T>(0.0f);
        }
      }
    }
  }

  template <int LD, bool kTranspose>
  __device__ __forceinline__ void Put(T* s) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int chunk = static_cast<int>(threadIdx.x) + i * NT;
      const int r = chunk / (COLS / V);
      const int cc = (chunk % (COLS / V)) * V;
      if constexpr (kTranspose) {
#pragma unroll
        for (int j = 0; j < V; ++j) s[(cc + j) * LD + r] = regs[i].v[j];
      } else {
        static_assert((LD * sizeof(T)) % 16 == 0, "shared rows keep vectors aligned");
        *reinterpret_cast<Vec<T, V>*>(s + r * LD + cc) = regs[i];
      }
    }
  }
};

// The epilogue of one element: alpha * s (+ beta * c), rounded once to c's
// dtype; beta == 0 never reads c (a fresh c may hold NaN bit patterns).
__device__ __forceinline__ void StoreResult(void* c, DType c_dtype, int64_t index, float sum,
                                            float alpha, float beta) {
  float v = __fmul_rn(alpha, sum);
  if (beta != 0.0f) v = __fadd_rn(v, __fmul_rn(beta, LoadAs(c, index, c_dtype)));
  StoreAs(c, index, c_dtype, v);
}

// ---- F16/BF16: tensor cores ---------------------------------------------------
constexpr int kMmaBK = 32;      // K per shared-memory stage: two mma steps
constexpr int kMmaPad = 8;      // elements past each shared row (bank spread; keeps 32-byte rows)
constexpr int kMmaSmallM = 32;  // up to this M, the small block shape (more blocks over N)

template <typename T, bool kTransA, bool kTransB, int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)
    gemm_invariant_mma_kernel(int m, int n, int k, float alpha, const T* a, int64_t lda, const T* b,
                              int64_t ldb, float beta, void* c, DType c_dtype, bool vec_a,
                              bool vec_b) {
  namespace wmma = nvcuda::wmma;
  constexpr int kWarpsN = BN / WN;
  constexpr int kWarps = (BM / WM) * kWarpsN;
  constexpr int NT = kWarps * 32;
  constexpr int kFragsM = WM / 16;
  constexpr int kFragsN = WN / 16;
  // Shared tiles in the operands' stored orientation: op(a) (BM, BK) is
  // a (BM, BK) row-major, or a^T's (BK, BM) read column-major; op(b) (BK,
  // BN) likewise. The fragment layout, not a transposing copy, absorbs it.
  constexpr int kARows = kTransA ? kMmaBK : BM;
  constexpr int kACols = kTransA ? BM : kMmaBK;
  constexpr int kALd = kACols + kMmaPad;
  constexpr int kBRows = kTransB ? BN : kMmaBK;
  constexpr int kBCols = kTransB ? kMmaBK : BN;
  constexpr int kBLd = kBCols + kMmaPad;
  using LayoutA = std::conditional_t<kTransA, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;

  __shared__ __align__(128) T sa[kARows * kALd];
  __shared__ __align__(128) T sb[kBRows * kBLd];
  __shared__ __align__(128) float staged[kWarps][16 * 16];  // one fragment's sums per warp

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_row = (warp / kWarpsN) * WM;  // within the block tile
  const int warp_col = (warp % kWarpsN) * WN;
  const int row0 = static_cast<int>(blockIdx.y) * BM;
  const int col0 = static_cast<int>(blockIdx.x) * BN;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsM][kFragsN];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  TileLoader<T, kARows, kACols, NT> load_a;
  TileLoader<T, kBRows, kBCols, NT> load_b;
  auto fetch = [&](int k0) {
    if constexpr (kTransA) {
      load_a.Fetch(a, lda, k0, row0, k, m, vec_a);  // a (K, M)
    } else {
      load_a.Fetch(a, lda, row0, k0, m, k, vec_a);  // a (M, K)
    }
    if constexpr (kTransB) {
      load_b.Fetch(b, ldb, col0, k0, n, k, vec_b);  // b (N, K)
    } else {
      load_b.Fetch(b, ldb, k0, col0, k, n, vec_b);  // b (K, N)
    }
  };

  fetch(0);
  for (int k0 = 0; k0 < k; k0 += kMmaBK) {
    load_a.template Put<kALd, false>(sa);
    load_b.template Put<kBLd, false>(sb);
    __syncthreads();
    if (k0 + kMmaBK < k) fetch(k0 + kMmaBK);  // in flight while this tile is multiplied
#pragma unroll
    for (int kk = 0; kk < kMmaBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa[kFragsM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb[kFragsN];
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        const int r = warp_row + i * 16;
        const T* p = kTransA ? sa + kk * kALd + r : sa + r * kALd + kk;
        wmma::load_matrix_sync(fa[i], p, kALd);
      }
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        const int cidx = warp_col + j * 16;
        const T* p = kTransB ? sb + cidx * kBLd + kk : sb + kk * kBLd + cidx;
        wmma::load_matrix_sync(fb[j], p, kBLd);
      }
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
    }
    __syncthreads();  // the tile is read before the next Put overwrites it
  }

  // Each fragment goes through the warp's staging square so every lane
  // knows its elements' coordinates (the fragment layout is opaque).
  float* stage = staged[warp];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 16 * 16; e += 32) {
        const int r = row0 + warp_row + i * 16 + e / 16;
        const int col = col0 + warp_col + j * 16 + e % 16;
        if (r < m && col < n) {
          StoreResult(c, c_dtype, static_cast<int64_t>(r) * n + col, stage[e], alpha, beta);
        }
      }
      __syncwarp();
    }
  }
}

// ---- F32: SIMT in the CPU oracle's order ------------------------------------
constexpr int kF32BM = 64;
constexpr int kF32BN = 64;
constexpr int kF32BK = 16;          // divides kF32ChunkK: a chunk ends on a tile boundary
constexpr int kF32ChunkK = 256;     // the oracle's sequential run (kChunkK there)
constexpr int kF32Threads = 256;    // 16 x 16 threads, 4 x 4 elements each
constexpr int kF32Ld = kF32BM + 4;  // shared row length: float4-aligned, fewer bank conflicts
static_assert(kF32BM == kF32BN, "one shared row length for both tiles");
static_assert(kF32ChunkK % kF32BK == 0, "a chunk is whole tiles");

template <bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kF32Threads)
    gemm_invariant_f32_kernel(int m, int n, int k, float alpha, const float* a, int64_t lda,
                              const float* b, int64_t ldb, float beta, float* c, bool vec_a,
                              bool vec_b) {
  // Both tiles K-major in shared memory: sa[l][i] = op(a)[row0 + i][k0 + l],
  // sb[l][j] = op(b)[k0 + l][col0 + j].
  __shared__ __align__(16) float sa[kF32BK * kF32Ld];
  __shared__ __align__(16) float sb[kF32BK * kF32Ld];
  const int tx = static_cast<int>(threadIdx.x) % 16;  // columns tx * 4 .. + 3
  const int ty = static_cast<int>(threadIdx.x) / 16;  // rows ty * 4 .. + 3
  const int row0 = static_cast<int>(blockIdx.y) * kF32BM;
  const int col0 = static_cast<int>(blockIdx.x) * kF32BN;

  constexpr int kARows = kTransA ? kF32BK : kF32BM;
  constexpr int kACols = kTransA ? kF32BM : kF32BK;
  constexpr int kBRows = kTransB ? kF32BN : kF32BK;
  constexpr int kBCols = kTransB ? kF32BK : kF32BN;
  TileLoader<float, kARows, kACols, kF32Threads> load_a;
  TileLoader<float, kBRows, kBCols, kF32Threads> load_b;
  auto fetch = [&](int k0) {
    if constexpr (kTransA) {
      load_a.Fetch(a, lda, k0, row0, k, m, vec_a);
    } else {
      load_a.Fetch(a, lda, row0, k0, m, k, vec_a);
    }
    if constexpr (kTransB) {
      load_b.Fetch(b, ldb, col0, k0, n, k, vec_b);
    } else {
      load_b.Fetch(b, ldb, k0, col0, k, n, vec_b);
    }
  };

  float total[4][4];
  float part[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) total[i][j] = part[i][j] = 0.0f;
  }
  auto step = [&](int l) {
    const float4 av = *reinterpret_cast<const float4*>(sa + l * kF32Ld + ty * 4);
    const float4 bv = *reinterpret_cast<const float4*>(sb + l * kF32Ld + tx * 4);
    const float as[4] = {av.x, av.y, av.z, av.w};
    const float bs[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) part[i][j] = __fadd_rn(part[i][j], __fmul_rn(as[i], bs[j]));
    }
  };

  fetch(0);
  for (int k0 = 0; k0 < k; k0 += kF32BK) {
    load_a.template Put<kF32Ld, !kTransA>(sa);  // a (M, K) is transposed into K-major
    load_b.template Put<kF32Ld, kTransB>(sb);   // b (N, K) likewise
    __syncthreads();
    if (k0 + kF32BK < k) fetch(k0 + kF32BK);
    const int steps = min(kF32BK, k - k0);  // the oracle adds no padding terms
    if (steps == kF32BK) {
#pragma unroll
      for (int l = 0; l < kF32BK; ++l) step(l);
    } else {
      for (int l = 0; l < steps; ++l) step(l);
    }
    if ((k0 + kF32BK) % kF32ChunkK == 0 || k0 + kF32BK >= k) {  // a chunk ends
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          total[i][j] = __fadd_rn(total[i][j], part[i][j]);
          part[i][j] = 0.0f;
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + ty * 4 + i;
    if (r >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = col0 + tx * 4 + j;
      if (col < n) {
        StoreResult(c, DType::kF32, static_cast<int64_t>(r) * n + col, total[i][j], alpha, beta);
      }
    }
  }
}

// Grid y counts row tiles; CUDA caps it at 65535.
constexpr int64_t kMaxGridY = 65535;

template <typename T, bool kTransA, bool kTransB>
absl::Status LaunchMma(int m, int n, int k, float alpha, const T* a, int64_t lda, const T* b,
                       int64_t ldb, float beta, void* c, DType c_dtype, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const bool vec_a = lda % V == 0 && VecAligned<V>(a);
  const bool vec_b = ldb % V == 0 && VecAligned<V>(b);
  if (m <= kMmaSmallM) {
    // A sampling step's few rows: 32 x 32 blocks of four warps, so a
    // narrow N still spreads over the SMs. Same per-element mma sequence.
    constexpr int BM = 32, BN = 32;
    const dim3 grid((n + BN - 1) / BN, (m + BM - 1) / BM);
    gemm_invariant_mma_kernel<T, kTransA, kTransB, BM, BN, 16, 16>
        <<<grid, 128, 0, stream>>>(m, n, k, alpha, a, lda, b, ldb, beta, c, c_dtype, vec_a, vec_b);
  } else {
    constexpr int BM = 128, BN = 128;
    const int64_t row_tiles = (m + BM - 1) / BM;
    if (row_tiles > kMaxGridY) {
      return absl::InvalidArgumentError(
          "batch-invariant GEMM: M exceeds 65535 row tiles of 128 (the grid's y limit)");
    }
    const dim3 grid((n + BN - 1) / BN, static_cast<unsigned>(row_tiles));
    gemm_invariant_mma_kernel<T, kTransA, kTransB, BM, BN, 64, 32>
        <<<grid, 256, 0, stream>>>(m, n, k, alpha, a, lda, b, ldb, beta, c, c_dtype, vec_a, vec_b);
  }
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

template <bool kTransA, bool kTransB>
absl::Status LaunchF32(int m, int n, int k, float alpha, const float* a, int64_t lda,
                       const float* b, int64_t ldb, float beta, float* c, cudaStream_t stream) {
  const int64_t row_tiles = (m + kF32BM - 1) / kF32BM;
  if (row_tiles > kMaxGridY) {
    return absl::InvalidArgumentError(
        "batch-invariant GEMM: M exceeds 65535 row tiles of 64 (the grid's y limit)");
  }
  const bool vec_a = lda % 4 == 0 && VecAligned<4>(a);
  const bool vec_b = ldb % 4 == 0 && VecAligned<4>(b);
  const dim3 grid((n + kF32BN - 1) / kF32BN, static_cast<unsigned>(row_tiles));
  gemm_invariant_f32_kernel<kTransA, kTransB>
      <<<grid, kF32Threads, 0, stream>>>(m, n, k, alpha, a, lda, b, ldb, beta, c, vec_a, vec_b);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

// The transposes as template arguments.
template <typename Fn>
absl::Status DispatchTranspose(bool trans_a, bool trans_b, Fn&& fn) {
  if (trans_a) {
    if (trans_b) return fn(std::true_type{}, std::true_type{});
    return fn(std::true_type{}, std::false_type{});
  }
  if (trans_b) return fn(std::false_type{}, std::true_type{});
  return fn(std::false_type{}, std::false_type{});
}

}  // namespace

absl::Status LaunchGemmInvariant(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                 const void* a, int lda, const void* b, int ldb, DType ab_dtype,
                                 float beta, void* c, DType c_dtype, cudaStream_t stream) {
  if (m == 0 || n == 0 || k == 0) {
    return absl::InvalidArgumentError("batch-invariant GEMM: m, n and k must be positive");
  }
  if (c_dtype != DType::kF32 && c_dtype != ab_dtype) {
    return absl::InvalidArgumentError("batch-invariant GEMM: c must be F32 or the operands' dtype");
  }
  return DispatchTranspose(trans_a, trans_b, [&](auto ta, auto tb) -> absl::Status {
    constexpr bool kTA = decltype(ta)::value;
    constexpr bool kTB = decltype(tb)::value;
    switch (ab_dtype) {
      case DType::kF32:
        return LaunchF32<kTA, kTB>(m, n, k, alpha, static_cast<const float*>(a), lda,
                                   static_cast<const float*>(b), ldb, beta, static_cast<float*>(c),
                                   stream);
      case DType::kF16:
        return LaunchMma<__half, kTA, kTB>(m, n, k, alpha, static_cast<const __half*>(a), lda,
                                           static_cast<const __half*>(b), ldb, beta, c, c_dtype,
                                           stream);
      case DType::kBF16:
        return LaunchMma<__nv_bfloat16, kTA, kTB>(
            m, n, k, alpha, static_cast<const __nv_bfloat16*>(a), lda,
            static_cast<const __nv_bfloat16*>(b), ldb, beta, c, c_dtype, stream);
      default:
        return absl::InvalidArgumentError(
            "batch-invariant GEMM: operands must be F32, F16 or BF16");
    }
  });
}

}  // namespace ampd::kernels::cuda
