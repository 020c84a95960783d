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

namespace {

// Memory a view borrows from the tensor it was cut from.
class BorrowedMemory final : public Memory {
 public:
  BorrowedMemory(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_;
  size_t bytes_;
};

}  // namespace

absl::StatusOr<Tensor> Tensor::View(int64_t offset, const Shape& shape) const {
  const int64_t count = NumElements(shape);
  if (empty() || offset < 0 || count < 0 || offset > numel() || count > numel() - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot view ", ShapeToString(shape), " at ", offset, " of ", DebugString()));
  }
  const size_t element = SizeOf(dtype_);
  // Views let ops write through a const tensor's storage by design: the
  // const only says this call does not change the tensor's own bookkeeping.
  char* base = static_cast<char*>(const_cast<Memory&>(*memory_).data());
  return Tensor(std::make_unique<BorrowedMemory>(base + static_cast<size_t>(offset) * element,
                                                 static_cast<size_t>(count) * element),
                dtype_, shape);
}

std::string Tensor::DebugString() const {
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_));
}

}  // namespace ampd::kernels
