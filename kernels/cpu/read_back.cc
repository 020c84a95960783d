// ReadBack: the step's one host read. On the CPU the tensors already live in
// host memory and every op has finished when it returns, so the read is a
// plain copy of each scalar and each HostCopy's bytes.
#include <cstring>

#include "kernels/cpu/cpu_internal.h"

namespace ampd::kernels::cpu {

absl::Status ReadBack(absl::Span<const Tensor* const> scalars, absl::Span<float> out,
                      absl::Span<const HostCopy> copies) {
  // Every operand is checked before any is read, so a bad call leaves out
  // untouched.
  if (absl::Status s = ValidateReadBack(scalars, out.size(), copies); !s.ok()) return s;
  for (size_t i = 0; i < scalars.size(); ++i) out[i] = scalars[i]->data_as<float>()[0];
  for (const HostCopy& c : copies) {
    if (c.bytes > 0) std::memcpy(c.dst, c.src->data(), c.bytes);
  }
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cpu
