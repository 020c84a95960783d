// FrozenBase: a base model's weights held once, read-only, in a job's
// working dtype, for every LoRA job on that base (server/engine/jobs/
// base_models.h loads and shares them). A LoRA decoder built over one
// (TransformerModel::Create's `base`) holds each frozen parameter as a view of
// the base's tensor rather than a copy of its own, and keeps the base alive
// (a shared_ptr) for as long as it lives: the last job's end frees it.
//
// The values are those a job made by ampd.from_pretrained holds: each
// tensor of the files widened exactly to F32 (as the Python client sends a
// bf16/fp16 checkpoint) and rounded to nearest even into the working dtype
// (as LoadStateDict rounds a frozen base given in F32), so that a shared
// base's job computes the bits of the same job with a base of its own.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "codec/state_dict.h"
#include "kernels/backend.h"
#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

// `t` (F32, F16 or BF16) as F32, exactly: how the Python client sends a
// 16-bit checkpoint's weights to a job, and how a full job made from a base
// model takes them. InvalidArgument naming `name` for another dtype.
absl::StatusOr<codec::HostTensor> WidenedToF32(const std::string& name, const codec::HostTensor& t);

class FrozenBase {
 public:
  // What names the base and ties a checkpoint to it: the base_model name
  // and a digest of its files (config.json and every weight file).
  struct Identity {
    std::string name;
    std::string digest;
  };

  // Builds a base one weight file at a time: each file's tensors (decoder
  // state-dict names, F32, F16 or BF16 as the files hold them) are rounded
  // into the working dtype of `precision`, uploaded to `backend` and freed
  // before the next file is read, so the host holds one file at a time
  // whatever the base's size. The base owns the backend (its memory must be
  // readable by the jobs' backends: the host for the CPU, one device for
  // CUDA). The rotary inv_freq buffers some Llama checkpoints carry are
  // dropped, and a tied model's lm_head.weight is taken only when it equals
  // the embedding, as TransformerModel::CanonicalNames does. InvalidArgument
  // naming config.base_model and the tensor for a dtype other than those,
  // a tensor given twice, a value that is inf or NaN or that overflows the
  // working dtype.
  class Loader {
   public:
    Loader(std::string name, const ModelSpec& spec, Precision precision,
           std::unique_ptr<kernels::Backend> backend);
    ~Loader();
    absl::Status Add(std::vector<codec::NamedTensor> tensors);
    // The base, named by `digest` (Identity); the Loader is spent.
    absl::StatusOr<std::shared_ptr<const FrozenBase>> Finish(std::string digest);

   private:
    std::shared_ptr<FrozenBase> base_;
    const bool tied_;
    // A tied model's head as the files give it, converted (Finish compares it).
    std::string head_;
    kernels::Shape head_shape_;
    bool has_head_ = false;
  };
  ~FrozenBase();

  const Identity& identity() const { return identity_; }
  Precision precision() const { return precision_; }
  // Device bytes of its tensors.
  int64_t bytes() const { return bytes_; }
  size_t size() const { return tensors_.size(); }
  // The names of its tensors, sorted.
  std::vector<std::string> names() const;

  // A view of the tensor `name` (no copy, never freed through it), which
  // must be of `shape`: InvalidArgument naming the base and the tensor
  // when it has none of that name or shape.
  absl::StatusOr<kernels::Tensor> View(const std::string& name, const kernels::Shape& shape) const;

 private:
  FrozenBase() = default;

  Identity identity_;
  Precision precision_ = Precision::kFp32;
  int64_t bytes_ = 0;
  // Declared before the tensors, so that they are freed before it.
  std::unique_ptr<kernels::Backend> backend_;
  std::map<std::string, kernels::Tensor> tensors_;
};

}  // namespace ampd::engine::model
