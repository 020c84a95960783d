// ParseJson's strictness and bounds: the refusals that keep a hostile
// config.json or index from reaching the mapping (duplicate keys, bytes
// that are not UTF-8, nesting past kMaxJsonDepth) and the time an object
// of many keys takes.
#include "codec/json_value.h"

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ampd::codec {
namespace {

using ::testing::HasSubstr;

TEST(JsonValueTest, ReadsADocumentWithItsLiterals) {
  absl::StatusOr<JsonValue> v = ParseJson(R"({"a": [1, 2.50, "x\u00e9"], "b": null, "c": true})");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_NE(v->Find("a"), nullptr);
  EXPECT_EQ(v->Find("a")->items[1].text, "2.50");
  EXPECT_EQ(v->Find("a")->items[2].text, "x\xc3\xa9");
  EXPECT_TRUE(v->Find("b")->is_null());
  EXPECT_TRUE(v->Find("c")->boolean);
}

TEST(JsonValueTest, RefusesADuplicateKey) {
  absl::StatusOr<JsonValue> v = ParseJson(R"({"a": 1, "b": {"a": 2}, "a": 3})");
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(v.status().message(), HasSubstr("the key \"a\" twice"));
  // The same key in two objects is no duplicate.
  EXPECT_TRUE(ParseJson(R"({"a": {"a": 1}, "b": {"a": 2}})").ok());
}

TEST(JsonValueTest, RefusesTextThatIsNotUtf8) {
  for (const std::string& text : {std::string("{\"k\": \"\xff\"}"), std::string("\"\xc0\xaf\""),
                                  std::string("\"\xed\xa0\x80\""), std::string("\"\xe2\x82\""),
                                  std::string("{\"\xf5\x80\x80\x80\": 1}")}) {
    absl::StatusOr<JsonValue> v = ParseJson(text);
    ASSERT_FALSE(v.ok()) << text;
    EXPECT_THAT(v.status().message(), HasSubstr("not UTF-8")) << text;
  }
  EXPECT_TRUE(ParseJson("\"\xf0\x9f\x98\x80 \xe2\x82\xac\"").ok());
}

TEST(JsonValueTest, RefusesNestingPastTheLimit) {
  const int deep = kMaxJsonDepth + 1;
  EXPECT_TRUE(
      ParseJson(std::string(kMaxJsonDepth + 1, '[') + std::string(kMaxJsonDepth + 1, ']')).ok());
  absl::StatusOr<JsonValue> v = ParseJson(std::string(deep + 1, '[') + std::string(deep + 1, ']'));
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(v.status().message(), HasSubstr("nested too deep"));
}

TEST(JsonValueTest, AnObjectOfManyKeysTakesLinearTime) {
  // 100k keys: a scan per key took ~10 s; a hash finds the duplicate in
  // tens of milliseconds. The bound guards the complexity, not the speed:
  // it is ~40x what a linear reader needs on a loaded 2-core machine.
  std::string text = "{";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&text, "\"", i, "\": 0, ");
  text += "\"99999\": 1}";
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<JsonValue> v = ParseJson(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(v.status().message(), HasSubstr("the key \"99999\" twice"));
  EXPECT_LT(seconds, 2.0);
}

TEST(JsonValueTest, TruthyIsPythons) {
  // Absent, null, false, 0, "", [] and {} are "not set"; anything else is.
  EXPECT_FALSE(JsonTruthy(nullptr));
  for (const char* text : {"null", "false", "0", "0.0", "-0", "\"\"", "[]", "{}"}) {
    absl::StatusOr<JsonValue> v = ParseJson(text);
    ASSERT_TRUE(v.ok()) << text;
    EXPECT_FALSE(JsonTruthy(&*v)) << text;
  }
  for (const char* text : {"true", "1", "-2.5", "1e-300", "\"x\"", "[0]", "{\"a\": null}"}) {
    absl::StatusOr<JsonValue> v = ParseJson(text);
    ASSERT_TRUE(v.ok()) << text;
    EXPECT_TRUE(JsonTruthy(&*v)) << text;
  }
}

}  // namespace
}  // namespace ampd::codec
