// safetensors encoder and a strict decoder. The JSON handled here is only the
// subset safetensors headers use (objects, strings, non-negative integers,
// arrays of integers), so the reader is schema-directed rather than a general
// JSON parser: it never builds a tree, never recurses on input, and every
// allocation is bounded by the size of the input.
#include "codec/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "codec/json_text.h"
#include "common/error_reason.h"
#include "common/status_macros.h"

namespace ampd::codec {
namespace {

constexpr absl::string_view kMetadataKey = "__metadata__";
// The reference aligns the start of the byte buffer to 8 (the widest dtype).
constexpr size_t kHeaderAlignment = 8;
constexpr size_t kLengthPrefixBytes = 8;

// ---------------------------------------------------------------- writing --

// ---------------------------------------------------------------- UTF-8 --

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF):
// the reference rejects headers that are not valid UTF-8, and Python could
// not hold such names as str.
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

// ---------------------------------------------------------------- reading --

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct Header {
  std::vector<TensorEntry> tensors;  // in header order
  std::map<std::string, std::string> metadata;
};

// Reads the header JSON with the expected schema built in. Errors carry the
// byte position in the header so a broken file can be inspected by hand.
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<Header> Parse() {
    Header header;
    // The reference insists the header starts with '{' (no leading spaces).
    if (text_.empty() || text_[0] != '{') return Error("header does not start with '{'");
    pos_ = 1;
    std::set<std::string> names;
    bool seen_metadata = false;
    SkipWhitespace();
    if (Peek() == '}') {
      ++pos_;
    } else {
      while (true) {
        SkipWhitespace();
        std::string key;
        AMPD_RETURN_IF_ERROR(ParseString(&key));
        AMPD_RETURN_IF_ERROR(ExpectChar(':'));
        if (key == kMetadataKey) {
          if (seen_metadata) return Error("duplicate \"__metadata__\"");
          seen_metadata = true;
          AMPD_RETURN_IF_ERROR(ParseMetadata(&header.metadata));
        } else {
          if (!names.insert(key).second) {
            return Error(absl::StrCat("duplicate tensor name \"", Echo(key), "\""));
          }
          TensorEntry entry;
          entry.name = std::move(key);
          AMPD_RETURN_IF_ERROR(ParseTensorInfo(&entry));
          header.tensors.push_back(std::move(entry));
        }
        bool more = false;
        AMPD_RETURN_IF_ERROR(ParseSeparator('}', &more));
        if (!more) break;
      }
    }
    // The reference pads with spaces; anything else after the object is junk.
    SkipWhitespace();
    if (pos_ != text_.size()) return Error("unexpected bytes after the header's JSON object");
    return header;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("safetensors header, byte ", pos_, ": ", what));
  }

  // 0 at the end of input; the header is valid UTF-8 with no NUL needed
  // anywhere a caller compares Peek() against a structural character.
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }

  void SkipWhitespace() { SkipJsonSpace(text_, &pos_); }

  absl::Status ExpectChar(char c) {
    SkipWhitespace();
    if (pos_ >= text_.size())
      return Error(absl::StrCat("expected '", std::string(1, c), "' but the header ended"));
    if (text_[pos_] != c) {
      return Error(absl::StrCat("expected '", std::string(1, c), "'"));
    }
    ++pos_;
    return absl::OkStatus();
  }

  // After a member or element: ',' (more follow) or `close` (done).
  absl::Status ParseSeparator(char close, bool* more) {
    SkipWhitespace();
    if (Peek() == ',') {
      ++pos_;
      *more = true;
      return absl::OkStatus();
    }
    if (Peek() == close) {
      ++pos_;
      *more = false;
      return absl::OkStatus();
    }
    return Error(absl::StrCat("expected ',' or '", std::string(1, close), "'"));
  }

  // The whole header was checked to be UTF-8 before parsing.
  absl::Status ParseString(std::string* out) {
    SkipWhitespace();
    if (absl::Status s = ReadJsonString(text_, &pos_, out); !s.ok()) return Error(s.message());
    return absl::OkStatus();
  }

  // A JSON non-negative integer no larger than `max`: no sign, no leading
  // zeros, no fraction or exponent (the reference reads these as usize).
  absl::Status ParseUint(uint64_t max, uint64_t* out) {
    SkipWhitespace();
    if (Peek() == '-') return Error("negative number");
    if (Peek() < '0' || Peek() > '9') return Error("expected a non-negative integer");
    if (Peek() == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' &&
        text_[pos_ + 1] <= '9') {
      return Error("number with a leading zero");
    }
    uint64_t v = 0;
    while (Peek() >= '0' && Peek() <= '9') {
      const auto digit = static_cast<uint64_t>(Peek() - '0');
      if (v > (max - digit) / 10) return Error("number too large");
      v = v * 10 + digit;
      ++pos_;
    }
    if (Peek() == '.' || Peek() == 'e' || Peek() == 'E') return Error("number is not an integer");
    *out = v;
    return absl::OkStatus();
  }

  absl::Status ParseUintArray(uint64_t max, std::vector<uint64_t>* out) {
    AMPD_RETURN_IF_ERROR(ExpectChar('['));
    SkipWhitespace();
    if (Peek() == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      uint64_t v = 0;
      AMPD_RETURN_IF_ERROR(ParseUint(max, &v));
      out->push_back(v);
      bool more = false;
      AMPD_RETURN_IF_ERROR(ParseSeparator(']', &more));
      if (!more) return absl::OkStatus();
    }
  }

  absl::Status ParseMetadata(std::map<std::string, std::string>* metadata) {
    AMPD_RETURN_IF_ERROR(ExpectChar('{'));
    SkipWhitespace();
    if (Peek() == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      std::string key, value;
      AMPD_RETURN_IF_ERROR(ParseString(&key));
      AMPD_RETURN_IF_ERROR(ExpectChar(':'));
      AMPD_RETURN_IF_ERROR(ParseString(&value));
      if (!metadata->emplace(key, std::move(value)).second) {
        return Error(absl::StrCat("duplicate metadata key \"", Echo(key), "\""));
      }
      bool more = false;
      AMPD_RETURN_IF_ERROR(ParseSeparator('}', &more));
      if (!more) return absl::OkStatus();
    }
  }

  absl::Status ParseTensorInfo(TensorEntry* entry) {
    const std::string where = absl::StrCat("tensor \"", Echo(entry->name), "\": ");
    AMPD_RETURN_IF_ERROR(ExpectChar('{'));
    bool has_dtype = false, has_shape = false, has_offsets = false;
    SkipWhitespace();
    if (Peek() != '}') {
      while (true) {
        std::string key;
        AMPD_RETURN_IF_ERROR(ParseString(&key));
        AMPD_RETURN_IF_ERROR(ExpectChar(':'));
        if (key == "dtype") {
          if (has_dtype) return Error(absl::StrCat(where, "duplicate \"dtype\""));
          has_dtype = true;
          std::string name;
          AMPD_RETURN_IF_ERROR(ParseString(&name));
          const std::optional<DType> dtype = DTypeFromName(name);
          if (!dtype) return Error(absl::StrCat(where, "unknown dtype \"", Echo(name), "\""));
          entry->dtype = *dtype;
        } else if (key == "shape") {
          if (has_shape) return Error(absl::StrCat(where, "duplicate \"shape\""));
          has_shape = true;
          std::vector<uint64_t> dims;
          // Dims become int64 in Shape.
          const auto max_dim = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
          AMPD_RETURN_IF_ERROR(ParseUintArray(max_dim, &dims));
          entry->shape.assign(dims.begin(), dims.end());
        } else if (key == "data_offsets") {
          if (has_offsets) return Error(absl::StrCat(where, "duplicate \"data_offsets\""));
          has_offsets = true;
          std::vector<uint64_t> offsets;
          AMPD_RETURN_IF_ERROR(ParseUintArray(std::numeric_limits<uint64_t>::max(), &offsets));
          if (offsets.size() != 2) {
            return Error(
                absl::StrCat(where, "data_offsets has ", offsets.size(), " entries, not 2"));
          }
          entry->begin = offsets[0];
          entry->end = offsets[1];
        } else {
          return Error(absl::StrCat(where, "unknown field \"", Echo(key), "\""));
        }
        bool more = false;
        AMPD_RETURN_IF_ERROR(ParseSeparator('}', &more));
        if (!more) break;
      }
    } else {
      ++pos_;
    }
    if (!has_dtype) return Error(absl::StrCat(where, "missing \"dtype\""));
    if (!has_shape) return Error(absl::StrCat(where, "missing \"shape\""));
    if (!has_offsets) return Error(absl::StrCat(where, "missing \"data_offsets\""));
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// Byte size of a tensor, or nullopt when the element count overflows int64
// (even with a zero dim, since NumElements multiplies left to right
// and must not overflow on a shape we hand out).
std::optional<uint64_t> TensorBytes(DType dtype, const Shape& shape) {
  const auto max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t nonzero_product = 1;
  bool has_zero = false;
  for (int64_t d : shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud == 0) {
      has_zero = true;
      continue;
    }
    if (nonzero_product > max / ud) return std::nullopt;
    nonzero_product *= ud;
  }
  if (has_zero) return 0;
  const uint64_t size = SizeOf(dtype);
  if (nonzero_product > std::numeric_limits<uint64_t>::max() / size) return std::nullopt;
  return nonzero_product * size;
}

std::string DescribeTensor(const TensorEntry& t) {
  return absl::StrCat("tensor \"", Echo(t.name), "\" (", DTypeName(t.dtype), ShapeToString(t.shape),
                      ")");
}

}  // namespace

absl::Status ValidateStateDict(const StateDict& state) {
  std::set<absl::string_view> names;
  for (const NamedTensor& t : state.tensors) {
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError("tensor name \"__metadata__\" is reserved by safetensors");
    }
    if (!IsValidUtf8(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name \"", Echo(t.name), "\" is not valid UTF-8"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate tensor name \"", Echo(t.name), "\""));
    }
    AMPD_RETURN_IF_ERROR(t.tensor.Validate(absl::StrCat("tensor \"", Echo(t.name), "\"")));
  }
  for (const auto& [key, value] : state.metadata) {
    if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata \"", Echo(key), "\" is not valid UTF-8"));
    }
  }
  return absl::OkStatus();
}

std::string EncodeSafetensorsHeader(const StateDict& state) {
  std::string header = "{";
  bool first = true;
  if (!state.metadata.empty()) {
    // Metadata first, as the reference writes it.
    header.append("\"__metadata__\":{");
    for (const auto& [key, value] : state.metadata) {
      if (!first) header.push_back(',');
      first = false;
      AppendJsonString(key, &header);
      header.push_back(':');
      AppendJsonString(value, &header);
    }
    header.push_back('}');
    first = false;
  }
  uint64_t offset = 0;
  for (const NamedTensor& t : state.tensors) {
    if (!first) header.push_back(',');
    first = false;
    AppendJsonString(t.name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"", DTypeName(t.tensor.dtype), "\",\"shape\":[",
                    absl::StrJoin(t.tensor.shape, ","), "],\"data_offsets\":[", offset, ",",
                    offset + t.tensor.data.size(), "]}");
    offset += t.tensor.data.size();
  }
  header.push_back('}');
  header.append((kHeaderAlignment - header.size() % kHeaderAlignment) % kHeaderAlignment, ' ');

  std::string out;
  out.reserve(kLengthPrefixBytes + header.size());
  const uint64_t n = header.size();
  for (size_t i = 0; i < kLengthPrefixBytes; ++i) {
    out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));  // little-endian
  }
  out.append(header);
  return out;
}

std::string EncodeSafetensors(const StateDict& state) {
  std::string out = EncodeSafetensorsHeader(state);
  size_t data_bytes = 0;
  for (const NamedTensor& t : state.tensors) data_bytes += t.tensor.data.size();
  out.reserve(out.size() + data_bytes);
  for (const NamedTensor& t : state.tensors) out.append(t.tensor.data);
  return out;
}

uint64_t EncodedSafetensors::size() const {
  uint64_t n = header.size();
  for (const NamedTensor& t : state.tensors) n += t.tensor.data.size();
  return n;
}

void EncodedSafetensors::CopyOut(uint64_t offset, uint64_t length, std::string* out) const {
  const auto take = [&](absl::string_view piece) {
    if (length == 0) return;
    if (offset >= piece.size()) {
      offset -= piece.size();
      return;
    }
    const uint64_t n = std::min<uint64_t>(length, piece.size() - offset);
    out->append(piece.data() + offset, n);
    offset = 0;
    length -= n;
  };
  take(header);
  for (const NamedTensor& t : state.tensors) take(t.tensor.data);
}

namespace {

// A file received in pieces (a stream's chunks), read as one byte range.
class Pieces {
 public:
  explicit Pieces(absl::Span<const absl::string_view> pieces) : pieces_(pieces) {
    for (absl::string_view p : pieces_) size_ += p.size();
  }
  uint64_t size() const { return size_; }
  // Copies [offset, offset + length) to dst; the range is within size().
  // Sequential calls (each starting where the last ended) cost no search.
  void CopyTo(uint64_t offset, uint64_t length, char* dst) {
    if (offset < cursor_start_) cursor_ = cursor_start_ = 0;
    while (cursor_ < pieces_.size() && offset >= cursor_start_ + pieces_[cursor_].size()) {
      cursor_start_ += pieces_[cursor_].size();
      ++cursor_;
    }
    uint64_t in_piece = offset - cursor_start_;
    while (length > 0) {
      const absl::string_view p = pieces_[cursor_];
      const uint64_t n = std::min<uint64_t>(length, p.size() - in_piece);
      std::memcpy(dst, p.data() + in_piece, n);
      dst += n;
      length -= n;
      in_piece += n;
      if (in_piece == p.size() && length > 0) {
        cursor_start_ += p.size();
        ++cursor_;
        in_piece = 0;
      }
    }
  }

 private:
  absl::Span<const absl::string_view> pieces_;
  uint64_t size_ = 0;
  size_t cursor_ = 0;
  uint64_t cursor_start_ = 0;
};

uint64_t ReadLengthPrefix(absl::string_view prefix) {
  uint64_t n = 0;
  for (size_t i = 0; i < kLengthPrefixBytes; ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  }
  return n;
}

absl::Status CheckHeaderLength(uint64_t n) {
  if (n <= kMaxSafetensorsHeaderBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", n,
                                                 " exceeds the limit of ",
                                                 kMaxSafetensorsHeaderBytes, " bytes"));
}

// Offsets are relative to the buffer; tensors must tile it exactly, in
// header order, so the file has one meaning and no hidden bytes. Without a
// buffer_size (a file still arriving) only the tiling from 0 is checked;
// *tiled_end (optional) gets where the last tensor ends.
absl::Status CheckTiling(const Header& header, std::optional<uint64_t> buffer_size,
                         uint64_t* tiled_end) {
  uint64_t expected_begin = 0;
  for (const TensorEntry& t : header.tensors) {
    if (t.end < t.begin) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: ", DescribeTensor(t),
                                                     " has data_offsets [", t.begin, ", ", t.end,
                                                     "] that end before they begin"));
    }
    if (t.begin != expected_begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: ", DescribeTensor(t), " begins at ", t.begin, " but the ",
                       expected_begin == 0 ? "buffer starts at 0" : "previous tensor ends at ",
                       expected_begin == 0 ? "" : absl::StrCat(expected_begin),
                       " (tensors must be contiguous, without gaps or overlaps, in header order)"));
    }
    const std::optional<uint64_t> nbytes = TensorBytes(t.dtype, t.shape);
    if (!nbytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: ", DescribeTensor(t), " has too many elements"));
    }
    if (*nbytes != t.end - t.begin) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: ", DescribeTensor(t), " needs ",
                                                     *nbytes, " bytes but data_offsets [", t.begin,
                                                     ", ", t.end, "] span ", t.end - t.begin));
    }
    if (buffer_size.has_value() && t.end > *buffer_size) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: ", DescribeTensor(t),
                                                     " ends at ", t.end, ", past the end of the ",
                                                     *buffer_size, "-byte buffer"));
    }
    expected_begin = t.end;
  }
  if (buffer_size.has_value() && expected_begin != *buffer_size) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: ", *buffer_size - expected_begin,
                                                   " trailing bytes after the last tensor"));
  }
  if (tiled_end != nullptr) *tiled_end = expected_begin;
  return absl::OkStatus();
}

// The length prefix and the parsed header of a `total`-byte file whose first
// bytes are `head` (at least the prefix and the header when they fit in
// `total`); *header_end is where the tensor buffer starts.
absl::StatusOr<Header> DecodeHeader(absl::string_view head, uint64_t total, uint64_t* header_end) {
  if (total < kLengthPrefixBytes || head.size() < kLengthPrefixBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: ", total, " bytes is shorter than the 8-byte header length"));
  }
  const uint64_t n = ReadLengthPrefix(head);
  AMPD_RETURN_IF_ERROR(CheckHeaderLength(n));
  if (n > total - kLengthPrefixBytes || n > head.size() - kLengthPrefixBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: header length ", n, " runs past the end of the ", total, "-byte input"));
  }
  const absl::string_view text = head.substr(kLengthPrefixBytes, n);
  *header_end = kLengthPrefixBytes + n;
  if (!IsValidUtf8(text)) {
    return absl::InvalidArgumentError("safetensors: header is not valid UTF-8");
  }
  return HeaderParser(text).Parse();
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> DecodeSafetensorsMetadata(
    absl::string_view bytes) {
  uint64_t header_end = 0;
  AMPD_ASSIGN_OR_RETURN(Header header, DecodeHeader(bytes, bytes.size(), &header_end));
  return std::move(header.metadata);
}

absl::StatusOr<uint64_t> DecodeSafetensorsHeaderLength(absl::string_view prefix) {
  if (prefix.size() < kLengthPrefixBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: ", prefix.size(), " bytes is shorter than the 8-byte header length"));
  }
  const uint64_t n = ReadLengthPrefix(prefix);
  AMPD_RETURN_IF_ERROR(CheckHeaderLength(n));
  return n;
}

absl::StatusOr<SafetensorsLayout> DecodeSafetensorsLayout(absl::string_view head) {
  uint64_t header_end = 0;
  // The file is at least what is here; its real length is the caller's.
  AMPD_ASSIGN_OR_RETURN(Header header, DecodeHeader(head, head.size(), &header_end));
  uint64_t tiled_end = 0;
  AMPD_RETURN_IF_ERROR(CheckTiling(header, std::nullopt, &tiled_end));
  if (tiled_end > std::numeric_limits<uint64_t>::max() - header_end) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: the tensors end at ", tiled_end, ", past any file length"));
  }
  SafetensorsLayout layout;
  layout.header_bytes = header_end;
  layout.file_bytes = header_end + tiled_end;
  layout.metadata = std::move(header.metadata);
  layout.tensors.reserve(header.tensors.size());
  for (TensorEntry& t : header.tensors) {
    layout.tensors.push_back({std::move(t.name), t.dtype, std::move(t.shape), t.begin, t.end});
  }
  return layout;
}

absl::StatusOr<StateDict> DecodeSafetensors(absl::string_view bytes) {
  return DecodeSafetensors(absl::MakeConstSpan(&bytes, 1));
}

absl::StatusOr<StateDict> DecodeSafetensors(absl::Span<const absl::string_view> pieces) {
  Pieces file(pieces);
  // Only the header is gathered into one string; the tensors are copied
  // from the pieces straight into their own buffers.
  std::string head(static_cast<size_t>(std::min<uint64_t>(file.size(), kLengthPrefixBytes)), '\0');
  file.CopyTo(0, head.size(), head.data());
  if (head.size() == kLengthPrefixBytes) {
    const uint64_t n = ReadLengthPrefix(head);
    if (n <= kMaxSafetensorsHeaderBytes && n <= file.size() - kLengthPrefixBytes) {
      head.resize(kLengthPrefixBytes + n);
      file.CopyTo(kLengthPrefixBytes, n, head.data() + kLengthPrefixBytes);
    }
  }
  uint64_t header_end = 0;
  AMPD_ASSIGN_OR_RETURN(Header header, DecodeHeader(head, file.size(), &header_end));
  const uint64_t buffer_size = file.size() - header_end;

  AMPD_RETURN_IF_ERROR(CheckTiling(header, buffer_size, nullptr));

  StateDict state;
  state.metadata = std::move(header.metadata);
  state.tensors.reserve(header.tensors.size());
  for (TensorEntry& t : header.tensors) {
    NamedTensor named;
    named.name = std::move(t.name);
    named.tensor.dtype = t.dtype;
    named.tensor.shape = std::move(t.shape);
    ResizeForBulkCopy(&named.tensor.data, t.end - t.begin);
    file.CopyTo(header_end + t.begin, t.end - t.begin, named.tensor.data.data());
    state.tensors.push_back(std::move(named));
  }
  return state;
}

}  // namespace ampd::codec
