// Tensor bookkeeping: element counts, reshape checks and printable names.
#include "kernels/tensor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ampd::kernels {

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

Tensor::Tensor(std::unique_ptr<Memory> memory, DType dtype, Shape shape)
    : memory_(std::move(memory)), dtype_(dtype), shape_(std::move(shape)) {}

absl::Status Tensor::Reshape(Shape shape) {
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot reshape ", DebugString(), " to ", ShapeToString(shape), ": element counts differ"));
  }
  shape_ = std::move(shape);
  return absl::OkStatus();
}

std::string Tensor::DebugString() const {
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_));
}

}  // namespace ampd::kernels
