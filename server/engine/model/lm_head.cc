// LmHeadLoss, its chunks and their extents, and TokenLossState (lm_head.h).
#include "server/engine/model/lm_head.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status TokenLossState::Load(kernels::Backend& backend, const TokenLossInputs& tokens,
                                  int64_t rows) {
  loss_fn = tokens.fn;
  auto load = [&](const HostTensor* host, Row& row) -> absl::Status {
    row.live = host != nullptr;
    if (!row.live) return absl::OkStatus();
    AMPD_RETURN_IF_ERROR(EnsureTensor(backend, kernels::DType::kF32, {rows}, row.all));
    return backend.CopyFromHost(host->data.data(), host->data.size(), row.all);
  };
  AMPD_RETURN_IF_ERROR(load(tokens.weights, weights));
  AMPD_RETURN_IF_ERROR(load(tokens.advantages, advantages));
  AMPD_RETURN_IF_ERROR(load(tokens.sampling_logprobs, sampling_logprobs));
  // The head's per-token outputs, when asked for.
  auto output = [&](bool wanted, Row& row) -> absl::Status {
    row.live = wanted;
    if (!row.live) return absl::OkStatus();
    return EnsureTensor(backend, kernels::DType::kF32, {rows}, row.all);
  };
  AMPD_RETURN_IF_ERROR(output(tokens.logprobs, logprobs));
  return output(tokens.token_losses, token_losses);
}

absl::StatusOr<kernels::TokenLossTerms> TokenLossState::ChunkTerms(int64_t start, int64_t r) {
  kernels::TokenLossTerms terms;
  switch (loss_fn.kind) {
    case LossFnKind::kModel:
    case LossFnKind::kCrossEntropy:
      terms.kind = kernels::TokenLossKind::kCrossEntropy;
      break;
    case LossFnKind::kImportanceSampling:
      terms.kind = kernels::TokenLossKind::kImportanceSampling;
      break;
    case LossFnKind::kPpo:
      terms.kind = kernels::TokenLossKind::kPpo;
      break;
    case LossFnKind::kCispo:
      terms.kind = kernels::TokenLossKind::kCispo;
      break;
    case LossFnKind::kDro:
      terms.kind = kernels::TokenLossKind::kDro;
      break;
  }
  if (terms.kind == kernels::TokenLossKind::kPpo || terms.kind == kernels::TokenLossKind::kCispo) {
    terms.clip_low = loss_fn.clip_low();
    terms.clip_high = loss_fn.clip_high();
  }
  terms.beta = loss_fn.beta();
  terms.temperature = loss_fn.logit_temperature();
  // The chunk's view of a row this batch carries (null otherwise).
  auto view = [&](Row& row) -> absl::StatusOr<Tensor*> {
    if (!row.live) return nullptr;
    AMPD_ASSIGN_OR_RETURN(row.chunk, row.all.View(start, {r}));
    return &row.chunk;
  };
  AMPD_ASSIGN_OR_RETURN(terms.weights, view(weights));
  AMPD_ASSIGN_OR_RETURN(terms.advantages, view(advantages));
  AMPD_ASSIGN_OR_RETURN(terms.sampling_logprobs, view(sampling_logprobs));
  AMPD_ASSIGN_OR_RETURN(terms.logprobs, view(logprobs));
  AMPD_ASSIGN_OR_RETURN(terms.token_losses, view(token_losses));
  return terms;
}

int64_t LmHeadChunkRows(int64_t vocab, Precision precision, int64_t rows, int64_t chunk_bytes) {
  const int64_t n = std::max<int64_t>(rows, 1);
  const auto element = static_cast<int64_t>(kernels::SizeOf(WorkingDType(precision)));
  const int64_t row_bytes = std::max<int64_t>(SaturatingMul(vocab, element), 1);
  const int64_t most = std::clamp<int64_t>(chunk_bytes / row_bytes, 1, n);
  const int64_t chunks = (n + most - 1) / most;
  // ceil(n / chunks) <= most, and chunks - 1 of them fall short of n, so
  // the rows still take exactly `chunks` chunks.
  return (n + chunks - 1) / chunks;
}

void AddLmHeadExtents(int64_t vocab, int64_t width, Precision precision, int64_t rows,
                      int64_t chunk_bytes, bool with_grad, kernels::ScratchExtents& e) {
  const int64_t r = LmHeadChunkRows(vocab, precision, rows, chunk_bytes);
  const int64_t logits = SaturatingMul(r, vocab);    // (R, V)
  const int64_t h = SaturatingMul(r, width);         // (R, C)
  const int64_t head = SaturatingMul(vocab, width);  // (V, C)
  e.gemm_a = std::max({e.gemm_a, h, with_grad ? logits : 0});
  e.gemm_b = std::max({e.gemm_b, head, with_grad ? h : 0});
  e.gemm_c = std::max({e.gemm_c, logits, with_grad ? head : 0});
  e.classes = std::max(e.classes, vocab);
  // The loss's rows: a chunk's at a time, but the CPU backend also reads
  // rows as the blocks' GEMMs' M (its BLAS panels), which is all N.
  e.rows = std::max(e.rows, rows);
}

int64_t TokenIdAt(const HostTensor& ids, int64_t i) {
  if (ids.dtype == kernels::DType::kI32) {
    int32_t x = 0;
    std::memcpy(&x, ids.data.data() + i * 4, 4);
    return x;
  }
  int64_t v = 0;
  std::memcpy(&v, ids.data.data() + i * 8, 8);
  return v;
}

namespace {

int64_t CountKept(const HostTensor& targets) {
  const int64_t n = kernels::NumElements(targets.shape);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) kept += TokenIdAt(targets, i) != kIgnoreIndex ? 1 : 0;
  return kept;
}

}  // namespace

absl::Status LoadTokenBatch(kernels::Backend& backend, const HostTensor& inputs,
                            const HostTensor& targets, const TokenLossInputs& tokens,
                            LmWorkspace& ws) {
  const kernels::Shape& shape = ws.shape();
  if (inputs.shape != shape || targets.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: ", kernels::ShapeToString(inputs.shape), " and targets ",
                     kernels::ShapeToString(targets.shape), " do not match the workspace's ",
                     kernels::ShapeToString(shape)));
  }
  ws.kept = CountKept(targets);
  AMPD_RETURN_IF_ERROR(EnsureTensor(backend, inputs.dtype, {ws.rows}, ws.ids));
  AMPD_RETURN_IF_ERROR(backend.CopyFromHost(inputs.data.data(), inputs.data.size(), ws.ids));
  AMPD_RETURN_IF_ERROR(EnsureTensor(backend, targets.dtype, {ws.rows}, ws.targets));
  AMPD_RETURN_IF_ERROR(backend.CopyFromHost(targets.data.data(), targets.data.size(), ws.targets));
  return ws.tokens.Load(backend, tokens, ws.rows);
}

absl::Status LmLogits(kernels::Backend& b, const Tensor& h, const Parameter& head, Tensor& logits) {
  return b.Gemm(false, true, 1.0f, h, head.value(), 0.0f, logits);
}

absl::Status LmHeadLoss(kernels::Backend& b, LmWorkspace& ws, Parameter& head,
                        float head_grad_alpha, float multiplier, float grad_scale, bool with_grad,
                        bool first_micro_batch, Tensor& loss) {
  if (ws.kept <= 0) {
    return absl::FailedPreconditionError("targets: no target to average over (LoadBatch first)");
  }
  const int64_t c = ws.ln_f.dim(1);
  const int64_t v = head.value().dim(0);
  // The model's own loss is the mean over kept targets; a token loss the
  // sum over them.
  const double per_target =
      static_cast<double>(multiplier) / (ws.tokens.summed() ? 1.0 : static_cast<double>(ws.kept));
  const auto loss_scale = static_cast<float>(per_target);
  const auto logit_grad_scale = static_cast<float>(static_cast<double>(grad_scale) * per_target);
  AMPD_RETURN_IF_ERROR(b.Fill(loss, 0.0f));
  // The F32 sum (several 16-bit chunks) starts afresh at the first chunk;
  // without it the chunk, or the fp32 chunks, go straight into the
  // gradient: the first of them writes it on the update's first
  // micro-batch (it holds ZeroGrads' zeros, so beta = 0 gives the values
  // beta = 1 would without reading them) and every other adds to it.
  const bool summed_head = !ws.head_grad.empty();
  Tensor& head_sum = summed_head ? ws.head_grad : head.grad;
  const bool fresh = summed_head || first_micro_batch;
  auto sum_beta = [fresh](int64_t start) { return fresh && start == 0 ? 0.0f : 1.0f; };
  for (int64_t start = 0; start < ws.rows; start += ws.chunk_rows) {
    const int64_t r = std::min(ws.chunk_rows, ws.rows - start);
    AMPD_ASSIGN_OR_RETURN(const Tensor h, ws.ln_f.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(Tensor dh, ws.d_ln.View(start * c, {r, c}));
    AMPD_ASSIGN_OR_RETURN(const Tensor labels, ws.targets.View(start, {r}));
    AMPD_ASSIGN_OR_RETURN(Tensor logits, ws.logits.View(0, {r, v}));
    AMPD_RETURN_IF_ERROR(LmLogits(b, h, head, logits));
    AMPD_ASSIGN_OR_RETURN(const kernels::TokenLossTerms terms, ws.tokens.ChunkTerms(start, r));
    AMPD_RETURN_IF_ERROR(b.CrossEntropyChunk(logits, labels, kIgnoreIndex, terms, loss_scale,
                                             logit_grad_scale, loss, logits));
    if (!with_grad) continue;
    AMPD_RETURN_IF_ERROR(b.Gemm(false, false, 1.0f, logits, head.value(), 0.0f, dh));
    // A frozen head (a LoRA job's) passes dh down and forms no gradient.
    if (head.frozen) continue;
    AMPD_RETURN_IF_ERROR(
        b.Gemm(true, false, head_grad_alpha, logits, h, sum_beta(start), head_sum));
  }
  if (with_grad && summed_head && !head.frozen) {
    AMPD_RETURN_IF_ERROR(b.Add(ws.head_grad, head.grad));
  }
  return absl::OkStatus();
}

absl::StatusOr<const Tensor*> TokenLogprobsOf(LmWorkspace& ws) {
  if (!ws.tokens.logprobs.live) {
    return absl::FailedPreconditionError("logprobs: LoadBatch did not ask for them");
  }
  return &ws.tokens.logprobs.all;
}

absl::StatusOr<const Tensor*> TokenLossesOf(LmWorkspace& ws) {
  if (!ws.tokens.token_losses.live) {
    return absl::FailedPreconditionError("token_losses: LoadBatch did not ask for them");
  }
  return &ws.tokens.token_losses.all;
}

}  // namespace ampd::engine::model
