// SafetensorsReceiver: decodes a safetensors file while its bytes arrive (a
// LoadStateDict stream's chunks) straight into the StateDict it returns.
// Each byte is copied once, from the chunk it came in into its tensor's
// buffer, so a chunk can be dropped (or its buffer reused) as soon as it is
// appended, and the file is never held twice. DecodeSafetensors's checks are
// made as soon as the bytes allow: the header and the tensors' layout when
// the header is complete, a byte past the last tensor when it arrives, a
// file cut short at Finish.
//
// Memory is asked for before it is taken: `reserve` is called with the
// header's size once its length is known, and with each tensor's size before
// its buffer is allocated (when its first byte arrives); an error from it
// stops the file there, nothing allocated for that request.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "codec/safetensors.h"
#include "codec/state_dict.h"

namespace ampd::codec {

class SafetensorsReceiver {
 public:
  using Reserve = std::function<absl::Status(uint64_t bytes)>;
  explicit SafetensorsReceiver(Reserve reserve);

  // The file's next bytes. InvalidArgument as DecodeSafetensors words it
  // when the file is not a valid one, or reserve's error; after an error
  // every later call returns it again.
  absl::Status Append(absl::string_view bytes);
  // The file's length as its header declares it; nullopt until the header
  // is complete.
  std::optional<uint64_t> declared_bytes() const;
  uint64_t received_bytes() const { return received_; }
  // The decoded file, once every byte the header declares has arrived;
  // InvalidArgument when the file stops short (or Append's error).
  absl::StatusOr<StateDict> Finish();

 private:
  absl::Status AppendToHeader(absl::string_view* bytes);
  absl::Status AppendToTensors(absl::string_view* bytes);
  absl::Status Fail(absl::Status status);

  Reserve reserve_;
  absl::Status error_;
  uint64_t received_ = 0;
  // Until the layout is known: the 8-byte length, then the header.
  std::string head_;
  uint64_t head_bytes_ = 8;  // what head_ must hold: 8, then 8 + the header's length
  std::optional<SafetensorsLayout> layout_;
  StateDict state_;  // tensors laid out from layout_, filled in order
  size_t next_ = 0;  // the tensor the next byte belongs to
};

}  // namespace ampd::codec
