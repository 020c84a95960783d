// The register-tile attention kernels' fragment arithmetic, run on the CPU:
// a warp's ldmatrix and mma.sync m16n8k16 emulated lane by lane from an
// independent transcription of the PTX ISA's definitions, driven by the
// index functions of kernels/attention_mma_layout.h in the same loops as
// the kernels' tile products (kernels/cuda/attention_flash.cuh:
// StripTimesRowsT for S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T;
// AccTimesRows for O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q), and
// compared with plain matrix products. A wrong lane offset, register order
// or accumulator-to-operand repacking fails here without a GPU.
#include "kernels/attention_mma_layout.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>
#include <vector>

namespace ampd::kernels {
namespace {

constexpr int kLanes = 32;
// One 32-bit register of two 16-bit values: [0] the lower half.
using Reg = std::array<float, 2>;
using Regs4 = std::array<Reg, 4>;
using Acc = std::array<float, 4>;  // one lane's 16 x 8 fp32 tile

// ---- the PTX ISA, transcribed ------------------------------------------------
// "Matrix Fragments for mma.m16n8k16 with floating point type":
// groupID = laneid >> 2, threadID_in_group = laneid % 4.
int GroupId(int lane) { return lane >> 2; }
int InGroup(int lane) { return lane % 4; }
// A: elements a0 .. a7 (register j holds a_2j, a_2j+1);
// row = groupID for i < 2 or 4 <= i < 6, else groupID + 8;
// col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
mma::RowCol SpecA(int lane, int i) {
  const int row = (i < 2 || (i >= 4 && i < 6)) ? GroupId(lane) : GroupId(lane) + 8;
  const int col = InGroup(lane) * 2 + (i & 1) + (i >= 4 ? 8 : 0);
  return {row, col};
}
// B (16 x 8, k x n): elements b0 .. b3; row = threadID_in_group * 2 + (i & 1),
// + 8 for i >= 2; col = groupID.
mma::RowCol SpecB(int lane, int i) {
  return {InGroup(lane) * 2 + (i & 1) + (i >= 2 ? 8 : 0), GroupId(lane)};
}
// C/D: c0 .. c3; row = groupID for i < 2, else groupID + 8;
// col = threadID_in_group * 2 + (i & 1).
mma::RowCol SpecC(int lane, int i) {
  return {i < 2 ? GroupId(lane) : GroupId(lane) + 8, InGroup(lane) * 2 + (i & 1)};
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: threads 8i .. 8i + 7
// give the addresses of rows 0 .. 7 of matrix i; register i of each thread
// receives, without .trans, row laneid / 4, elements 2 (laneid % 4) and
// + 1 of matrix i; with .trans the matrix is read column-major: elements
// (2 (laneid % 4) + j, laneid / 4) for j = 0, 1. addr[lane] is the index
// in `smem` of the row the lane gives.
std::array<Regs4, kLanes> Ldmatrix(const std::vector<float>& smem,
                                   const std::array<int, kLanes>& addr, bool trans) {
  std::array<Regs4, kLanes> out{};
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 2; ++j) {
        const int src = trans ? addr[8 * i + 2 * (lane % 4) + j] + lane / 4
                              : addr[8 * i + lane / 4] + 2 * (lane % 4) + j;
        out[lane][i][j] = smem.at(static_cast<size_t>(src));
      }
    }
  }
  return out;
}

// d += a b for one warp, each operand rebuilt from the lanes' registers by
// the spec (and every element of A, B and C checked to come from exactly
// one lane).
void Mma(std::array<Acc, kLanes>& d, const std::array<Regs4, kLanes>& a,
         const std::array<std::array<Reg, 2>, kLanes>& b) {
  double am[16][16], bm[16][8], cm[16][8];
  int an[16][16] = {}, bn[16][8] = {}, cn[16][8] = {};
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 8; ++i) {
      const mma::RowCol rc = SpecA(lane, i);
      am[rc.row][rc.col] = a[lane][i / 2][i % 2];
      ++an[rc.row][rc.col];
    }
    for (int i = 0; i < 4; ++i) {
      const mma::RowCol rc = SpecB(lane, i);
      bm[rc.row][rc.col] = b[lane][i / 2][i % 2];
      ++bn[rc.row][rc.col];
      const mma::RowCol cc = SpecC(lane, i);
      cm[cc.row][cc.col] = d[lane][i];
      ++cn[cc.row][cc.col];
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) ASSERT_EQ(an[r][c], 1) << "A " << r << "," << c;
  }
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 8; ++c) {
      ASSERT_EQ(bn[r][c], 1) << "B " << r << "," << c;
      ASSERT_EQ(cn[r][c], 1) << "C " << r << "," << c;
    }
  }
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const mma::RowCol rc = SpecC(lane, i);
      double sum = cm[rc.row][rc.col];
      for (int k = 0; k < 16; ++k) sum += am[rc.row][k] * bm[k][rc.col];
      d[lane][i] = static_cast<float>(sum);
    }
  }
}

// ---- the kernels' loops, over the emulated warp -------------------------------

// A (rows, ld) tile of small integers (products and sums stay exact).
struct Tile {
  int rows, cols, ld;
  std::vector<float> v;
  Tile(int r, int c, uint32_t seed) : rows(r), cols(c), ld(c + 8), v(static_cast<size_t>(r * ld)) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int> dist(-4, 4);
    for (auto& x : v) x = static_cast<float>(dist(gen));
  }
  float at(int r, int c) const { return v[static_cast<size_t>(r * ld + c)]; }
};

// attention_flash.cuh's StripTimesRowsT: acc (n8 tiles) += rows a_row ..
// a_row + 15 of a times the transpose of rows b_row .. of b.
std::vector<std::array<Acc, kLanes>> StripTimesRowsT(const Tile& a, int a_row, const Tile& b,
                                                     int b_row, int n8) {
  std::vector<std::array<Acc, kLanes>> acc(static_cast<size_t>(n8));
  const int d = a.cols;
  for (int kk = 0; kk < d / 16; ++kk) {
    std::array<int, kLanes> addr{};
    for (int lane = 0; lane < kLanes; ++lane) {
      const mma::RowCol ao = mma::LdsmA(lane);
      addr[lane] = (a_row + ao.row) * a.ld + kk * 16 + ao.col;
    }
    const auto af = Ldmatrix(a.v, addr, false);
    for (int np = 0; np < n8 / 2; ++np) {
      for (int lane = 0; lane < kLanes; ++lane) {
        const mma::RowCol bo = mma::LdsmBFromNK(lane);
        addr[lane] = (b_row + np * 16 + bo.row) * b.ld + kk * 16 + bo.col;
      }
      const auto bf = Ldmatrix(b.v, addr, false);
      std::array<std::array<Reg, 2>, kLanes> b0{}, b1{};
      for (int lane = 0; lane < kLanes; ++lane) {
        b0[lane] = {bf[lane][0], bf[lane][1]};
        b1[lane] = {bf[lane][2], bf[lane][3]};
      }
      Mma(acc[static_cast<size_t>(2 * np)], af, b0);
      Mma(acc[static_cast<size_t>(2 * np + 1)], af, b1);
    }
  }
  return acc;
}

// attention_flash.cuh's AccTimesRows: acc (d / 8 tiles) += w (2 k16
// accumulator tiles, repacked as A operands) times rows b_row .. of b.
void AccTimesRows(std::vector<std::array<Acc, kLanes>>& acc,
                  const std::vector<std::array<Acc, kLanes>>& w, const Tile& b, int b_row,
                  int k16) {
  const int d = b.cols;
  for (int kk = 0; kk < k16; ++kk) {
    std::array<Regs4, kLanes> af{};
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int r = 0; r < 4; ++r) {
        const Acc& src = w[static_cast<size_t>(mma::AccTileOf(kk, r))][lane];
        const int e = mma::AccPairFirst(r);
        af[lane][r] = {src[e], src[e + 1]};
      }
    }
    for (int np = 0; np < d / 16; ++np) {
      std::array<int, kLanes> addr{};
      for (int lane = 0; lane < kLanes; ++lane) {
        const mma::RowCol bo = mma::LdsmBFromKN(lane);
        addr[lane] = (b_row + kk * 16 + bo.row) * b.ld + np * 16 + bo.col;
      }
      const auto bf = Ldmatrix(b.v, addr, true);
      std::array<std::array<Reg, 2>, kLanes> b0{}, b1{};
      for (int lane = 0; lane < kLanes; ++lane) {
        b0[lane] = {bf[lane][0], bf[lane][1]};
        b1[lane] = {bf[lane][2], bf[lane][3]};
      }
      Mma(acc[static_cast<size_t>(2 * np)], af, b0);
      Mma(acc[static_cast<size_t>(2 * np + 1)], af, b1);
    }
  }
}

// The logical matrix element (row, col) of a warp's accumulator tiles, read
// the way the kernels read them (AccElement): tile col / 8.
float AccAt(const std::vector<std::array<Acc, kLanes>>& acc, int row, int col) {
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const mma::RowCol rc = mma::AccElement(lane, i);
      if (rc.row == row && rc.col == col % 8) return acc[static_cast<size_t>(col / 8)][lane][i];
    }
  }
  ADD_FAILURE() << "no lane holds " << row << "," << col;
  return 0.0f;
}

TEST(AttentionMmaLayoutTest, AccElementIsThePtxAccumulatorLayout) {
  int seen[16][8] = {};
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const mma::RowCol rc = mma::AccElement(lane, i);
      const mma::RowCol want = SpecC(lane, i);
      EXPECT_EQ(rc.row, want.row) << lane << " " << i;
      EXPECT_EQ(rc.col, want.col) << lane << " " << i;
      ++seen[rc.row][rc.col];
      // What the kernels assume of it: elements 2, 3 are 8 rows below 0, 1;
      // odd elements one column right of even ones; a row's lanes form a
      // quad (lane bits 0 and 1).
      const mma::RowCol first = mma::AccElement(lane, 0);
      EXPECT_EQ(rc.row, first.row + 8 * (i >> 1));
      EXPECT_EQ(rc.col, first.col + (i & 1));
      EXPECT_EQ(first.row, mma::AccElement(lane ^ 1, 0).row);
      EXPECT_EQ(first.row, mma::AccElement(lane ^ 2, 0).row);
    }
  }
  for (auto& row : seen) {
    for (int n : row) EXPECT_EQ(n, 1);
  }
}

// S = Q K^T (forward, dQ pass: strip of 16 queries, 64 keys) and the dK/dV
// pass's S^T = K Q^T over chunks of 32 and 16 queries, D = 64 and 128.
TEST(AttentionMmaLayoutTest, StripTimesRowsTransposedIsTheMatrixProduct) {
  for (int d : {64, 128}) {
    for (int n8 : {8, 4, 2}) {
      for (int strip : {0, 48}) {
        for (int b_row : {0, 64 - 8 * n8}) {
          SCOPED_TRACE(::testing::Message()
                       << "D=" << d << " n8=" << n8 << " strip=" << strip << " b_row=" << b_row);
          const Tile a(64, d, 1u + static_cast<uint32_t>(d + n8));
          const Tile b(64, d, 2u + static_cast<uint32_t>(d * n8));
          const auto acc = StripTimesRowsT(a, strip, b, b_row, n8);
          for (int r = 0; r < 16; ++r) {
            for (int c = 0; c < 8 * n8; ++c) {
              double want = 0;
              for (int k = 0; k < d; ++k) want += a.at(strip + r, k) * b.at(b_row + c, k);
              ASSERT_EQ(AccAt(acc, r, c), static_cast<float>(want)) << r << "," << c;
            }
          }
        }
      }
    }
  }
}

// O += P V: the accumulator tiles of one product (P, 16 x 16 k16) repacked
// as the A operand of the next, times rows of a [k][n] tile, D = 64 and 128,
// onto accumulators that already hold values.
TEST(AttentionMmaLayoutTest, AccumulatorsTimesRowsIsTheMatrixProduct) {
  for (int d : {64, 128}) {
    for (int k16 : {4, 2, 1}) {
      for (int b_row : {0, 64 - 16 * k16}) {
        SCOPED_TRACE(::testing::Message() << "D=" << d << " k16=" << k16 << " b_row=" << b_row);
        // w: 16 x 16 k16 from a plain product of small tiles (any values
        // do; these are exact).
        const Tile p_a(64, 16, 7u + static_cast<uint32_t>(k16));
        const Tile p_b(64, 16, 8u + static_cast<uint32_t>(d));
        const auto w = StripTimesRowsT(p_a, 16, p_b, 0, 2 * k16);
        const Tile v(64, d, 9u + static_cast<uint32_t>(k16 * d));
        std::vector<std::array<Acc, kLanes>> acc(static_cast<size_t>(d / 8));
        for (size_t n = 0; n < acc.size(); ++n) {
          for (int lane = 0; lane < kLanes; ++lane) {
            for (int i = 0; i < 4; ++i) acc[n][lane][i] = static_cast<float>((lane + i + n) % 5);
          }
        }
        const auto before = acc;
        AccTimesRows(acc, w, v, b_row, k16);
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < d; ++c) {
            double want = AccAt(before, r, c);
            for (int k = 0; k < 16 * k16; ++k) want += AccAt(w, r, k) * v.at(b_row + k, c);
            ASSERT_EQ(AccAt(acc, r, c), static_cast<float>(want)) << r << "," << c;
          }
        }
      }
    }
  }
}

// The ldmatrix row offsets stay inside the 16 x 16 block they load and
// start on 16-byte (8-element) boundaries, as ldmatrix requires.
TEST(AttentionMmaLayoutTest, LdmatrixRowsAreAlignedAndInsideTheBlock) {
  for (int lane = 0; lane < kLanes; ++lane) {
    for (const mma::RowCol rc :
         {mma::LdsmA(lane), mma::LdsmBFromNK(lane), mma::LdsmBFromKN(lane)}) {
      EXPECT_GE(rc.row, 0);
      EXPECT_LT(rc.row, 16);
      EXPECT_TRUE(rc.col == 0 || rc.col == 8) << rc.col;
    }
  }
}

}  // namespace
}  // namespace ampd::kernels
