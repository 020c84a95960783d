// CrossEntropyChunk on the device, fully fused and with no host
// involvement: the row engine (cross_entropy_rows.cuh) reads each row once
// (the max, the sum of exp(z - max) and the gradient all from registers,
// for V up to 65536 fp16/bf16 or 32768 fp32), writes
// grad_scale * (softmax - onehot) rounded once to the dtype (in place when
// dlogits is logits), and each row's loss_scale * (log(sum) - (z[label] -
// max)) joins its block's partial sum; one block then adds the partials,
// in block order, into loss[0] (which the chunks of a step accumulate).
// Nothing is added atomically, so a step's loss is the same bits from run
// to run (the grid depends only on rows and V).
// A row labelled ignore_index gets a zero gradient and adds nothing; a label
// outside [0, V) otherwise sets kErrorCrossEntropyChunkLabel in the
// backend's error word (reported at the step's read-back), and its row is
// treated as ignored. The loss is the CPU oracle's sum of the same per-row
// terms, added in another (fixed) order. With token-loss terms a row's
// term (kernels/token_loss.h) replaces its loss and its coefficient joins
// grad_scale, in the row engine, which also writes each row's log-prob and
// what it added to loss when asked (terms.logprobs, terms.token_losses).
// At terms.temperature the row engine reads logits / T. LabelLogprobs is
// the same row engine with no dlogits: the log-probs alone, the same bits.
#include "kernels/cuda/cross_entropy_rows.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/loss_common.cuh"

namespace ampd::kernels::cuda {

absl::Status LaunchCrossEntropyChunk(const void* logits, DType dtype, const void* labels,
                                     DType label_dtype, int64_t rows, int64_t vocab,
                                     int64_t ignore_index, const TokenLossTerms& terms,
                                     float loss_scale, float grad_scale, float* loss, void* dlogits,
                                     float* partials, int* error_flags, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  xent::RowArgs args{};
  args.logits = logits;
  args.dlogits = dlogits;
  args.labels = labels;
  args.label_dtype = label_dtype;
  args.rows = rows;
  args.vocab = vocab;
  args.ignore_index = ignore_index;
  args.grad_scale = grad_scale;
  args.loss_scale = loss_scale;
  args.loss = partials;  // (blocks) F32: each block's sum of its rows' terms
  args.error_flags = error_flags;
  args.token_kind = terms.kind;
  auto row_input = [](const Tensor* t) -> const float* {
    return t == nullptr ? nullptr : t->data_as<float>();
  };
  args.weights = row_input(terms.weights);
  args.advantages = row_input(terms.advantages);
  args.sampling_logprobs = row_input(terms.sampling_logprobs);
  args.clip_low = terms.clip_low;
  args.clip_high = terms.clip_high;
  args.beta = terms.beta;
  args.temperature = terms.temperature;
  auto row_output = [](Tensor* t) -> float* {
    return t == nullptr ? nullptr : t->data_as<float>();
  };
  args.logprobs = row_output(terms.logprobs);
  args.token_losses = row_output(terms.token_losses);
  const int blocks = DispatchFloat(dtype, [&](auto tag) {
    return xent::LaunchRows<decltype(tag), /*kChunk=*/true>(args, kMaxReductionBlocks, stream);
  });
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  accumulate_loss_kernel<><<<1, kThreads, 0, stream>>>(partials, blocks, loss);
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

absl::Status LaunchLabelLogprobs(const void* logits, DType dtype, const void* labels,
                                 DType label_dtype, int64_t rows, int64_t vocab,
                                 int64_t ignore_index, float temperature, float* logprobs,
                                 float* partials, int* error_flags, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  xent::RowArgs args{};
  args.logits = logits;
  args.dlogits = nullptr;  // no gradient
  args.labels = labels;
  args.label_dtype = label_dtype;
  args.rows = rows;
  args.vocab = vocab;
  args.ignore_index = ignore_index;
  args.loss = partials;  // written, never added anywhere
  args.error_flags = error_flags;
  args.token_kind = TokenLossKind::kCrossEntropy;
  args.temperature = temperature;
  args.logprobs = logprobs;
  DispatchFloat(dtype, [&](auto tag) {
    return xent::LaunchRows<decltype(tag), /*kChunk=*/true>(args, kMaxReductionBlocks, stream);
  });
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
