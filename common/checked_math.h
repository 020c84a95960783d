// Overflow-checked int64 arithmetic for sizes computed from client input
// (shapes, element and parameter counts, byte counts). A wrapped product is
// how a request for 2^63 parameters turns into a small number that passes a
// memory limit; every such size is computed here before anything is
// allocated. Header-only; every layer may use it.
#pragma once

#include <cstdint>
#include <limits>

namespace ampd {

// *out = a * b; false (and *out unspecified) when the product overflows int64.
inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// *out = a + b; false (and *out unspecified) when the sum overflows int64.
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

// a * b and a + b for non-negative operands, saturating at INT64_MAX: for
// estimates compared with a limit, where "too large to represent" must
// still compare as too large.
inline int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t out = 0;
  return CheckedMul(a, b, &out) ? out : std::numeric_limits<int64_t>::max();
}
inline int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  return CheckedAdd(a, b, &out) ? out : std::numeric_limits<int64_t>::max();
}

}  // namespace ampd
