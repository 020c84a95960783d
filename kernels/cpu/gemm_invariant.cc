// The batch-invariant fp32 GEMM (Backend::SetBatchInvariant): out (M, N) =
// alpha * op(a) @ op(b) + beta * out with every element's sum over K formed
// in one fixed order that depends only on K:
//
//   s = 0; for each chunk [k0, k0 + 256) of K, in order:
//     p = 0; for l in the chunk, in order: p = p + a[m][l] * b[l][n]
//     s = s + p
//   out = alpha * s            (beta == 0: out is never read)
//   out = alpha * s + beta * out
//
// each step one fp32 multiply or add rounded to nearest-even; this file is
// compiled without multiply-add contraction (kernels/CMakeLists.txt). The
// 256-long sequential runs keep the rounding error near (256 + K / 256)
// ulps of the sum of |terms| instead of K. Nothing in it depends on M, on
// where a row sits in the call or on the thread count, so a row's bits are
// the same computed alone or among any others: OpenBLAS, by contrast, takes
// a GEMV path for M == 1 and picks its kernels by the shape.
//
// Speed: op(b) is packed into panels of NR columns, (K, NR) each,
// zero-padded past N; a register tile of MR rows x NR columns is
// accumulated with SIMD lanes across N (one output element per lane, so the
// vector width changes no element's arithmetic), each lane getting a
// broadcast a[m][l] times b[l][n:n+NR]. The last tile's missing rows repeat
// the last row and are not stored: every stored element runs the same code
// as in a full tile. Tiles are split over the backend's thread pool. The
// tile shape follows the CPU (AVX-512: 12 x 32 in 24 zmm registers; AVX2:
// 6 x 16 in 12 ymm registers; else 4 x 8 on SSE2); all compute the same
// bits (cpu_gemm_invariant_test runs each the CPU has). AVX-512F brings
// FMA instructions with it; with contraction off the compiler emits none
// (the object file has no vfmadd).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {
namespace {

// fp32 lanes (GCC vector extensions), each an independent output element:
// eight are one ymm register with AVX2 (two xmm on SSE2), sixteen one zmm
// register with AVX-512.
using V8 = float __attribute__((vector_size(32)));
using V16 = float __attribute__((vector_size(64)));
// The same vectors read from any float address (packed panels are only
// float-aligned): one unaligned load, no staging through the stack.
using V8Load = float __attribute__((vector_size(32), aligned(4), may_alias));
using V16Load = float __attribute__((vector_size(64), aligned(4), may_alias));
// The sequential run length of the fixed order above. Part of the order:
// changing it changes bits.
constexpr int64_t kChunkK = 256;

// What one register tile reads and writes. rows[i] is row i's first
// element of op(a); element l of it is at rows[i][l * a_step].
struct TileArgs {
  int64_t k;
  const float* const* rows;  // MR row starts
  int64_t a_step;            // 1 when a is (M, K), lda when a is (K, M)
  const float* panel;        // (K, NR) packed op(b) columns
  float alpha;
  float beta;
  float* out;  // the tile's first element
  int64_t ldc;
  int rows_valid;  // rows and columns stored (the rest is padding)
  int cols_valid;
};

template <typename V, typename VLoad, int MR, int NR>
[[gnu::always_inline]] inline void TileBody(const TileArgs& t) {
  constexpr int kLanes = static_cast<int>(sizeof(V) / sizeof(float));
  static_assert(NR % kLanes == 0, "a panel is whole vectors");
  constexpr int kNV = NR / kLanes;
  const float* rows[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) rows[i] = t.rows[i];
  V total[MR][kNV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kNV; ++j) total[i][j] = V{};
  }
  for (int64_t k0 = 0; k0 < t.k; k0 += kChunkK) {
    const int64_t k1 = std::min(t.k, k0 + kChunkK);
    V acc[MR][kNV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kNV; ++j) acc[i][j] = V{};
    }
    for (int64_t l = k0; l < k1; ++l) {
      V b[kNV];
#pragma GCC unroll 16
      for (int j = 0; j < kNV; ++j) {
        b[j] = *reinterpret_cast<const VLoad*>(t.panel + l * NR + j * kLanes);
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float x = rows[i][l * t.a_step];
#pragma GCC unroll 16
        for (int j = 0; j < kNV; ++j) acc[i][j] += x * b[j];
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kNV; ++j) total[i][j] += acc[i][j];
    }
  }
  float sums[MR][NR];  // total as plain floats, for the partial stores below
  std::memcpy(sums, total, sizeof(sums));
  for (int i = 0; i < t.rows_valid; ++i) {
    float* out = t.out + i * t.ldc;
    for (int c = 0; c < t.cols_valid; ++c) {
      const float s = t.alpha * sums[i][c];
      out[c] = t.beta == 0.0f ? s : s + t.beta * out[c];
    }
  }
}

[[gnu::target("avx512f")]] void TileAvx512(const TileArgs& t) { TileBody<V16, V16Load, 12, 32>(t); }
[[gnu::target("avx2")]] void TileAvx2(const TileArgs& t) { TileBody<V8, V8Load, 6, 16>(t); }
void TileSse2(const TileArgs& t) { TileBody<V8, V8Load, 4, 8>(t); }

// Rows per task: a block of op(a) (kRowTiles tiles of MR rows, all of K)
// stays in cache while the task runs over panels of op(b).
constexpr int64_t kRowTiles = 8;

template <int MR, int NR>
void Run(ThreadPool& pool, void (*tile)(const TileArgs&), bool trans_a, bool trans_b, int64_t m,
         int64_t n, int64_t k, float alpha, const float* pa, int64_t lda, const float* pb,
         int64_t ldb, float beta, float* out) {
  // Pack op(b) (K, N) into panels (K, NR), columns past N zero.
  const int64_t panels = (n + NR - 1) / NR;
  std::vector<float>& packed_buf = pool.Scratch(ThreadPool::kPackB);
  const size_t packed_elements = static_cast<size_t>(panels * k * NR);
  if (packed_buf.capacity() < packed_elements) {
    packed_buf = std::vector<float>();  // frees the smaller one first
    packed_buf.reserve(packed_elements);
  }
  packed_buf.resize(packed_elements);
  float* packed = packed_buf.data();  // (panels, K, NR)
  auto pack = [&](int64_t p) {
    float* dst = packed + p * k * NR;
    const int64_t col0 = p * NR;
    const int cols = static_cast<int>(std::min<int64_t>(NR, n - col0));
    if (trans_b) {
      // b (N, K): the panel's NR rows are read side by side, one element
      // of each per step of K (NR sequential streams).
      for (int64_t l = 0; l < k; ++l) {
        for (int j = 0; j < cols; ++j) dst[l * NR + j] = pb[(col0 + j) * ldb + l];
      }
    } else {
      for (int64_t l = 0; l < k; ++l) {
        std::memcpy(dst + l * NR, pb + l * ldb + col0, static_cast<size_t>(cols) * sizeof(float));
      }
    }
    if (cols < NR) {
      for (int64_t l = 0; l < k; ++l) {
        for (int j = cols; j < NR; ++j) dst[l * NR + j] = 0.0f;
      }
    }
  };

  const int64_t rows_per_task = MR * kRowTiles;
  const int64_t row_blocks = (m + rows_per_task - 1) / rows_per_task;
  const int64_t a_step = trans_a ? lda : 1;
  // One block of rows (a sampling step's few): each panel is used by one
  // task, which packs it just before, while it is still in cache. More
  // blocks share every panel, so all are packed first.
  const bool pack_in_task = row_blocks == 1;
  if (!pack_in_task) pool.ForEachChunk(panels, pack);
  pool.ForEachChunk(row_blocks * panels, [&](int64_t task) {
    const int64_t p = task % panels;
    const int64_t block = task / panels;
    const int64_t col0 = p * NR;
    const int cols = static_cast<int>(std::min<int64_t>(NR, n - col0));
    const int64_t row_end = std::min(m, (block + 1) * rows_per_task);
    if (pack_in_task) pack(p);
    for (int64_t r0 = block * rows_per_task; r0 < row_end; r0 += MR) {
      const float* rows[MR];
      for (int i = 0; i < MR; ++i) {
        const int64_t r = std::min(r0 + i, m - 1);  // padding repeats the last row
        rows[i] = trans_a ? pa + r : pa + r * lda;
      }
      const TileArgs args{k,
                          rows,
                          a_step,
                          packed + p * k * NR,
                          alpha,
                          beta,
                          out + r0 * n + col0,
                          n,
                          static_cast<int>(std::min<int64_t>(MR, m - r0)),
                          cols};
      tile(args);
    }
  });
}

}  // namespace

bool CpuSupports(InvariantGemmIsa isa) {
  switch (isa) {
    case InvariantGemmIsa::kAvx512:
      return __builtin_cpu_supports("avx512f");
    case InvariantGemmIsa::kAvx2:
      return __builtin_cpu_supports("avx2");
    case InvariantGemmIsa::kBest:
    case InvariantGemmIsa::kSse2:
      break;
  }
  return true;  // x86-64's baseline
}

void GemmInvariantF32(ThreadPool& pool, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                      float alpha, const float* pa, int64_t lda, const float* pb, int64_t ldb,
                      float beta, float* out, InvariantGemmIsa isa) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // the empty sum: out = beta * out, never reading out when beta == 0
    for (int64_t i = 0; i < m * n; ++i) out[i] = beta == 0.0f ? 0.0f : beta * out[i];
    return;
  }
  if (isa == InvariantGemmIsa::kBest) {
    isa = CpuSupports(InvariantGemmIsa::kAvx512) ? InvariantGemmIsa::kAvx512
          : CpuSupports(InvariantGemmIsa::kAvx2) ? InvariantGemmIsa::kAvx2
                                                 : InvariantGemmIsa::kSse2;
  }
  switch (isa) {
    case InvariantGemmIsa::kAvx512:
      Run<12, 32>(pool, TileAvx512, trans_a, trans_b, m, n, k, alpha, pa, lda, pb, ldb, beta, out);
      return;
    case InvariantGemmIsa::kAvx2:
      Run<6, 16>(pool, TileAvx2, trans_a, trans_b, m, n, k, alpha, pa, lda, pb, ldb, beta, out);
      return;
    case InvariantGemmIsa::kBest:
    case InvariantGemmIsa::kSse2:
      break;
  }
  Run<4, 8>(pool, TileSse2, trans_a, trans_b, m, n, k, alpha, pa, lda, pb, ldb, beta, out);
}

}  // namespace ampd::kernels::cpu
