// KvCache: a language model's keys and values of every layer for a
// sampler's S sequences (network.h's DecodeState), and the host side of a
// decode step of every transformer family: checking and uploading
// the step's tokens and positions, and keeping each prompt's last row.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "server/engine/model/network.h"

namespace ampd::engine::model {

struct KvCache {
  std::vector<kernels::Tensor> k, v;  // per layer (S, max_len, W)
  int64_t width = 0;                  // W: one position's key (and value) columns
  // Where the key and the value start in a layer's fused q|k|v row.
  int64_t k_col = 0, v_col = 0;

  absl::Status Allocate(kernels::Backend& backend, kernels::DType dtype, int64_t layers,
                        int64_t sequences, int64_t max_len, int64_t width, int64_t k_col,
                        int64_t v_col);
  // From each layer's fused rows of (S, P) right-padded prompts
  // (layer_rows[l]: (S P, row width), row s P + t being sequence s's
  // position t), the first lengths[s] positions of every sequence s.
  absl::Status Prefill(kernels::Backend& backend,
                       absl::Span<const kernels::Tensor* const> layer_rows, int64_t prompt_len,
                       absl::Span<const int64_t> lengths);
  // Row i of a layer's fused rows (S, row width) into position
  // positions[i] of sequence i (positions (S) I64 on the backend's device,
  // the decode step's): one WriteKvRows for both K and V.
  absl::Status Write(kernels::Backend& backend, size_t layer, const kernels::Tensor& rows,
                     const kernels::Tensor& positions);
};

// Prefill's arguments: one length per sequence of `state`, each in
// [1, min(prompt_len, max_len)], and `batch` prompts.
absl::Status CheckPrefill(absl::Span<const int64_t> lengths, int64_t batch, int64_t prompt_len,
                          const DecodeState& state);

// A decode step's tokens (each in [0, vocab)) and positions (each in
// [0, max_len)) checked and uploaded into state.tokens and state.positions
// (checked here on the host: the device ops that read them cannot).
absl::Status LoadDecodeStep(kernels::Backend& backend, absl::Span<const int64_t> tokens,
                            absl::Span<const int64_t> positions, int64_t vocab, DecodeState& state);

// Each sequence's last prompt row of the final norm's output ln_f
// (S P, C) into hidden (S, C).
absl::Status KeepLastRows(kernels::Backend& backend, const kernels::Tensor& ln_f,
                          int64_t prompt_len, absl::Span<const int64_t> lengths,
                          kernels::Tensor& hidden);

}  // namespace ampd::engine::model
