// BaseModels: the server's --models-dir, a folder of Hugging Face model
// folders (config.json and safetensors weights, one file or shards with
// model.safetensors.index.json, as transformers' save_pretrained writes
// them) that jobs name as their base_model. It resolves a name to its
// folder without leaving the directory, reads the folder's config.json into
// a ModelSpec (model/hf_config.h) and its weights, and holds each base that
// LoRA jobs share: loaded once per (name, precision, device) by the first
// job that needs it, kept alive by the jobs' models (shared_ptr) and freed
// with the last of them. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "codec/state_dict.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/model/frozen_base.h"

namespace ampd::engine {

class BaseModels {
 public:
  // `models_dir` empty: none (every base_model is refused).
  explicit BaseModels(std::string models_dir);

  // The model of base `name`'s config.json. InvalidArgument naming
  // config.base_model for a name that is malformed, escapes the directory
  // (.., an absolute path, a symlink out of it), is no folder with a
  // config.json, or whose config.json ampd cannot map (naming its key) or
  // maps onto a model ValidateModelSpec refuses (naming its field);
  // FailedPrecondition without a models dir.
  absl::StatusOr<model::ModelSpec> Spec(const std::string& name) const;

  // Calls `each` with the tensors of each weight file of base `name` in
  // turn (the index's files in name order, or the one model.safetensors),
  // as the file holds them, one file in host memory at a time; returns the
  // digest of the folder's files ("sha256:" and the hex of SHA-256 over
  // config.json and each weight file, each named and sized): what a
  // checkpoint of a job on the base is tied to. A tensor in two files is
  // refused, and so are files of more bytes in all than 8 a parameter of
  // config.json's model and 64 MiB (F32 weights, a tied head's copy and
  // headers), before they are read.
  using WeightFileFn = absl::FunctionRef<absl::Status(std::vector<codec::NamedTensor> tensors)>;
  absl::StatusOr<std::string> ForEachWeightFile(const std::string& name, WeightFileFn each) const;

  // The shared base of `name` in `precision` on `device`: the one held now,
  // or loaded (ForEachWeightFile, model::FrozenBase::Loader) on a backend of its
  // own by this call, once however many jobs ask at once.
  absl::StatusOr<std::shared_ptr<const model::FrozenBase>> Acquire(const std::string& name,
                                                                   const model::ModelSpec& spec,
                                                                   model::Precision precision,
                                                                   const std::string& device);

  // The bases held now (some job's model views them) and their bytes.
  struct Held {
    int64_t count = 0;
    int64_t bytes = 0;
  };
  Held held() const;

  // The names of the folders with a config.json, up to three levels deep
  // (Qwen/Qwen2.5-0.5B), sorted.
  std::vector<std::string> List() const;

  bool enabled() const { return !root_.empty(); }

 private:
  // The folder of `name`, checked (see Spec), its real path.
  absl::StatusOr<std::string> Folder(const std::string& name) const;
  // A file of the folder, read whole; InvalidArgument when its real path
  // leaves the models dir.
  absl::StatusOr<std::string> ReadInside(const std::string& name, const std::string& path,
                                         size_t max_bytes) const;

  std::string root_;  // the real path of --models-dir ("" without one)

  using Key = std::tuple<std::string, model::Precision, std::string>;
  struct Entry {
    absl::Mutex load_mu;  // held while the base loads
    std::weak_ptr<const model::FrozenBase> base ABSL_GUARDED_BY(load_mu);
    // The same, for held(), which must not wait for a load (under mu_).
    std::weak_ptr<const model::FrozenBase> loaded;
  };
  mutable absl::Mutex mu_;
  std::map<Key, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ampd::engine
