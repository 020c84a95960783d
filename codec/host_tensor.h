// HostTensor: a tensor's bytes in host memory, little-endian, row-major, as
// they travel in a Step request, a batch file or a state dict. ampctl builds
// them from files, the engine copies them to a backend; nothing here knows
// about devices or protobuf.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "codec/dtype.h"
#include "codec/shape.h"

namespace ampd::codec {

struct HostTensor {
  DType dtype = DType::kF32;
  Shape shape;
  std::string data;  // NumElements(shape) * SizeOf(dtype) bytes

  // InvalidArgument naming `what` when the byte length does not match the
  // shape and dtype, or a dim is negative.
  absl::Status Validate(absl::string_view what) const;
};

// Resizes *buffer to `bytes` for a bulk copy of a tensor or a file into it.
// Buffers of 16 MiB and more are first reserved and their 2 MiB-aligned
// interior marked for transparent huge pages before anything touches it:
// faulting in a fresh state dict 4 KiB at a time costs more than copying it.
// The new bytes are zero, as with std::string::resize.
void ResizeForBulkCopy(std::string* buffer, size_t bytes);
// Reserves room for `bytes` in *buffer (its size unchanged), with the same
// huge-page hint, for a buffer filled by appends as its bytes arrive: no
// page is touched before its bytes are written.
void ReserveForBulkCopy(std::string* buffer, size_t bytes);

}  // namespace ampd::codec
