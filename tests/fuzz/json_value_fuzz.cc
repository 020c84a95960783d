// libFuzzer target: codec's JSON reader (ParseJson), which reads the
// config.json text a client sends in CreateJob (JobConfig.hf_config_json)
// and --models-dir's config.json and index files. Any input must be refused
// with a Status or parsed into a tree that keeps the reader's promises
// (unique keys, bounded depth, UTF-8 strings); what parses must write
// (hf::JsonText, the export's writer) and parse again to the same text.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "absl/strings/string_view.h"
#include "codec/json_value.h"
#include "server/engine/model/hf_config_writer.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {

using ampd::codec::JsonValue;
using ampd::fuzz::Check;

void CheckTree(const JsonValue& v, int depth) {
  Check(depth <= ampd::codec::kMaxJsonDepth, "a parsed tree is no deeper than kMaxJsonDepth");
  switch (v.type) {
    case JsonValue::Type::kNumber:
      Check(!v.text.empty(), "a number keeps its literal");
      break;
    case JsonValue::Type::kArray:
      for (const JsonValue& item : v.items) CheckTree(item, depth + 1);
      break;
    case JsonValue::Type::kObject: {
      std::set<std::string> keys;
      for (const auto& [key, value] : v.members) {
        Check(keys.insert(key).second, "an object's keys are unique");
        Check(v.Find(key) == &value, "Find finds each member");
        CheckTree(value, depth + 1);
      }
      break;
    }
    default:
      Check(v.items.empty() && v.members.empty(), "a scalar has no children");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<JsonValue> parsed = ampd::codec::ParseJson(text);
  if (!parsed.ok()) {
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument,
          "a refused document is InvalidArgument");
    return 0;
  }
  CheckTree(*parsed, 0);
  const std::string written = ampd::engine::model::hf::JsonText(*parsed);
  absl::StatusOr<JsonValue> again = ampd::codec::ParseJson(written);
  Check(again.ok(), "a parsed document, written, parses again");
  Check(ampd::engine::model::hf::JsonText(*again) == written,
        "a written document reads back as itself");
  return 0;
}
