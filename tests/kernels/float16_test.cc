// kernels/float16.h against the IEEE definitions: every fp16 bit pattern
// decodes to the value its fields define and survives half -> float -> half;
// float -> fp16 / bf16 rounding matches an independent float64 model
// (kernel_test_util.h) on the boundary cases and on millions of random floats.
#include "kernels/float16.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

using testing::RefBf16;
using testing::RefDecodeBf16;
using testing::RefDecodeHalf;
using testing::RefHalf;

float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// fp16 result of float16.h vs the reference: same value, same sign of zero,
// both NaN (with the input's sign) or neither.
void ExpectHalfMatches(float x) {
  const uint16_t bits = FloatToHalfBits(x);
  const double got = RefDecodeHalf(bits);
  const double want = RefHalf(static_cast<double>(x));
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << "x=" << x << " bits=" << bits;
    ASSERT_EQ(std::signbit(got), std::signbit(x)) << "x=" << x;
    return;
  }
  ASSERT_EQ(got, want) << "x=" << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  ASSERT_EQ(std::signbit(got), std::signbit(want)) << "x=" << x;
}

void ExpectBf16Matches(float x) {
  const uint16_t bits = FloatToBf16Bits(x);
  const double got = RefDecodeBf16(bits);
  const double want = RefBf16(static_cast<double>(x));
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << "x=" << x;
    ASSERT_EQ(std::signbit(got), std::signbit(x)) << "x=" << x;
    return;
  }
  ASSERT_EQ(got, want) << "x=" << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  ASSERT_EQ(std::signbit(got), std::signbit(want)) << "x=" << x;
}

TEST(Float16, EveryHalfBitPatternDecodesAndRoundTrips) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f = HalfBitsToFloat(bits);
    const double ref = RefDecodeHalf(bits);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_EQ(std::signbit(f), (b & 0x8000u) != 0) << b;
      const uint16_t back = FloatToHalfBits(f);
      // Still NaN (exponent all ones, mantissa nonzero) with the same sign.
      ASSERT_EQ(back & 0x7c00u, 0x7c00u) << b;
      ASSERT_NE(back & 0x3ffu, 0u) << b;
      ASSERT_EQ(back & 0x8000u, b & 0x8000u) << b;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << b;
    ASSERT_EQ(std::signbit(f), std::signbit(ref)) << b;
    ASSERT_EQ(FloatToHalfBits(f), bits) << b;
  }
}

TEST(Float16, HalfBoundaryCases) {
  const double two_m24 = std::ldexp(1.0, -24);
  const double two_m25 = std::ldexp(1.0, -25);
  // Largest finite, and the overflow threshold (the halfway point to 2^16).
  EXPECT_EQ(RoundToHalf(65504.0f), 65504.0f);
  EXPECT_EQ(RoundToHalf(65519.99f), 65504.0f);
  EXPECT_EQ(RoundToHalf(std::nextafter(65520.0f, 0.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(RoundToHalf(65520.0f)));
  EXPECT_TRUE(std::isinf(RoundToHalf(-65520.0f)) && RoundToHalf(-65520.0f) < 0);
  EXPECT_TRUE(std::isinf(RoundToHalf(1e30f)));
  // Subnormals: 2^-24 is the smallest; 2^-25 is a tie and goes to (even) 0;
  // anything above 2^-25 goes up to 2^-24.
  EXPECT_EQ(RoundToHalf(static_cast<float>(two_m24)), static_cast<float>(two_m24));
  EXPECT_EQ(RoundToHalf(static_cast<float>(two_m25)), 0.0f);
  EXPECT_EQ(RoundToHalf(std::nextafter(static_cast<float>(two_m25), 1.0f)),
            static_cast<float>(two_m24));
  // 1.5 * 2^-24 is a tie between 1 and 2 units: even is 2.
  EXPECT_EQ(RoundToHalf(static_cast<float>(1.5 * two_m24)), static_cast<float>(2 * two_m24));
  // 2.5 units: tie between 2 and 3, even is 2.
  EXPECT_EQ(RoundToHalf(static_cast<float>(2.5 * two_m24)), static_cast<float>(2 * two_m24));
  // Subnormal/normal boundary: largest subnormal 1023 * 2^-24, min normal 2^-14,
  // and the tie between them (1023.5 units) rounds to the even one, 2^-14.
  EXPECT_EQ(RoundToHalf(static_cast<float>(1023 * two_m24)), static_cast<float>(1023 * two_m24));
  EXPECT_EQ(RoundToHalf(static_cast<float>(1023.5 * two_m24)), kF16MinNormal);
  EXPECT_EQ(RoundToHalf(static_cast<float>(1023.25 * two_m24)), static_cast<float>(1023 * two_m24));
  EXPECT_EQ(RoundToHalf(kF16MinNormal), kF16MinNormal);
  // Normal ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> 1 (even);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9 -> 1 + 2^-9.
  EXPECT_EQ(RoundToHalf(1.0f + std::ldexp(1.0f, -11)), 1.0f);
  EXPECT_EQ(RoundToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  // Negative zero keeps its sign; NaN stays NaN with its sign.
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000u);
  EXPECT_EQ(FloatToHalfBits(0.0f), 0x0000u);
  EXPECT_EQ(FloatToHalfBits(-1e-30f), 0x8000u);
  EXPECT_TRUE(std::isnan(RoundToHalf(NAN)));
  EXPECT_TRUE(std::signbit(RoundToHalf(-NAN)));
  // Every case above, and their negations, also agree with the reference.
  const float cases[] = {65504.0f,
                         65519.99f,
                         65520.0f,
                         65536.0f,
                         static_cast<float>(two_m24),
                         static_cast<float>(two_m25),
                         std::nextafter(static_cast<float>(two_m25), 1.0f),
                         std::nextafter(static_cast<float>(two_m25), 0.0f),
                         static_cast<float>(1023.5 * two_m24),
                         kF16MinNormal,
                         std::nextafter(kF16MinNormal, 0.0f),
                         1.0f + std::ldexp(1.0f, -11),
                         0.0f,
                         INFINITY,
                         NAN,
                         1e-45f,
                         3.4028235e38f};
  for (float c : cases) {
    ExpectHalfMatches(c);
    ExpectHalfMatches(-c);
  }
}

TEST(Float16, Bf16BoundaryCases) {
  // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1; 1 + 3 * 2^-8 -> 1 + 2^-6.
  EXPECT_EQ(RoundToBf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  EXPECT_EQ(RoundToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(RoundToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)),
            1.0f + std::ldexp(1.0f, -7));
  // Largest finite bf16 (0x7f7f) stays; float max rounds to inf (past the tie).
  const float bf16_max = FromBits(0x7f7f0000u);
  EXPECT_EQ(RoundToBf16(bf16_max), bf16_max);
  EXPECT_TRUE(std::isinf(RoundToBf16(3.4028235e38f)));
  EXPECT_EQ(FloatToBf16Bits(-0.0f), 0x8000u);
  EXPECT_TRUE(std::isnan(RoundToBf16(NAN)));
  EXPECT_TRUE(std::signbit(RoundToBf16(-NAN)));
  // A signalling-style NaN whose payload sits only in the low 16 bits must
  // not truncate to inf.
  EXPECT_TRUE(std::isnan(RoundToBf16(FromBits(0x7f800001u))));
  const float cases[] = {1.0f + std::ldexp(1.0f, -8),
                         bf16_max,
                         FromBits(0x7f7f8000u),
                         FromBits(0x7f7f7fffu),
                         3.4028235e38f,
                         1e-45f,
                         FromBits(0x00018000u),
                         FromBits(0x00008000u),
                         0.0f,
                         INFINITY,
                         NAN,
                         65504.0f};
  for (float c : cases) {
    ExpectBf16Matches(c);
    ExpectBf16Matches(-c);
  }
}

// Random bit patterns cover every exponent (NaN, inf, subnormal floats);
// a second sweep concentrates on fp16's own range where rounding is subtle.
TEST(Float16, RandomFloatsMatchReference) {
  std::mt19937 rng(20240611);
  for (int i = 0; i < (1 << 22); ++i) {
    const float x = FromBits(static_cast<uint32_t>(rng()));
    ExpectHalfMatches(x);
    ExpectBf16Matches(x);
  }
  std::uniform_int_distribution<int> exp_dist(-27, 16);
  for (int i = 0; i < (1 << 22); ++i) {
    const uint32_t mantissa = static_cast<uint32_t>(rng()) & 0x7fffffu;
    const uint32_t sign = (static_cast<uint32_t>(rng()) & 1u) << 31;
    const uint32_t exponent = static_cast<uint32_t>(exp_dist(rng) + 127);
    const float x = FromBits(sign | (exponent << 23) | mantissa);
    ExpectHalfMatches(x);
    ExpectBf16Matches(x);
  }
}

// Exact ties are rare among random floats, so every fp16 tie is tried: the
// midpoint between each pair of adjacent positive finite fp16 values.
TEST(Float16, EveryHalfTieRoundsToEven) {
  for (uint32_t b = 0; b < 0x7bffu; ++b) {
    const double lo = RefDecodeHalf(static_cast<uint16_t>(b));
    const double hi = RefDecodeHalf(static_cast<uint16_t>(b + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint16_t want = static_cast<uint16_t>((b & 1u) ? b + 1 : b);
    ASSERT_EQ(FloatToHalfBits(mid), want) << b;
    ASSERT_EQ(FloatToHalfBits(-mid), want | 0x8000u) << b;
    ExpectHalfMatches(mid);
  }
}

}  // namespace
}  // namespace ampd::kernels
