// TransformerModel's sampling (network.h): the KV cache of every layer's K/V
// heads, filled from the prompts' training forward (Prefill) and by each
// decode step, whose rows run BlockForward, the code Forward runs, with the
// attention of each row's new query over its cached keys. A decoder's
// separate q, k and v weights (and LoRA's q/k/v adapters) are stacked once
// per block at Prefill, not per block per token: the weights a Sample reads
// (the job's, or a snapshot's swapped in for the whole call) cannot change
// between its prefill and its last decode step.
#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/kv_cache.h"
#include "server/engine/model/transformer/transformer_model.h"
#include "server/engine/model/transformer/transformer_workspace.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

// A decoder's DecodeState: the cache and one decode step's buffers over
// its S rows (widths as transformer_model.h's).
struct TransformerDecodeState : DecodeState {
  Tensor inv_freq;          // (D/2) F32, RoPE's frequencies; empty for learned positions
  Tensor inv_freq_local;    // (D/2) F32, the sliding layers'; empty without them
  KvCache cache;            // per layer (S, max_len, KV)
  std::array<Tensor, 2> x;  // (S, C) the residual stream, in turn
  Tensor position_rows;     // (S, C) wpe[positions] (learned positions)
  BlockBuffers rows;        // one block's buffers, reused by every block
  Tensor q;                 // (S, Q) the query heads, contiguous
  Tensor mean_f, rstd_f;    // (S) F32, the final norm's statistics (mean_f a LayerNorm's)
  // Per block, its stacked q|k|v weight, bias and adapters (three q, k, v;
  // empty for GPT-2's fused c_attn without q/k/v adapters), filled at
  // Prefill.
  std::vector<QkvStack> stacks;
  bool stacked = false;  // Prefill filled stacks
};

absl::StatusOr<int64_t> TransformerModel::DecodeStateBytes(int64_t sequences,
                                                           int64_t max_len) const {
  const TransformerParts& s = parts_;
  if (sequences < 1 || max_len < 1 || max_len > s.max_positions) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", sequences, " sequences of up to ", max_len,
                     " tokens; a transformer samples >= 1 sequences of 1 to ",
                     s.names.max_positions_field, " (", s.max_positions, ") tokens"));
  }
  const Widths wd(s);
  const auto w = static_cast<int64_t>(kernels::SizeOf(working_dtype()));
  const int64_t rank = s.lora.has_value() ? s.lora->rank : 0;
  const LoraTargets targets = LoraTargetsOf(s);
  bool ok = true;
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = sequences;
  // With qk_norm, the per-head norms' statistics (S, H + K) F32.
  const int64_t qk_rstd = s.qk_norm ? product({n, s.heads + s.kv_heads, 4}) : 0;
  // With sandwich norms, the branch outputs before their norms and their
  // statistics.
  const int64_t sandwich = s.sandwich_norms ? product({2, n, wd.c, w}) + product({2, n, 4}) : 0;
  const int64_t stats = s.layer_norm() ? 2 : 1;  // rstd, and a LayerNorm's mean
  int64_t total = 0;
  for (int64_t part : {
           product({2, s.layers, n, max_len, wd.kv, w}),          // the K and V caches
           product({s.learned_positions() ? 3 : 2, n, wd.c, w}),  // x twice, position rows
           product({3, n, wd.c, w}),                              // ln_1, resid, ln_2
           product({3, stats, n, 4}),                             // the norms' statistics
           qk_rstd,                                               // rstd_q, rstd_k
           sandwich,                                              // attn_o, mlp_o and their rstd
           product({n, wd.qkv, w}),
           product({2, n, wd.q, w}),                             // qkv; attn_y, q
           product({s.gated() ? 3 : 2, n, wd.i, w}),             // gate, (up,) act
           product({n, rank, targets.qkv + targets.others, w}),  // LoRA's u
           product({n, wd.c, w}),                                // hidden
           product({2, n, 8}),                                   // positions, tokens
           // Each block's stacked weight, bias and adapters.
           s.fused_qkv ? 0 : product({s.layers, wd.qkv, wd.c + 1, w}),
           product({s.layers, rank, targets.qkv, wd.c + wd.qkv, w}),
           product({s.any_slides() ? 2 : 1, static_cast<int64_t>(s.inv_freq.size()), 4}),
       }) {
    ok = ok && CheckedAdd(total, part, &total);
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", sequences, " sequences of ",
                                                   max_len, " tokens need more than 2^63 bytes"));
  }
  return total;
}

absl::StatusOr<std::unique_ptr<DecodeState>> TransformerModel::MakeDecodeState(int64_t sequences,
                                                                               int64_t max_len) {
  const TransformerParts& s = parts_;
  const Widths wd(s);
  const DType w = working_dtype();
  const int64_t n = sequences;
  auto owned = std::make_unique<TransformerDecodeState>();
  TransformerDecodeState& st = *owned;
  const RowAllocator alloc{backend_, s, n};
  AMPD_RETURN_IF_ERROR(alloc.Upload(s.inv_freq, st.inv_freq));
  AMPD_RETURN_IF_ERROR(alloc.Upload(s.inv_freq_local, st.inv_freq_local));
  // Keys and values follow the q heads in a fused row.
  AMPD_RETURN_IF_ERROR(
      st.cache.Allocate(backend_, w, s.layers, n, max_len, wd.kv, wd.q, wd.q + wd.kv));
  for (Tensor& t : st.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, t));
  if (s.learned_positions()) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, st.position_rows));
  BlockBuffers& r = st.rows;
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.ln_1));
  AMPD_RETURN_IF_ERROR(alloc.Stats(r.mean_1, r.rstd_1));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, r.qkv));
  if (s.qk_norm) {  // no qkv_pre: a decode step has no backward
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.heads}, r.rstd_q));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n, s.kv_heads}, r.rstd_k));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, r.attn_y));
  if (s.sandwich_norms) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.attn_o));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, r.rstd_ao));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.mlp_o));
    AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, r.rstd_mo));
  }
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.resid));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.ln_2));
  AMPD_RETURN_IF_ERROR(alloc.Stats(r.mean_2, r.rstd_2));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.gate));
  if (s.gated()) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.up));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.act));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, st.q));
  AMPD_RETURN_IF_ERROR(alloc.Stats(st.mean_f, st.rstd_f));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, st.hidden));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.positions));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.tokens));
  st.stacks.resize(blocks_.size());
  if (!s.fused_qkv) {
    for (QkvStack& stack : st.stacks) {
      AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, stack.w));
      if (s.qkv_bias) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, stack.b));
    }
  }
  if (lora()) {
    const int64_t rank = s.lora->rank;
    const int64_t stacked = static_cast<int64_t>(qkv_targets_.size()) * rank;
    if (stacked > 0) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, stacked}, r.lora_u_qkv));
      for (QkvStack& stack : st.stacks) {
        AMPD_RETURN_IF_ERROR(alloc(w, {stacked, wd.c}, stack.lora_a));
        AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, stacked}, stack.lora_b));
        // Only the diagonal blocks are ever written (StackQkvAdapters).
        AMPD_RETURN_IF_ERROR(backend_.Fill(stack.lora_b, 0.0f));
      }
    }
    for (int module = kO; module < kModules; ++module) {
      if (!blocks_.front().lora[static_cast<size_t>(module)].present()) continue;
      AMPD_RETURN_IF_ERROR(alloc(w, {n, rank}, r.lora_u[static_cast<size_t>(module - kO)]));
    }
  }
  return std::unique_ptr<DecodeState>(std::move(owned));
}

absl::Status TransformerModel::Prefill(Workspace& any, absl::Span<const int64_t> lengths,
                                       DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(TransformerWorkspace * ws, Own<TransformerWorkspace>(any));
  AMPD_ASSIGN_OR_RETURN(TransformerDecodeState * st, OwnState<TransformerDecodeState>(state));
  AMPD_RETURN_IF_ERROR(CheckPrefill(lengths, ws->batch, ws->seq, *st));
  std::vector<const Tensor*> rows;  // each layer's fused q|k|v rows, after RoPE
  for (const BlockBuffers& b : ws->blocks) rows.push_back(&b.qkv);
  AMPD_RETURN_IF_ERROR(st->cache.Prefill(backend_, rows, ws->seq, lengths));
  AMPD_RETURN_IF_ERROR(StackDecodeWeights(st->stacks));
  st->stacked = true;
  return KeepLastRows(backend_, ws->ln_f, ws->seq, lengths, st->hidden);
}

absl::Status TransformerModel::StackDecodeWeights(std::vector<QkvStack>& stacks) {
  for (size_t l = 0; l < blocks_.size(); ++l) {
    QkvStack& stack = stacks[l];
    if (!parts_.fused_qkv) {
      Tensor* bias = stack.b.empty() ? nullptr : &stack.b;
      AMPD_RETURN_IF_ERROR(
          CopyQkv(blocks_[l], /*grads=*/false, /*to_params=*/false, stack.w, bias));
    }
    if (!stack.lora_b.empty()) AMPD_RETURN_IF_ERROR(StackQkvAdapters(blocks_[l], stack));
  }
  return absl::OkStatus();
}

absl::Status TransformerModel::DecodeStep(absl::Span<const int64_t> tokens,
                                          absl::Span<const int64_t> positions, DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(TransformerDecodeState * own, OwnState<TransformerDecodeState>(state));
  TransformerDecodeState& st = *own;
  kernels::Backend& b = backend_;
  const TransformerParts& s = parts_;
  const Widths wd(s);
  const int64_t n = st.sequences();
  if (!st.stacked) {
    return absl::FailedPreconditionError("sampling: a decode step before its state's Prefill");
  }
  AMPD_RETURN_IF_ERROR(LoadDecodeStep(b, tokens, positions, s.vocab, st));
  // Each row's new query over its cached keys: RoPE at the row's own
  // position, its K/V written into the cache, then the cached attention
  // (the layer's window and scale, as the forward's).
  const Attend attend = [&](size_t layer, BlockBuffers& sv) -> absl::Status {
    if (!s.learned_positions()) {
      AMPD_ASSIGN_OR_RETURN(Tensor qkv, sv.qkv.View(0, {n, 1, wd.qkv}));
      AMPD_ASSIGN_OR_RETURN(const Tensor at, st.positions.View(0, {n, 1}));
      AMPD_RETURN_IF_ERROR(b.Rope(qkv, s.heads + s.kv_heads, wd.d,
                                  InvFreqOf(layer, st.inv_freq, st.inv_freq_local), &at, false));
    }
    AMPD_RETURN_IF_ERROR(st.cache.Write(b, layer, sv.qkv, st.positions));
    AMPD_RETURN_IF_ERROR(b.CopyColumns(sv.qkv, 0, wd.q, st.q, 0));
    return b.AttentionDecode(st.q, st.cache.k[layer], st.cache.v[layer], st.positions, s.heads,
                             s.kv_heads, AttentionOptionsOf(layer), sv.attn_y);
  };
  AMPD_RETURN_IF_ERROR(b.EmbeddingForward(st.tokens, Value(embed_), embed_scale_, st.x[0]));
  if (positions_ >= 0) {
    // x_0 += wpe[position]: Forward's sum of the same two rows.
    AMPD_RETURN_IF_ERROR(b.EmbeddingForward(st.positions, Value(positions_), st.position_rows));
    AMPD_RETURN_IF_ERROR(b.Add(st.position_rows, st.x[0]));
  }
  for (size_t layer = 0; layer < blocks_.size(); ++layer) {
    Tensor& in = st.x[layer % 2];
    Tensor& out = st.x[(layer + 1) % 2];
    AMPD_RETURN_IF_ERROR(
        BlockForward(layer, in, st.rows, st.stacks[layer], /*restack=*/false, attend, out));
  }
  return Norm(st.x[blocks_.size() % 2], norm_, st.hidden, st.mean_f, st.rstd_f);
}

}  // namespace ampd::engine::model
