// Helpers shared by the kernel tests: an independent float64 model of fp16
// and bf16 rounding (written from the IEEE definitions with frexp/nearbyint,
// not from kernels/float16.h's bit manipulation), tensors made from and read
// back into double vectors, seeded random inputs, and the tolerance units.
#pragma once

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/float16.h"

namespace ampd::kernels::testing {

// ---- reference rounding ----------------------------------------------------
// Round |x| to a multiple of the format's quantum at x's binade, ties to
// even (nearbyint under the default FE_TONEAREST mode), then overflow to
// inf when the rounded value reaches 2^(emax+1). Works in double, where
// every float and every quotient by a power of two is exact.
inline double RefRound(double x, int mantissa_bits, int min_normal_exp, int max_exp) {
  if (std::isnan(x)) return x;
  if (std::isinf(x) || x == 0.0) return x;
  const double a = std::fabs(x);
  int e2;
  std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1): floor(log2 a) = e2 - 1
  int exp = e2 - 1;
  if (exp < min_normal_exp) exp = min_normal_exp;  // subnormals share the lowest quantum
  const double quantum = std::ldexp(1.0, exp - mantissa_bits);
  const double r = std::nearbyint(a / quantum) * quantum;
  const double result = r >= std::ldexp(1.0, max_exp + 1) ? INFINITY : r;
  return std::copysign(result, x);
}
// fp16: 10 mantissa bits, normals from 2^-14, largest binade 2^15.
inline double RefHalf(double x) { return RefRound(x, 10, -14, 15); }
// bf16: 7 mantissa bits, fp32's exponent range (normals from 2^-126).
inline double RefBf16(double x) { return RefRound(x, 7, -126, 127); }
// fp32 itself, for completeness of RefStore.
inline double RefF32(double x) { return static_cast<double>(static_cast<float>(x)); }

inline double RefStore(DType dtype, double x) {
  switch (dtype) {
    case DType::kF16:
      return RefHalf(x);
    case DType::kBF16:
      return RefBf16(x);
    default:
      return RefF32(x);
  }
}

// Machine epsilon of each dtype (one ulp at 1.0): 2^-10, 2^-7, 2^-23.
inline double Eps(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return std::ldexp(1.0, -10);
    case DType::kBF16:
      return std::ldexp(1.0, -7);
    default:
      return std::ldexp(1.0, -23);
  }
}
inline const double kEps32 = std::ldexp(1.0, -23);
// fp32's unit roundoff (half its machine epsilon).
inline const double kU32 = std::ldexp(1.0, -24);

// The smallest positive value of a dtype (its subnormal quantum): the
// absolute floor of a tolerance.
inline double DenormMin(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return std::ldexp(1.0, -24);
    case DType::kBF16:
      return std::ldexp(1.0, -133);
    default:
      return std::ldexp(1.0, -149);
  }
}

// ---- tensors ---------------------------------------------------------------
// Uploads values (each must already be representable in dtype; checked).
inline Tensor MakeTensor(Backend& be, DType dtype, const Shape& shape,
                         const std::vector<double>& values) {
  absl::StatusOr<Tensor> t = be.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(static_cast<size_t>(NumElements(shape)), values.size());
  std::vector<unsigned char> bytes(values.size() * SizeOf(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kF32: {
        const float f = static_cast<float>(v);
        EXPECT_TRUE(std::isnan(v) || static_cast<double>(f) == v) << v;
        std::memcpy(&bytes[i * 4], &f, 4);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        const float f = static_cast<float>(v);
        const uint16_t bits = dtype == DType::kF16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
        EXPECT_TRUE(std::isnan(v) || RefStore(dtype, v) == v) << v << " not exact";
        std::memcpy(&bytes[i * 2], &bits, 2);
        break;
      }
      case DType::kI32: {
        const int32_t x = static_cast<int32_t>(v);
        std::memcpy(&bytes[i * 4], &x, 4);
        break;
      }
      case DType::kI64: {
        const int64_t x = static_cast<int64_t>(v);
        std::memcpy(&bytes[i * 8], &x, 8);
        break;
      }
      case DType::kU8:
      case DType::kBool:
        bytes[i] = static_cast<uint8_t>(v);
        break;
    }
  }
  EXPECT_TRUE(be.CopyFromHost(bytes.data(), bytes.size(), *t).ok());
  return std::move(*t);
}

inline std::vector<unsigned char> RawBytes(Backend& be, const Tensor& t) {
  std::vector<unsigned char> bytes(t.nbytes());
  EXPECT_TRUE(be.CopyToHost(t, bytes.data(), bytes.size()).ok());
  return bytes;
}

// Decodes fp16 bits from the definition: (-1)^s * 2^(e-15) * (1 + m/1024),
// subnormals 2^-24 * m.
inline double RefDecodeHalf(uint16_t bits) {
  const int s = bits >> 15;
  const int e = (bits >> 10) & 0x1f;
  const int m = bits & 0x3ff;
  double v;
  if (e == 0x1f) {
    v = m == 0 ? INFINITY : NAN;
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else {
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  }
  return s ? -v : v;
}
inline double RefDecodeBf16(uint16_t bits) {
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline std::vector<double> ReadTensor(Backend& be, const Tensor& t) {
  std::vector<unsigned char> bytes = RawBytes(be, t);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    switch (t.dtype()) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, &bytes[i * 4], 4);
        out[i] = f;
        break;
      }
      case DType::kF16: {
        uint16_t b;
        std::memcpy(&b, &bytes[i * 2], 2);
        out[i] = RefDecodeHalf(b);
        break;
      }
      case DType::kBF16: {
        uint16_t b;
        std::memcpy(&b, &bytes[i * 2], 2);
        out[i] = RefDecodeBf16(b);
        break;
      }
      case DType::kI32: {
        int32_t x;
        std::memcpy(&x, &bytes[i * 4], 4);
        out[i] = x;
        break;
      }
      case DType::kI64: {
        int64_t x;
        std::memcpy(&x, &bytes[i * 8], 8);
        out[i] = static_cast<double>(x);
        break;
      }
      case DType::kU8:
      case DType::kBool:
        out[i] = static_cast<double>(bytes[i]);
        break;
    }
  }
  return out;
}

// n values uniform in [lo, hi), rounded to dtype so they are storable.
inline std::vector<double> RandomValues(std::mt19937_64& rng, DType dtype, size_t n, double lo,
                                        double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = RefStore(dtype, RefF32(dist(rng)));
  return v;
}

inline const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

inline void ExpectInvalid(const absl::Status& s) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace ampd::kernels::testing
