// Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2,
// 3", SC11; the generator cuRAND and PyTorch use) and the uniform and normal
// draws built on it, in one header compiled by both the host compiler and
// nvcc. A draw is a pure function of (seed, stream, index), so every element
// of a tensor can be drawn independently: by any thread on the CPU, by one
// CUDA thread each on the GPU, with the same bits on both.
//
// Bit-identity across compilers rests on three rules followed below:
// - only integer math, and double-precision +, -, *, / and sqrt, which IEEE
//   754 rounds exactly (no libm: glibc's and CUDA's log/cos differ in the
//   last bit);
// - no fused multiply-add: nvcc contracts a * b + c into one fma by default,
//   so device code spells every operation with its _rn intrinsic, and the
//   host build of kernels/ passes -ffp-contract=off;
// - conversions to float round to nearest even on both sides.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AMPD_HOST_DEVICE __host__ __device__
#else
#define AMPD_HOST_DEVICE
#endif

namespace ampd::kernels::philox {

// Random123's constants: the two round multipliers and the Weyl key bumps
// (the golden ratio and sqrt(3) - 1 in 32-bit fixed point).
inline constexpr uint32_t kM0 = 0xD2511F53u;
inline constexpr uint32_t kM1 = 0xCD9E8D57u;
inline constexpr uint32_t kW0 = 0x9E3779B9u;
inline constexpr uint32_t kW1 = 0xBB67AE85u;
inline constexpr int kRounds = 10;

struct Block {
  uint32_t v[4];
};

// One Philox4x32 evaluation: 10 rounds, the key bumped between rounds.
AMPD_HOST_DEVICE inline Block Philox4x32_10(Block ctr, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr.v[2];
    const Block next = {{static_cast<uint32_t>(p1 >> 32) ^ ctr.v[1] ^ k0, static_cast<uint32_t>(p1),
                         static_cast<uint32_t>(p0 >> 32) ^ ctr.v[3] ^ k1,
                         static_cast<uint32_t>(p0)}};
    ctr = next;
  }
  return ctr;
}

// The block that holds draws [4 * block, 4 * block + 4) of one stream: the
// key is the seed, the counter is (block, stream) as four 32-bit words.
AMPD_HOST_DEVICE inline Block StreamBlock(uint64_t seed, uint64_t stream, uint64_t block) {
  const Block ctr = {{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                      static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return Philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// ---- exactly rounded double arithmetic ------------------------------------
AMPD_HOST_DEVICE inline double Add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
AMPD_HOST_DEVICE inline double Sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
AMPD_HOST_DEVICE inline double Mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
AMPD_HOST_DEVICE inline double Div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
AMPD_HOST_DEVICE inline double Sqrt(double a) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
AMPD_HOST_DEVICE inline float ToFloat(double a) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(a);
#else
  return static_cast<float>(a);
#endif
}
AMPD_HOST_DEVICE inline uint64_t DoubleBits(double a) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(a));
#else
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  return bits;
#endif
}
AMPD_HOST_DEVICE inline double BitsToDouble(uint64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double a;
  std::memcpy(&a, &bits, sizeof(a));
  return a;
#endif
}
AMPD_HOST_DEVICE inline uint32_t FloatBits(float a) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(a);
#else
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  return bits;
#endif
}
AMPD_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float a;
  std::memcpy(&a, &bits, sizeof(a));
  return a;
#endif
}

// ---- the distributions ----------------------------------------------------
// [0, 1) with 24 random bits: every value is an exact float.
AMPD_HOST_DEVICE inline double Unit24(uint32_t word) {
  return static_cast<double>(word >> 8) * 0x1.0p-24;
}
// [0, 1) with 53 random bits from two words (27 + 26 bits).
AMPD_HOST_DEVICE inline double Unit53(uint32_t a, uint32_t b) {
  return static_cast<double>((static_cast<uint64_t>(a >> 5) << 26) | (b >> 6)) * 0x1.0p-53;
}

// The largest float below hi.
AMPD_HOST_DEVICE inline float FloatBelow(float hi) {
  const uint32_t bits = FloatBits(hi);
  if ((bits & 0x7fffffffu) == 0) return BitsToFloat(0x80000001u);  // below +-0
  return BitsToFloat((bits & 0x80000000u) ? bits + 1 : bits - 1);
}

// lo + (hi - lo) * u in double, rounded once to float and kept below hi
// (the rounding can reach hi when u is within 2^-24 of 1). lo == hi gives lo.
AMPD_HOST_DEVICE inline float UniformFromWord(uint32_t word, float lo, float hi) {
  const double span = Sub(static_cast<double>(hi), static_cast<double>(lo));
  const float v = ToFloat(Add(static_cast<double>(lo), Mul(span, Unit24(word))));
  return (lo < hi && v >= hi) ? FloatBelow(hi) : v;
}

// Natural log of x in [2^-1022, 1]: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, by its series to
// s^21 (the next term is below 2^-56 of the sum).
AMPD_HOST_DEVICE inline double Log(double x) {
  const uint64_t bits = DoubleBits(x);
  int e = static_cast<int>(bits >> 52) - 1022;  // x = m 2^e, m in [1/2, 1)
  double m = BitsToDouble((bits & 0x000fffffffffffffull) | 0x3fe0000000000000ull);
  if (m < 0.70710678118654752440) {
    m = Mul(m, 2.0);  // exact
    --e;
  }
  const double f = Sub(m, 1.0);  // exact (Sterbenz)
  const double s = Div(f, Add(2.0, f));
  const double z = Mul(s, s);
  double p = Div(1.0, 21.0);
  for (int k = 19; k >= 1; k -= 2) p = Add(Mul(p, z), Div(1.0, static_cast<double>(k)));
  const double log_m = Mul(Mul(2.0, s), p);
  // ln 2 split so that e * kLn2Hi is exact for |e| < 2^11.
  constexpr double kLn2Hi = 0x1.62e42fefa3800p-1;
  constexpr double kLn2Lo = 0x1.ef35793c76730p-45;
  const double de = static_cast<double>(e);
  return Add(Mul(de, kLn2Hi), Add(Mul(de, kLn2Lo), log_m));
}

// sin and cos of x in [0, pi/4] by Taylor series in nested form, to x^17
// and x^18 (next terms below 1e-19).
AMPD_HOST_DEVICE inline double SinSmall(double x) {
  const double x2 = Mul(x, x);
  double p = 1.0;
  for (int k = 16; k >= 2; k -= 2) {
    p = Sub(1.0, Mul(Div(x2, static_cast<double>(k * (k + 1))), p));
  }
  return Mul(x, p);
}
AMPD_HOST_DEVICE inline double CosSmall(double x) {
  const double x2 = Mul(x, x);
  double p = 1.0;
  for (int k = 17; k >= 1; k -= 2) {
    p = Sub(1.0, Mul(Div(x2, static_cast<double>(k * (k + 1))), p));
  }
  return p;
}

// cos and sin of 2 pi t for t in [0, 1), reduced exactly on t (a dyadic
// rational): quadrant q = floor(4t), then the angle within the quadrant is
// folded into [0, pi/4] where the series are short.
AMPD_HOST_DEVICE inline void CosSinTwoPi(double t, double& c, double& s) {
  constexpr double kHalfPi = 1.57079632679489661923;
  const double t4 = Mul(t, 4.0);  // exact
  const int q = static_cast<int>(t4);
  const double f = Sub(t4, static_cast<double>(q));  // exact, in [0, 1)
  double sp, cp;                                     // sin and cos of f pi/2
  if (f <= 0.5) {
    const double a = Mul(f, kHalfPi);
    sp = SinSmall(a);
    cp = CosSmall(a);
  } else {
    const double a = Mul(Sub(1.0, f), kHalfPi);  // 1 - f exact
    sp = CosSmall(a);
    cp = SinSmall(a);
  }
  switch (q) {
    case 0:
      c = cp;
      s = sp;
      break;
    case 1:
      c = -sp;
      s = cp;
      break;
    case 2:
      c = -cp;
      s = -sp;
      break;
    default:
      c = sp;
      s = -cp;
      break;
  }
}

// Two independent N(mean, stddev) draws from one block by Box-Muller:
// radius from words 0-1, angle from words 2-3. 1 - u is in [2^-53, 1], so
// the log is finite (radius at most 8.58).
AMPD_HOST_DEVICE inline void NormalPairFromBlock(const Block& b, float mean, float stddev,
                                                 float& z0, float& z1) {
  const double u = Unit53(b.v[0], b.v[1]);
  const double t = Unit53(b.v[2], b.v[3]);
  const double r = Sqrt(Mul(-2.0, Log(Sub(1.0, u))));
  double c, s;
  CosSinTwoPi(t, c, s);
  const double m = static_cast<double>(mean);
  const double sd = static_cast<double>(stddev);
  z0 = ToFloat(Add(m, Mul(sd, Mul(r, c))));
  z1 = ToFloat(Add(m, Mul(sd, Mul(r, s))));
}

}  // namespace ampd::kernels::philox
