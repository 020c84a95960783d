// HostTensor: a tensor's bytes in host memory, little-endian, row-major, as
// they arrive in a Step request and leave in a state dict. The engine copies
// them to the backend; nothing here knows about devices or protobuf.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace ampd::engine {

struct HostTensor {
  kernels::DType dtype = kernels::DType::kF32;
  kernels::Shape shape;
  std::string data;  // NumElements(shape) * SizeOf(dtype) bytes

  // InvalidArgument naming `what` when the byte length does not match the
  // shape and dtype, or a dim is negative.
  absl::Status Validate(absl::string_view what) const;
};

}  // namespace ampd::engine
