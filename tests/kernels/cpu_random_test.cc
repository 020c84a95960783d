// FillRandom on the CPU backend: Philox4x32-10 against Random123's published
// known-answer vectors, the mapping of draws to Philox words, the uniform
// and normal distributions' moments over a million draws (bounds derived
// from the sample size), the normal transform against libm in float64, the
// same bits whatever the thread count or the split into pieces, and the
// argument checks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/philox.h"

namespace ampd::kernels {
namespace {

namespace px = philox;

// Random123's kat_vectors, "philox4x32 10" lines: counter[4] key[2] -> out[4].
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  struct Kat {
    px::Block ctr;
    uint32_t k0, k1;
    px::Block want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const Kat& k : kats) {
    const px::Block got = px::Philox4x32_10(k.ctr, k.k0, k.k1);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(got.v[w], k.want.v[w]) << "word " << w;
  }
}

std::vector<float> Draw(Backend& b, int64_t n, const RandomFill& fill) {
  absl::StatusOr<Tensor> t = b.Allocate(DType::kF32, {n});
  EXPECT_TRUE(t.ok()) << t.status();
  const absl::Status s = b.FillRandom(*t, fill);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<float> out(static_cast<size_t>(n));
  EXPECT_TRUE(b.CopyToHost(*t, out.data(), out.size() * sizeof(float)).ok());
  return out;
}

RandomFill Uniform(float lo, float hi, uint64_t seed, uint64_t stream, uint64_t offset = 0) {
  RandomFill f;
  f.distribution = RandomDistribution::kUniform;
  f.lo = lo;
  f.hi = hi;
  f.seed = seed;
  f.stream = stream;
  f.offset = offset;
  return f;
}

RandomFill Normal(float mean, float stddev, uint64_t seed, uint64_t stream, uint64_t offset = 0) {
  RandomFill f;
  f.distribution = RandomDistribution::kNormal;
  f.mean = mean;
  f.stddev = stddev;
  f.seed = seed;
  f.stream = stream;
  f.offset = offset;
  return f;
}

// Uniform draw d is lo + (hi - lo) * (word >> 8) / 2^24 of word d % 4 of
// block d / 4 (counter = (block, stream), key = seed), computed here in
// float64 from the raw generator.
TEST(CpuFillRandomTest, UniformDrawsAreTheDocumentedWords) {
  auto b = CreateCpuBackend(2);
  const uint64_t seed = 0x0123456789abcdefull, stream = 0x1122334455667788ull;
  const int64_t n = 1001;
  const uint64_t offset = 6;
  const std::vector<float> got = Draw(*b, n, Uniform(-2.0f, 3.0f, seed, stream, offset));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t d = offset + static_cast<uint64_t>(i);
    const uint64_t block = d / 4;
    const px::Block ctr = {{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                            static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
    const px::Block r =
        px::Philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    const double u = std::ldexp(static_cast<double>(r.v[d % 4] >> 8), -24);
    ASSERT_EQ(got[static_cast<size_t>(i)], static_cast<float>(-2.0 + 5.0 * u)) << "element " << i;
  }
}

// Box-Muller with glibc's log, cos and sin in float64: the header's own
// log and sincos (arithmetic only, so that CUDA gives the same bits) must
// agree to within one float rounding.
TEST(CpuFillRandomTest, NormalDrawsMatchBoxMullerWithLibm) {
  auto b = CreateCpuBackend(2);
  const int64_t n = 100001;  // odd: the last pair is used by half
  const std::vector<float> got = Draw(*b, n, Normal(0.0f, 1.0f, 99, 5));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t d = static_cast<uint64_t>(i);
    const px::Block r = px::StreamBlock(99, 5, d / 2);
    const double u = std::ldexp(
        static_cast<double>((static_cast<uint64_t>(r.v[0] >> 5) << 26) | (r.v[1] >> 6)), -53);
    const double t = std::ldexp(
        static_cast<double>((static_cast<uint64_t>(r.v[2] >> 5) << 26) | (r.v[3] >> 6)), -53);
    const double radius = std::sqrt(-2.0 * std::log(1.0 - u));
    const double angle = 2.0 * M_PI * t;
    const double want = radius * (d % 2 == 0 ? std::cos(angle) : std::sin(angle));
    const double g = got[static_cast<size_t>(i)];
    // One float ulp at |want| plus the float64 error of the reference.
    const double tol = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), 1e-30)) - 23) + 1e-13;
    ASSERT_LE(std::fabs(g - want), tol) << "element " << i << " want " << want << " got " << g;
  }
}

// Sample moments of n draws: the mean within 6 standard errors
// (sigma / sqrt(n)), the variance within 6 standard errors of the sample
// variance (sqrt((mu4 - sigma^4) / n)). 6 sigma: a correct generator fails
// this about once in 10^8 seeds, a biased transform almost always.
struct Moments {
  double mean, var;
};
Moments SampleMoments(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += x;
  const double mean = sum / static_cast<double>(v.size());
  double ss = 0;
  for (float x : v) ss += (x - mean) * (x - mean);
  return {mean, ss / static_cast<double>(v.size() - 1)};
}

TEST(CpuFillRandomTest, UniformMomentsOfAMillionDraws) {
  auto b = CreateCpuBackend(2);
  const int64_t n = 1 << 20;
  const float lo = -0.25f, hi = 1.75f;
  const std::vector<float> v = Draw(*b, n, Uniform(lo, hi, 2026, 3));
  for (float x : v) ASSERT_TRUE(x >= lo && x < hi) << x;
  const double w = hi - lo;
  const double sigma2 = w * w / 12.0, mu4 = w * w * w * w / 80.0;
  const Moments m = SampleMoments(v);
  const double nd = static_cast<double>(n);
  EXPECT_NEAR(m.mean, (lo + hi) / 2.0, 6.0 * std::sqrt(sigma2 / nd));
  EXPECT_NEAR(m.var, sigma2, 6.0 * std::sqrt((mu4 - sigma2 * sigma2) / nd));
}

TEST(CpuFillRandomTest, NormalMomentsOfAMillionDraws) {
  auto b = CreateCpuBackend(2);
  const int64_t n = 1 << 20;
  const float mean = 0.5f, sd = 2.0f;
  const std::vector<float> v = Draw(*b, n, Normal(mean, sd, 2026, 4));
  const double sigma2 = static_cast<double>(sd) * sd;
  const Moments m = SampleMoments(v);
  const double nd = static_cast<double>(n);
  EXPECT_NEAR(m.mean, mean, 6.0 * std::sqrt(sigma2 / nd));
  EXPECT_NEAR(m.var, sigma2, 6.0 * std::sqrt(2.0 * sigma2 * sigma2 / nd));  // mu4 = 3 sigma^4
  // The share within one sigma, a check on the shape beyond two moments.
  int64_t inside = 0;
  for (float x : v) inside += std::fabs(x - mean) < sd;
  const double p = 0.682689492137086;
  EXPECT_NEAR(static_cast<double>(inside) / nd, p, 6.0 * std::sqrt(p * (1 - p) / nd));
  // Box-Muller's radius is at most sqrt(2 * 53 ln 2) = 8.58 with 53-bit u.
  for (float x : v) ASSERT_LE(std::fabs(x - mean), 8.6 * sd);
}

TEST(CpuFillRandomTest, StreamsAndSeedsAreIndependent) {
  auto b = CreateCpuBackend(2);
  const std::vector<float> a = Draw(*b, 4096, Uniform(0, 1, 1, 0));
  const std::vector<float> s = Draw(*b, 4096, Uniform(0, 1, 1, 1));
  const std::vector<float> k = Draw(*b, 4096, Uniform(0, 1, 2, 0));
  int same_stream = 0, same_seed = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    same_stream += a[i] == s[i];
    same_seed += a[i] == k[i];
  }
  // Equal 24-bit values by chance: expected 4096 / 2^24.
  EXPECT_LE(same_stream, 2);
  EXPECT_LE(same_seed, 2);
}

// The same bits with 1, 2, 3 or 8 threads, and when the tensor is filled
// in pieces through offset (pieces that start mid-block included).
TEST(CpuFillRandomTest, BitsDoNotDependOnThreadsOrPieces) {
  const int64_t n = 300007;  // several chunks, not a multiple of 4
  for (bool normal : {false, true}) {
    const RandomFill whole = normal ? Normal(-1, 0.5f, 77, 9, 3) : Uniform(-3, 4, 77, 9, 3);
    auto one = CreateCpuBackend(1);
    const std::vector<float> want = Draw(*one, n, whole);
    for (int threads : {2, 3, 8}) {
      auto b = CreateCpuBackend(threads);
      EXPECT_EQ(Draw(*b, n, whole), want) << threads << " threads, normal " << normal;
    }
    std::vector<float> pieces;
    for (int64_t begin = 0; begin < n;) {
      const int64_t len = std::min<int64_t>(n - begin, 1 + (begin * 7919) % 70001);
      RandomFill f = whole;
      f.offset = whole.offset + static_cast<uint64_t>(begin);
      const std::vector<float> part = Draw(*one, len, f);
      pieces.insert(pieces.end(), part.begin(), part.end());
      begin += len;
    }
    EXPECT_EQ(pieces, want) << "normal " << normal;
  }
}

TEST(CpuFillRandomTest, UniformStaysBelowHi) {
  auto b = CreateCpuBackend(2);
  // hi one ulp above lo: lo + (hi - lo) u rounds to hi for u >= 1/2, and
  // must be brought back below it.
  const float lo = 1.0f, hi = std::nextafter(1.0f, 2.0f);
  for (float x : Draw(*b, 10000, Uniform(lo, hi, 3, 3))) ASSERT_EQ(x, lo);
  for (float x : Draw(*b, 100, Uniform(0.0f, 0.0f, 3, 3))) ASSERT_EQ(x, 0.0f);
  const float nlo = -std::nextafter(0.0f, 1.0f);
  for (float x : Draw(*b, 1000, Uniform(nlo, 0.0f, 3, 3))) ASSERT_EQ(x, nlo);
}

TEST(CpuFillRandomTest, RejectsBadArguments) {
  auto b = CreateCpuBackend(1);
  Tensor f32 = *b->Allocate(DType::kF32, {8});
  Tensor f16 = *b->Allocate(DType::kF16, {8});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    Tensor* dst;
    RandomFill fill;
    const char* mentions;
  };
  RandomFill overflow = Uniform(0, 1, 1, 1);
  overflow.offset = std::numeric_limits<uint64_t>::max() - 7;  // offset + 8 wraps past 2^64 - 1
  RandomFill bad_kind = Uniform(0, 1, 1, 1);
  bad_kind.distribution = static_cast<RandomDistribution>(9);
  const Case cases[] = {
      {&f16, Uniform(0, 1, 1, 1), "dst"},
      {&f32, Uniform(1, 0, 1, 1), "lo <= hi"},
      {&f32, Uniform(nan, 1, 1, 1), "lo <= hi"},
      {&f32, Uniform(0, inf, 1, 1), "lo <= hi"},
      {&f32, Normal(0, -1, 1, 1), "stddev >= 0"},
      {&f32, Normal(nan, 1, 1, 1), "stddev >= 0"},
      {&f32, overflow, "overflows"},
      {&f32, bad_kind, "distribution"},
  };
  for (const Case& c : cases) {
    const absl::Status s = b->FillRandom(*c.dst, c.fill);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.mentions;
    EXPECT_NE(s.message().find(c.mentions), absl::string_view::npos) << s;
  }
  // offset + numel may reach 2^64 - 1 exactly.
  RandomFill last = Uniform(0, 1, 1, 1);
  last.offset = std::numeric_limits<uint64_t>::max() - 8;
  EXPECT_TRUE(b->FillRandom(f32, last).ok());
}

}  // namespace
}  // namespace ampd::kernels
