// Element types a tensor can hold, their sizes and names: the dtypes of the
// wire's tensors, of safetensors files and of every backend's memory, which
// are one list so no layer converts between them. Header-only and
// dependency-free but for absl, so ampctl and the kernels both include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace ampd::codec {

enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kI64 };

constexpr size_t SizeOf(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI64:
      return 8;
  }
  return 0;
}

constexpr bool IsFloating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// Names as safetensors spells them ("F32", "F16", "BF16", "I32", "I64").
constexpr absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
  }
  return "?";
}

constexpr std::optional<DType> DTypeFromName(absl::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kI32, DType::kI64}) {
    if (DTypeName(d) == name) return d;
  }
  return std::nullopt;
}

}  // namespace ampd::codec
