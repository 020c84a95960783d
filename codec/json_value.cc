// ParseJson: a recursive-descent reader of one JSON document (RFC 8259),
// depth-bounded, into JsonValue.
#include "codec/json_value.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "codec/json_text.h"

namespace ampd::codec {
namespace {

class Parser {
 public:
  explicit Parser(absl::string_view s) : s_(s) {}

  absl::StatusOr<JsonValue> Document() {
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
    while (true) {
      SkipJsonSpace(s_, &pos_);
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("a key expected");
      std::string key;
      if (absl::Status st = ReadJsonString(s_, &pos_, &key); !st.ok()) return Error(st.message());
      if (out->Find(key) != nullptr) return Error(absl::StrCat("the key \"", key, "\" twice"));
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

}  // namespace ampd::codec
