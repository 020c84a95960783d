// safetensors: round trips of every dtype, the exact bytes the reference
// library writes, a decode error for each kind of malformed file, and a fuzz
// loop proving hostile bytes give an error rather than a crash.
#include "codec/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/safetensors_receiver.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ampd::codec {
namespace {

using ::testing::HasSubstr;

// A tensor whose bytes are a recognisable pattern (index + seed).
HostTensor MakeTensor(DType dtype, Shape shape, int seed = 0) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const size_t n = static_cast<size_t>(NumElements(t.shape)) * SizeOf(dtype);
  for (size_t i = 0; i < n; ++i) t.data.push_back(static_cast<char>((i * 7 + seed) & 0xFF));
  return t;
}

// A file from a raw header and buffer: the length prefix and nothing else,
// so malformed headers can be written exactly as a hostile client would.
std::string RawFile(const std::string& header, const std::string& buffer = "") {
  std::string out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  return out + header + buffer;
}

void ExpectSameState(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    SCOPED_TRACE(a.tensors[i].name);
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].tensor.dtype, b.tensors[i].tensor.dtype);
    EXPECT_EQ(a.tensors[i].tensor.shape, b.tensors[i].tensor.shape);
    EXPECT_EQ(a.tensors[i].tensor.data, b.tensors[i].tensor.data);
  }
  EXPECT_EQ(a.metadata, b.metadata);
}

StateDict EveryKindOfState() {
  StateDict s;
  s.tensors.push_back({"model.0.weight", MakeTensor(DType::kF32, {4, 3}, 1)});
  s.tensors.push_back({"model.0.bias", MakeTensor(DType::kF16, {3}, 2)});
  s.tensors.push_back({"bf16", MakeTensor(DType::kBF16, {2, 2, 2}, 3)});
  s.tensors.push_back({"i32", MakeTensor(DType::kI32, {5}, 4)});
  s.tensors.push_back({"i64", MakeTensor(DType::kI64, {1, 2}, 5)});
  s.tensors.push_back({"scalar", MakeTensor(DType::kF32, {}, 6)});  // 0-dim: shape []
  s.tensors.push_back({"empty", MakeTensor(DType::kF16, {0}, 7)});
  s.tensors.push_back({"empty3d", MakeTensor(DType::kI64, {3, 0, 2}, 8)});
  s.tensors.push_back({"na\xC3\xAFve \"quoted\" \\name", MakeTensor(DType::kBF16, {}, 9)});
  s.metadata["scaler.scale"] = "65536";
  s.metadata["quote\"s"] = "back\\slash \"and\" quotes";
  s.metadata["unicode"] = "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";    // é € U+1F600
  static constexpr char kControl[] = "tab\tnl\nnul\0x\x01\x1F\x7F";  // embedded NUL
  s.metadata["control"] = std::string(kControl, sizeof(kControl) - 1);
  s.metadata["empty"] = "";
  return s;
}

TEST(SafetensorsTest, RoundTripsEveryDTypeShapeAndMetadata) {
  const StateDict state = EveryKindOfState();
  ASSERT_TRUE(ValidateStateDict(state).ok());
  const std::string bytes = EncodeSafetensors(state);
  absl::StatusOr<StateDict> decoded = DecodeSafetensors(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameState(state, *decoded);
  for (const NamedTensor& t : decoded->tensors) EXPECT_TRUE(t.tensor.Validate(t.name).ok());
  // Encoding is deterministic, so a re-encode is byte-identical.
  EXPECT_EQ(EncodeSafetensors(*decoded), bytes);
}

// Streaming writers send the header and then the tensors' bytes from where
// they are; every slicing of that must be the encoded file, byte for byte.
TEST(SafetensorsTest, HeaderAndTensorSlicesAreTheEncodedFile) {
  EncodedSafetensors file;
  file.state = EveryKindOfState();
  file.header = EncodeSafetensorsHeader(file.state);
  const std::string whole = EncodeSafetensors(file.state);
  ASSERT_EQ(file.size(), whole.size());
  EXPECT_EQ(whole.substr(0, file.header.size()), file.header);
  for (uint64_t chunk : {uint64_t{1}, uint64_t{3}, uint64_t{8}, uint64_t{61}, file.size()}) {
    std::string streamed;
    for (uint64_t offset = 0; offset < file.size(); offset += chunk) {
      file.CopyOut(offset, chunk, &streamed);
    }
    EXPECT_EQ(streamed, whole) << "chunk " << chunk;
  }
  std::string past_end;
  file.CopyOut(file.size() - 2, 100, &past_end);
  EXPECT_EQ(past_end, whole.substr(whole.size() - 2));
}

// The metadata alone, from the file's first bytes (no tensor bytes needed),
// and the same errors as a full decode for a header that is cut short.
TEST(SafetensorsTest, MetadataDecodesFromTheHeaderAlone) {
  const StateDict state = EveryKindOfState();
  const std::string header = EncodeSafetensorsHeader(state);
  absl::StatusOr<std::map<std::string, std::string>> metadata = DecodeSafetensorsMetadata(header);
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  EXPECT_EQ(*metadata, state.metadata);
  EXPECT_THAT(DecodeSafetensorsMetadata(header.substr(0, header.size() - 1)).status().message(),
              HasSubstr("runs past the end"));
  EXPECT_EQ(DecodeSafetensorsMetadata("abc").status().code(), absl::StatusCode::kInvalidArgument);
}

// A file received in chunks decodes exactly as the joined file does, for
// every split (empty pieces included), and a cut-short file fails the same.
TEST(SafetensorsTest, DecodesFromPiecesAsFromTheJoinedFile) {
  const StateDict state = EveryKindOfState();
  const std::string whole = EncodeSafetensors(state);
  for (size_t chunk : {size_t{1}, size_t{5}, size_t{8}, size_t{64}, whole.size()}) {
    std::vector<absl::string_view> pieces;
    for (size_t offset = 0; offset < whole.size(); offset += chunk) {
      pieces.push_back(absl::string_view(whole).substr(offset, chunk));
      pieces.push_back(absl::string_view());
    }
    absl::StatusOr<StateDict> decoded = DecodeSafetensors(absl::MakeConstSpan(pieces));
    ASSERT_TRUE(decoded.ok()) << "chunk " << chunk << ": " << decoded.status();
    ExpectSameState(state, *decoded);
  }
  for (size_t cut : {size_t{0}, size_t{3}, size_t{12}, whole.size() - 1}) {
    const absl::string_view prefix = absl::string_view(whole).substr(0, cut);
    std::vector<absl::string_view> pieces;
    for (size_t offset = 0; offset < prefix.size(); offset += 7) {
      pieces.push_back(prefix.substr(offset, 7));
    }
    EXPECT_EQ(DecodeSafetensors(absl::MakeConstSpan(pieces)).status(),
              DecodeSafetensors(prefix).status())
        << "cut " << cut;
  }
}

TEST(SafetensorsTest, HeaderIsPaddedWithSpacesToAMultipleOfEight) {
  // Names of growing length walk the unpadded header through every residue.
  for (int len = 1; len <= 16; ++len) {
    StateDict s;
    s.tensors.push_back({std::string(static_cast<size_t>(len), 'x'), MakeTensor(DType::kF16, {1})});
    const std::string bytes = EncodeSafetensors(s);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i)
      n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    EXPECT_EQ(n % 8, 0u) << len;
    ASSERT_EQ(bytes.size(), 8 + n + 2);
    const std::string header = bytes.substr(8, n);
    const size_t close = header.rfind('}');
    EXPECT_LT(header.size() - 1 - close, 8u);  // never a whole extra block
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);
  }
}

// The bytes Python's safetensors.torch.save_file writes for
//   {"a": tensor([1., -2.]), "b": tensor(1., dtype=torch.float16)}
// with metadata {"format": "pt"}: the reference sorts tensors by dtype
// (F32 before F16), which is also our order here.
TEST(SafetensorsTest, MatchesTheReferenceBytesExactly) {
  StateDict s;
  HostTensor a;
  a.dtype = DType::kF32;
  a.shape = {2};
  a.data = std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);  // 1.0f, -2.0f little-endian
  HostTensor b;
  b.dtype = DType::kF16;
  b.shape = {};
  b.data = std::string("\x00\x3c", 2);  // half 1.0 = 0x3C00
  s.tensors.push_back({"a", a});
  s.tensors.push_back({"b", b});
  s.metadata["format"] = "pt";

  // Compact JSON, metadata first: 138 bytes, so 6 spaces of padding to 144.
  const std::string json = R"({"__metadata__":{"format":"pt"},)"
                           R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F16","shape":[],"data_offsets":[8,10]}})";
  ASSERT_EQ(json.size(), 138u);
  const std::string expected = std::string("\x90\x00\x00\x00\x00\x00\x00\x00", 8) + json +
                               "      " + std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8) +
                               std::string("\x00\x3c", 2);
  ASSERT_EQ(expected.size(), 8u + 144u + 10u);
  EXPECT_EQ(EncodeSafetensors(s), expected);

  absl::StatusOr<StateDict> decoded = DecodeSafetensors(expected);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectSameState(s, *decoded);
}

TEST(SafetensorsTest, EmptyStateIsAnEmptyObjectPadded) {
  const std::string expected = std::string("\x08\x00\x00\x00\x00\x00\x00\x00", 8) + "{}      ";
  EXPECT_EQ(EncodeSafetensors(StateDict{}), expected);
  absl::StatusOr<StateDict> decoded = DecodeSafetensors(expected);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->tensors.empty());
  EXPECT_TRUE(decoded->metadata.empty());
}

TEST(SafetensorsTest, EscapesStringsAsSerdeJsonDoes) {
  StateDict s;
  s.metadata["k"] = "a\"b\\c/\b\f\n\r\t\x01\x1f\xC3\xA9";
  const std::string bytes = EncodeSafetensors(s);
  // serde_json: short escapes, other controls as lowercase \u00xx, '/' and
  // non-ASCII verbatim.
  EXPECT_THAT(bytes, HasSubstr(R"({"__metadata__":{"k":"a\"b\\c/\b\f\n\r\t\u0001\u001f)"
                               "\xC3\xA9\"}}"));
}

TEST(SafetensorsTest, DecodesEscapesWhitespaceAndMetadataAnywhere) {
  // What other writers may produce: pretty-printed JSON, \u escapes (a
  // surrogate pair included), "\/", metadata after the tensors.
  const std::string header =
      "{\n  \"t\\u00e9\\/x\" : { \"shape\" : [ 2 ] , \"dtype\" : \"I32\",\n"
      "    \"data_offsets\" : [0, 8] },\n"
      "  \"__metadata__\" : { \"smile\" : \"\\ud83d\\ude00\", \"e\": \"\\u00E9\" }\n}\t\r\n ";
  absl::StatusOr<StateDict> decoded = DecodeSafetensors(RawFile(header, std::string(8, '\x05')));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->tensors.size(), 1u);
  EXPECT_EQ(decoded->tensors[0].name, "t\xC3\xA9/x");
  EXPECT_EQ(decoded->tensors[0].tensor.dtype, DType::kI32);
  EXPECT_EQ(decoded->tensors[0].tensor.shape, Shape({2}));
  EXPECT_EQ(decoded->metadata.at("smile"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(decoded->metadata.at("e"), "\xC3\xA9");
  // An empty "__metadata__" object is what save_file(..., metadata={}) writes.
  EXPECT_TRUE(DecodeSafetensors(RawFile(R"({"__metadata__":{}})")).ok());
}

struct BadCase {
  const char* label;
  std::string file;
  const char* message;  // a substring the error must contain
};

std::vector<BadCase> BadCases() {
  const std::string f32x2 = std::string(8, '\0');
  return {
      {"too short", std::string("\x02\x00\x00", 3), "shorter than the 8-byte header length"},
      {"header over 100 MB", std::string("\x01\xe1\xf5\x05\x00\x00\x00\x00{}", 10),
       "exceeds the limit"},
      {"header length past the end", std::string("\x40\x00\x00\x00\x00\x00\x00\x00{}", 10),
       "runs past the end"},
      {"huge header length", std::string(8, '\xff') + "{}", "exceeds the limit"},
      {"does not start with {", RawFile(" {}"), "does not start with '{'"},
      {"not an object", RawFile("[]"), "does not start with '{'"},
      {"empty header", RawFile(""), "does not start with '{'"},
      {"missing colon", RawFile(R"({"a" {}})"), "expected ':'"},
      {"unterminated string", RawFile(R"({"abc)"), "unterminated string"},
      {"unterminated object", RawFile(R"({"__metadata__":{}  )"), "expected ',' or '}'"},
      {"trailing comma", RawFile(R"({"__metadata__":{},})"), "expected a string"},
      {"junk after object", RawFile("{}  x"), "unexpected bytes after"},
      {"second object", RawFile("{}{}"), "unexpected bytes after"},
      {"invalid utf-8", RawFile("{\"\xC3\x28\":{}}"), "not valid UTF-8"},
      {"overlong utf-8", RawFile("{\"\xC0\xAF\":{}}"), "not valid UTF-8"},
      {"raw control char", RawFile("{\"a\x01\":{}}"), "control character"},
      {"bad escape", RawFile(R"({"__metadata__":{"a":"\x41"}})"), "bad escape"},
      {"bad hex", RawFile(R"({"__metadata__":{"a":"\u00g1"}})"), "bad hex digit"},
      {"lone high surrogate", RawFile(R"({"__metadata__":{"a":"\ud83dx"}})"),
       "lone high surrogate"},
      {"lone low surrogate", RawFile(R"({"__metadata__":{"a":"\ude00"}})"), "lone low surrogate"},
      {"metadata value not a string", RawFile(R"({"__metadata__":{"a":1}})"), "expected a string"},
      {"metadata null", RawFile(R"({"__metadata__":null})"), "expected '{'"},
      {"duplicate metadata", RawFile(R"({"__metadata__":{},"__metadata__":{}})"),
       "duplicate \"__metadata__\""},
      {"duplicate metadata key", RawFile(R"({"__metadata__":{"a":"1","a":"2"}})"),
       "duplicate metadata key \"a\""},
      {"unknown dtype", RawFile(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", f32x2),
       "unknown dtype \"F64\""},
      {"dtype not a string", RawFile(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})"),
       "expected a string"},
      {"unknown field",
       RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[]}})", f32x2),
       "unknown field \"x\""},
      {"missing dtype", RawFile(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f32x2),
       "missing \"dtype\""},
      {"missing shape", RawFile(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", f32x2),
       "missing \"shape\""},
      {"missing offsets", RawFile(R"({"a":{"dtype":"F32","shape":[2]}})", f32x2),
       "missing \"data_offsets\""},
      {"empty tensor info", RawFile(R"({"a":{}})"), "missing \"dtype\""},
      {"duplicate field",
       RawFile(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "duplicate \"dtype\""},
      {"three offsets",
       RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", f32x2),
       "data_offsets has 3 entries"},
      {"negative dim", RawFile(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
       "negative number"},
      {"float dim", RawFile(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2),
       "not an integer"},
      {"exponent dim",
       RawFile(R"({"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}})", f32x2),
       "not an integer"},
      {"leading zero", RawFile(R"({"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}})", f32x2),
       "leading zero"},
      {"dim over int64",
       RawFile(R"({"a":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})"),
       "number too large"},
      {"offset over uint64",
       RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}})"),
       "number too large"},
      {"element count overflow",
       RawFile(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})"),
       "too many elements"},
      {"shape/offset mismatch",
       RawFile(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
       "needs 12 bytes but data_offsets [0, 8] span 8"},
      {"dtype/offset mismatch",
       RawFile(R"({"a":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "needs 16 bytes"},
      {"end before begin",
       RawFile(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f32x2),
       "end before they begin"},
      {"first tensor not at 0",
       RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2), "begins at 4"},
      {"overlap",
       RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               f32x2),
       "begins at 4 but the previous tensor ends at 8"},
      {"out of order",
       RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
               f32x2),
       "in header order"},
      {"gap",
       RawFile(R"({"a":{"dtype":"F16","shape":[1],"data_offsets":[0,2]},)"
               R"("b":{"dtype":"F16","shape":[1],"data_offsets":[4,6]}})",
               std::string(6, '\0')),
       "begins at 4 but the previous tensor ends at 2"},
      {"past the end", RawFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f32x2),
       "past the end of the 8-byte buffer"},
      {"trailing bytes",
       RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32x2),
       "4 trailing bytes after the last tensor"},
      {"bytes with no tensors", RawFile("{}", "x"), "1 trailing bytes"},
      {"duplicate names",
       RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
               R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               f32x2),
       "duplicate tensor name \"a\""},
  };
}

TEST(SafetensorsTest, RejectsEachMalformedFileNamingTheDefect) {
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.label);
    absl::StatusOr<StateDict> decoded = DecodeSafetensors(c.file);
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(c.message));
  }
}

TEST(SafetensorsTest, ValidateStateDictRejectsWhatWouldNotRoundTrip) {
  StateDict short_data;
  short_data.tensors.push_back({"w", MakeTensor(DType::kF32, {2})});
  short_data.tensors[0].tensor.data.pop_back();
  EXPECT_EQ(ValidateStateDict(short_data).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ValidateStateDict(short_data).message()), HasSubstr("tensor \"w\""));

  StateDict dup;
  dup.tensors.push_back({"w", MakeTensor(DType::kF32, {1})});
  dup.tensors.push_back({"w", MakeTensor(DType::kF32, {1})});
  EXPECT_THAT(std::string(ValidateStateDict(dup).message()), HasSubstr("duplicate tensor name"));

  StateDict reserved;
  reserved.tensors.push_back({"__metadata__", MakeTensor(DType::kF32, {1})});
  EXPECT_THAT(std::string(ValidateStateDict(reserved).message()), HasSubstr("reserved"));

  StateDict bad_name;
  bad_name.tensors.push_back({"\xFF", MakeTensor(DType::kF32, {1})});
  EXPECT_THAT(std::string(ValidateStateDict(bad_name).message()), HasSubstr("UTF-8"));

  StateDict bad_meta;
  bad_meta.metadata["k"] = "\xED\xA0\x80";  // an encoded surrogate
  EXPECT_THAT(std::string(ValidateStateDict(bad_meta).message()), HasSubstr("UTF-8"));

  EXPECT_TRUE(ValidateStateDict(EveryKindOfState()).ok());
}

// Random damage to a valid file must yield OK or an error, never a crash or
// a huge allocation; anything accepted must be self-consistent.
TEST(SafetensorsTest, FuzzedFilesNeverCrash) {
  const std::string valid = EncodeSafetensors(EveryKindOfState());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(valid[i])) << (8 * i);
  const size_t header_end = static_cast<size_t>(8 + n);
  std::mt19937 rng(20240611);
  static constexpr char kInteresting[] = "{}[]\":,\\u0123456789-.eE \x80\xff";
  int accepted = 0;
  int rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string file = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !file.empty(); ++e) {
      // Mostly hit the header (prefix + JSON), where the parsing happens.
      const size_t limit = (rng() % 4 != 0) ? std::min(header_end, file.size()) : file.size();
      const size_t pos = rng() % limit;
      switch (rng() % 5) {
        case 0:
          file[pos] = static_cast<char>(file[pos] ^ (1 << (rng() % 8)));
          break;
        case 1:
          file[pos] = kInteresting[rng() % (sizeof(kInteresting) - 1)];
          break;
        case 2:
          file.resize(pos);
          break;
        case 3:
          file.insert(pos, 1, kInteresting[rng() % (sizeof(kInteresting) - 1)]);
          break;
        case 4:
          file.erase(pos, 1 + rng() % 8);
          break;
      }
    }
    absl::StatusOr<StateDict> decoded = DecodeSafetensors(file);
    if (decoded.ok()) {
      ++accepted;
      for (const NamedTensor& t : decoded->tensors) ASSERT_TRUE(t.tensor.Validate(t.name).ok());
    } else {
      ++rejected;
      ASSERT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // Both outcomes occur, so the loop exercised the decoder's paths.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

// ---- SafetensorsReceiver ---------------------------------------------------

// The file through a receiver in chunks of `chunk` bytes, every reservation
// granted; the first error of Append, else Finish's result.
absl::StatusOr<StateDict> Receive(absl::string_view file, size_t chunk,
                                  std::vector<uint64_t>* reserved = nullptr) {
  SafetensorsReceiver receiver([&](uint64_t n) {
    if (reserved != nullptr) reserved->push_back(n);
    return absl::OkStatus();
  });
  for (size_t offset = 0; offset < file.size(); offset += chunk) {
    if (absl::Status s = receiver.Append(file.substr(offset, chunk)); !s.ok()) return s;
  }
  return receiver.Finish();
}

TEST(SafetensorsReceiverTest, DecodesChunkedFilesAsDecodeSafetensorsDoes) {
  const StateDict state = EveryKindOfState();
  const std::string whole = EncodeSafetensors(state);
  for (size_t chunk : {size_t{1}, size_t{3}, size_t{8}, size_t{9}, size_t{64}, whole.size()}) {
    absl::StatusOr<StateDict> received = Receive(whole, chunk);
    ASSERT_TRUE(received.ok()) << "chunk " << chunk << ": " << received.status();
    ExpectSameState(state, *received);
  }
  // No tensors at all, and no metadata either.
  absl::StatusOr<StateDict> empty = Receive(EncodeSafetensors(StateDict()), 3);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->tensors.empty());
}

// Memory is asked for before it is taken: the header's length with its
// prefix, then each tensor with bytes, in the file's order, once each.
TEST(SafetensorsReceiverTest, ReservesTheHeaderThenEachTensorBeforeItsBytes) {
  StateDict state;
  state.tensors.push_back({"a", MakeTensor(DType::kF32, {100}, 1)});
  state.tensors.push_back({"none", MakeTensor(DType::kF32, {0}, 2)});
  state.tensors.push_back({"b", MakeTensor(DType::kI64, {7, 3}, 3)});
  const std::string file = EncodeSafetensors(state);
  const uint64_t header = file.size() - 400 - 168;
  std::vector<uint64_t> reserved;
  absl::StatusOr<StateDict> received = Receive(file, 16, &reserved);
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(reserved, (std::vector<uint64_t>{header, 400, 168}));
  ExpectSameState(state, *received);

  // A refusal stops the file there, with the refusal's status, and sticks.
  int calls = 0;
  SafetensorsReceiver refusing([&](uint64_t n) {
    ++calls;
    return n == 168 ? absl::ResourceExhaustedError("over budget") : absl::OkStatus();
  });
  absl::Status s = refusing.Append(file);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(refusing.Append("x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refusing.Finish().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(calls, 3);
}

TEST(SafetensorsReceiverTest, KnowsTheDeclaredLengthOnceTheHeaderIsIn) {
  const std::string file = EncodeSafetensors(EveryKindOfState());
  SafetensorsReceiver receiver([](uint64_t) { return absl::OkStatus(); });
  ASSERT_TRUE(receiver.Append(absl::string_view(file).substr(0, 9)).ok());
  EXPECT_FALSE(receiver.declared_bytes().has_value());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(file[i])) << (8 * i);
  ASSERT_TRUE(receiver.Append(absl::string_view(file).substr(9, 8 + n - 9)).ok());
  ASSERT_TRUE(receiver.declared_bytes().has_value());
  EXPECT_EQ(*receiver.declared_bytes(), file.size());
  EXPECT_EQ(receiver.received_bytes(), 8 + n);
}

// Every malformed file the decoder refuses, the receiver refuses too
// (InvalidArgument), in any chunking; those whose defect is in the header or
// the layout with the decoder's words. A file cut short or run long is only
// known as such while it streams, so those name the lengths instead.
TEST(SafetensorsReceiverTest, RefusesEveryMalformedFile) {
  const std::vector<std::string> length_defects = {"too short", "header length past the end",
                                                   "past the end", "trailing bytes",
                                                   "bytes with no tensors"};
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.label);
    for (size_t chunk : {size_t{1}, size_t{5}, c.file.size() + 1}) {
      absl::StatusOr<StateDict> received = Receive(c.file, chunk);
      ASSERT_FALSE(received.ok()) << "chunk " << chunk;
      EXPECT_EQ(received.status().code(), absl::StatusCode::kInvalidArgument);
      if (std::find(length_defects.begin(), length_defects.end(), c.label) ==
          length_defects.end()) {
        EXPECT_THAT(std::string(received.status().message()), HasSubstr(c.message));
      }
    }
  }
  EXPECT_THAT(std::string(Receive(BadCases()[3].file, 4).status().message()),
              HasSubstr("exceeds the limit"));
  const std::string valid = EncodeSafetensors(EveryKindOfState());
  EXPECT_THAT(std::string(Receive(valid + "x", 64).status().message()),
              HasSubstr("trailing bytes after the last tensor"));
  EXPECT_THAT(std::string(Receive(valid.substr(0, valid.size() - 1), 64).status().message()),
              HasSubstr(absl::StrCat("ends after ", valid.size() - 1, " bytes")));
}

// Damaged files: the receiver accepts exactly what the decoder accepts, and
// decodes it to the same state.
TEST(SafetensorsReceiverTest, AgreesWithTheDecoderOnDamagedFiles) {
  const std::string valid = EncodeSafetensors(EveryKindOfState());
  std::mt19937 rng(20261126);
  int accepted = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    std::string file = valid;
    const size_t pos = rng() % file.size();
    switch (rng() % 3) {
      case 0:
        file[pos] = static_cast<char>(file[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:
        file.resize(pos);
        break;
      case 2:
        file.insert(pos, 1, static_cast<char>(rng()));
        break;
    }
    const absl::StatusOr<StateDict> decoded = DecodeSafetensors(file);
    const absl::StatusOr<StateDict> received = Receive(file, 1 + rng() % 97);
    ASSERT_EQ(decoded.ok(), received.ok())
        << "iteration " << iter << ": " << decoded.status() << " / " << received.status();
    if (decoded.ok()) {
      ++accepted;
      ExpectSameState(*decoded, *received);
    } else {
      EXPECT_EQ(received.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  EXPECT_GT(accepted, 0);
}

}  // namespace
}  // namespace ampd::codec
