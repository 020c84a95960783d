// DecoderModel's sampling (network.h): the KV cache of every layer's K/V
// heads, filled from the prompts' training forward (Prefill) and by each
// decode step, whose rows run BlockForward, the code Forward runs, with the
// attention of each row's new query over its cached keys.
#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/model/decoder/decoder_model.h"
#include "server/engine/model/decoder/decoder_workspace.h"

namespace ampd::engine::model {

using kernels::DType;
using kernels::Tensor;

// A decoder's DecodeState: the cache and one decode step's buffers over
// its S rows (widths as decoder_model.h's).
struct DecoderDecodeState : DecodeState {
  Tensor inv_freq;                       // (D/2) F32, RoPE's frequencies
  std::vector<Tensor> k_cache, v_cache;  // per layer (S, max_len, KV)
  std::array<Tensor, 2> x;               // (S, C) the residual stream, in turn
  DecoderBlockBuffers rows;              // one block's buffers, reused by every block
  Tensor q;                              // (S, Q) the query heads, contiguous
  Tensor rstd_f;                         // (S) F32, the final norm's statistic
  QkvStack stack;                        // the stacked q|k|v weight and adapters
  std::vector<int64_t> host_positions;   // the step's positions, for the cache writes
};

namespace {

struct Widths {
  int64_t c, d, q, kv, qkv, i;
  explicit Widths(const DecoderSpec& s)
      : c(s.hidden_size),
        d(DecoderHeadDim(s)),
        q(s.num_attention_heads * d),
        kv(s.num_key_value_heads * d),
        qkv(q + 2 * kv),
        i(s.intermediate_size) {}
};

// LoRA's (stacked q|k|v targets, other targets) counts.
std::pair<int64_t, int64_t> AdapterTargets(const DecoderSpec& s) {
  int64_t qkv = 0, others = 0;
  if (!s.lora.has_value()) return {0, 0};
  for (const std::string& m : s.lora->target_modules) {
    (m == "q_proj" || m == "k_proj" || m == "v_proj" ? qkv : others) += 1;
  }
  return {qkv, others};
}

}  // namespace

absl::StatusOr<int64_t> DecoderModel::DecodeStateBytes(int64_t sequences, int64_t max_len) const {
  const DecoderSpec& s = decoder();
  if (sequences < 1 || max_len < 1 || max_len > s.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", sequences, " sequences of up to ", max_len,
                     " tokens; a decoder samples >= 1 sequences of 1 to max_position_embeddings (",
                     s.max_position_embeddings, ") tokens"));
  }
  const Widths wd(s);
  const auto w = static_cast<int64_t>(kernels::SizeOf(working_dtype()));
  const int64_t rank = s.lora.has_value() ? s.lora->rank : 0;
  const auto [t_qkv, t_others] = AdapterTargets(s);
  bool ok = true;
  auto product = [&ok](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) ok = ok && CheckedMul(p, f, &p);
    return ok ? p : 0;
  };
  const int64_t n = sequences;
  int64_t total = 0;
  for (int64_t part : {
           product({2, s.num_hidden_layers, n, max_len, wd.kv, w}),  // the K and V caches
           product({2, n, wd.c, w}),                                 // x, twice
           product({3, n, wd.c, w}),                                 // ln_1, resid, ln_2
           product({3, n, 4}),                                       // rstd_1, rstd_2, rstd_f
           product({n, wd.qkv, w}), product({2, n, wd.q, w}),        // qkv; attn_y, q
           product({3, n, wd.i, w}),                                 // gate, up, act
           product({n, rank, t_qkv + t_others, w}),                  // LoRA's u
           product({n, wd.c, w}),                                    // hidden
           product({2, n, 8}),                                       // positions, tokens
           product({wd.qkv, wd.c + 1, w}),                           // stacked weight, bias
           product({rank, t_qkv, wd.c + wd.qkv, w}),                 // stacked adapters
           product({wd.d / 2, 4}),                                   // inv_freq
       }) {
    ok = ok && CheckedAdd(total, part, &total);
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", sequences, " sequences of ",
                                                   max_len, " tokens need more than 2^63 bytes"));
  }
  return total;
}

absl::StatusOr<std::unique_ptr<DecodeState>> DecoderModel::MakeDecodeState(int64_t sequences,
                                                                           int64_t max_len) {
  const DecoderSpec& s = decoder();
  const Widths wd(s);
  const DType w = working_dtype();
  const int64_t n = sequences;
  auto owned = std::make_unique<DecoderDecodeState>();
  DecoderDecodeState& st = *owned;
  auto alloc = [&](DType dtype, const kernels::Shape& shape, Tensor& t) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(t, backend_.Allocate(dtype, shape));
    return absl::OkStatus();
  };
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {wd.d / 2}, st.inv_freq));
  AMPD_RETURN_IF_ERROR(
      backend_.CopyFromHost(inv_freq_.data(), inv_freq_.size() * sizeof(float), st.inv_freq));
  st.k_cache.resize(static_cast<size_t>(s.num_hidden_layers));
  st.v_cache.resize(static_cast<size_t>(s.num_hidden_layers));
  for (size_t l = 0; l < st.k_cache.size(); ++l) {
    AMPD_RETURN_IF_ERROR(alloc(w, {n, max_len, wd.kv}, st.k_cache[l]));
    AMPD_RETURN_IF_ERROR(alloc(w, {n, max_len, wd.kv}, st.v_cache[l]));
  }
  for (Tensor& t : st.x) AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, t));
  DecoderBlockBuffers& r = st.rows;
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.ln_1));
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, r.rstd_1));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.qkv}, r.qkv));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, r.attn_y));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.resid));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, r.ln_2));
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, r.rstd_2));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.gate));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.up));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.i}, r.act));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.q}, st.q));
  AMPD_RETURN_IF_ERROR(alloc(DType::kF32, {n}, st.rstd_f));
  AMPD_RETURN_IF_ERROR(alloc(w, {n, wd.c}, st.hidden));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.positions));
  AMPD_RETURN_IF_ERROR(alloc(DType::kI64, {n}, st.tokens));
  AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, wd.c}, st.stack.w));
  if (s.qkv_bias) AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv}, st.stack.b));
  if (lora()) {
    const int64_t rank = s.lora->rank;
    const int64_t stacked = static_cast<int64_t>(qkv_targets_.size()) * rank;
    if (stacked > 0) {
      AMPD_RETURN_IF_ERROR(alloc(w, {n, stacked}, r.lora_u_qkv));
      AMPD_RETURN_IF_ERROR(alloc(w, {stacked, wd.c}, st.stack.lora_a));
      AMPD_RETURN_IF_ERROR(alloc(w, {wd.qkv, stacked}, st.stack.lora_b));
      // Only the diagonal blocks are ever written (StackQkvAdapters).
      AMPD_RETURN_IF_ERROR(backend_.Fill(st.stack.lora_b, 0.0f));
    }
    for (int module = kO; module < kModules; ++module) {
      if (!blocks_.front().lora[static_cast<size_t>(module)].present()) continue;
      AMPD_RETURN_IF_ERROR(alloc(w, {n, rank}, r.lora_u[static_cast<size_t>(module - kO)]));
    }
  }
  return std::unique_ptr<DecodeState>(std::move(owned));
}

absl::Status DecoderModel::Prefill(Workspace& any, absl::Span<const int64_t> lengths,
                                   DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(DecoderWorkspace * ws, Own<DecoderWorkspace>(any));
  AMPD_ASSIGN_OR_RETURN(DecoderDecodeState * st, OwnState<DecoderDecodeState>(state));
  const Widths wd(decoder());
  const int64_t n = st->sequences();
  const int64_t max_len = st->max_len();
  if (static_cast<int64_t>(lengths.size()) != n || ws->batch != n) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: ", lengths.size(), " lengths and ",
                                                   ws->batch, " prompts for ", n, " sequences"));
  }
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = lengths[static_cast<size_t>(s)];
    if (len < 1 || len > ws->seq || len > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill: prompt ", s, " of ", len, " tokens in rows of ", ws->seq));
    }
    const int64_t first = s * ws->seq;  // the sequence's first row
    for (size_t l = 0; l < blocks_.size(); ++l) {
      AMPD_ASSIGN_OR_RETURN(const Tensor rows,
                            ws->blocks[l].qkv.View(first * wd.qkv, {len, wd.qkv}));
      AMPD_ASSIGN_OR_RETURN(Tensor k, st->k_cache[l].View(s * max_len * wd.kv, {len, wd.kv}));
      AMPD_ASSIGN_OR_RETURN(Tensor v, st->v_cache[l].View(s * max_len * wd.kv, {len, wd.kv}));
      AMPD_RETURN_IF_ERROR(backend_.CopyColumns(rows, wd.q, wd.kv, k, 0));
      AMPD_RETURN_IF_ERROR(backend_.CopyColumns(rows, wd.q + wd.kv, wd.kv, v, 0));
    }
    AMPD_ASSIGN_OR_RETURN(const Tensor last, ws->ln_f.View((first + len - 1) * wd.c, {1, wd.c}));
    AMPD_ASSIGN_OR_RETURN(Tensor hidden, st->hidden.View(s * wd.c, {1, wd.c}));
    AMPD_RETURN_IF_ERROR(backend_.Copy(last, hidden));
  }
  return absl::OkStatus();
}

absl::Status DecoderModel::DecodeStep(absl::Span<const int64_t> tokens,
                                      absl::Span<const int64_t> positions, DecodeState& state) {
  AMPD_ASSIGN_OR_RETURN(DecoderDecodeState * own, OwnState<DecoderDecodeState>(state));
  DecoderDecodeState& st = *own;
  kernels::Backend& b = backend_;
  const DecoderSpec& s = decoder();
  const Widths wd(s);
  const int64_t n = st.sequences();
  if (static_cast<int64_t>(tokens.size()) != n || static_cast<int64_t>(positions.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", tokens.size(), " tokens and ",
                                                   positions.size(), " positions for ", n,
                                                   " sequences"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tokens[static_cast<size_t>(i)];
    const int64_t p = positions[static_cast<size_t>(i)];
    if (t < 0 || t >= s.vocab_size || p < 0 || p >= st.max_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: sequence ", i, " token ", t, " at position ", p));
    }
  }
  st.host_positions.assign(positions.begin(), positions.end());
  AMPD_RETURN_IF_ERROR(b.CopyFromHost(tokens.data(), tokens.size() * sizeof(int64_t), st.tokens));
  AMPD_RETURN_IF_ERROR(
      b.CopyFromHost(positions.data(), positions.size() * sizeof(int64_t), st.positions));
  const int64_t heads = s.num_attention_heads;
  const int64_t kv_heads = s.num_key_value_heads;
  size_t layer = 0;
  // Each row's new query over its cached keys: RoPE at the row's own
  // position, its K/V written into the cache, then the cached attention.
  const Attend attend = [&](DecoderBlockBuffers& sv) -> absl::Status {
    AMPD_ASSIGN_OR_RETURN(Tensor qkv, sv.qkv.View(0, {n, 1, wd.qkv}));
    AMPD_ASSIGN_OR_RETURN(const Tensor at, st.positions.View(0, {n, 1}));
    AMPD_RETURN_IF_ERROR(b.Rope(qkv, heads + kv_heads, wd.d, st.inv_freq, &at, false));
    const int64_t max_len = st.max_len();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = i * max_len + st.host_positions[static_cast<size_t>(i)];
      AMPD_ASSIGN_OR_RETURN(const Tensor row, sv.qkv.View(i * wd.qkv, {1, wd.qkv}));
      AMPD_ASSIGN_OR_RETURN(Tensor k, st.k_cache[layer].View(slot * wd.kv, {1, wd.kv}));
      AMPD_ASSIGN_OR_RETURN(Tensor v, st.v_cache[layer].View(slot * wd.kv, {1, wd.kv}));
      AMPD_RETURN_IF_ERROR(b.CopyColumns(row, wd.q, wd.kv, k, 0));
      AMPD_RETURN_IF_ERROR(b.CopyColumns(row, wd.q + wd.kv, wd.kv, v, 0));
    }
    AMPD_RETURN_IF_ERROR(b.CopyColumns(sv.qkv, 0, wd.q, st.q, 0));
    return b.AttentionDecode(st.q, st.k_cache[layer], st.v_cache[layer], st.positions, heads,
                             kv_heads, sv.attn_y);
  };
  AMPD_RETURN_IF_ERROR(
      b.EmbeddingForward(st.tokens, params()[static_cast<size_t>(embed_)].value(), st.x[0]));
  for (layer = 0; layer < blocks_.size(); ++layer) {
    Tensor& in = st.x[layer % 2];
    Tensor& out = st.x[(layer + 1) % 2];
    AMPD_RETURN_IF_ERROR(BlockForward(layer, in, st.rows, st.stack, attend, out));
  }
  return b.RmsNormForward(st.x[blocks_.size() % 2], params()[static_cast<size_t>(norm_)].value(),
                          s.rms_norm_eps, st.hidden, st.rstd_f);
}

}  // namespace ampd::engine::model
