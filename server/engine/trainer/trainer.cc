// Trainer: building a job's model, optimizer state and scaler on its
// Backend (Create), and what the job reads of it between steps.
#include "server/engine/trainer/trainer.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

namespace {

absl::StatusOr<Tensor> AllocScalar(kernels::Backend& b, const kernels::Shape& shape) {
  AMPD_ASSIGN_OR_RETURN(Tensor t, b.Allocate(DType::kF32, shape));
  AMPD_RETURN_IF_ERROR(b.Fill(t, 0.0f));
  return t;
}

}  // namespace

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const JobConfig& config, std::unique_ptr<kernels::Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  AMPD_ASSIGN_OR_RETURN(const ValidJobConfig valid, ValidJobConfig::Check(config));
  return Create(valid, std::move(backend));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const ValidJobConfig& valid, std::unique_ptr<kernels::Backend> backend,
    std::shared_ptr<const model::FrozenBase> base) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  const JobConfig& config = valid.get();
  if ((base != nullptr) != SharesBase(config)) {
    return absl::InvalidArgumentError(
        "base_model: a LoRA job on a base model is built on its shared base, and no other job");
  }
  // Validation has kept per-layer scales to layer stacks of at most
  // kMaxLayerScaleGroups groups.
  const int64_t layer_groups =
      config.scaler.per_layer_scales ? model::LayerScaleGroups(config.model) : 1;
  AMPD_ASSIGN_OR_RETURN(amp::GradScaler scaler,
                        amp::GradScaler::Create(config.scaler, layer_groups));
  // Refused before any allocation when the weights alone cannot fit: the
  // backend's allocator would fail (or, with overcommit, succeed and let the
  // kernel kill the process when the pages are touched).
  const int64_t need = SaturatingAdd(EstimateJobBytes(config), SharedBaseBytes(config));
  const int64_t capacity = backend->MemoryCapacityBytes();
  if (capacity > 0 && need > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model: the job's weights, gradients and optimizer state need an estimated ",
                     need, " bytes, more than the ", capacity, " bytes of ", backend->name()));
  }
  if (config.batch_invariant) {
    // Refused where the backend cannot pin its kernels: a job that asked
    // for bitwise sampler-trainer agreement must not silently lose it.
    if (absl::Status s = backend->SetBatchInvariant(true); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("batch_invariant: ", s.message()));
    }
  }
  auto impl = std::make_unique<Impl>(config, std::move(backend), std::move(scaler));
  kernels::Backend& b = *impl->backend;

  AMPD_ASSIGN_OR_RETURN(impl->model, model::CreateNetwork(config.model, config.precision,
                                                          config.seed, b, std::move(base)));

  // The optimizer, the scaler's checks and the update cover the trainable
  // parameters alone (a LoRA job's frozen base has no master, gradient or
  // state); impl's per-parameter lists are in model->trainable()'s order.
  std::vector<model::Parameter>& params = impl->model->params();
  std::vector<std::string> names;
  std::vector<kernels::Shape> shapes;
  for (const int index : impl->model->trainable()) {
    const model::Parameter& p = params[static_cast<size_t>(index)];
    names.push_back(p.name);
    shapes.push_back(p.master.shape());
  }
  AMPD_ASSIGN_OR_RETURN(impl->optimizer,
                        optim::OptimizerState::Create(config.optimizer, names, shapes, b));

  impl->slot_of.assign(params.size(), -1);
  for (const int index : impl->model->trainable()) {
    model::Parameter& p = params[static_cast<size_t>(index)];
    impl->slot_of[static_cast<size_t>(index)] = static_cast<int>(impl->refs.size());
    kernels::ParamRef r{};
    r.master = &p.master;
    r.working = p.working.empty() ? nullptr : &p.working;
    r.grad = &p.grad;
    impl->refs.push_back(r);
    impl->grads.push_back(&p.grad);
    impl->const_grads.push_back(&p.grad);
  }
  impl->optimizer.Bind(impl->refs);
  impl->ready_grads.reserve(impl->grads.size());
  impl->grad_started.assign(impl->grads.size(), 0);

  // One scale group of every parameter, or one per layer group.
  std::vector<int> group_of(params.size(), 0);
  if (config.scaler.per_layer_scales) group_of = impl->model->ParamScaleGroups();
  // The model's own grouping must cover every parameter with a group the
  // scaler has: anything else is a bug of the model kind, not of the config.
  if (group_of.size() != params.size()) {
    return absl::InternalError(absl::StrCat("per_layer_scales: the model grouped ", group_of.size(),
                                            " of ", params.size(), " parameters"));
  }
  impl->groups.resize(static_cast<size_t>(layer_groups));
  for (size_t slot = 0; slot < impl->refs.size(); ++slot) {
    const int group = group_of[static_cast<size_t>(impl->model->trainable()[slot])];
    if (group < 0 || group >= layer_groups) {
      return absl::InternalError(absl::StrCat("per_layer_scales: parameter ", slot, " in group ",
                                              group, " of ", layer_groups));
    }
    const size_t p = slot;
    Impl::ScaleGroup& g = impl->groups[static_cast<size_t>(group)];
    g.refs.push_back(impl->refs[p]);
    g.grads.push_back(impl->grads[p]);
    g.const_grads.push_back(impl->const_grads[p]);
  }
  for (Impl::ScaleGroup& g : impl->groups) {
    AMPD_ASSIGN_OR_RETURN(g.max_abs, AllocScalar(b, {1, 1}));
    AMPD_ASSIGN_OR_RETURN(g.histogram, b.Allocate(DType::kI64, {kGradHistogramBins}));
  }
  for (Tensor* t : {&impl->loss, &impl->loss_sum, &impl->accum_loss, &impl->found_inf,
                    &impl->norm_sq, &impl->no_inf}) {
    AMPD_ASSIGN_OR_RETURN(*t, AllocScalar(b, {1, 1}));
  }
  impl->read_scalars = {&impl->loss_sum, &impl->found_inf, &impl->norm_sq};
  for (const Impl::ScaleGroup& g : impl->groups) impl->read_scalars.push_back(&g.max_abs);
  impl->read_values.assign(impl->read_scalars.size(), 0.0f);
  impl->group_scales.assign(impl->groups.size(), 1.0f);
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

const JobConfig& Trainer::config() const { return impl_->config; }
int64_t Trainer::steps_run() const { return impl_->steps_run; }
int64_t Trainer::applied_steps() const { return impl_->optimizer.applied_steps(); }
ScalerSnapshot Trainer::scaler() const {
  const amp::GradScaler& s = impl_->scaler;
  return ScalerSnapshot{s.scale(), s.counters(),
                        s.config().per_layer_scales ? s.layer_scales() : std::vector<float>{}};
}
int64_t Trainer::workspace_bytes() const {
  return SaturatingAdd(SaturatingAdd(impl_->model->cached_workspace_bytes(), impl_->scratch_bytes),
                       SaturatingMul(impl_->step_logprobs_held(), int64_t{sizeof(float)}));
}
void Trainer::ReleaseWorkspaces() {
  impl_->model->ReleaseWorkspaces();
  impl_->backend->ReleaseScratch();
  impl_->scratch_bytes = 0;
  impl_->step_logprobs = kernels::Tensor();
}
void Trainer::SetMemoryPressureHandler(std::function<void()> relieve) {
  impl_->relieve_memory = std::move(relieve);
}
int64_t Trainer::parameter_count() const { return impl_->model->parameter_count(); }
kernels::Backend& Trainer::backend() { return *impl_->backend; }
const model::FrozenBase* Trainer::frozen_base() const { return impl_->model->frozen_base(); }

}  // namespace ampd::engine
