// CrossEntropyChunk on the device, fully fused and with no host
// involvement: the row engine (cross_entropy_rows.cuh) reads each row once
// (the max, the sum of exp(z - max) and the gradient all from registers,
// for V up to 65536 fp16/bf16 or 32768 fp32), writes
// grad_scale * (softmax - onehot) rounded once to the dtype (in place when
// dlogits is logits), and the row's first thread adds
// loss_scale * (log(sum) - (z[label] - max)) into loss[0] with one fp32
// atomicAdd.
// A row labelled ignore_index gets a zero gradient and adds nothing; a label
// outside [0, V) otherwise sets kErrorCrossEntropyChunkLabel in the
// backend's error word (reported at the step's read-back), and its row is
// treated as ignored. The loss is the CPU oracle's sum of the same per-row
// terms, added in the order the rows finish. With token-loss terms a row's
// term (kernels/token_loss.h) replaces its loss and its coefficient joins
// grad_scale, in the row engine, which also writes each row's log-prob and
// what it added to loss when asked (terms.logprobs, terms.token_losses).
#include "kernels/cuda/cross_entropy_rows.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = int64_t{1} << 20;  // rows beyond are grid-strided

}  // namespace

absl::Status LaunchCrossEntropyChunk(const void* logits, DType dtype, const void* labels,
                                     DType label_dtype, int64_t rows, int64_t vocab,
                                     int64_t ignore_index, const TokenLossTerms& terms,
                                     float loss_scale, float grad_scale, float* loss, void* dlogits,
                                     int* error_flags, cudaStream_t stream) {
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
  args.loss = loss;
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
  auto row_output = [](Tensor* t) -> float* {
    return t == nullptr ? nullptr : t->data_as<float>();
  };
  args.logprobs = row_output(terms.logprobs);
  args.token_losses = row_output(terms.token_losses);
  DispatchFloat(dtype, [&](auto tag) {
    return xent::LaunchRows<decltype(tag), /*kChunk=*/true>(args, kMaxRowBlocks, stream);
  });
  AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
  return absl::OkStatus();
}

}  // namespace ampd::kernels::cuda
