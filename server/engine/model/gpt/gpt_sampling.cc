// GptModel's sampling (network.h): the KV cache of every layer's keys and
// values, filled from the prompts' training forward (Prefill) and by each
// decode step, whose rows run BlockForward, the code Forward runs, with the
// attention of each row's new query over its cached keys.
#include <array>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/gpt/gpt_model.h"
#include "server/engine/model/gpt/gpt_workspace.h"
#include "server/engine/model/kv_cache.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

// A GPT's DecodeState: the cache and one decode step's buffers over its S
// rows (C = d_model, H = mlp_ratio C).
struct GptDecodeState : DecodeState {
  KvCache cache;            // per layer (S, max_len, C)
  std::array<Tensor, 2> x;  // (S, C) the residual stream, in turn
  Tensor position_rows;     // (S, C) wpe[positions]
  GptBlockBuffers rows;     // one block's buffers, reused by every block
  Tensor q;                 // (S, C) the query heads, contiguous
  Tensor mean_f, rstd_f;    // (S) F32, ln_f's statistics
};

absl::StatusOr<int64_t> GptModel::DecodeStateBytes(int64_t sequences, int64_t max_len) const {
  const GptSpec& g = gpt();
  if (sequences < 1 || max_len < 1 || max_len > g.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", sequences, " sequences of up to ", max_len,
                     " tokens; a GPT samples >= 1 sequences of 1 to context_length (",
                     g.context_length, ") tokens"));
  }
  const int64_t c = g.d_model;
  const int64_t h = g.mlp_ratio * c;
  const auto w = static_cast<int64_t>(kernels::SizeOf(working_dtype()));
  bool ok = true;
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = sequences;
  int64_t total = 0;
  for (int64_t part : {
           product({2, g.n_layer, n, max_len, c, w}),  // the K and V caches
           product({3, n, c, w}),                      // x twice, position rows
           product({8, n, c, w}),                      // ln_1, qkv (3), attn_y, resid, ln_2, q
           product({6, n, 4}),                         // the LayerNorms' statistics
           product({2, n, h, w}),                      // fc_pre, fc_post
           product({n, c, w}),                         // hidden
           product({2, n, 8}),                         // positions, tokens
       }) {
    ok = ok && CheckedAdd(total, part, &total);
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", sequences, " sequences of ",
                                                   max_len, " tokens need more than 2^63 bytes"));
  }
  return total;
}

absl::StatusOr<std::unique_ptr<DecodeState>> GptModel::MakeDecodeState(int64_t sequences,
                                                                       int64_t max_len) {
  const GptSpec& g = gpt();
  const int64_t c = g.d_model;
  const int64_t h = g.mlp_ratio * c;
  const DType w = working_dtype();
  const int64_t n = sequences;
  auto owned = std::make_unique<GptDecodeState>();
  GptDecodeState& st = *owned;
  auto alloc = [&](DType dtype, const kernels::Shape& shape, Tensor& t) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(t, backend_.Allocate(dtype, shape));
    return absl::OkStatus();
  };
  // A fused row is q | k | v, C columns each.
  AMPD_RETURN_IF_ERROR(st.cache.Allocate(backend_, w, g.n_layer, n, max_len, c, c, 2 * c));
  for (Tensor& t : st.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, t));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, st.position_rows));
  GptBlockBuffers& r = st.rows;
  for (Tensor* t : {&r.ln_1, &r.attn_y, &r.resid, &r.ln_2, &st.q, &st.hidden}) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, c}, *t));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, 3 * c}, r.qkv));
  for (Tensor* t : {&r.mean_1, &r.rstd_1, &r.mean_2, &r.rstd_2, &st.mean_f, &st.rstd_f}) {
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, *t));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, h}, r.fc_pre));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, h}, r.fc_post));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.positions));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.tokens));
  return std::unique_ptr<DecodeState>(std::move(owned));
}

absl::Status GptModel::Prefill(Workspace& any, absl::Span<const int64_t> lengths,
                               DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(GptWorkspace * ws, Own<GptWorkspace>(any));
  AMPD_ASSIGN_OR_RETURN(GptDecodeState * st, OwnState<GptDecodeState>(state));
  AMPD_RETURN_IF_ERROR(CheckPrefill(lengths, ws->batch, ws->seq, *st));
  std::vector<const Tensor*> rows;  // each layer's fused q|k|v rows
  for (const GptBlockBuffers& b : ws->blocks) rows.push_back(&b.qkv);
  AMPD_RETURN_IF_ERROR(st->cache.Prefill(backend_, rows, ws->seq, lengths));
  return KeepLastRows(backend_, ws->ln_f, ws->seq, lengths, st->hidden);
}

absl::Status GptModel::DecodeStep(absl::Span<const int64_t> tokens,
                                  absl::Span<const int64_t> positions, DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(GptDecodeState * own, OwnState<GptDecodeState>(state));
  GptDecodeState& st = *own;
  kernels::Backend& b = backend_;
  const GptSpec& g = gpt();
  const int64_t c = g.d_model;
  AMPD_RETURN_IF_ERROR(LoadDecodeStep(b, tokens, positions, g.vocab_size, st));
  auto value = [this](int index) -> const Tensor& { return params()[index].value(); };
  size_t layer = 0;
  // Each row's new query over its cached keys, its own K/V written first.
  const Attend attend = [&](GptBlockBuffers& sv) -> absl::Status {
    AMPD_RETURN_IF_ERROR(st.cache.Write(b, layer, sv.qkv, st.positions));
    AMPD_RETURN_IF_ERROR(b.CopyColumns(sv.qkv, 0, c, st.q, 0));
    return b.AttentionDecode(st.q, st.cache.k[layer], st.cache.v[layer], st.positions, g.n_head,
                             g.n_head, sv.attn_y);
  };
  // x_0 = wte[token] + wpe[position]: Forward's sum of the same two rows.
  AMPD_RETURN_IF_ERROR(b.EmbeddingForward(st.tokens, value(wte_), st.x[0]));
  AMPD_RETURN_IF_ERROR(b.EmbeddingForward(st.positions, value(wpe_), st.position_rows));
  AMPD_RETURN_IF_ERROR(b.Add(st.position_rows, st.x[0]));
  for (layer = 0; layer < blocks_.size(); ++layer) {
    AMPD_RETURN_IF_ERROR(
        BlockForward(layer, st.x[layer % 2], st.rows, attend, st.x[(layer + 1) % 2]));
  }
  return b.LayerNormForward(st.x[blocks_.size() % 2], &value(ln_f_weight_), &value(ln_f_bias_),
                            g.layer_norm_eps, st.hidden, st.mean_f, st.rstd_f);
}

}  // namespace ampd::engine::model
