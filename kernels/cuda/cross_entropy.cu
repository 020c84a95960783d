// CrossEntropyLoss on the device, in fp32:
//   row loss = log(sum exp(x - max)) - (x[label] - max)   (max-shifted)
//   loss = multiplier * (sum of row losses * (1/N))
//   dlogits = ((multiplier * (1/N)) (exp(x - max) * (1/sum) - onehot)) * grad_scale
// in the CPU oracle's operation order (the scale last, so a scale near
// float32's top cannot turn a zero gradient into inf * 0 = NaN). dlogits may
// alias logits. Each row is read once and written once by the row engine
// (cross_entropy_rows.cuh, which fixes the order of a row's sum). Row
// losses are summed per block in a fixed order (the grid depends only on
// N and V), then by one block, so the loss is reproducible. A label outside
// [0, V) sets kErrorCrossEntropyLabel (reported by the backend at the next
// Synchronize/CopyToHost); its row contributes 0 and gets a zero gradient.
#include "kernels/cuda/cross_entropy_rows.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/loss_common.cuh"

namespace ampd::kernels::cuda {

absl::Status LaunchCrossEntropy(const void* logits, DType dtype, const void* labels,
                                DType label_dtype, int64_t rows, int64_t vocab, float multiplier,
                                float grad_scale, float* loss, void* dlogits, float* partials,
                                int* error_flags, cudaStream_t stream) {
  // Reciprocals as the CPU oracle multiplies by them (kernels/cpu/cross_entropy.cc).
  const float inv_rows = 1.0f / static_cast<float>(rows);
  xent::RowArgs args{};
  args.logits = logits;
  args.dlogits = dlogits;
  args.labels = labels;
  args.label_dtype = label_dtype;
  args.rows = rows;
  args.vocab = vocab;
  args.coef = multiplier * inv_rows;
  args.temperature = 1.0f;  // the mean loss reads the logits as they are
  args.grad_scale = grad_scale;
  args.loss = partials;
  args.error_flags = error_flags;
  const int blocks = DispatchFloat(dtype, [&](auto tag) {
    return xent::LaunchRows<decltype(tag), /*kChunk=*/false>(args, kMaxReductionBlocks, stream);
  });
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  finalize_loss_kernel<><<<1, kThreads, 0, stream>>>(partials, blocks, inv_rows, multiplier, loss);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
