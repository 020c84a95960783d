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

// kU8 and kBool exist for files that carry them beside a model's weights
// (Hugging Face GPT-2's attn.bias causal-mask buffer, saved as U8 or BOOL
// by some versions): a state dict decodes them, and the engine drops the
// buffers it knows and refuses any other tensor of them by name. No
// backend op takes them, and the wire has no dtype for them.
enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kI64, kU8, kBool };

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
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

constexpr bool IsFloating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// Names as safetensors spells them ("F32", "F16", "BF16", "I32", "I64",
// "U8", "BOOL").
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
    case DType::kU8:
      return "U8";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

constexpr std::optional<DType> DTypeFromName(absl::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kI32, DType::kI64, DType::kU8,
                  DType::kBool}) {
    if (DTypeName(d) == name) return d;
  }
  return std::nullopt;
}

}  // namespace ampd::codec
