#include "kernels/cuda/cuda_backend.h"
#include <cuda_runtime.h>
namespace ampd::kernels::cuda {
int DeviceCount() { int n = 0; if (cudaGetDeviceCount(&n) != cudaSuccess) return 0; return n; }
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int) { return absl::UnimplementedError("x"); }
}
