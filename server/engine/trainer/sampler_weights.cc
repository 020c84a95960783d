// Sampler snapshots' weights: a device copy of what Sample reads, sampling
// from it by swapping it into the parameters for one call, and its host
// form for the snapshot's file. Only the trainable parameters are copied;
// a LoRA job's frozen base is the job's own and never changes.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::Tensor;

SamplerWeights::SamplerWeights() = default;
SamplerWeights::~SamplerWeights() = default;
SamplerWeights::SamplerWeights(SamplerWeights&&) noexcept = default;
SamplerWeights& SamplerWeights::operator=(SamplerWeights&&) noexcept = default;

int64_t Trainer::sampler_weights_bytes() const {
  const model::Network& net = *impl_->model;
  int64_t bytes = 0;
  for (const int i : net.trainable()) {
    bytes = SaturatingAdd(
        bytes, static_cast<int64_t>(net.params()[static_cast<size_t>(i)].value().nbytes()));
  }
  return bytes;
}

absl::StatusOr<SamplerWeights> Trainer::CopySamplerWeights() {
  Impl& m = *impl_;
  SamplerWeights weights;
  weights.owner_ = this;
  weights.tensors_.reserve(m.model->trainable().size());
  for (const int i : m.model->trainable()) {
    const Tensor& value = m.model->params()[static_cast<size_t>(i)].value();
    AMPD_ASSIGN_OR_RETURN(Tensor copy, m.backend->Allocate(value.dtype(), value.shape()));
    AMPD_RETURN_IF_ERROR(m.backend->Copy(value, copy));
    weights.bytes_ += static_cast<int64_t>(copy.nbytes());
    weights.tensors_.push_back(std::move(copy));
  }
  return weights;
}

namespace {

// Swaps a snapshot's tensors with the parameters' values for its lifetime:
// Sample reads the snapshot through the model's own parameters, and the
// job's weights are back in place on every way out.
class SwappedIn {
 public:
  SwappedIn(model::Network& net, std::vector<Tensor>& tensors) : net_(net), tensors_(tensors) {
    Swap();
  }
  ~SwappedIn() { Swap(); }
  SwappedIn(const SwappedIn&) = delete;
  SwappedIn& operator=(const SwappedIn&) = delete;

 private:
  void Swap() {
    const std::vector<int>& trainable = net_.trainable();
    for (size_t k = 0; k < trainable.size(); ++k) {
      model::Parameter& p = net_.params()[static_cast<size_t>(trainable[k])];
      std::swap(p.working.empty() ? p.master : p.working, tensors_[k]);
    }
  }
  model::Network& net_;
  std::vector<Tensor>& tensors_;
};

}  // namespace

absl::StatusOr<SampleReport> Trainer::SampleFrom(SamplerWeights& weights,
                                                 const Valid<SampleRequest>& request,
                                                 const std::function<absl::Status(int64_t)>& admit,
                                                 const CallToken& call) {
  if (weights.owner_ != this || weights.tensors_.size() != impl_->model->trainable().size()) {
    return absl::InvalidArgumentError("snapshot: its weights belong to another model");
  }
  SwappedIn swapped(*impl_->model, weights.tensors_);
  return Sample(request, admit, call);
}

absl::StatusOr<checkpoint::StateDict> Trainer::ExportSamplerWeights(const SamplerWeights& weights) {
  Impl& m = *impl_;
  const std::vector<int>& trainable = m.model->trainable();
  if (weights.owner_ != this || weights.tensors_.size() != trainable.size()) {
    return absl::InvalidArgumentError("snapshot: its weights belong to another model");
  }
  std::vector<std::pair<std::string, Tensor*>> sources;
  sources.reserve(trainable.size());
  for (size_t k = 0; k < trainable.size(); ++k) {
    // ReadHostTensors only reads them.
    sources.emplace_back(m.model->params()[static_cast<size_t>(trainable[k])].name,
                         const_cast<Tensor*>(&weights.tensors_[k]));
  }
  checkpoint::StateDict state;
  AMPD_ASSIGN_OR_RETURN(state.tensors, ReadHostTensors(*m.backend, sources));
  return state;
}

absl::StatusOr<bool> Trainer::HoldsSamplerWeights(const SamplerWeights& weights) {
  Impl& m = *impl_;
  const std::vector<int>& trainable = m.model->trainable();
  if (weights.owner_ != this || weights.tensors_.size() != trainable.size()) return false;
  std::vector<std::pair<std::string, Tensor*>> sources;
  sources.reserve(2 * trainable.size());
  for (size_t k = 0; k < trainable.size(); ++k) {
    model::Parameter& p = m.model->params()[static_cast<size_t>(trainable[k])];
    // ReadHostTensors only reads them.
    sources.emplace_back(p.name, const_cast<Tensor*>(&p.value()));
    sources.emplace_back(p.name, const_cast<Tensor*>(&weights.tensors_[k]));
  }
  AMPD_ASSIGN_OR_RETURN(const std::vector<codec::NamedTensor> read,
                        ReadHostTensors(*m.backend, sources));
  for (size_t k = 0; k + 1 < read.size(); k += 2) {
    if (read[k].tensor.data != read[k + 1].tensor.data) return false;
  }
  return true;
}

absl::StatusOr<SamplerWeights> Trainer::LoadSamplerWeights(const checkpoint::StateDict& state) {
  Impl& m = *impl_;
  std::map<std::string, const HostTensor*> by_name;
  for (const codec::NamedTensor& t : state.tensors) by_name[t.name] = &t.tensor;
  SamplerWeights weights;
  weights.owner_ = this;
  for (const int i : m.model->trainable()) {
    const model::Parameter& p = m.model->params()[static_cast<size_t>(i)];
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::DataLossError(absl::StrCat(p.name, ": missing from the snapshot"));
    }
    const HostTensor& h = *it->second;
    const Tensor& value = p.value();
    if (h.dtype != value.dtype() || h.shape != value.shape() || h.data.size() != value.nbytes()) {
      return absl::DataLossError(absl::StrCat(p.name, ": the snapshot's tensor (",
                                              kernels::DTypeName(h.dtype), ", ", h.data.size(),
                                              " bytes) is not the model's ", value.DebugString()));
    }
    AMPD_ASSIGN_OR_RETURN(Tensor copy, m.backend->Allocate(value.dtype(), value.shape()));
    AMPD_RETURN_IF_ERROR(m.backend->CopyFromHost(h.data.data(), h.data.size(), copy));
    weights.bytes_ += static_cast<int64_t>(copy.nbytes());
    weights.tensors_.push_back(std::move(copy));
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return absl::DataLossError(
        absl::StrCat(by_name.begin()->first, ": the snapshot holds a tensor the model does not"));
  }
  return weights;
}

}  // namespace ampd::engine
