// JSON whitespace, string literals and their writer (see json_text.h).
#include "codec/json_text.h"

#include <cstdint>

namespace ampd::codec {
namespace {

absl::Status Problem(absl::string_view what) { return absl::InvalidArgumentError(what); }

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Four hex digits of a \u escape at text[*pos].
absl::Status ReadHex4(absl::string_view text, size_t* pos, uint32_t* unit) {
  if (text.size() - *pos < 4) return Problem("a short \\u escape");
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const char c = text[(*pos)++];
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint32_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= static_cast<uint32_t>(c - 'A' + 10);
    } else {
      return Problem("a bad hex digit in a \\u escape");
    }
  }
  *unit = v;
  return absl::OkStatus();
}

}  // namespace

void SkipJsonSpace(absl::string_view text, size_t* pos) {
  while (*pos < text.size() &&
         (text[*pos] == ' ' || text[*pos] == '\t' || text[*pos] == '\n' || text[*pos] == '\r')) {
    ++*pos;
  }
}

absl::Status ReadJsonString(absl::string_view text, size_t* pos, std::string* out) {
  if (*pos >= text.size() || text[*pos] != '"') return Problem("expected a string");
  ++*pos;
  out->clear();
  while (true) {
    if (*pos >= text.size()) return Problem("an unterminated string");
    const char c = text[(*pos)++];
    if (c == '"') return absl::OkStatus();
    if (static_cast<unsigned char>(c) < 0x20) return Problem("a control character in a string");
    if (c != '\\') {
      out->push_back(c);
      continue;
    }
    if (*pos >= text.size()) return Problem("an unterminated string");
    const char e = text[(*pos)++];
    switch (e) {
      case '"':
      case '\\':
      case '/':
        out->push_back(e);
        break;
      case 'b':
        out->push_back('\b');
        break;
      case 'f':
        out->push_back('\f');
        break;
      case 'n':
        out->push_back('\n');
        break;
      case 'r':
        out->push_back('\r');
        break;
      case 't':
        out->push_back('\t');
        break;
      case 'u': {
        uint32_t unit = 0;
        if (absl::Status s = ReadHex4(text, pos, &unit); !s.ok()) return s;
        if (unit >= 0xDC00 && unit <= 0xDFFF) return Problem("a lone low surrogate");
        if (unit >= 0xD800 && unit <= 0xDBFF) {
          // A high surrogate must be followed by an escaped low one.
          if (text.size() - *pos < 2 || text[*pos] != '\\' || text[*pos + 1] != 'u') {
            return Problem("a lone high surrogate");
          }
          *pos += 2;
          uint32_t low = 0;
          if (absl::Status s = ReadHex4(text, pos, &low); !s.ok()) return s;
          if (low < 0xDC00 || low > 0xDFFF) return Problem("a lone high surrogate");
          unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
        }
        AppendUtf8(unit, out);
        break;
      }
      default:
        return Problem("a bad escape");
    }
  }
}

void AppendJsonString(absl::string_view s, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20) {
          out->append("\\u00");
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 0xf]);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

}  // namespace ampd::codec
