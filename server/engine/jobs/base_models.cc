// BaseModels: names checked against the models dir, config.json and the
// weight files read, the digest, and the table of shared bases.
#include "server/engine/jobs/base_models.h"

#include <malloc.h>
#include <openssl/evp.h>
#include <stdlib.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "codec/json_value.h"
#include "codec/safetensors.h"
#include "common/status_macros.h"
#include "kernels/backend_factory.h"
#include "server/engine/config/job_config.h"
#include "server/engine/model/hf_config.h"

namespace ampd::engine {
namespace {

constexpr char kField[] = "config.base_model";
constexpr char kIndex[] = "model.safetensors.index.json";
constexpr char kSingle[] = "model.safetensors";
// config.json and the index are small; anything larger is not one.
constexpr size_t kMaxJsonBytes = size_t{16} << 20;
// A weight file at most (a folder's files are bounded further by the size
// of config.json's model; the backend's allocation bounds what is loaded).
constexpr size_t kMaxWeightFileBytes = size_t{1} << 40;
// Beyond 8 bytes a parameter: the headers and buffers a folder's weight
// files may hold besides the weights.
constexpr size_t kWeightSlackBytes = size_t{64} << 20;

absl::Status Invalid(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(kField, ": ", name, ": ", what));
}

// The real path of `path` (symlinks resolved), "" when it does not exist.
std::string RealPath(const std::string& path) {
  char buffer[PATH_MAX];
  if (realpath(path.c_str(), buffer) == nullptr) return "";
  return buffer;
}

}  // namespace

BaseModels::BaseModels(std::string models_dir) {
  if (models_dir.empty()) return;
  root_ = RealPath(models_dir);
  if (root_.empty()) root_ = models_dir;  // Folder() then refuses every name, saying why
}

absl::StatusOr<std::string> BaseModels::Folder(const std::string& name) const {
  if (root_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kField, ": this ampd has no --models-dir, so no base model"));
  }
  if (absl::Status s = CheckBaseModelName(name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config.", s.message()));
  }
  const std::string real = RealPath(absl::StrCat(root_, "/", name));
  if (real.empty() || !std::filesystem::is_directory(real)) {
    return Invalid(name, "no such folder in --models-dir");
  }
  if (!absl::StartsWith(real, absl::StrCat(root_, "/"))) {
    return Invalid(name, "a symlink out of --models-dir; the base must lie inside it");
  }
  return real;
}

absl::StatusOr<std::string> BaseModels::ReadInside(const std::string& name, const std::string& path,
                                                   size_t max_bytes) const {
  const std::string real = RealPath(path);
  const std::string file = std::filesystem::path(path).filename().string();
  if (real.empty()) return Invalid(name, absl::StrCat(file, ": missing"));
  if (!absl::StartsWith(real, absl::StrCat(root_, "/"))) {
    return Invalid(name, absl::StrCat(file, ": a symlink out of --models-dir"));
  }
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(real, error);
  if (error) return Invalid(name, absl::StrCat(file, ": ", error.message()));
  if (size > max_bytes) {
    return Invalid(name, absl::StrCat(file, ": ", size, " bytes, more than ", max_bytes));
  }
  std::ifstream in(real, std::ios::binary);
  std::string bytes(static_cast<size_t>(size), '\0');
  if (!in.read(bytes.data(), static_cast<std::streamsize>(size))) {
    return absl::InternalError(absl::StrCat(kField, ": ", name, ": ", file, ": cannot be read"));
  }
  return bytes;
}

absl::StatusOr<model::ModelSpec> BaseModels::Spec(const std::string& name) const {
  AMPD_ASSIGN_OR_RETURN(const std::string folder, Folder(name));
  AMPD_ASSIGN_OR_RETURN(const std::string config,
                        ReadInside(name, folder + "/config.json", kMaxJsonBytes));
  absl::StatusOr<model::ModelSpec> spec = model::ModelSpecOfHfConfig(config);
  if (!spec.ok()) return Invalid(name, spec.status().message());
  // A model the server refuses is config.json's error, not that of the
  // config.model.* field a later check would name (the request sent none).
  if (absl::Status valid = model::ValidateModelSpec(*spec); !valid.ok()) {
    return Invalid(name, absl::StrCat("config.json: ", valid.message()));
  }
  return spec;
}

absl::StatusOr<std::string> BaseModels::ForEachWeightFile(const std::string& name,
                                                          WeightFileFn each) const {
  AMPD_ASSIGN_OR_RETURN(const std::string folder, Folder(name));
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> sha(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (sha == nullptr || EVP_DigestInit_ex(sha.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("SHA-256: cannot start a digest");
  }
  auto digest_part = [&sha](absl::string_view label, absl::string_view bytes) {
    const std::string head = absl::StrCat(label, ":", bytes.size(), ":");
    EVP_DigestUpdate(sha.get(), head.data(), head.size());
    EVP_DigestUpdate(sha.get(), bytes.data(), bytes.size());
  };
  AMPD_ASSIGN_OR_RETURN(const std::string config,
                        ReadInside(name, folder + "/config.json", kMaxJsonBytes));
  digest_part("config.json", config);
  // The files in load order: the index's (sorted, each once), or the one file.
  std::vector<std::string> files;
  if (std::filesystem::exists(folder + "/" + kIndex)) {
    AMPD_ASSIGN_OR_RETURN(const std::string index_text,
                          ReadInside(name, folder + "/" + kIndex, kMaxJsonBytes));
    absl::StatusOr<codec::JsonValue> index = codec::ParseJson(index_text);
    if (!index.ok()) return Invalid(name, absl::StrCat(kIndex, ": ", index.status().message()));
    const codec::JsonValue* map = index->Find("weight_map");
    if (map == nullptr || map->type != codec::JsonValue::Type::kObject) {
      return Invalid(name, absl::StrCat(kIndex, ": weight_map: missing or not an object"));
    }
    std::set<std::string> unique;
    for (const auto& [tensor, file] : map->members) {
      if (file.type != codec::JsonValue::Type::kString || file.text.empty() ||
          file.text.find('/') != std::string::npos || file.text == "." || file.text == "..") {
        return Invalid(
            name, absl::StrCat(kIndex, ": weight_map.", tensor, ": not a file name of the folder"));
      }
      unique.insert(file.text);
    }
    files.assign(unique.begin(), unique.end());
  } else {
    files.push_back(kSingle);
  }
  // The files hold the model's weights, at most in F32, and a tied head's
  // copy of the embedding at most as large again (buffers such as inv_freq
  // and the headers within the slack): each file is read whole into host
  // memory, so a folder of more bytes than that is refused before it is.
  AMPD_ASSIGN_OR_RETURN(const model::ModelSpec spec, Spec(name));
  size_t budget = std::min<size_t>(
      kMaxWeightFileBytes,
      size_t{8} * static_cast<size_t>(model::ParameterCount(spec)) + kWeightSlackBytes);
  std::set<std::string> seen;
  for (const std::string& file : files) {
    AMPD_ASSIGN_OR_RETURN(std::string bytes, ReadInside(name, folder + "/" + file, budget));
    budget -= bytes.size();
    digest_part(file, bytes);
    absl::StatusOr<codec::StateDict> state = codec::DecodeSafetensors(bytes);
    if (!state.ok()) return Invalid(name, absl::StrCat(file, ": ", state.status().message()));
    bytes = std::string();
    for (const codec::NamedTensor& t : state->tensors) {
      if (!seen.insert(t.name).second) {
        return Invalid(name, absl::StrCat(file, ": ", t.name, ": in more than one file"));
      }
    }
    AMPD_RETURN_IF_ERROR(each(std::move(state->tensors)));
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(sha.get(), out, &length) != 1) {
    return absl::InternalError("SHA-256: cannot finish a digest");
  }
  return absl::StrCat(
      "sha256:", absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(out), length)));
}

absl::StatusOr<std::shared_ptr<const model::FrozenBase>> BaseModels::Acquire(
    const std::string& name, const model::ModelSpec& spec, model::Precision precision,
    const std::string& device) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    // Entries of bases freed since go (a few bytes each, but a server may
    // see many names over its life).
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = it->second->loaded.expired() && it->second.use_count() == 1 ? entries_.erase(it)
                                                                       : std::next(it);
    }
    std::shared_ptr<Entry>& slot = entries_[Key{name, precision, device}];
    if (slot == nullptr) slot = std::make_shared<Entry>();
    entry = slot;
  }
  absl::MutexLock load(&entry->load_mu);
  if (std::shared_ptr<const model::FrozenBase> held = entry->base.lock()) return held;
  AMPD_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend(device));
  model::FrozenBase::Loader loader(name, spec, precision, std::move(backend));
  AMPD_ASSIGN_OR_RETURN(std::string digest,
                        ForEachWeightFile(name, [&](std::vector<codec::NamedTensor> tensors) {
                          return loader.Add(std::move(tensors));
                        }));
  AMPD_ASSIGN_OR_RETURN(std::shared_ptr<const model::FrozenBase> base,
                        loader.Finish(std::move(digest)));
  entry->base = base;
  // The load freed about the base's size in host buffers at once (the
  // files' tensors and their conversions, each below the mmap threshold
  // main.cc sets, so kept in the arenas): give them back, or the server
  // would hold a second base's worth of idle memory per base loaded.
  malloc_trim(0);
  std::fprintf(stderr, "ampd: base model %s loaded (%s, %s, %lld bytes, %s)\n", name.c_str(),
               std::string(model::PrecisionName(precision)).c_str(), device.c_str(),
               static_cast<long long>(base->bytes()), base->identity().digest.c_str());
  absl::MutexLock lock(&mu_);
  entry->loaded = base;
  return base;
}

BaseModels::Held BaseModels::held() const {
  Held held;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, entry] : entries_) {
    if (std::shared_ptr<const model::FrozenBase> base = entry->loaded.lock()) {
      ++held.count;
      held.bytes += base->bytes();
    }
  }
  return held;
}

std::vector<std::string> BaseModels::List() const {
  std::vector<std::string> names;
  if (root_.empty()) return names;
  std::error_code error;
  const std::filesystem::path root(root_);
  for (auto it = std::filesystem::recursive_directory_iterator(
           root, std::filesystem::directory_options::skip_permission_denied, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    if (it.depth() >= 3) {
      it.disable_recursion_pending();
      continue;
    }
    if (!it->is_directory(error)) continue;
    const std::string relative = std::filesystem::relative(it->path(), root, error).string();
    if (error || !Folder(relative).ok()) continue;
    if (std::filesystem::exists(it->path() / "config.json", error)) names.push_back(relative);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace ampd::engine
