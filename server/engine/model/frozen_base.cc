// FrozenBase: the conversion of a base's tensors into the working dtype,
// their upload, and the views jobs take of them.
#include "server/engine/model/frozen_base.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/float16.h"

namespace ampd::engine::model {
namespace {

using kernels::DType;

// Element i of a floating host tensor as F32 (exact from F16 and BF16).
float Widened(const codec::HostTensor& t, size_t i) {
  if (t.dtype == DType::kF32) {
    float v = 0;
    std::memcpy(&v, t.data.data() + i * sizeof(float), sizeof(float));
    return v;
  }
  uint16_t bits = 0;
  std::memcpy(&bits, t.data.data() + i * sizeof(uint16_t), sizeof(uint16_t));
  return t.dtype == DType::kF16 ? kernels::HalfBitsToFloat(bits) : kernels::Bf16BitsToFloat(bits);
}

// `t` widened to F32 and rounded to nearest even into `dtype`: the bytes a
// job's tensor of that dtype holds. InvalidArgument naming the tensor and
// the element for inf or NaN, or a finite value the dtype cannot hold.
absl::StatusOr<std::string> Converted(const std::string& base, const std::string& name,
                                      const codec::HostTensor& t, DType dtype) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("config.base_model: ", base, ": ", name, ": ",
                                                   kernels::DTypeName(t.dtype),
                                                   ", not a floating dtype (F32, F16, BF16)"));
  }
  const size_t n = t.data.size() / kernels::SizeOf(t.dtype);
  std::string out;
  out.resize(n * kernels::SizeOf(dtype));
  for (size_t i = 0; i < n; ++i) {
    const float v = Widened(t, i);
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.base_model: ", base, ": ", name, ": element ", i,
                       " is inf or NaN; a job on it could never train"));
    }
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + i * sizeof(float), &v, sizeof(float));
      continue;
    }
    const uint16_t bits =
        dtype == DType::kF16 ? kernels::FloatToHalfBits(v) : kernels::FloatToBf16Bits(v);
    const float back =
        dtype == DType::kF16 ? kernels::HalfBitsToFloat(bits) : kernels::Bf16BitsToFloat(bits);
    if (!std::isfinite(back)) {
      return absl::InvalidArgumentError(absl::StrCat("config.base_model: ", base, ": ", name,
                                                     ": element ", i, " (", v, ") overflows ",
                                                     kernels::DTypeName(dtype)));
    }
    std::memcpy(out.data() + i * sizeof(uint16_t), &bits, sizeof(uint16_t));
  }
  return out;
}

}  // namespace

absl::StatusOr<codec::HostTensor> WidenedToF32(const std::string& name,
                                               const codec::HostTensor& t) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", kernels::DTypeName(t.dtype),
                                                   ", not a floating dtype (F32, F16, BF16)"));
  }
  AMPD_RETURN_IF_ERROR(t.Validate(name));
  codec::HostTensor out;
  out.dtype = DType::kF32;
  out.shape = t.shape;
  const size_t n = static_cast<size_t>(codec::NumElements(t.shape));
  codec::ResizeForBulkCopy(&out.data, n * sizeof(float));
  for (size_t i = 0; i < n; ++i) {
    const float v = Widened(t, i);
    std::memcpy(out.data.data() + i * sizeof(float), &v, sizeof(float));
  }
  return out;
}

FrozenBase::~FrozenBase() = default;

FrozenBase::Loader::Loader(std::string name, const ModelSpec& spec, Precision precision,
                           std::unique_ptr<kernels::Backend> backend)
    : base_(new FrozenBase()),
      tied_(spec.decoder() != nullptr && spec.decoder()->tie_word_embeddings) {
  base_->identity_.name = std::move(name);
  base_->precision_ = precision;
  base_->backend_ = std::move(backend);
}

FrozenBase::Loader::~Loader() = default;

absl::Status FrozenBase::Loader::Add(std::vector<codec::NamedTensor> tensors) {
  if (base_ == nullptr || base_->backend_ == nullptr) {
    return absl::FailedPreconditionError("FrozenBase::Loader: finished, or made without a backend");
  }
  const std::string& name = base_->identity_.name;
  const DType dtype = WorkingDType(base_->precision_);
  for (codec::NamedTensor& t : tensors) {
    if (absl::EndsWith(t.name, ".rotary_emb.inv_freq")) continue;
    AMPD_RETURN_IF_ERROR(t.tensor.Validate(t.name));
    if (base_->tensors_.contains(t.name) || (tied_ && t.name == "lm_head.weight" && has_head_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.base_model: ", name, ": ", t.name, ": given twice"));
    }
    AMPD_ASSIGN_OR_RETURN(std::string bytes, Converted(name, t.name, t.tensor, dtype));
    t.tensor.data = std::string();  // the file's copy goes as soon as it is converted
    if (tied_ && t.name == "lm_head.weight") {
      // Kept to be compared with the embedding, which may be in a later file.
      head_ = std::move(bytes);
      head_shape_ = t.tensor.shape;
      has_head_ = true;
      continue;
    }
    AMPD_ASSIGN_OR_RETURN(kernels::Tensor device, base_->backend_->Allocate(dtype, t.tensor.shape));
    AMPD_RETURN_IF_ERROR(base_->backend_->CopyFromHost(bytes.data(), bytes.size(), device));
    // The copy may only be queued, reading `bytes` later (backend.h).
    AMPD_RETURN_IF_ERROR(base_->backend_->Synchronize());
    base_->bytes_ += static_cast<int64_t>(device.nbytes());
    base_->tensors_.emplace(t.name, std::move(device));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const FrozenBase>> FrozenBase::Loader::Finish(std::string digest) {
  if (base_ == nullptr) return absl::FailedPreconditionError("FrozenBase::Loader: finished");
  const std::string& name = base_->identity_.name;
  if (has_head_) {
    // A tied model's head is the embedding: taken only when it holds the
    // embedding's values (in the working dtype), as a job's load takes it.
    auto embedding = base_->tensors_.find("model.embed_tokens.weight");
    std::string held;
    if (embedding != base_->tensors_.end() && embedding->second.shape() == head_shape_) {
      held.resize(embedding->second.nbytes());
      AMPD_RETURN_IF_ERROR(
          base_->backend_->CopyToHost(embedding->second, held.data(), held.size()));
    }
    if (held != head_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.base_model: ", name,
          ": lm_head.weight: the config ties the head to model.embed_tokens.weight, and the "
          "files' head differs from it"));
    }
  }
  base_->identity_.digest = std::move(digest);
  return std::shared_ptr<const FrozenBase>(std::move(base_));
}

std::vector<std::string> FrozenBase::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

absl::StatusOr<kernels::Tensor> FrozenBase::View(const std::string& name,
                                                 const kernels::Shape& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("config.base_model: ", identity_.name, ": ",
                                                   name, ": missing from its weight files"));
  }
  if (it->second.shape() != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.base_model: ", identity_.name, ": ", name, ": the files hold ",
                     kernels::ShapeToString(it->second.shape()), ", its config.json makes it ",
                     kernels::ShapeToString(shape)));
  }
  return it->second.View(0, shape);
}

}  // namespace ampd::engine::model
