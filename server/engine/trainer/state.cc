// Trainer::ExportState and Trainer::LoadState: a job's master weights,
// optimizer moments, scaler state and counts as a state dict, and back, all
// or nothing. A state dict of model weights alone (no optimizer.* tensors
// and no optimizer.step, e.g. a pretrained model's file) loads too, when
// the job's count is kept: it replaces the weights, starts the optimizer
// afresh (zero moments, no update applied) and leaves the scaler as it is.
// A partial state (Coverage::kPartial: one file of a sharded checkpoint)
// replaces the weights it holds and nothing else. A state from elsewhere
// (StepCount::kKeep: an import) must hold finite values only.
// ReplaceState is LoadState that keeps what it replaced (on the device) so
// a caller can undo it, and ArrangeForLoad turns a state dict into what
// ExportState would read back once it is loaded, without loading it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/float16.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

// The live tensors a ReplaceState swapped out (each beside the Tensor object
// it was swapped out of), and the scaler and counts it replaced.
struct Trainer::ReplacedState::Parts {
  std::vector<std::pair<Tensor*, Tensor>> tensors;
  amp::GradScaler scaler;
  int64_t applied_steps = 0;
  int64_t steps_run = 0;
};

Trainer::ReplacedState::ReplacedState() = default;
Trainer::ReplacedState::~ReplacedState() = default;
Trainer::ReplacedState::ReplacedState(ReplacedState&&) noexcept = default;
Trainer::ReplacedState& Trainer::ReplacedState::operator=(ReplacedState&&) noexcept = default;

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

// The state dict's tensors in ExportState's order: each parameter's held
// tensor (its F32 master, or a frozen 16-bit parameter's working copy), then
// every trainable parameter's optimizer buffers. Name -> live tensor.
std::vector<std::pair<std::string, Tensor*>> StateTensors(model::Network& model,
                                                          optim::OptimizerState& optimizer) {
  std::vector<model::Parameter>& params = model.params();
  const auto& buffer_names = optimizer.buffer_names();
  std::vector<std::pair<std::string, Tensor*>> tensors;
  tensors.reserve(params.size() + model.trainable().size() * buffer_names.size());
  for (model::Parameter& p : params) {
    // A shared base is the base model's files, not this job's state.
    if (!p.shared) tensors.emplace_back(p.name, &p.held());
  }
  for (size_t slot = 0; slot < model.trainable().size(); ++slot) {
    const std::string& name = params[static_cast<size_t>(model.trainable()[slot])].name;
    for (size_t i = 0; i < buffer_names.size(); ++i) {
      tensors.emplace_back(absl::StrCat("optimizer.", name, ".", buffer_names[i]),
                           &optimizer.buffers()[slot][i]);
    }
  }
  return tensors;
}

// A state tensor for a live tensor of dtype `live`: of that dtype, or F32
// for a 16-bit one (a frozen base given in full precision, as a full job
// exports it), rounded to nearest even here. InvalidArgument for another
// dtype, or an F32 value the 16-bit dtype cannot hold (inf from a finite
// value would freeze a non-finite weight into the model).
bool LoadsInto(DType given, DType live) {
  return given == live || (given == DType::kF32 && live != DType::kF32);
}

absl::StatusOr<HostTensor> RoundedTo(const std::string& name, const HostTensor& f32, DType dtype) {
  HostTensor out;
  out.dtype = dtype;
  out.shape = f32.shape;
  const size_t n = f32.data.size() / sizeof(float);
  ResizeForBulkCopy(&out.data, n * sizeof(uint16_t));
  for (size_t i = 0; i < n; ++i) {
    float v = 0.0f;
    std::memcpy(&v, f32.data.data() + i * sizeof(float), sizeof(float));
    const uint16_t bits =
        dtype == DType::kF16 ? kernels::FloatToHalfBits(v) : kernels::FloatToBf16Bits(v);
    const float back =
        dtype == DType::kF16 ? kernels::HalfBitsToFloat(bits) : kernels::Bf16BitsToFloat(bits);
    if (std::isfinite(v) && !std::isfinite(back)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": element ", i, " (", v, ") overflows ", kernels::DTypeName(dtype)));
    }
    std::memcpy(out.data.data() + i * sizeof(uint16_t), &bits, sizeof(uint16_t));
  }
  return out;
}

// InvalidArgument naming the tensor and the first element that is inf or
// NaN, for a floating tensor: a state dict from elsewhere (a base model, an
// adapter, another job's export) with one would make a job that can never
// take a step (every gradient non-finite, or a frozen weight that stays
// NaN), so it is refused at the load.
absl::Status CheckFiniteValues(const std::string& name, const HostTensor& t) {
  // The exponent bits all set: inf or NaN, in each format's own layout.
  auto first_non_finite = [&t](auto word, uint64_t exponent) -> int64_t {
    using Word = decltype(word);
    const size_t n = t.data.size() / sizeof(Word);
    for (size_t i = 0; i < n; ++i) {
      Word bits;
      std::memcpy(&bits, t.data.data() + i * sizeof(Word), sizeof(Word));
      if ((static_cast<uint64_t>(bits) & exponent) == exponent) return static_cast<int64_t>(i);
    }
    return -1;
  };
  int64_t bad = -1;
  switch (t.dtype) {
    case DType::kF32:
      bad = first_non_finite(uint32_t{0}, 0x7f800000u);
      break;
    case DType::kF16:
      bad = first_non_finite(uint16_t{0}, 0x7c00u);
      break;
    case DType::kBF16:
      bad = first_non_finite(uint16_t{0}, 0x7f80u);
      break;
    default:
      return absl::OkStatus();
  }
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": element ", bad,
                   " is inf or NaN; a loaded state must be finite (a job that holds it "
                   "could never train)"));
}

// Device copies of `sources` in fresh tensors shaped and typed as
// `targets` (a null source is a tensor that starts at zero), waited for:
// the live state is untouched, and a device error leaves it whole. Each
// source is of its target's dtype (PlanLoad converts the others).
absl::StatusOr<std::vector<Tensor>> StageTensors(
    kernels::Backend& b, const std::vector<std::pair<std::string, Tensor*>>& targets,
    const std::vector<const HostTensor*>& sources) {
  std::vector<Tensor> fresh;
  fresh.reserve(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    const Tensor& live = *targets[i].second;
    AMPD_ASSIGN_OR_RETURN(Tensor t, b.Allocate(live.dtype(), live.shape()));
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
  return fresh;
}

// PlanLoad's parts. Each tensor's index by the model's own name for it
// ("" names a tensor the model ignores); a name given twice is refused.
absl::StatusOr<absl::flat_hash_map<std::string, int64_t>> IndexByName(
    const checkpoint::StateDict& state, const std::vector<std::string>& names) {
  absl::flat_hash_map<std::string, int64_t> by_name;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (names[i].empty()) continue;
    if (!by_name.emplace(names[i], static_cast<int64_t>(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(state.tensors[i].name, ": ", names[i], " is given twice"));
    }
  }
  return by_name;
}

// No tensor the load has no target for (a state saved for another model or
// optimizer), and none of a shared base's frozen weights.
absl::Status CheckNoStrangers(const checkpoint::StateDict& state,
                              const std::vector<std::string>& names,
                              const std::vector<std::pair<std::string, Tensor*>>& targets,
                              const model::Network& model) {
  absl::flat_hash_set<absl::string_view> known;
  for (const auto& target : targets) known.insert(target.first);
  absl::flat_hash_set<absl::string_view> shared;
  for (const model::Parameter& p : model.params()) {
    if (p.shared) shared.insert(p.name);
  }
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (!names[i].empty() && shared.contains(names[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          state.tensors[i].name, ": a frozen weight of base_model ",
          model.frozen_base()->identity().name,
          ", which this job shares read-only with the other jobs on it; load its adapters "
          "alone"));
    }
    if (!names[i].empty() && !known.contains(names[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(state.tensors[i].name, ": not a tensor of this job's model or optimizer"));
    }
  }
  return absl::OkStatus();
}

// A partial load's metadata names no optimizer or scaler state, and a
// shared base's job takes states of its own base only: the adapters
// trained on other weights would be wrong on these.
absl::Status CheckLoadMetadata(const checkpoint::StateDict& state, bool partial,
                               const model::FrozenBase* base) {
  if (partial) {
    for (const auto& [key, value] : state.metadata) {
      if (key == kMetaOptimizerStep || absl::StartsWith(key, "scaler.")) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata ", key,
                         ": a partial load replaces model weights only; load the whole "
                         "state to restore the optimizer or the scaler"));
      }
    }
  }
  if (base == nullptr) return absl::OkStatus();
  auto digest = state.metadata.find(kMetaBaseDigest);
  if (digest != state.metadata.end() && digest->second != base->identity().digest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata ", kMetaBaseDigest, ": the state was trained on a base whose files' digest is ",
        digest->second, "; base_model ", base->identity().name, "'s files now have ",
        base->identity().digest, " (they changed since)"));
  }
  return absl::OkStatus();
}

// The state's scaler.* metadata into `scaler` (the plan's copy).
absl::Status LoadScalerState(const checkpoint::StateDict& state, amp::GradScaler& scaler) {
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
  return absl::OkStatus();
}

}  // namespace

void Trainer::AddStateMetadata(const amp::GradScaler& scaler, int64_t opt_step, int64_t steps_run,
                               checkpoint::StateDict& state) const {
  for (const auto& [key, value] : scaler.StateDict()) {
    state.metadata[absl::StrCat("scaler.", key)] = amp::FormatStateNumber(value);
  }
  state.metadata[kMetaOptimizerStep] = absl::StrCat(opt_step);
  state.metadata[kMetaStep] = absl::StrCat(steps_run);
  if (const model::FrozenBase* base = impl_->model->frozen_base(); base != nullptr) {
    state.metadata[kMetaBaseModel] = base->identity().name;
    state.metadata[kMetaBaseDigest] = base->identity().digest;
  }
  impl_->model->AnnotateExport(state);
}

absl::StatusOr<std::vector<codec::NamedTensor>> ReadHostTensors(
    kernels::Backend& backend, const std::vector<std::pair<std::string, Tensor*>>& sources) {
  // The host tensors are laid out first and filled by a few batched
  // ReadBacks (one device sync per batch, not one per tensor); their buffers
  // are only addressed once the vector holding them stops growing.
  std::vector<codec::NamedTensor> tensors;
  tensors.reserve(sources.size());
  for (const auto& [name, t] : sources) {
    HostTensor h;
    h.dtype = t->dtype();
    h.shape = t->shape();
    ResizeForBulkCopy(&h.data, t->nbytes());
    tensors.push_back({name, std::move(h)});
  }
  // Batches of at most kExportBatchBytes (a larger tensor goes alone): a
  // CUDA backend stages ReadBack's copies in a pinned buffer it keeps, and
  // that buffer must not grow to the size of the whole state.
  constexpr size_t kExportBatchBytes = size_t{64} << 20;
  std::vector<kernels::HostCopy> copies;
  size_t batch_bytes = 0;
  for (size_t i = 0; i <= sources.size(); ++i) {
    const size_t bytes = i < sources.size() ? tensors[i].tensor.data.size() : 0;
    if (!copies.empty() && (i == sources.size() || batch_bytes + bytes > kExportBatchBytes)) {
      AMPD_RETURN_IF_ERROR(backend.ReadBack({}, {}, copies));
      copies.clear();
      batch_bytes = 0;
    }
    if (i == sources.size()) break;
    std::string& data = tensors[i].tensor.data;
    copies.push_back({sources[i].second, data.data(), data.size()});
    batch_bytes += bytes;
  }
  return tensors;
}

absl::StatusOr<checkpoint::StateDict> Trainer::ExportState() const {
  Impl& m = *impl_;
  checkpoint::StateDict state;
  AMPD_ASSIGN_OR_RETURN(state.tensors,
                        ReadHostTensors(*m.backend, StateTensors(*m.model, m.optimizer)));
  AddStateMetadata(m.scaler, m.optimizer.applied_steps(), m.steps_run, state);
  return state;
}

absl::Status Trainer::LoadState(const checkpoint::StateDict& state, StepCount step_count,
                                Coverage coverage) {
  // What was replaced is freed on the way out.
  return ReplaceState(state, step_count, coverage).status();
}

// What a load would do, checked (LoadState's steps 0 to 2): the live tensor
// each of the state's tensors replaces, and the scaler and counts after it.
struct Trainer::LoadPlan {
  // ExportState's order; a partial load's are the weights it holds only.
  std::vector<std::pair<std::string, Tensor*>> targets;
  // Index into state.tensors of each target's source; -1: a moment a
  // weights-only load starts at zero.
  std::vector<int64_t> sources;
  // By target: the source rounded to the target's 16-bit dtype, where the
  // state gave it in F32 (LoadsInto); loaded in its place.
  std::map<size_t, HostTensor> rounded;

  // Target t's source in `state` (the one planned, or an arranged copy of
  // it), rounded when it had to be; nullptr for a zero moment.
  template <typename State>
  auto Source(State& state, size_t t) -> decltype(&state.tensors[0].tensor) {
    if (auto it = rounded.find(t); it != rounded.end()) return &it->second;
    return sources[t] < 0 ? nullptr : &state.tensors[static_cast<size_t>(sources[t])].tensor;
  }
  amp::GradScaler scaler;
  int64_t opt_step = 0;
  int64_t steps_run = 0;
};

absl::StatusOr<Trainer::LoadPlan> Trainer::PlanLoad(const checkpoint::StateDict& state,
                                                    StepCount step_count, Coverage coverage) const {
  Impl& m = *impl_;

  // 0. The model's own names for what the file calls its tensors (a GPT
  //    takes Hugging Face's variants); "" drops a tensor the model ignores.
  AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> names, m.model->CanonicalNames(state));
  AMPD_ASSIGN_OR_RETURN(const auto by_name, IndexByName(state, names));
  bool has_optimizer = state.metadata.contains(kMetaOptimizerStep);
  for (const auto& [name, index] : by_name) {
    has_optimizer = has_optimizer || absl::StartsWith(name, "optimizer.");
  }
  const bool weights_only = !has_optimizer && step_count == StepCount::kKeep;
  const bool partial = coverage == Coverage::kPartial;
  AMPD_RETURN_IF_ERROR(CheckLoadMetadata(state, partial, m.model->frozen_base()));

  // 1. Every expected tensor present with the right dtype, shape and bytes;
  //    nothing unexpected (a state saved for another model or optimizer).
  LoadPlan plan{StateTensors(*m.model, m.optimizer), {}, {}, m.scaler, 0, m.steps_run};
  const size_t weight_count = m.model->params().size();
  std::vector<std::pair<std::string, Tensor*>> present;  // a partial load's targets
  for (size_t t = 0; t < plan.targets.size(); ++t) {
    const auto& [name, live] = plan.targets[t];
    if (weights_only && t >= weight_count) {
      plan.sources.push_back(-1);  // zero moments: the optimizer starts afresh
      continue;
    }
    auto found = by_name.find(name);
    if (found == by_name.end() && partial) continue;  // stays as it is
    if (found == by_name.end()) return absl::InvalidArgumentError(absl::StrCat(name, ": missing"));
    if (partial && t >= weight_count) {
      return absl::InvalidArgumentError(
          absl::StrCat(state.tensors[static_cast<size_t>(found->second)].name,
                       ": a partial load replaces model weights only"));
    }
    if (partial) present.push_back(plan.targets[t]);
    const HostTensor& h = state.tensors[static_cast<size_t>(found->second)].tensor;
    AMPD_RETURN_IF_ERROR(h.Validate(name));
    // A state from elsewhere is checked value by value; a job's own
    // checkpoint (kFromState) restores as it was written.
    if (step_count == StepCount::kKeep) AMPD_RETURN_IF_ERROR(CheckFiniteValues(name, h));
    if (!LoadsInto(h.dtype, live->dtype()) || h.shape != live->shape()) {
      const std::string also_f32 = live->dtype() != DType::kF32 ? " (or F32)" : "";
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected ", kernels::DTypeName(live->dtype()), also_f32,
                       kernels::ShapeToString(live->shape()), ", got ", Got(h)));
    }
    if (h.dtype != live->dtype()) {
      AMPD_ASSIGN_OR_RETURN(HostTensor rounded, RoundedTo(name, h, live->dtype()));
      plan.rounded.emplace(plan.sources.size(), std::move(rounded));  // this target's index
    }
    plan.sources.push_back(found->second);
  }
  AMPD_RETURN_IF_ERROR(CheckNoStrangers(state, names, plan.targets, *m.model));
  // 2. Counters and the scaler, into the plan's copies (weights alone keep
  //    the scaler and the job's count; the optimizer has applied nothing,
  //    or, partial, what it had).
  if (partial) {
    if (present.empty()) {
      return absl::InvalidArgumentError(
          "tensors: a partial load holds none of the model's weights");
    }
    plan.targets = std::move(present);
    plan.opt_step = m.optimizer.applied_steps();
    return plan;
  }
  if (weights_only) return plan;
  AMPD_ASSIGN_OR_RETURN(plan.opt_step, ParseCount(state, kMetaOptimizerStep));
  AMPD_ASSIGN_OR_RETURN(const int64_t job_step, ParseCount(state, kMetaStep));
  AMPD_RETURN_IF_ERROR(LoadScalerState(state, plan.scaler));
  if (step_count == StepCount::kFromState) plan.steps_run = job_step;
  return plan;
}

absl::StatusOr<checkpoint::StateDict> Trainer::ArrangeForLoad(checkpoint::StateDict state,
                                                              StepCount step_count,
                                                              Coverage coverage) const {
  AMPD_ASSIGN_OR_RETURN(LoadPlan plan, PlanLoad(state, step_count, coverage));
  if (coverage == Coverage::kPartial) {
    // What the load leaves as it is must be read back: the job's state
    // with the file's weights laid over it.
    AMPD_ASSIGN_OR_RETURN(checkpoint::StateDict arranged, ExportState());
    absl::flat_hash_map<std::string, size_t> index;
    for (size_t i = 0; i < arranged.tensors.size(); ++i) index[arranged.tensors[i].name] = i;
    for (size_t t = 0; t < plan.targets.size(); ++t) {
      arranged.tensors[index.at(plan.targets[t].first)].tensor = std::move(*plan.Source(state, t));
    }
    return arranged;
  }
  checkpoint::StateDict arranged;
  arranged.tensors.reserve(plan.targets.size());
  for (size_t t = 0; t < plan.targets.size(); ++t) {
    const auto& [name, live] = plan.targets[t];
    HostTensor h;
    if (HostTensor* source = plan.Source(state, t); source != nullptr) {
      // The bytes the device will be given, so the bytes it would give
      // back (a copy in the live dtype is exact): moved, not copied.
      h = std::move(*source);
    } else {
      h.dtype = live->dtype();
      h.shape = live->shape();
      h.data.assign(static_cast<size_t>(live->nbytes()), '\0');
    }
    arranged.tensors.push_back({name, std::move(h)});
  }
  AddStateMetadata(plan.scaler, plan.opt_step, plan.steps_run, arranged);
  return arranged;
}

absl::StatusOr<Trainer::ReplacedState> Trainer::ReplaceState(const checkpoint::StateDict& state,
                                                             StepCount step_count,
                                                             Coverage coverage) {
  Impl& m = *impl_;
  AMPD_ASSIGN_OR_RETURN(LoadPlan plan, PlanLoad(state, step_count, coverage));
  std::vector<const HostTensor*> sources;
  sources.reserve(plan.sources.size());
  for (size_t t = 0; t < plan.sources.size(); ++t) sources.push_back(plan.Source(state, t));
  // 3. The device copies, into fresh tensors; then the commit swaps them
  //    into the live Tensor objects (their addresses are what the cached
  //    ParamRefs point at), and what was live is kept for UndoReplace.
  AMPD_ASSIGN_OR_RETURN(std::vector<Tensor> fresh, StageTensors(*m.backend, plan.targets, sources));
  ReplacedState replaced;
  replaced.parts_ = std::make_unique<ReplacedState::Parts>(
      ReplacedState::Parts{{},
                           std::exchange(m.scaler, std::move(plan.scaler)),
                           m.optimizer.applied_steps(),
                           m.steps_run});
  replaced.parts_->tensors.reserve(plan.targets.size());
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    std::swap(*plan.targets[i].second, fresh[i]);
    replaced.parts_->tensors.emplace_back(plan.targets[i].second, std::move(fresh[i]));
  }
  m.optimizer.set_applied_steps(plan.opt_step);
  m.steps_run = plan.steps_run;
  if (absl::Status cast = m.model->CastWorking(); !cast.ok()) {
    // The masters are in but the working copy is not theirs: go back.
    absl::Status undone = UndoReplace(std::move(replaced));
    return undone.ok()
               ? cast
               : absl::Status(cast.code(),
                              absl::StrCat(cast.message(),
                                           "; undoing the load failed too: ", undone.message()));
  }
  return replaced;
}

absl::Status Trainer::UndoReplace(ReplacedState replaced) {
  if (replaced.parts_ == nullptr) {
    return absl::FailedPreconditionError("UndoReplace: nothing was replaced");
  }
  Impl& m = *impl_;
  ReplacedState::Parts& parts = *replaced.parts_;
  for (auto& [live, previous] : parts.tensors) std::swap(*live, previous);
  m.scaler = std::move(parts.scaler);
  m.optimizer.set_applied_steps(parts.applied_steps);
  m.steps_run = parts.steps_run;
  return m.model->CastWorking();
}

}  // namespace ampd::engine
