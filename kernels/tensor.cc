// Tensor bookkeeping: reshape checks and printable names.
#include "kernels/tensor.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace ampd::kernels {

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
