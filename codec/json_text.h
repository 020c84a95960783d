// The JSON text ampd's two strict readers share (safetensors headers, and
// a checkpoint's job config in server/engine/config/job_config_codec.cc):
// whitespace, string literals with every escape and surrogate pairs, and the one way ampd
// writes a string. Each reader keeps its own grammar and error wording on
// top (a schema-driven header parser, a small document reader); what a
// string literal means, and which are refused, is decided here once.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ampd::codec {

// JSON's four whitespace characters.
void SkipJsonSpace(absl::string_view text, size_t* pos);

// Reads the string literal at text[*pos] (which must be '"') into *out,
// unescaped, and leaves *pos just past its closing quote. Bytes >= 0x80 are
// copied as they are (a caller that needs UTF-8 checks the whole text). A
// malformed literal (unterminated, a raw control character, an unknown
// escape, a short or non-hex \u escape, a lone surrogate) is
// InvalidArgument whose message is that problem alone ("a lone high
// surrogate"), with *pos where it was found: the caller adds its own code,
// context and position.
absl::Status ReadJsonString(absl::string_view text, size_t* pos, std::string* out);

// Appends s as a JSON string literal, escaped as serde_json escapes (the
// safetensors reference writer, so that headers match it byte for byte):
// '"', '\\', the short control escapes, other control characters as \u00xx
// in lowercase hex, everything else (non-ASCII included) verbatim.
void AppendJsonString(absl::string_view s, std::string* out);

}  // namespace ampd::codec
