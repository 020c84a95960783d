// Tensor: an owning, move-only block of backend memory with a dtype and a
// row-major shape. The memory belongs to the backend that allocated it (host
// RAM for the CPU backend, device memory for CUDA) and is returned to it when
// the tensor dies; the engine never frees anything by hand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/shape.h"
#include "kernels/dtype.h"

namespace ampd::kernels {

// Shapes are the codec's, as dtypes are (kernels/dtype.h).
using codec::NumElements;
using codec::Shape;
using codec::ShapeToString;

// One allocation; each backend supplies its own, whose destructor frees it.
class Memory {
 public:
  virtual ~Memory() = default;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::unique_ptr<Memory> memory, DType dtype, Shape shape);
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  bool empty() const { return memory_ == nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[static_cast<size_t>(i < 0 ? rank() + i : i)]; }
  int64_t numel() const { return NumElements(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * SizeOf(dtype_); }

  // Backend memory: dereference only on the backend that owns it.
  void* data() { return memory_ ? memory_->data() : nullptr; }
  const void* data() const { return memory_ ? memory_->data() : nullptr; }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data());
  }

  // Same bytes, new shape of the same element count (no copy).
  absl::Status Reshape(Shape shape);

  // A tensor of `shape` over this one's elements [offset, offset + numel):
  // same dtype, no copy, nothing freed when it dies. It aliases this tensor's
  // memory, so it must not outlive it; ops may write through it (a row block
  // of a workspace, the first T rows of a positional table). InvalidArgument
  // when the range falls outside this tensor.
  absl::StatusOr<Tensor> View(int64_t offset, const Shape& shape) const;

  std::string DebugString() const;  // "F16(4, 8)"

 private:
  std::unique_ptr<Memory> memory_;
  DType dtype_ = DType::kF32;
  Shape shape_;
};

}  // namespace ampd::kernels
