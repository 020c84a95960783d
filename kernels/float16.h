// IEEE 754 binary16 (fp16) and bfloat16 conversions on the host, bit-exact.
//
// These are the rounding rules every backend must reproduce: float -> fp16
// and float -> bf16 round to nearest, ties to even, on every store; fp16
// overflows to inf above 65504 (precisely: at or above 65520, the halfway
// point to the next power of two); fp16 keeps subnormals down to 2^-24; NaN
// stays NaN (quiet) with its sign. The CPU backend uses them for every store,
// which is what makes it the oracle the CUDA backend is compared with.
#pragma once

#include <bit>
#include <cstdint>

namespace ampd::kernels {

constexpr float kF16Max = 65504.0f;
constexpr float kF16MinSubnormal = 5.9604644775390625e-08f;  // 2^-24
constexpr float kF16MinNormal = 6.103515625e-05f;            // 2^-14

constexpr uint16_t FloatToHalfBits(float value) {
  const uint32_t f = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
  const uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x38800000u && abs < 0x477ff000u) {
    // Normal fp16 range, by far the common case, tested first so that the
    // CPU backend's stores take one well-predicted branch: rebias the
    // exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest
    // even by adding 0xfff plus the kept lsb; a carry into the exponent is
    // the correct next binade, and below 65520 it never reaches inf.
    const uint32_t rebased = abs - (112u << 23);
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  if (abs > 0x7f800000u) {  // NaN: keep it quiet, keep the top payload bits.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // >= 65520 (the tie between 65504 and 65536 goes to even, i.e. inf) and inf.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  // Below 2^-14: fp16 subnormal (or zero). Shift the 24-bit significand
  // (implicit one included) right so that its unit is 2^-24, rounding to
  // nearest even on the bits shifted out.
  if (abs < 0x33000000u) return sign;  // below 2^-25: rounds to zero (2^-25 is a tie to 0)
  const uint32_t exponent = abs >> 23;
  const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24 for exponents 112..102
  const uint32_t rounded_down = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  uint32_t result = rounded_down;
  if (remainder > halfway || (remainder == halfway && (rounded_down & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

constexpr float HalfBitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) {  // inf or NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * kF16MinSubnormal;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

constexpr uint16_t FloatToBf16Bits(float value) {
  const uint32_t f = std::bit_cast<uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet it, keep sign
    return static_cast<uint16_t>((f >> 16) | 0x0040u);
  }
  // Round to nearest even on the low 16 bits; overflow past bf16's largest
  // finite value carries into the exponent and correctly yields inf.
  const uint32_t rounding_bias = 0x7fffu + ((f >> 16) & 1u);
  return static_cast<uint16_t>((f + rounding_bias) >> 16);
}

constexpr float Bf16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Value after one store to fp16 / bf16: what a kernel writing that dtype keeps.
constexpr float RoundToHalf(float value) { return HalfBitsToFloat(FloatToHalfBits(value)); }
constexpr float RoundToBf16(float value) { return Bf16BitsToFloat(FloatToBf16Bits(value)); }

}  // namespace ampd::kernels
