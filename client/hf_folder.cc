// Hugging Face folders' files for ampctl: the weights in (index, shards,
// widening to F32), a PEFT adapter's config as a LoRA, and an export out
// (config.json as the server wrote it, the shards and their index).
#include "client/hf_folder.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "codec/json_text.h"
#include "codec/json_value.h"
#include "codec/safetensors.h"
#include "common/status_macros.h"

namespace ampd::hf {
namespace {

using codec::JsonTruthy;
using codec::JsonValue;

constexpr char kIndex[] = "model.safetensors.index.json";
constexpr char kSingle[] = "model.safetensors";

absl::Status Invalid(absl::string_view what) { return absl::InvalidArgumentError(what); }

std::string Join(const std::string& directory, const std::string& name) {
  return (std::filesystem::path(directory) / name).string();
}

// IEEE binary16 -> binary32, exact (every half is a float).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits = 0;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {
    // A subnormal half: shift it to a normal float.
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// t widened to F32 in place (F16, BF16; any other dtype unchanged).
void Widen(codec::HostTensor& t) {
  if (t.dtype != codec::DType::kF16 && t.dtype != codec::DType::kBF16) return;
  const size_t n = t.data.size() / 2;
  std::string wide(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, t.data.data() + 2 * i, 2);
    uint32_t bits;
    if (t.dtype == codec::DType::kBF16) {
      bits = static_cast<uint32_t>(h) << 16;  // bf16 is a float's top half
    } else {
      const float f = HalfToFloat(h);
      std::memcpy(&bits, &f, 4);
    }
    std::memcpy(wide.data() + 4 * i, &bits, 4);
  }
  t.data = std::move(wide);
  t.dtype = codec::DType::kF32;
}

const JsonValue* Get(const JsonValue& object, absl::string_view key) {
  const JsonValue* v = object.Find(key);
  return v == nullptr || v->is_null() ? nullptr : v;
}

// The full paths PEFT saves (model.layers.{i}.MODULE.PROJ) as their module
// when every layer lists it; other entries as they are.
absl::StatusOr<std::vector<std::string>> Targets(const std::vector<std::string>& modules,
                                                 int64_t num_layers) {
  std::vector<std::string> out;
  std::map<std::string, std::set<int64_t>> layers_of;
  for (const std::string& m : modules) {
    if (!absl::StartsWith(m, "model.layers.")) {
      out.push_back(m);
      continue;
    }
    const std::vector<std::string> parts = absl::StrSplit(m, '.');
    int64_t layer = 0;
    if (parts.size() != 5 || !absl::SimpleAtoi(parts[2], &layer)) {
      return Invalid(absl::StrCat("adapter_config.json: target_modules \"", m,
                                  "\": not a projection of a layer"));
    }
    layers_of[absl::StrCat(parts[3], ".", parts[4])].insert(layer);
  }
  for (const auto& [module, layers] : layers_of) {
    if (static_cast<int64_t>(layers.size()) != num_layers || *layers.begin() != 0 ||
        *layers.rbegin() != num_layers - 1) {
      return Invalid(absl::StrCat("adapter_config.json: target_modules: ", module, " in ",
                                  layers.size(), " of ", num_layers,
                                  " layers only; ampd adapts every layer alike"));
    }
    out.push_back(module);
  }
  return out;
}

std::string ShardName(size_t index, size_t count) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", index + 1, count);
}

absl::Status WriteBytes(const std::string& path, absl::string_view bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  if (!file.good()) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadFile(absl::string_view what, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return Invalid(absl::StrCat(what, ": cannot read ", path));
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

absl::StatusOr<std::string> ReadJsonFile(absl::string_view what, const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    const uintmax_t size = std::filesystem::file_size(path, error);
    if (!error && size > kMaxJsonFileBytes) {
      return Invalid(
          absl::StrCat(what, ": ", path, ": ", size, " bytes, more than ", kMaxJsonFileBytes));
    }
  } else if (std::filesystem::exists(path, error)) {
    return Invalid(absl::StrCat(what, ": ", path, ": not a file"));
  }
  AMPD_ASSIGN_OR_RETURN(std::string text, ReadFile(what, path));
  if (absl::StatusOr<JsonValue> parsed = codec::ParseJson(text); !parsed.ok()) {
    return Invalid(absl::StrCat(what, ": ", path, ": ", parsed.status().message()));
  }
  return text;
}

absl::StatusOr<std::vector<std::string>> WeightFiles(const std::string& directory) {
  const std::string index = Join(directory, kIndex);
  if (std::filesystem::exists(index)) {
    AMPD_ASSIGN_OR_RETURN(const std::string text, ReadJsonFile(kIndex, index));
    absl::StatusOr<JsonValue> parsed = codec::ParseJson(text);
    if (!parsed.ok()) return Invalid(absl::StrCat(index, ": ", parsed.status().message()));
    const JsonValue* map = parsed->Find("weight_map");
    if (map == nullptr || map->type != JsonValue::Type::kObject) {
      return Invalid(absl::StrCat(index, ": no weight_map object"));
    }
    std::set<std::string> files;
    for (const auto& [name, file] : map->members) {
      // A file of the folder itself: no path out of it.
      if (file.type != JsonValue::Type::kString || file.text.empty() ||
          file.text.find('/') != std::string::npos || file.text == "..") {
        return Invalid(absl::StrCat(index, ": weight_map[\"", name, "\"]: not a file name"));
      }
      files.insert(file.text);
    }
    std::vector<std::string> out;
    for (const std::string& f : files) out.push_back(Join(directory, f));
    return out;
  }
  const std::string single = Join(directory, kSingle);
  if (std::filesystem::exists(single)) return std::vector<std::string>{single};
  return Invalid(absl::StrCat(directory, ": neither ", kIndex, " nor ", kSingle));
}

absl::StatusOr<std::string> WidenToF32(std::string file) {
  AMPD_ASSIGN_OR_RETURN(codec::StateDict state, codec::DecodeSafetensors(file));
  const bool narrow = std::any_of(state.tensors.begin(), state.tensors.end(), [](const auto& t) {
    return t.tensor.dtype == codec::DType::kF16 || t.tensor.dtype == codec::DType::kBF16;
  });
  if (!narrow) return file;
  file.clear();
  file.shrink_to_fit();
  for (codec::NamedTensor& t : state.tensors) Widen(t.tensor);
  return codec::EncodeSafetensors(state);
}

absl::StatusOr<v1::LoRA> LoraOfPeftConfig(absl::string_view adapter_config_json,
                                          int64_t num_layers) {
  absl::StatusOr<JsonValue> parsed = codec::ParseJson(adapter_config_json);
  if (!parsed.ok()) {
    return Invalid(absl::StrCat("adapter_config.json: ", parsed.status().message()));
  }
  const JsonValue& c = *parsed;
  if (c.type != JsonValue::Type::kObject) return Invalid("adapter_config.json: not an object");
  // Strings and numbers by type: "8" is no rank, nor ["LORA"] a peft_type.
  if (const JsonValue* t = Get(c, "peft_type");
      t != nullptr && (t->type != JsonValue::Type::kString || t->text != "LORA")) {
    return Invalid(
        absl::StrCat("adapter_config.json: peft_type \"", t->text, "\": only LORA adapters"));
  }
  if (const JsonValue* b = Get(c, "bias");
      b != nullptr && (b->type != JsonValue::Type::kString || b->text != "none")) {
    return Invalid(absl::StrCat("adapter_config.json: bias \"", b->text,
                                "\": ampd trains LoRA without biases (\"none\")"));
  }
  for (const char* key : {"use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                          "layers_to_transform", "modules_to_save", "lora_bias"}) {
    if (JsonTruthy(Get(c, key))) {
      return Invalid(
          absl::StrCat("adapter_config.json: ", key, ": set; ampd trains LoRA without it"));
    }
  }
  v1::LoRA lora;
  const JsonValue* r = Get(c, "r");
  const JsonValue* alpha = Get(c, "lora_alpha");
  int64_t rank = 0;
  double a = 0;
  if (r == nullptr || r->type != JsonValue::Type::kNumber || !absl::SimpleAtoi(r->text, &rank)) {
    return Invalid("adapter_config.json: r: missing or not an integer");
  }
  if (alpha == nullptr || alpha->type != JsonValue::Type::kNumber ||
      !absl::SimpleAtod(alpha->text, &a)) {
    return Invalid("adapter_config.json: lora_alpha: missing or not a number");
  }
  lora.set_rank(rank);
  lora.set_alpha(static_cast<float>(a));
  const JsonValue* targets = Get(c, "target_modules");
  if (targets == nullptr) return lora;
  if (targets->type == JsonValue::Type::kString) {
    if (targets->text != "all-linear") {
      return Invalid(absl::StrCat("adapter_config.json: target_modules \"", targets->text,
                                  "\": a regular expression; give module names"));
    }
    lora.add_target_modules(targets->text);
    return lora;
  }
  if (targets->type != JsonValue::Type::kArray) {
    return Invalid("adapter_config.json: target_modules: a list of names or \"all-linear\"");
  }
  std::vector<std::string> modules;
  for (const JsonValue& m : targets->items) {
    if (m.type != JsonValue::Type::kString) {
      return Invalid("adapter_config.json: target_modules: names must be strings");
    }
    modules.push_back(m.text);
  }
  AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> names, Targets(modules, num_layers));
  for (const std::string& name : names) lora.add_target_modules(name);
  return lora;
}

absl::StatusOr<uint64_t> ParseShardSize(absl::string_view text) {
  const std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  const struct {
    const char* suffix;
    uint64_t scale;
  } units[] = {{"GIB", uint64_t{1} << 30},
               {"MIB", uint64_t{1} << 20},
               {"KIB", uint64_t{1} << 10},
               {"GB", 1'000'000'000},
               {"MB", 1'000'000},
               {"KB", 1'000},
               {"B", 1}};
  for (const auto& u : units) {
    if (!absl::EndsWith(t, u.suffix)) continue;
    uint64_t n = 0;
    if (!absl::SimpleAtoi(t.substr(0, t.size() - std::strlen(u.suffix)), &n) || n == 0 ||
        n > UINT64_MAX / u.scale) {
      break;
    }
    return n * u.scale;
  }
  uint64_t n = 0;
  if (absl::SimpleAtoi(t, &n) && n > 0) return n;
  return Invalid(absl::StrCat("--max-shard-size: \"", text,
                              "\": a positive size such as 5GB, 100KB, 2GiB or a byte count"));
}

absl::StatusOr<std::vector<std::string>> WriteFolder(const std::string& directory,
                                                     const std::string& config_json,
                                                     codec::StateDict state,
                                                     uint64_t max_shard_bytes) {
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (error)
    return absl::InternalError(absl::StrCat("cannot make ", directory, ": ", error.message()));
  AMPD_RETURN_IF_ERROR(WriteBytes(Join(directory, "config.json"), config_json));
  // The token ids, if any, are the model config's (transformers' own
  // default for a model saved without a generation config).
  AMPD_RETURN_IF_ERROR(WriteBytes(Join(directory, "generation_config.json"),
                                  "{\n  \"_from_model_config\": true\n}\n"));

  // huggingface_hub's split: in order, a new shard where the next tensor
  // would pass the limit, a tensor larger than the limit in a shard alone.
  std::vector<codec::StateDict> shards;
  codec::StateDict current;
  uint64_t current_bytes = 0, total = 0;
  for (codec::NamedTensor& t : state.tensors) {
    const uint64_t bytes = t.tensor.data.size();
    total += bytes;
    if (bytes > max_shard_bytes) {
      codec::StateDict alone;
      alone.tensors.push_back(std::move(t));
      shards.push_back(std::move(alone));
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes && !current.tensors.empty()) {
      shards.push_back(std::move(current));
      current = codec::StateDict();
      current_bytes = 0;
    }
    current.tensors.push_back(std::move(t));
    current_bytes += bytes;
  }
  if (!current.tensors.empty()) shards.push_back(std::move(current));

  // Stale weights of an earlier export would be read beside the new ones.
  std::filesystem::remove(Join(directory, kIndex), error);
  std::filesystem::remove(Join(directory, kSingle), error);
  std::vector<std::string> names;
  std::string weight_map;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shards.size() == 1 ? kSingle : ShardName(i, shards.size());
    shards[i].metadata["format"] = "pt";
    AMPD_RETURN_IF_ERROR(codec::ValidateStateDict(shards[i]));
    AMPD_RETURN_IF_ERROR(WriteBytes(Join(directory, name), codec::EncodeSafetensors(shards[i])));
    for (const codec::NamedTensor& t : shards[i].tensors) {
      absl::StrAppend(&weight_map, weight_map.empty() ? "\n    " : ",\n    ");
      codec::AppendJsonString(t.name, &weight_map);
      absl::StrAppend(&weight_map, ": ");
      codec::AppendJsonString(name, &weight_map);
    }
    names.push_back(name);
  }
  if (shards.size() > 1) {
    const std::string index = absl::StrCat("{\n  \"metadata\": {\n    \"total_size\": ", total,
                                           "\n  },\n  \"weight_map\": {", weight_map, "\n  }\n}\n");
    AMPD_RETURN_IF_ERROR(WriteBytes(Join(directory, kIndex), index));
  }
  return names;
}

}  // namespace ampd::hf
