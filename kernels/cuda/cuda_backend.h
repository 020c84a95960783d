#pragma once
#include <memory>
#include "absl/status/statusor.h"
#include "kernels/backend.h"
namespace ampd::kernels::cuda {
int DeviceCount();
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);
}
