// libFuzzer target: the safetensors decoder, which reads state dicts from
// clients (LoadStateDict) and from the state directory. Any input must be
// refused with a Status or decoded; what decodes must validate, encode and
// decode again to the same state (the encoder and decoder agree).
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "codec/safetensors.h"
#include "tests/fuzz/fuzz_jobs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using ampd::codec::DecodeSafetensors;
  using ampd::codec::EncodeSafetensors;
  using ampd::codec::StateDict;
  using ampd::codec::ValidateStateDict;
  absl::StatusOr<StateDict> state =
      DecodeSafetensors(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!state.ok()) return 0;
  if (!ValidateStateDict(*state).ok()) return 0;  // decodable but not ours to write back
  absl::StatusOr<StateDict> again = DecodeSafetensors(EncodeSafetensors(*state));
  ampd::fuzz::Check(again.ok(), "a decoded state dict re-encodes into a decodable file");
  ampd::fuzz::Check(again->metadata == state->metadata, "metadata survives a round trip");
  ampd::fuzz::Check(again->tensors.size() == state->tensors.size(), "tensors survive a round trip");
  for (size_t i = 0; i < state->tensors.size(); ++i) {
    const auto& a = state->tensors[i];
    const auto& b = again->tensors[i];
    ampd::fuzz::Check(a.name == b.name && a.tensor.dtype == b.tensor.dtype &&
                          a.tensor.shape == b.tensor.shape && a.tensor.data == b.tensor.data,
                      "each tensor survives a round trip");
  }
  return 0;
}
