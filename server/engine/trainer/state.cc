// Trainer::ExportState and Trainer::LoadState: a job's master weights,
// optimizer moments, scaler state and counts as a state dict, and back, all
// or nothing. A state dict of model weights alone (no optimizer.* tensors
// and no optimizer.step, e.g. a pretrained model's file) loads too, when
// the job's count is kept: it replaces the weights, starts the optimizer
// afresh (zero moments, no update applied) and leaves the scaler as it is.
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

namespace {

std::string Got(const HostTensor& t) {
  return absl::StrCat(kernels::DTypeName(t.dtype), kernels::ShapeToString(t.shape));
}

absl::StatusOr<int64_t> ParseCount(const checkpoint::StateDict& state, const std::string& key) {
  auto it = state.metadata.find(key);
  if (it == state.metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata ", key, ": missing"));
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", key, ": expected a count >= 0, got \"", it->second, "\""));
  }
  return v;
}

absl::Status CommitTensors(kernels::Backend& b,
                           const std::vector<std::pair<std::string, Tensor*>>& targets,
                           const std::vector<const HostTensor*>& sources) {
  // Device copies into fresh tensors, so a device error leaves the live
  // state whole; then commit by moving them into the live Tensor objects
  // (their addresses are what the cached ParamRefs point at). A null source
  // is a tensor that starts at zero.
  std::vector<Tensor> fresh;
  fresh.reserve(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    AMPD_ASSIGN_OR_RETURN(Tensor t, b.Allocate(DType::kF32, targets[i].second->shape()));
    if (sources[i] == nullptr) {
      AMPD_RETURN_IF_ERROR(b.Fill(t, 0.0f));
    } else {
      AMPD_RETURN_IF_ERROR(b.CopyFromHost(sources[i]->data.data(), sources[i]->data.size(), t));
    }
    fresh.push_back(std::move(t));
  }
  // The copies may only be queued, reading the caller's buffers later
  // (backend.h's CopyFromHost contract); wait for them before returning,
  // and before committing, so a device error leaves the live state whole.
  AMPD_RETURN_IF_ERROR(b.Synchronize());
  for (size_t i = 0; i < targets.size(); ++i) *targets[i].second = std::move(fresh[i]);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<checkpoint::StateDict> Trainer::ExportState() const {
  const Impl& m = *impl_;
  checkpoint::StateDict state;
  // The host tensors are laid out first and filled by a few batched
  // ReadBacks (one device sync per batch, not one per tensor); their buffers
  // are only addressed once the vector holding them stops growing.
  std::vector<const Tensor*> sources;
  auto add = [&](const std::string& name, const Tensor& t) {
    HostTensor h;
    h.dtype = DType::kF32;
    h.shape = t.shape();
    ResizeForBulkCopy(&h.data, t.nbytes());
    state.tensors.push_back({name, std::move(h)});
    sources.push_back(&t);
  };
  const std::vector<model::Parameter>& params = m.model->params();
  const auto& names = m.optimizer.buffer_names();
  state.tensors.reserve(params.size() * (1 + names.size()));
  for (const model::Parameter& p : params) add(p.name, p.master);
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t i = 0; i < names.size(); ++i) {
      add(absl::StrCat("optimizer.", params[p].name, ".", names[i]), m.optimizer.buffers()[p][i]);
    }
  }
  // Batches of at most kExportBatchBytes (a larger tensor goes alone): a
  // CUDA backend stages ReadBack's copies in a pinned buffer it keeps, and
  // that buffer must not grow to the size of the whole state.
  constexpr size_t kExportBatchBytes = size_t{64} << 20;
  std::vector<kernels::HostCopy> copies;
  size_t batch_bytes = 0;
  for (size_t i = 0; i <= sources.size(); ++i) {
    const size_t bytes = i < sources.size() ? state.tensors[i].tensor.data.size() : 0;
    if (!copies.empty() && (i == sources.size() || batch_bytes + bytes > kExportBatchBytes)) {
      AMPD_RETURN_IF_ERROR(m.backend->ReadBack({}, {}, copies));
      copies.clear();
      batch_bytes = 0;
    }
    if (i == sources.size()) break;
    std::string& data = state.tensors[i].tensor.data;
    copies.push_back({sources[i], data.data(), data.size()});
    batch_bytes += bytes;
  }
  for (const auto& [key, value] : m.scaler.StateDict()) {
    state.metadata[absl::StrCat("scaler.", key)] = amp::FormatStateNumber(value);
  }
  state.metadata[kMetaOptimizerStep] = absl::StrCat(m.optimizer.applied_steps());
  state.metadata[kMetaStep] = absl::StrCat(m.steps_run);
  m.model->AnnotateExport(state);
  return state;
}

absl::Status Trainer::LoadState(const checkpoint::StateDict& state, StepCount step_count) {
  Impl& m = *impl_;
  std::vector<model::Parameter>& params = m.model->params();
  const auto& buffer_names = m.optimizer.buffer_names();

  // 0. The model's own names for what the file calls its tensors (a GPT
  //    takes Hugging Face's variants); "" drops a tensor the model ignores.
  AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> names, m.model->CanonicalNames(state));
  absl::flat_hash_map<std::string, const HostTensor*> by_name;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (names[i].empty()) continue;
    if (!by_name.emplace(names[i], &state.tensors[i].tensor).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(state.tensors[i].name, ": ", names[i], " is given twice"));
    }
  }
  bool has_optimizer = state.metadata.contains(kMetaOptimizerStep);
  for (const auto& [name, tensor] : by_name) {
    has_optimizer = has_optimizer || absl::StartsWith(name, "optimizer.");
  }
  const bool weights_only = !has_optimizer && step_count == StepCount::kKeep;

  // 1. Every expected tensor present with the right dtype, shape and bytes;
  //    nothing unexpected (a state saved for another model or optimizer).
  std::vector<std::pair<std::string, Tensor*>> targets;  // name -> live tensor it replaces
  for (model::Parameter& p : params) targets.emplace_back(p.name, &p.master);
  const size_t weight_count = targets.size();
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t i = 0; i < buffer_names.size(); ++i) {
      targets.emplace_back(absl::StrCat("optimizer.", params[p].name, ".", buffer_names[i]),
                           &m.optimizer.buffers()[p][i]);
    }
  }
  std::vector<const HostTensor*> sources;
  for (size_t t = 0; t < targets.size(); ++t) {
    const auto& [name, live] = targets[t];
    if (weights_only && t >= weight_count) {
      sources.push_back(nullptr);  // zero moments: the optimizer starts afresh
      continue;
    }
    auto found = by_name.find(name);
    const HostTensor* h = found == by_name.end() ? nullptr : found->second;
    if (h == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": missing"));
    AMPD_RETURN_IF_ERROR(h->Validate(name));
    if (h->dtype != DType::kF32 || h->shape != live->shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected F32", kernels::ShapeToString(live->shape()), ", got ", Got(*h)));
    }
    sources.push_back(h);
  }
  absl::flat_hash_set<absl::string_view> known;
  for (const auto& target : targets) known.insert(target.first);
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (!names[i].empty() && !known.contains(names[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(state.tensors[i].name, ": not a tensor of this job's model or optimizer"));
    }
  }
  // 2. Counters and the scaler, into copies (weights alone keep the scaler
  //    and the job's count; the optimizer has applied nothing to them).
  amp::GradScaler scaler = m.scaler;
  if (weights_only) {
    AMPD_RETURN_IF_ERROR(CommitTensors(*m.backend, targets, sources));
    m.optimizer.set_applied_steps(0);
    return m.model->CastWorking();
  }
  AMPD_ASSIGN_OR_RETURN(const int64_t opt_step, ParseCount(state, kMetaOptimizerStep));
  AMPD_ASSIGN_OR_RETURN(const int64_t job_step, ParseCount(state, kMetaStep));
  amp::ScalerState scaler_state;
  for (const auto& [key, text] : state.metadata) {
    if (!absl::StartsWith(key, "scaler.")) continue;
    absl::StatusOr<double> v = amp::ParseStateNumber(key, text);
    if (!v.ok())
      return absl::Status(v.status().code(), absl::StrCat("metadata ", v.status().message()));
    scaler_state[key.substr(7)] = *v;
  }
  if (absl::Status s = scaler.LoadStateDict(scaler_state); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("metadata scaler.", s.message()));
  }
  AMPD_RETURN_IF_ERROR(CommitTensors(*m.backend, targets, sources));
  m.scaler = std::move(scaler);
  m.optimizer.set_applied_steps(opt_step);
  if (step_count == StepCount::kFromState) m.steps_run = job_step;
  return m.model->CastWorking();
}

}  // namespace ampd::engine
