// Trainer: SCALER.md's "one training step" on a Backend.
//
// Step, in device order:
//   zero the += gradients (LayerNorm, Embedding); Linear grads are written
//     by the first micro-batch with beta = 0; zero found_inf and loss_sum
//   per micro-batch k of K: upload, forward (working dtype, fp32 GEMM
//     accumulation), loss with grad_scale = S / K (so K accumulated
//     micro-batches give one big batch's gradient, times S), Add it into
//     loss_sum on the device, backward accumulating into the grads
//     (beta = 1: an inf survives accumulation)
//   [optional] GradLog2Histogram over the scaled grads
//   UnscaleAndCheck over ALL grads, in_place = false (found_inf and norm_sq,
//     the norm on every step since the pass reads every gradient anyway and
//     the report carries it): 16-bit grads must not be unscaled in 16 bits, and for
//     fp32 grads leaving the unscale to the fused update saves a write pass
//   fused Adam/SGD update with GradTransform{1/S, found_inf, norm_sq}; the
//     device skips it entirely on found_inf and it recasts the working copy
//   ONE ReadBack of [loss_sum, found_inf, norm_sq, max_abs] (and the
//     histogram when sampled), then scaler.Update with found_inf, max|g| of
//     the unscaled grads (the check pass computes it in the same read) and,
//     when sampled, the histogram's fp16 underflow fraction.
// An adaptive-scaler job's first step (and its first after a state without
// scaler keys was loaded) first runs CalibrateLossScale: one extra forward
// and backward at S = 1 and one small read, so that the step itself starts
// at the calibrated scale instead of skipping while it backs off.
// The four scalars stay on the device, each in its own (1, 1) F32 tensor,
// until the end: ReadBack waits for the device once and copies all four
// together, so the step makes one device->host round trip, not one per
// micro-batch (the losses are summed on the device with Add) or per scalar.
// Keeping them in separate tensors also means a non-finite loss can never
// reach found_inf: the scaler skips on bad gradients, not on a bad loss.
//
// Bytes per parameter (AdamW, fp16 or bf16 grads; m, v, master F32):
//   check pass (UnscaleAndCheck, not in place)        read grad 2           =  2 B
//   fused update  read grad 2 + master 4 + m 4 + v 4,
//                 write master 4 + m 4 + v 4 + working copy 2               = 28 B
//   total 30 B/param against the 28 B minimum (grad once, master/m/v read
//   and written, working copy written): the check pass's extra read of the
//   2 B grad is the only overhead, +7%. It is what lets a skipped step write
//   nothing at all: found_inf is known before the update touches anything.
//   A skipped step moves 2 B/param (the check) plus the update's read of
//   found_inf. Gradient zeroing costs nothing for Linear weights (beta = 0
//   on the first micro-batch); LayerNorm/Embedding grads are zeroed (2 B).
//   fp32 jobs: 4 B check + 4 + 12 + 12 update = 32 B against 28 B; SGD with
//   momentum in fp16: 2 + (2 + 4 + 4 read, 4 + 4 + 2 write) = 22 B vs 20 B.
//
// Timing: PhaseSeconds are steady_clock intervals around the host calls. On
// the CPU backend ops run synchronously, so they are the phases' real cost;
// on CUDA forward/backward/unscale/optimizer are host-side launch times
// (adding a sync per phase would stall the stream) and only `total`, which
// ends after the ReadScalars that waits for the device, is wall time.
#include "server/engine/jobs/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "server/engine/amp/adaptive_policy.h"
#include "server/engine/model/batch_check.h"
#include "server/engine/model/layers.h"
#include "server/engine/optim/optimizer_state.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;
using Clock = std::chrono::steady_clock;

namespace {

// Positions in the step's one ReadScalars.
constexpr int kReadLossSum = 0;
constexpr int kReadFoundInf = 1;
constexpr int kReadNormSq = 2;
constexpr int kReadMaxAbs = 3;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string Got(const HostTensor& t) {
  return absl::StrCat(kernels::DTypeName(t.dtype), kernels::ShapeToString(t.shape));
}

// Everything Step checks before it touches any state.
absl::Status ValidateStepInput(const model::ModelSpec& spec, const StepInput& input) {
  if (input.micro_batches.empty()) {
    return absl::InvalidArgumentError("micro_batches: at least one micro-batch is required");
  }
  if (input.learning_rate.has_value() &&
      !(std::isfinite(*input.learning_rate) && *input.learning_rate >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("learning_rate: must be finite and >= 0, got ", *input.learning_rate));
  }
  for (size_t i = 0; i < input.micro_batches.size(); ++i) {
    const MicroBatch& mb = input.micro_batches[i];
    AMPD_RETURN_IF_ERROR(model::CheckBatchFitsModel(
        spec, mb.inputs, mb.targets, absl::StrCat("micro_batches[", i, "].inputs"),
        absl::StrCat("micro_batches[", i, "].targets")));
  }
  return absl::OkStatus();
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

absl::StatusOr<Tensor> AllocScalar(kernels::Backend& b, const kernels::Shape& shape) {
  absl::StatusOr<Tensor> t = b.Allocate(DType::kF32, shape);
  if (!t.ok()) return t.status();
  AMPD_RETURN_IF_ERROR(b.Fill(*t, 0.0f));
  return t;
}

}  // namespace

struct Trainer::Impl {
  Impl(const JobConfig& c, std::unique_ptr<kernels::Backend> b, amp::GradScaler s)
      : config(c), backend(std::move(b)), scaler(std::move(s)) {}

  JobConfig config;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Model> model;
  optim::OptimizerState optimizer;
  amp::GradScaler scaler;
  int64_t steps_run = 0;

  // Views the Backend calls take, built once (the tensors never move:
  // LoadState move-assigns into the same Tensor objects).
  std::vector<kernels::ParamRef> refs;
  std::vector<Tensor*> grads;
  std::vector<const Tensor*> const_grads;

  Tensor loss;       // (1, 1) F32, one micro-batch's loss
  Tensor loss_sum;   // (1, 1) F32, sum of the step's micro-batch losses
  Tensor found_inf;  // (1, 1) F32
  Tensor norm_sq;    // (1, 1) F32
  Tensor max_abs;    // (1, 1) F32, max |g| of the unscaled grads
  Tensor no_inf;     // (1, 1) F32 zero: the update's found_inf when the scaler is disabled
  Tensor histogram;  // (kGradHistogramBins) I64
  std::vector<int64_t> zero_bins = std::vector<int64_t>(kernels::kGradHistogramBins, 0);

  absl::Status CalibrateLossScale(const StepInput& input);
};

// The adaptive scaler's calibration: the step's micro-batches forward and
// backward at a loss scale of 1 (each micro-batch's gradient carries 1 / K,
// as in the step), then the fused check pass for max|g|, read back once.
// S = 1 is the safe scale: the gradients overflow there only when they
// exceed fp16's range unscaled, and then no scale could help (the scaler
// starts at 1 and backs off from the step's real overflow). The gradients it
// leaves are overwritten by the step (ZeroGrads, beta = 0 on micro-batch 0).
absl::Status Trainer::Impl::CalibrateLossScale(const StepInput& input) {
  kernels::Backend& b = *backend;
  const auto k = static_cast<int64_t>(input.micro_batches.size());
  AMPD_RETURN_IF_ERROR(model->ZeroGrads());
  AMPD_RETURN_IF_ERROR(b.Fill(found_inf, 0.0f));
  AMPD_RETURN_IF_ERROR(b.Fill(max_abs, 0.0f));
  for (int64_t i = 0; i < k; ++i) {
    const MicroBatch& mb = input.micro_batches[static_cast<size_t>(i)];
    AMPD_ASSIGN_OR_RETURN(model::Workspace * ws, model->GetWorkspace(mb.inputs.shape[0]));
    AMPD_RETURN_IF_ERROR(model->LoadBatch(mb.inputs, mb.targets, *ws));
    AMPD_RETURN_IF_ERROR(model->Forward(*ws));
    AMPD_RETURN_IF_ERROR(model->Loss(*ws, 1.0f / static_cast<float>(k), loss));
    AMPD_RETURN_IF_ERROR(model->Backward(*ws, /*first_micro_batch=*/i == 0));
  }
  AMPD_RETURN_IF_ERROR(b.UnscaleAndCheck(grads, 1.0f, /*in_place=*/false, found_inf,
                                         /*norm_sq=*/nullptr, &max_abs));
  const Tensor* const scalars[2] = {&found_inf, &max_abs};
  float host[2] = {0, 0};
  AMPD_RETURN_IF_ERROR(b.ReadScalars(scalars, host));
  scaler.Calibrate(host[0] != 0.0f ? std::numeric_limits<float>::infinity() : host[1]);
  return absl::OkStatus();
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const JobConfig& config, std::unique_ptr<kernels::Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  AMPD_ASSIGN_OR_RETURN(const ValidJobConfig valid, ValidJobConfig::Check(config));
  return Create(valid, std::move(backend));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const ValidJobConfig& valid, std::unique_ptr<kernels::Backend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend: null");
  const JobConfig& config = valid.get();
  absl::StatusOr<amp::GradScaler> scaler = amp::GradScaler::Create(config.scaler);
  if (!scaler.ok()) return scaler.status();
  // Refused before any allocation when the weights alone cannot fit: the
  // backend's allocator would fail (or, with overcommit, succeed and let the
  // kernel kill the process when the pages are touched).
  const int64_t need = EstimateJobBytes(config);
  const int64_t capacity = backend->MemoryCapacityBytes();
  if (capacity > 0 && need > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model: the job's weights, gradients and optimizer state need an estimated ",
                     need, " bytes, more than the ", capacity, " bytes of ", backend->name()));
  }
  auto impl = std::make_unique<Impl>(config, std::move(backend), *std::move(scaler));
  kernels::Backend& b = *impl->backend;

  absl::StatusOr<std::unique_ptr<model::Model>> m =
      model::Model::Create(config.model, config.precision, config.seed, b);
  if (!m.ok()) return m.status();
  impl->model = *std::move(m);

  std::vector<std::string> names;
  std::vector<kernels::Shape> shapes;
  for (const model::Parameter& p : impl->model->params()) {
    names.push_back(p.name);
    shapes.push_back(p.master.shape());
  }
  absl::StatusOr<optim::OptimizerState> opt =
      optim::OptimizerState::Create(config.optimizer, names, shapes, b);
  if (!opt.ok()) return opt.status();
  impl->optimizer = *std::move(opt);

  for (model::Parameter& p : impl->model->params()) {
    kernels::ParamRef r{};
    r.master = &p.master;
    r.working = p.working.empty() ? nullptr : &p.working;
    r.grad = &p.grad;
    impl->refs.push_back(r);
    impl->grads.push_back(&p.grad);
    impl->const_grads.push_back(&p.grad);
  }
  impl->optimizer.Bind(impl->refs);

  for (Tensor* t : {&impl->loss, &impl->loss_sum, &impl->found_inf, &impl->norm_sq, &impl->max_abs,
                    &impl->no_inf}) {
    absl::StatusOr<Tensor> s = AllocScalar(b, {1, 1});
    if (!s.ok()) return s.status();
    *t = *std::move(s);
  }
  absl::StatusOr<Tensor> hist = b.Allocate(DType::kI64, {kernels::kGradHistogramBins});
  if (!hist.ok()) return hist.status();
  impl->histogram = *std::move(hist);
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<StepReport> Trainer::Step(const StepInput& input,
                                         const std::function<absl::Status(int64_t)>& admit) {
  const Clock::time_point t_start = Clock::now();
  Impl& m = *impl_;
  AMPD_RETURN_IF_ERROR(ValidateStepInput(m.config.model, input));
  kernels::Backend& b = *m.backend;
  model::Model& net = *m.model;
  StepReport report;

  // Admission before allocation: the step's workspace, all of it, whether
  // cached already or not (a limit shared with other jobs must see what this
  // job holds during the step).
  std::vector<int64_t> sizes;
  for (const MicroBatch& mb : input.micro_batches) {
    const int64_t rows = mb.inputs.shape[0];
    if (std::find(sizes.begin(), sizes.end(), rows) == sizes.end()) sizes.push_back(rows);
  }
  net.KeepWorkspaces(sizes);
  int64_t need = 0;
  for (int64_t rows : sizes) {
    AMPD_ASSIGN_OR_RETURN(const int64_t bytes,
                          model::WorkspaceBytes(m.config.model, m.config.precision, rows));
    need = SaturatingAdd(need, bytes);
  }
  const int64_t capacity = b.MemoryCapacityBytes();
  const int64_t to_allocate = need - net.cached_workspace_bytes();
  if (capacity > 0 && SaturatingAdd(b.BytesInUse(), to_allocate) > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("micro_batches: the step needs an estimated ", need,
                     " bytes of activation and workspace memory for its batch sizes, and with the ",
                     b.BytesInUse(), " bytes the job holds that exceeds the ", capacity,
                     " bytes of ", b.name(), "; send smaller micro-batches"));
  }
  if (admit) AMPD_RETURN_IF_ERROR(admit(need));
  // Whatever the outcome, a step's oversized buffers do not outlive it.
  struct TrimCache {
    model::Model& net;
    ~TrimCache() {
      if (net.cached_workspace_bytes() > kMaxCachedWorkspaceBytes) net.ReleaseWorkspaces();
    }
  } trim{net};

  if (m.scaler.NeedsCalibration()) AMPD_RETURN_IF_ERROR(m.CalibrateLossScale(input));
  const float scale = m.scaler.scale();
  const auto k = static_cast<int64_t>(input.micro_batches.size());
  // d(S * mean_k L_k)/dw: each micro-batch's loss gradient carries S / K.
  const float grad_scale = scale / static_cast<float>(k);
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale));
  const bool clip = m.config.optimizer.max_grad_norm > 0.0f;

  AMPD_RETURN_IF_ERROR(net.ZeroGrads());
  AMPD_RETURN_IF_ERROR(b.Fill(m.found_inf, 0.0f));
  AMPD_RETURN_IF_ERROR(b.Fill(m.loss_sum, 0.0f));
  AMPD_RETURN_IF_ERROR(b.Fill(m.norm_sq, 0.0f));
  AMPD_RETURN_IF_ERROR(b.Fill(m.max_abs, 0.0f));

  for (int64_t i = 0; i < k; ++i) {
    const MicroBatch& mb = input.micro_batches[static_cast<size_t>(i)];
    const int64_t rows = mb.inputs.shape[0];
    report.samples += rows;
    absl::StatusOr<model::Workspace*> ws = net.GetWorkspace(rows);
    if (!ws.ok()) return ws.status();
    const Clock::time_point t0 = Clock::now();
    AMPD_RETURN_IF_ERROR(net.LoadBatch(mb.inputs, mb.targets, **ws));
    AMPD_RETURN_IF_ERROR(net.Forward(**ws));
    AMPD_RETURN_IF_ERROR(net.Loss(**ws, grad_scale, m.loss));
    AMPD_RETURN_IF_ERROR(b.Add(m.loss, m.loss_sum));
    const Clock::time_point t1 = Clock::now();
    AMPD_RETURN_IF_ERROR(net.Backward(**ws, /*first_micro_batch=*/i == 0));
    const Clock::time_point t2 = Clock::now();
    report.seconds.forward += Seconds(t0, t1);
    report.seconds.backward += Seconds(t1, t2);
  }

  if (input.sample_grad_histogram) {
    // On the scaled grads: what the operator needs to see is where the
    // values sit relative to fp16's range, i.e. what was actually stored.
    AMPD_RETURN_IF_ERROR(
        b.CopyFromHost(m.zero_bins.data(), m.zero_bins.size() * sizeof(int64_t), m.histogram));
    AMPD_RETURN_IF_ERROR(b.GradLog2Histogram(m.const_grads, m.histogram));
  }

  const Clock::time_point t3 = Clock::now();
  AMPD_RETURN_IF_ERROR(b.UnscaleAndCheck(m.grads, inv_scale, /*in_place=*/false, m.found_inf,
                                         &m.norm_sq, &m.max_abs));
  const Clock::time_point t4 = Clock::now();

  // A disabled scaler (PyTorch's enabled=False) never skips, so the update
  // reads a found_inf that is always 0.
  const bool scaler_enabled = m.config.scaler.enabled;
  kernels::GradTransform transform;
  transform.inv_scale = inv_scale;
  transform.found_inf = scaler_enabled ? &m.found_inf : &m.no_inf;
  transform.norm_sq = clip ? &m.norm_sq : nullptr;
  transform.max_grad_norm = m.config.optimizer.max_grad_norm;
  AMPD_RETURN_IF_ERROR(m.optimizer.Apply(b, m.refs, input.learning_rate, transform));
  const Clock::time_point t5 = Clock::now();

  // One read brings the scalars and, when sampled, the histogram.
  const Tensor* const scalars[4] = {&m.loss_sum, &m.found_inf, &m.norm_sq, &m.max_abs};
  float host[4] = {0, 0, 0, 0};  // [loss sum, found_inf, norm_sq, max_abs]
  kernels::HostCopy histogram_copy;
  if (input.sample_grad_histogram) {
    report.grad_histogram.resize(kernels::kGradHistogramBins);
    histogram_copy = {&m.histogram, report.grad_histogram.data(),
                      report.grad_histogram.size() * sizeof(int64_t)};
  }
  AMPD_RETURN_IF_ERROR(b.ReadBack(
      scalars, host, absl::MakeConstSpan(&histogram_copy, input.sample_grad_histogram ? 1 : 0)));
  const bool found_inf = host[kReadFoundInf] != 0.0f;
  amp::StepGradStats stats;
  stats.found_inf = found_inf;
  stats.max_abs = host[kReadMaxAbs];
  if (input.sample_grad_histogram) {
    stats.underflow_fraction = amp::UnderflowFraction(report.grad_histogram);
    report.grad_underflow_fraction = stats.underflow_fraction;
  }
  absl::StatusOr<amp::ScalerUpdate> update = m.scaler.Update(stats);
  if (!update.ok()) {
    // deepspeed at min_scale: the device already skipped the update
    // (found_inf was set), so the job's state is as it was.
    return absl::FailedPreconditionError(update.status().message());
  }
  const bool applied = !(scaler_enabled && found_inf);
  if (applied) m.optimizer.set_applied_steps(m.optimizer.applied_steps() + 1);
  ++m.steps_run;

  report.step = m.steps_run;
  report.applied_steps = m.optimizer.applied_steps();
  report.loss = host[kReadLossSum] / static_cast<float>(k);
  report.scaler = *update;
  report.grad_max_abs = host[kReadMaxAbs];
  // Every applied step reports its norm; a skipped one only when clipping
  // (the norm of gradients that overflowed is inf or NaN, kept as clipping
  // always reported it).
  if (applied || clip) report.grad_norm = std::sqrt(host[kReadNormSq]);
  report.seconds.unscale = Seconds(t3, t4);
  report.seconds.optimizer = Seconds(t4, t5);
  report.seconds.total = Seconds(t_start, Clock::now());
  return report;
}

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
  state.metadata["optimizer.step"] = absl::StrCat(m.optimizer.applied_steps());
  state.metadata["ampd.step"] = absl::StrCat(m.steps_run);
  return state;
}

absl::Status Trainer::LoadState(const checkpoint::StateDict& state) {
  Impl& m = *impl_;
  kernels::Backend& b = *m.backend;
  std::vector<model::Parameter>& params = m.model->params();
  const auto& buffer_names = m.optimizer.buffer_names();

  // 1. Every expected tensor present with the right dtype, shape and bytes;
  //    nothing unexpected (a state saved for another model or optimizer).
  std::vector<std::pair<std::string, Tensor*>> targets;  // name -> live tensor it replaces
  for (model::Parameter& p : params) targets.emplace_back(p.name, &p.master);
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t i = 0; i < buffer_names.size(); ++i) {
      targets.emplace_back(absl::StrCat("optimizer.", params[p].name, ".", buffer_names[i]),
                           &m.optimizer.buffers()[p][i]);
    }
  }
  std::vector<const HostTensor*> sources;
  for (const auto& [name, live] : targets) {
    const HostTensor* h = state.Find(name);
    if (h == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": missing"));
    AMPD_RETURN_IF_ERROR(h->Validate(name));
    if (h->dtype != DType::kF32 || h->shape != live->shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected F32", kernels::ShapeToString(live->shape()), ", got ", Got(*h)));
    }
    sources.push_back(h);
  }
  for (const checkpoint::NamedTensor& t : state.tensors) {
    bool known = false;
    for (const auto& target : targets) known = known || target.first == t.name;
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat(t.name, ": not a tensor of this job's model or optimizer"));
    }
  }
  // 2. Counters and the scaler, into copies.
  absl::StatusOr<int64_t> opt_step = ParseCount(state, "optimizer.step");
  if (!opt_step.ok()) return opt_step.status();
  absl::StatusOr<int64_t> job_step = ParseCount(state, "ampd.step");
  if (!job_step.ok()) return job_step.status();
  amp::ScalerState scaler_state;
  for (const auto& [key, text] : state.metadata) {
    if (!absl::StartsWith(key, "scaler.")) continue;
    absl::StatusOr<double> v = amp::ParseStateNumber(key, text);
    if (!v.ok())
      return absl::Status(v.status().code(), absl::StrCat("metadata ", v.status().message()));
    scaler_state[key.substr(7)] = *v;
  }
  amp::GradScaler scaler = m.scaler;
  if (absl::Status s = scaler.LoadStateDict(scaler_state); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("metadata scaler.", s.message()));
  }
  // 3. Device copies into fresh tensors, so a device error leaves the live
  //    state whole; then commit by moving them into the live Tensor objects
  //    (their addresses are what the cached ParamRefs point at).
  std::vector<Tensor> fresh;
  fresh.reserve(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StatusOr<Tensor> t = b.Allocate(DType::kF32, targets[i].second->shape());
    if (!t.ok()) return t.status();
    AMPD_RETURN_IF_ERROR(b.CopyFromHost(sources[i]->data.data(), sources[i]->data.size(), *t));
    fresh.push_back(*std::move(t));
  }
  // The copies may only be queued, reading the caller's buffers later
  // (backend.h's CopyFromHost contract); wait for them before returning,
  // and before committing, so a device error leaves the live state whole.
  AMPD_RETURN_IF_ERROR(b.Synchronize());
  for (size_t i = 0; i < targets.size(); ++i) *targets[i].second = std::move(fresh[i]);
  m.scaler = std::move(scaler);
  m.optimizer.set_applied_steps(*opt_step);
  m.steps_run = *job_step;
  return m.model->CastWorking();
}

const JobConfig& Trainer::config() const { return impl_->config; }
int64_t Trainer::steps_run() const { return impl_->steps_run; }
float Trainer::loss_scale() const { return impl_->scaler.scale(); }
amp::ScalerCounters Trainer::scaler_counters() const { return impl_->scaler.counters(); }
int64_t Trainer::workspace_bytes() const { return impl_->model->cached_workspace_bytes(); }
int64_t Trainer::parameter_count() const { return impl_->model->parameter_count(); }
kernels::Backend& Trainer::backend() { return *impl_->backend; }

}  // namespace ampd::engine
