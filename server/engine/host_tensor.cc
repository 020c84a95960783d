// Byte-length and shape checks for tensors received from clients.
#include "server/engine/host_tensor.h"

#include "absl/strings/str_cat.h"

namespace ampd::engine {

absl::Status HostTensor::Validate(absl::string_view what) const {
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension in shape ", kernels::ShapeToString(shape)));
    }
  }
  const size_t expected = static_cast<size_t>(kernels::NumElements(shape)) * kernels::SizeOf(dtype);
  if (data.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", kernels::DTypeName(dtype), kernels::ShapeToString(shape),
                     " needs ", expected, " bytes but ", data.size(), " were sent"));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine
