// GatherScalars: the device half of ReadBack, the step's one host read. The
// scalars the step reads back (loss sum, found_inf, norm_sq, ...) live in separate
// one-element tensors, and the device error word beside them; one tiny
// kernel copies them all into one contiguous device block, so that a single
// device-to-host copy (one DMA, one synchronisation) brings them home. The
// alternative, one cudaMemcpyAsync per scalar, costs a copy-engine launch
// each, and reading the word from mapped host memory costs every block that
// consults it a PCIe round trip.
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

__global__ void gather_scalars_kernel(GatherScalarsArgs args, float* out) {
  // out (count + 1): out[i] = *src[i]; out[count] holds the error word's
  // bits when this launch carries the word (the last of a long list).
  const int i = static_cast<int>(threadIdx.x);
  if (i < args.count) out[i] = *args.src[i];
  if (i == args.count && args.error_word != nullptr) out[i] = __int_as_float(*args.error_word);
}

}  // namespace

absl::Status LaunchGatherScalars(const GatherScalarsArgs& args, float* out, cudaStream_t stream) {
  // One warp covers kMaxGatherScalars + 1 slots.
  gather_scalars_kernel<<<1, 32, 0, stream>>>(args, out);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
