// Which lane of a warp holds which element of a tensor-core operand, as the
// CUDA register-tile attention kernels (kernels/cuda/attention_flash_*.cu)
// use it: the accumulator layout of mma.sync.aligned.m16n8k16 (16-bit A
// and B, fp32 C and D; PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"), the shared-memory row each lane hands to
// ldmatrix.x4 for the three kinds of operand loads the kernels make, and
// how a product's C fragments become the next product's A fragments.
//
// Plain C++ (host and nvcc) so that tests/kernels/attention_mma_layout_test.cc
// can run the kernels' index arithmetic on the CPU against an independent
// transcription of the PTX ISA's fragment tables, without a GPU.
#pragma once

#if defined(__CUDACC__)
#define AMPD_MMA_HD __host__ __device__
#else
#define AMPD_MMA_HD
#endif

namespace ampd::kernels::mma {

// A position inside a tile: row, column.
struct RowCol {
  int row;
  int col;
};

// ---- accumulators -----------------------------------------------------------
// C/D of m16n8k16 is a 16 x 8 fp32 tile, four floats per lane: lane l holds
// row l / 4 (elements 0, 1) and row l / 4 + 8 (elements 2, 3), columns
// 2 (l % 4) and 2 (l % 4) + 1. So the four lanes 4g .. 4g + 3 (a "quad")
// hold all of rows g and g + 8, and a row's reduction is two xor-shuffles
// (over lane bits 0 and 1).
AMPD_MMA_HD constexpr RowCol AccElement(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}

// ---- ldmatrix.x4 row addresses ---------------------------------------------
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit values; lane 8i + j hands
// over the address of row j of matrix i, and every lane receives one 32-bit
// register per matrix. Each function below gives the (row, column) offset,
// inside the 16 x 16 block being loaded from a row-major tile in shared
// memory, of the row this lane hands over.
//
// A operand (16 x 16, row-major, stored [m][k]): matrices (rows 0-7,
// cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15,
// cols 8-15) = registers a0, a1, a2, a3.
AMPD_MMA_HD constexpr RowCol LdsmA(int lane) { return {lane & 15, 8 * (lane >> 4)}; }

// B operands of two adjacent 8-column n-tiles, from a tile stored [n][k]
// (K or V rows as the "n" of S = Q K^T or dP = dO V^T): matrices (n 0-7,
// k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = registers
// b0, b1 of n-tile 0, then b0, b1 of n-tile 1. Plain (non-transposing)
// ldmatrix.
AMPD_MMA_HD constexpr RowCol LdsmBFromNK(int lane) {
  return {(lane & 7) + 8 * (lane >> 4), 8 * ((lane >> 3) & 1)};
}

// B operands of two adjacent n-tiles from a tile stored [k][n] (V of P V,
// K of dS K, dout and Q of the dK/dV products): matrices (k 0-7, n 0-7),
// (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15), loaded with
// ldmatrix.trans so each lane receives two consecutive k of one n.
AMPD_MMA_HD constexpr RowCol LdsmBFromKN(int lane) {
  return {(lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4)};
}

// ---- accumulators as the next product's A operand ---------------------------
// A 16 x 64 product kept as eight 16 x 8 accumulator tiles (S, P, dS) is the
// A operand of a product over those 64 columns in four k-steps of 16:
// register r (0 .. 3) of k-step kk packs elements AccPairFirst(r) and
// AccPairFirst(r) + 1 (lower half first) of accumulator tile AccTileOf(kk, r).
AMPD_MMA_HD constexpr int AccTileOf(int kk, int r) { return 2 * kk + (r >> 1); }
AMPD_MMA_HD constexpr int AccPairFirst(int r) { return 2 * (r & 1); }

}  // namespace ampd::kernels::mma
