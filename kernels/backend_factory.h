// Chooses and creates a Backend from a device string, as `ampd --device=`
// and the tests spell it.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace ampd::kernels {

// "cpu", "cuda" (device 0), "cuda:N", or "auto" (the first GPU when one is
// present and the CUDA backend was built, else the CPU). Each call returns a
// new backend with its own stream; backends on one GPU share its memory pool.
// Asking for CUDA where it is absent is FailedPrecondition, saying why.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device);

// Number of usable CUDA devices (0 without the CUDA backend or a GPU).
int CudaDeviceCount();

}  // namespace ampd::kernels
