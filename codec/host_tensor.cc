// Byte-length and shape checks for tensors received from clients.
#include "codec/host_tensor.h"

#include <sys/mman.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"

namespace ampd::codec {

absl::Status HostTensor::Validate(absl::string_view what) const {
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension in shape ", ShapeToString(shape)));
    }
  }
  // Checked: a shape whose element or byte count wraps (2^62 x 4 wraps to
  // 0) would otherwise match an empty buffer and reach the allocators.
  int64_t elements = 1;
  int64_t bytes = 0;
  for (int64_t d : shape) {
    if (!CheckedMul(elements, d, &elements)) elements = -1;
    if (elements < 0) break;
  }
  if (elements < 0 || !CheckedMul(elements, static_cast<int64_t>(SizeOf(dtype)), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape ", ShapeToString(shape), " has more than 2^63 bytes"));
  }
  const auto expected = static_cast<size_t>(bytes);
  if (data.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", DTypeName(dtype),
                                                   ShapeToString(shape), " needs ", expected,
                                                   " bytes but ", data.size(), " were sent"));
  }
  return absl::OkStatus();
}

void ReserveForBulkCopy(std::string* buffer, size_t bytes) {
  constexpr size_t kMinBytes = size_t{16} << 20;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  if (bytes <= buffer->capacity()) return;
  buffer->reserve(bytes);
  if (bytes < kMinBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(buffer->data());
  const uintptr_t first = (begin + buffer->size() + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
  // A hint: where the kernel declines, the buffer works as before.
  if (last > first) {
    (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
}

void ResizeForBulkCopy(std::string* buffer, size_t bytes) {
  if (bytes > buffer->size()) ReserveForBulkCopy(buffer, bytes);
  buffer->resize(bytes);
}

}  // namespace ampd::codec
