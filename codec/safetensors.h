// safetensors encoding of a StateDict: 8-byte little-endian header length,
// a JSON header ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__":
// {string: string}}), then the tensor bytes back to back. The format
// Hugging Face's safetensors library reads, so `ampctl state export` files
// open in Python with safetensors.torch.load_file.
//
// The header is written as the reference (Rust) implementation writes it:
// compact JSON, "__metadata__" first (omitted when there is none), tensors in
// StateDict order with their bytes in that same order, and the JSON padded
// with spaces to a multiple of 8 bytes so the tensor bytes start 8-aligned.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/state_dict.h"

namespace ampd::codec {

// Safetensors refuses headers above this size (the reference's
// MAX_HEADER_SIZE), so a hostile length never drives an allocation.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// OK when `state` can be encoded into a file DecodeSafetensors (and the
// reference library) reads back unchanged: every tensor passes
// HostTensor::Validate, names are unique, none is "__metadata__", and names
// and metadata are valid UTF-8. InvalidArgument naming the culprit otherwise.
absl::Status ValidateStateDict(const StateDict& state);

// Precondition: ValidateStateDict(state) is OK. A tensor whose bytes do not
// match its shape is written as given, and the result will not decode.
std::string EncodeSafetensors(const StateDict& state);

// The file's first bytes: the 8-byte length and the padded JSON header.
// EncodeSafetensors(state) == EncodeSafetensorsHeader(state) followed by the
// tensors' bytes in order; writers that stream a state send those pieces
// instead of concatenating the whole file first. Same precondition.
std::string EncodeSafetensorsHeader(const StateDict& state);

// A safetensors file held as its header plus the tensors it came from, so a
// state dict the size of a model is not copied once more just to be sent.
struct EncodedSafetensors {
  std::string header;  // EncodeSafetensorsHeader(state)
  StateDict state;

  // Bytes of the whole file.
  uint64_t size() const;
  // Appends the file's bytes [offset, offset + length) (clipped to size())
  // to *out.
  void CopyOut(uint64_t offset, uint64_t length, std::string* out) const;
};

// InvalidArgument naming what is wrong (header length past the end, bad
// JSON, unknown dtype, offsets that overlap, leave gaps or run past the end,
// duplicate names) — never a crash on hostile bytes. Tensors come back in
// header order, which must also be the order of their bytes.
absl::StatusOr<StateDict> DecodeSafetensors(absl::string_view bytes);
// The same for a file held as consecutive pieces (a stream's chunks): the
// tensors are copied from the pieces into their own buffers once, without
// first joining the pieces into one string.
absl::StatusOr<StateDict> DecodeSafetensors(absl::Span<const absl::string_view> pieces);

// Where a file's tensors lie, from its header alone.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // [begin, end): in the byte buffer that follows the header
  uint64_t end = 0;
};
struct SafetensorsLayout {
  uint64_t header_bytes = 0;  // the 8-byte length and the header: where the buffer starts
  uint64_t file_bytes = 0;    // header_bytes plus the buffer the tensors tile exactly
  std::vector<SafetensorsEntry> tensors;  // in header order, which is their bytes' order
  std::map<std::string, std::string> metadata;
};

// The length the first 8 bytes of a file give its header; InvalidArgument
// past kMaxSafetensorsHeaderBytes. `prefix` has at least 8 bytes.
absl::StatusOr<uint64_t> DecodeSafetensorsHeaderLength(absl::string_view prefix);

// The layout of a file from its first bytes (`head`: the 8-byte length and
// at least the header it announces). DecodeSafetensors's checks of the header
// and of the offsets (tensors contiguous from 0 in header order, each the
// size of its dtype and shape), with the same errors; the file's length is
// not known here, so that it is file_bytes is the caller's to check.
absl::StatusOr<SafetensorsLayout> DecodeSafetensorsLayout(absl::string_view head);

// The "__metadata__" of a safetensors file from its first bytes: the 8-byte
// length and the header (what follows, if anything, is not looked at). The
// same checks of the header as DecodeSafetensors, none of the tensor bytes;
// for reading a file's metadata without reading the whole file.
absl::StatusOr<std::map<std::string, std::string>> DecodeSafetensorsMetadata(
    absl::string_view bytes);

}  // namespace ampd::codec
