// KvCache and the decode step's host side (kv_cache.h): the prompts' keys
// and values copied as column blocks (Backend::CopyColumns) from fused
// q|k|v rows into the cache, a decode step's in one Backend::WriteKvRows
// per layer.
#include "server/engine/model/kv_cache.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

using kernels::Tensor;

absl::Status KvCache::Allocate(kernels::Backend& backend, kernels::DType dtype, int64_t layers,
                               int64_t sequences, int64_t max_len, int64_t w, int64_t k_offset,
                               int64_t v_offset) {
  width = w;
  k_col = k_offset;
  v_col = v_offset;
  k.resize(static_cast<size_t>(layers));
  v.resize(static_cast<size_t>(layers));
  for (size_t l = 0; l < k.size(); ++l) {
    AMPD_ASSIGN_OR_RETURN(k[l], backend.Allocate(dtype, {sequences, max_len, width}));
    AMPD_ASSIGN_OR_RETURN(v[l], backend.Allocate(dtype, {sequences, max_len, width}));
  }
  return absl::OkStatus();
}

absl::Status KvCache::Prefill(kernels::Backend& backend, absl::Span<const Tensor* const> layer_rows,
                              int64_t prompt_len, absl::Span<const int64_t> lengths) {
  if (layer_rows.size() != k.size()) {
    return absl::InternalError(absl::StrCat("prefill: ", layer_rows.size(), " layers' rows for ",
                                            k.size(), " cached layers"));
  }
  for (size_t l = 0; l < k.size(); ++l) {
    const int64_t row_width = layer_rows[l]->dim(1);
    const int64_t max_len = k[l].dim(1);
    for (size_t s = 0; s < lengths.size(); ++s) {
      const auto seq = static_cast<int64_t>(s);
      const int64_t len = lengths[s];
      AMPD_ASSIGN_OR_RETURN(const Tensor rows,
                            layer_rows[l]->View(seq * prompt_len * row_width, {len, row_width}));
      AMPD_ASSIGN_OR_RETURN(Tensor keys, k[l].View(seq * max_len * width, {len, width}));
      AMPD_ASSIGN_OR_RETURN(Tensor values, v[l].View(seq * max_len * width, {len, width}));
      AMPD_RETURN_IF_ERROR(backend.CopyColumns(rows, k_col, width, keys, 0));
      AMPD_RETURN_IF_ERROR(backend.CopyColumns(rows, v_col, width, values, 0));
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::Write(kernels::Backend& backend, size_t layer, const Tensor& rows,
                            const Tensor& positions) {
  return backend.WriteKvRows(rows, k_col, v_col, positions, k[layer], v[layer]);
}

absl::Status CheckPrefill(absl::Span<const int64_t> lengths, int64_t batch, int64_t prompt_len,
                          const DecodeState& state) {
  const int64_t n = state.sequences();
  if (static_cast<int64_t>(lengths.size()) != n || batch != n) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: ", lengths.size(), " lengths and ",
                                                   batch, " prompts for ", n, " sequences"));
  }
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int64_t len = lengths[s];
    if (len < 1 || len > prompt_len || len > state.max_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill: prompt ", s, " of ", len, " tokens in rows of ", prompt_len));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadDecodeStep(kernels::Backend& backend, absl::Span<const int64_t> tokens,
                            absl::Span<const int64_t> positions, int64_t vocab,
                            DecodeState& state) {
  const int64_t n = state.sequences();
  if (static_cast<int64_t>(tokens.size()) != n || static_cast<int64_t>(positions.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", tokens.size(), " tokens and ",
                                                   positions.size(), " positions for ", n,
                                                   " sequences"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab || positions[i] < 0 ||
        positions[i] >= state.max_len()) {
      return absl::InvalidArgumentError(absl::StrCat("decode: sequence ", i, " token ", tokens[i],
                                                     " at position ", positions[i]));
    }
  }
  AMPD_RETURN_IF_ERROR(
      backend.CopyFromHost(tokens.data(), tokens.size() * sizeof(int64_t), state.tokens));
  return backend.CopyFromHost(positions.data(), positions.size() * sizeof(int64_t),
                              state.positions);
}

absl::Status KeepLastRows(kernels::Backend& backend, const Tensor& ln_f, int64_t prompt_len,
                          absl::Span<const int64_t> lengths, Tensor& hidden) {
  const int64_t c = ln_f.dim(1);
  for (size_t s = 0; s < lengths.size(); ++s) {
    const auto seq = static_cast<int64_t>(s);
    AMPD_ASSIGN_OR_RETURN(const Tensor last,
                          ln_f.View((seq * prompt_len + lengths[s] - 1) * c, {1, c}));
    AMPD_ASSIGN_OR_RETURN(Tensor row, hidden.View(seq * c, {1, c}));
    AMPD_RETURN_IF_ERROR(backend.Copy(last, row));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::model
