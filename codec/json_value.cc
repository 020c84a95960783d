// ParseJson: a recursive-descent reader of one JSON document (RFC 8259),
// depth-bounded, UTF-8 only, into JsonValue.
#include "codec/json_value.h"

#include <unordered_set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "codec/json_text.h"

namespace ampd::codec {
namespace {

// The offset of the first byte of text that is not strict UTF-8 (no
// overlong forms, no surrogates, nothing above U+10FFFF), or npos. RFC 8259
// documents are UTF-8; a key or string of other bytes would otherwise reach
// error messages and ErrorInfo, which must be UTF-8 on the wire.
size_t FirstNonUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = 1;
    uint32_t cp = c;
    if (c >= 0x80) {
      if (c >= 0xC2 && c <= 0xDF) {
        len = 2, cp = c & 0x1F;
      } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, cp = c & 0x0F;
      } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, cp = c & 0x07;
      } else {
        return i;
      }
      if (s.size() - i < len) return i;
      for (size_t k = 1; k < len; ++k) {
        const auto cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xC0) != 0x80) return i;
        cp = (cp << 6) | (cc & 0x3F);
      }
      if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
          (cp >= 0xD800 && cp <= 0xDFFF)) {
        return i;
      }
    }
    i += len;
  }
  return absl::string_view::npos;
}

class Parser {
 public:
  explicit Parser(absl::string_view s) : s_(s) {}

  absl::StatusOr<JsonValue> Document() {
    if (const size_t bad = FirstNonUtf8(s_); bad != absl::string_view::npos) {
      pos_ = bad;
      return Error("not UTF-8");
    }
    SkipJsonSpace(s_, &pos_);
    JsonValue v;
    if (absl::Status st = Value(0, &v); !st.ok()) return st;
    SkipJsonSpace(s_, &pos_);
    if (pos_ != s_.size()) return Error("characters after the value");
    return v;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("not a JSON document: ", what, " at offset ", pos_));
  }

  bool Consume(absl::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status Value(int depth, JsonValue* out) {
    if (depth > kMaxJsonDepth) return Error("nested too deep");
    if (pos_ >= s_.size()) return Error("a value expected");
    const char c = s_[pos_];
    if (c == '{') return Object(depth, out);
    if (c == '[') return Array(depth, out);
    if (c == '"') {
      out->type = JsonValue::Type::kString;
      if (absl::Status st = ReadJsonString(s_, &pos_, &out->text); !st.ok()) {
        return Error(st.message());
      }
      return absl::OkStatus();
    }
    if (Consume("true") || Consume("false")) {
      out->type = JsonValue::Type::kBool;
      out->boolean = s_[pos_ - 2] == 'u';  // tr(u)e, not fal(s)e
      return absl::OkStatus();
    }
    if (Consume("null")) return absl::OkStatus();
    return Number(out);
  }

  absl::Status Number(JsonValue* out) {
    const size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      return pos_ > from;
    };
    if (!digits()) return Error("a value expected");
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) return Error("a digit expected after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) return Error("a digit expected in the exponent");
    }
    out->type = JsonValue::Type::kNumber;
    out->text = std::string(s_.substr(start, pos_ - start));
    return absl::OkStatus();
  }

  absl::Status Array(int depth, JsonValue* out) {
    out->type = JsonValue::Type::kArray;
    ++pos_;
    SkipJsonSpace(s_, &pos_);
    if (Consume("]")) return absl::OkStatus();
    while (true) {
      SkipJsonSpace(s_, &pos_);
      out->items.emplace_back();
      if (absl::Status st = Value(depth + 1, &out->items.back()); !st.ok()) return st;
      SkipJsonSpace(s_, &pos_);
      if (Consume("]")) return absl::OkStatus();
      if (!Consume(",")) return Error("',' or ']' expected");
    }
  }

  absl::Status Object(int depth, JsonValue* out) {
    out->type = JsonValue::Type::kObject;
    ++pos_;
    SkipJsonSpace(s_, &pos_);
    if (Consume("}")) return absl::OkStatus();
    // The keys so far, hashed: a linear Find per key would make an object
    // of n keys cost n^2 / 2 comparisons (seconds for a 1 MiB request).
    std::unordered_set<std::string> keys;
    while (true) {
      SkipJsonSpace(s_, &pos_);
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("a key expected");
      std::string key;
      if (absl::Status st = ReadJsonString(s_, &pos_, &key); !st.ok()) return Error(st.message());
      if (!keys.insert(key).second) return Error(absl::StrCat("the key \"", key, "\" twice"));
      SkipJsonSpace(s_, &pos_);
      if (!Consume(":")) return Error("':' expected");
      SkipJsonSpace(s_, &pos_);
      out->members.emplace_back(std::move(key), JsonValue());
      if (absl::Status st = Value(depth + 1, &out->members.back().second); !st.ok()) return st;
      SkipJsonSpace(s_, &pos_);
      if (Consume("}")) return absl::OkStatus();
      if (!Consume(",")) return Error("',' or '}' expected");
    }
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

JsonValue::JsonValue() = default;
JsonValue::~JsonValue() = default;
JsonValue::JsonValue(const JsonValue&) = default;
JsonValue::JsonValue(JsonValue&&) noexcept = default;
JsonValue& JsonValue::operator=(const JsonValue&) = default;
JsonValue& JsonValue::operator=(JsonValue&&) noexcept = default;

const JsonValue* JsonValue::Find(absl::string_view key) const {
  if (type != Type::kObject) return nullptr;
  for (const auto& [k, v] : members) {
    if (k == key) return &v;
  }
  return nullptr;
}

absl::StatusOr<JsonValue> ParseJson(absl::string_view text) { return Parser(text).Document(); }

bool JsonTruthy(const JsonValue* v) {
  if (v == nullptr) return false;
  switch (v->type) {
    case JsonValue::Type::kBool:
      return v->boolean;
    case JsonValue::Type::kNumber: {
      double d = 0;
      return !absl::SimpleAtod(v->text, &d) || d != 0;
    }
    case JsonValue::Type::kString:
      return !v->text.empty();
    case JsonValue::Type::kArray:
      return !v->items.empty();
    case JsonValue::Type::kObject:
      return !v->members.empty();
    case JsonValue::Type::kNull:
      return false;
  }
  return false;
}

}  // namespace ampd::codec
