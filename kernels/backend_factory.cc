// Device-string parsing and backend selection.
#include "kernels/backend_factory.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#ifdef AMPD_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace ampd::kernels {

int CudaDeviceCount() {
#ifdef AMPD_HAVE_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device) {
  if (device == "cpu") return CreateCpuBackend();
  if (device == "auto") {
    if (CudaDeviceCount() > 0) return CreateBackend("cuda:0");
    return CreateCpuBackend();
  }
  if (device == "cuda" || absl::StartsWith(device, "cuda:")) {
    int index = 0;
    if (device != "cuda" && !absl::SimpleAtoi(device.substr(5), &index)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device \"", device, "\": expected cuda:N with N a device index"));
    }
#ifdef AMPD_HAVE_CUDA
    const int count = CudaDeviceCount();
    if (index < 0 || index >= count) {
      return absl::FailedPreconditionError(absl::StrCat("device \"", device, "\" requested but ",
                                                        count, " CUDA device(s) are visible"));
    }
    return cuda::CreateCudaBackend(index);
#else
    return absl::FailedPreconditionError(absl::StrCat(
        "device \"", device, "\" requested but this ampd was built without the CUDA backend"));
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device \"", device, "\": expected auto, cpu, cuda or cuda:N"));
}

}  // namespace ampd::kernels
