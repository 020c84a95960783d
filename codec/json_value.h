// JsonValue: a JSON document read whole into a tree, for the files ampd
// reads but does not write (a Hugging Face config.json, an index of sharded
// weights). Strict where a silent guess would change what is read: a
// duplicate key, trailing text, bytes that are not UTF-8 or nesting deeper
// than kMaxJsonDepth is an error (found in time linear in the text's size); numbers keep their
// literal so that an integer field is read exactly. String literals are json_text.h's.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ampd::codec {

inline constexpr int kMaxJsonDepth = 64;

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  std::string text;  // kNumber: the literal; kString: the decoded bytes
  std::vector<JsonValue> items;
  // In document order; keys unique.
  std::vector<std::pair<std::string, JsonValue>> members;

  // Declared here and defaulted in json_value.cc, where JsonValue is
  // complete: members' pair<string, JsonValue> needs it (libstdc++ under
  // clang checks at the implicit members' point of definition).
  JsonValue();
  ~JsonValue();
  JsonValue(const JsonValue&);
  JsonValue(JsonValue&&) noexcept;
  JsonValue& operator=(const JsonValue&);
  JsonValue& operator=(JsonValue&&) noexcept;

  // The member named key of an object; nullptr when absent or not an object.
  const JsonValue* Find(absl::string_view key) const;
  bool is_null() const { return type == Type::kNull; }
};

// Python's truthiness of a value that may be absent (nullptr): how the
// Hugging Face and PEFT readers test a key written as `if config.key`, whose
// "not set" may be null, false, 0, "", [] or {} alike.
bool JsonTruthy(const JsonValue* v);

// InvalidArgument naming the problem and its byte offset.
absl::StatusOr<JsonValue> ParseJson(absl::string_view text);

}  // namespace ampd::codec
