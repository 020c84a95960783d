// Protobuf <-> engine translation (see translate.h).
#include "server/rpc/translate.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/model/hf_config.h"

namespace ampd::rpc {

namespace amp = engine::amp;
namespace model = engine::model;
namespace optim = engine::optim;

namespace {

using engine::JobConfig;

absl::StatusOr<model::Precision> PrecisionFromProto(v1::Precision p) {
  switch (p) {
    case v1::PRECISION_UNSPECIFIED:
    case v1::PRECISION_FP16:
      return model::Precision::kFp16;
    case v1::PRECISION_FP32:
      return model::Precision::kFp32;
    case v1::PRECISION_BF16:
      return model::Precision::kBf16;
    default:
      return FieldError("config.precision", absl::StrCat("unknown value ", p));
  }
}

v1::Precision PrecisionToProto(model::Precision p) {
  switch (p) {
    case model::Precision::kFp32:
      return v1::PRECISION_FP32;
    case model::Precision::kFp16:
      return v1::PRECISION_FP16;
    case model::Precision::kBf16:
      return v1::PRECISION_BF16;
  }
  return v1::PRECISION_UNSPECIFIED;
}

absl::StatusOr<amp::ScalerPolicy> PolicyFromProto(v1::ScalerPolicy p) {
  switch (p) {
    case v1::SCALER_POLICY_UNSPECIFIED:
    case v1::SCALER_POLICY_PYTORCH:
      return amp::ScalerPolicy::kPyTorch;
    case v1::SCALER_POLICY_PADDLE:
      return amp::ScalerPolicy::kPaddle;
    case v1::SCALER_POLICY_DEEPSPEED:
      return amp::ScalerPolicy::kDeepSpeed;
    case v1::SCALER_POLICY_MEGATRON:
      return amp::ScalerPolicy::kMegatron;
    case v1::SCALER_POLICY_ADAPTIVE:
      return amp::ScalerPolicy::kAdaptive;
    default:
      return FieldError("config.scaler.policy", absl::StrCat("unknown value ", p));
  }
}

v1::ScalerPolicy PolicyToProto(amp::ScalerPolicy p) {
  switch (p) {
    case amp::ScalerPolicy::kPyTorch:
      return v1::SCALER_POLICY_PYTORCH;
    case amp::ScalerPolicy::kPaddle:
      return v1::SCALER_POLICY_PADDLE;
    case amp::ScalerPolicy::kDeepSpeed:
      return v1::SCALER_POLICY_DEEPSPEED;
    case amp::ScalerPolicy::kMegatron:
      return v1::SCALER_POLICY_MEGATRON;
    case amp::ScalerPolicy::kAdaptive:
      return v1::SCALER_POLICY_ADAPTIVE;
  }
  return v1::SCALER_POLICY_UNSPECIFIED;
}

absl::StatusOr<optim::OptimizerKind> OptimizerKindFromProto(v1::OptimizerKind kind) {
  switch (kind) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_ADAMW:
      return optim::OptimizerKind::kAdamW;
    case v1::OPTIMIZER_ADAM:
      return optim::OptimizerKind::kAdam;
    case v1::OPTIMIZER_SGD:
      return optim::OptimizerKind::kSgd;
    default:
      return FieldError("config.optimizer.kind", absl::StrCat("unknown value ", kind));
  }
}

// The schedule with its defaults filled (warmup_steps 0, min_lr lr / 10);
// its fields are refused on the constant schedule, which reads none of them.
// decay_steps has no default: the engine refuses a warmup-cosine schedule
// without one (decay_steps > warmup_steps).
absl::Status LrScheduleFromProto(const v1::OptimizerConfig& proto, optim::OptimizerSpec* spec) {
  optim::LrSchedule& schedule = spec->lr_schedule;
  switch (proto.lr_schedule()) {
    case v1::LR_SCHEDULE_UNSPECIFIED:
    case v1::LR_SCHEDULE_CONSTANT:
      schedule.kind = optim::LrScheduleKind::kConstant;
      for (const auto& [name, set] :
           {std::pair<const char*, bool>{"warmup_steps", proto.has_warmup_steps()},
            {"decay_steps", proto.has_decay_steps()},
            {"min_lr", proto.has_min_lr()}}) {
        if (set) {
          return FieldError(absl::StrCat("config.optimizer.", name),
                            "applies to lr_schedule warmup_cosine only");
        }
      }
      return absl::OkStatus();
    case v1::LR_SCHEDULE_WARMUP_COSINE:
      schedule.kind = optim::LrScheduleKind::kWarmupCosine;
      break;
    default:
      return FieldError("config.optimizer.lr_schedule",
                        absl::StrCat("unknown value ", proto.lr_schedule()));
  }
  schedule.warmup_steps = proto.has_warmup_steps() ? proto.warmup_steps() : 0;
  schedule.decay_steps = proto.decay_steps();
  if (proto.has_min_lr()) {
    AMPD_RETURN_IF_ERROR(CheckFinite("config.optimizer.min_lr", proto.min_lr()));
    schedule.min_lr = proto.min_lr();
  } else {
    schedule.min_lr = optim::BaseLearningRate(*spec) / 10.0f;
  }
  return absl::OkStatus();
}

// The engine's defaults for the request's kind with the fields the request
// sets copied on top.
absl::Status OptimizerFromProto(const v1::OptimizerConfig& proto, optim::OptimizerSpec* spec) {
  AMPD_ASSIGN_OR_RETURN(optim::OptimizerKind kind, OptimizerKindFromProto(proto.kind()));
  *spec = optim::DefaultOptimizerSpec(kind);
  const bool sgd = spec->kind == optim::OptimizerKind::kSgd;
  struct FloatField {
    const char* name;
    bool set;
    float value;
    float* target;
  };
  const FloatField fields[] = {
      {"lr", proto.has_lr(), proto.lr(), sgd ? &spec->sgd.lr : &spec->adam.lr},
      {"weight_decay", proto.has_weight_decay(), proto.weight_decay(),
       sgd ? &spec->sgd.weight_decay : &spec->adam.weight_decay},
      {"momentum", proto.has_momentum(), proto.momentum(), sgd ? &spec->sgd.momentum : nullptr},
      {"dampening", proto.has_dampening(), proto.dampening(), sgd ? &spec->sgd.dampening : nullptr},
      {"beta1", proto.has_beta1(), proto.beta1(), sgd ? nullptr : &spec->adam.beta1},
      {"beta2", proto.has_beta2(), proto.beta2(), sgd ? nullptr : &spec->adam.beta2},
      {"eps", proto.has_eps(), proto.eps(), sgd ? nullptr : &spec->adam.eps},
      {"max_grad_norm", proto.has_max_grad_norm(), proto.max_grad_norm(), &spec->max_grad_norm},
  };
  for (const FloatField& f : fields) {
    if (!f.set) continue;
    const std::string name = absl::StrCat("config.optimizer.", f.name);
    AMPD_RETURN_IF_ERROR(CheckFinite(name, f.value));
    if (f.target == nullptr) {
      return FieldError(
          name, absl::StrCat("does not apply to optimizer ", optim::OptimizerName(spec->kind)));
    }
    *f.target = f.value;
  }
  if (proto.has_nesterov()) {
    if (!sgd) return FieldError("config.optimizer.nesterov", "applies to sgd only");
    spec->sgd.nesterov = proto.nesterov();
  }
  return LrScheduleFromProto(proto, spec);
}

absl::Status ScalerFromProto(const v1::ScalerConfig& p, amp::ScalerConfig* c) {
  for (const auto& [name, set, value] : {
           std::tuple<const char*, bool, double>{"init_scale", p.has_init_scale(), p.init_scale()},
           {"growth_factor", p.has_growth_factor(), p.growth_factor()},
           {"backoff_factor", p.has_backoff_factor(), p.backoff_factor()},
           {"min_scale", p.has_min_scale(), p.min_scale()},
           {"max_scale", p.has_max_scale(), p.max_scale()},
           {"underflow_threshold", p.has_underflow_threshold(), p.underflow_threshold()},
       }) {
    if (set) {
      AMPD_RETURN_IF_ERROR(CheckFinite(absl::StrCat("config.scaler.", name), value));
    }
  }
  if (p.has_enabled()) c->enabled = p.enabled();
  if (p.has_dynamic()) c->dynamic = p.dynamic();
  if (p.has_init_scale()) c->init_scale = p.init_scale();
  if (p.has_growth_factor()) c->growth_factor = p.growth_factor();
  if (p.has_backoff_factor()) c->backoff_factor = p.backoff_factor();
  if (p.has_growth_interval()) c->growth_interval = p.growth_interval();
  if (p.has_hysteresis()) c->hysteresis = p.hysteresis();
  if (p.has_consecutive_hysteresis()) c->consecutive_hysteresis = p.consecutive_hysteresis();
  if (p.has_raise_at_min_scale()) c->raise_at_min_scale = p.raise_at_min_scale();
  if (p.has_min_scale()) c->min_scale = p.min_scale();
  if (p.has_max_scale()) c->max_scale = p.max_scale();
  const bool adaptive = c->policy == amp::ScalerPolicy::kAdaptive;
  if (p.has_overflow_margin_log2()) {
    if (!adaptive)
      return FieldError("config.scaler.overflow_margin_log2", "applies to adaptive only");
    c->overflow_margin_log2 = p.overflow_margin_log2();
  }
  if (p.has_underflow_threshold()) {
    if (!adaptive)
      return FieldError("config.scaler.underflow_threshold", "applies to adaptive only");
    c->underflow_threshold = p.underflow_threshold();
  }
  if (p.has_per_layer_scales()) {
    if (!adaptive) return FieldError("config.scaler.per_layer_scales", "applies to adaptive only");
    c->per_layer_scales = p.per_layer_scales();
  }
  return absl::OkStatus();
}

// A create with base_model: the model is config.json's, so the request
// may set only the LoRA adapters and the loss multiplier; anything else
// it sets would be silently replaced, and is refused naming it.
absl::Status CheckBaseModelRequest(const v1::ModelSpec& model) {
  if (model.layers_size() > 0 || model.has_gpt()) {
    return FieldError(model.has_gpt() ? "config.model.gpt" : "config.model.layers",
                      "set by base_model's config.json; send only decoder.lora");
  }
  if (model.loss() != v1::LOSS_UNSPECIFIED) {
    return FieldError("config.model.loss", "set by base_model's config.json; leave it unset");
  }
  if (!model.has_decoder()) return absl::OkStatus();
  v1::Decoder rest = model.decoder();
  rest.clear_lora();
  if (rest.ByteSizeLong() == 0) return absl::OkStatus();
  std::vector<const google::protobuf::FieldDescriptor*> set;
  rest.GetReflection()->ListFields(rest, &set);
  return FieldError(absl::StrCat("config.model.decoder.", set.front()->name()),
                    "set by base_model's config.json; send only decoder.lora");
}

// The largest config.json a create may carry: a real one is a few KiB.
constexpr size_t kMaxHfConfigBytes = size_t{1} << 20;

// The model of a create with hf_config_json: config.json mapped by the
// server's one mapping (model/hf_config.h), as the wire's effective model,
// with the fields the request's model sets over it (a proto merge: a set
// field replaces config.json's; sliding_layers and rope_scaling, when sent,
// whole).
absl::StatusOr<v1::ModelSpec> ModelOfHfConfig(const v1::JobConfig& proto) {
  if (!proto.base_model().empty()) {
    return FieldError("config.hf_config_json", "give base_model or hf_config_json, not both");
  }
  if (proto.hf_config_json().size() > kMaxHfConfigBytes) {
    return FieldError(
        "config.hf_config_json",
        absl::StrCat("at most ", kMaxHfConfigBytes, " bytes, got ", proto.hf_config_json().size()));
  }
  absl::StatusOr<engine::model::ModelSpec> mapped =
      engine::model::ModelSpecOfHfConfig(proto.hf_config_json());
  if (!mapped.ok()) return FieldError("config.hf_config_json", mapped.status().message());
  // A config.json that maps onto a model the server refuses is the file's
  // error: the config.model.* field a later check would name was never sent.
  if (absl::Status valid = engine::model::ValidateModelSpec(*mapped); !valid.ok()) {
    return FieldError("config.hf_config_json", absl::StrCat("config.json: ", valid.message()));
  }
  v1::ModelSpec model = ModelSpecToProto(*mapped);
  const v1::ModelSpec& request = proto.model();
  if (request.layers_size() > 0) {
    return FieldError("config.model.layers", "set by hf_config_json's config.json");
  }
  const bool decoder = model.has_decoder();
  if ((decoder && request.has_gpt()) || (!decoder && request.has_decoder())) {
    return FieldError(
        request.has_gpt() ? "config.model.gpt" : "config.model.decoder",
        absl::StrCat("hf_config_json's config.json describes a ", decoder ? "decoder" : "GPT"));
  }
  // A list or a message sent replaces config.json's whole (RoPE's scaling
  // is one value: a linear factor over llama3's would keep llama3's
  // fields).
  if (request.has_decoder() && request.decoder().sliding_layers_size() > 0) {
    model.mutable_decoder()->clear_sliding_layers();
  }
  if (request.has_decoder() && request.decoder().has_rope_scaling()) {
    model.mutable_decoder()->clear_rope_scaling();
  }
  model.MergeFrom(request);
  return model;
}

}  // namespace

absl::StatusOr<JobConfig> JobConfigFromProto(const v1::JobConfig& proto) {
  AMPD_ASSIGN_OR_RETURN(model::Precision precision, PrecisionFromProto(proto.precision()));
  AMPD_ASSIGN_OR_RETURN(amp::ScalerPolicy policy, PolicyFromProto(proto.scaler().policy()));
  JobConfig config = engine::DefaultJobConfig(precision, policy);
  AMPD_RETURN_IF_ERROR(CheckLength("config.display_name", proto.display_name()));
  config.display_name = proto.display_name();
  config.seed = proto.seed();
  config.batch_invariant = proto.batch_invariant();
  config.base_model = proto.base_model();
  if (!config.base_model.empty()) AMPD_RETURN_IF_ERROR(CheckBaseModelRequest(proto.model()));
  if (!proto.hf_config_json().empty()) {
    AMPD_ASSIGN_OR_RETURN(const v1::ModelSpec model, ModelOfHfConfig(proto));
    AMPD_RETURN_IF_ERROR(ModelSpecFromProto(model, "config.model", &config.model));
  } else {
    AMPD_RETURN_IF_ERROR(ModelSpecFromProto(proto.model(), "config.model", &config.model));
  }
  AMPD_RETURN_IF_ERROR(OptimizerFromProto(proto.optimizer(), &config.optimizer));
  AMPD_RETURN_IF_ERROR(ScalerFromProto(proto.scaler(), &config.scaler));
  if (proto.has_distributed()) {
    // Unset world_size reads as 1; the engine refuses the other fields
    // beside it (a job of world_size 1 is not distributed).
    const v1::Distributed& d = proto.distributed();
    config.distributed.world_size = d.world_size() == 0 ? 1 : d.world_size();
    config.distributed.rank = d.rank();
    config.distributed.group = d.group();
    config.distributed.rendezvous = d.rendezvous();
    if (d.timeout_ms() != 0) config.distributed.timeout_ms = d.timeout_ms();
    config.distributed.secret = d.secret();
  }
  return config;
}

v1::JobConfig JobConfigToProto(const JobConfig& config) {
  v1::JobConfig proto;
  proto.set_display_name(config.display_name);
  proto.set_seed(config.seed);
  proto.set_batch_invariant(config.batch_invariant);
  proto.set_base_model(config.base_model);
  proto.set_precision(PrecisionToProto(config.precision));
  *proto.mutable_model() = ModelSpecToProto(config.model);
  if (config.distributed.enabled()) {
    v1::Distributed* d = proto.mutable_distributed();
    d->set_world_size(config.distributed.world_size);
    d->set_rank(config.distributed.rank);
    d->set_group(config.distributed.group);
    d->set_rendezvous(config.distributed.rendezvous);
    d->set_timeout_ms(config.distributed.timeout_ms);
    // The secret is not echoed: it is what the ranks prove they belong with.
  }

  v1::OptimizerConfig* o = proto.mutable_optimizer();
  const optim::OptimizerSpec& spec = config.optimizer;
  switch (spec.kind) {
    case optim::OptimizerKind::kSgd:
      o->set_kind(v1::OPTIMIZER_SGD);
      o->set_lr(spec.sgd.lr);
      o->set_momentum(spec.sgd.momentum);
      o->set_dampening(spec.sgd.dampening);
      o->set_nesterov(spec.sgd.nesterov);
      o->set_weight_decay(spec.sgd.weight_decay);
      break;
    case optim::OptimizerKind::kAdam:
    case optim::OptimizerKind::kAdamW:
      o->set_kind(spec.kind == optim::OptimizerKind::kAdam ? v1::OPTIMIZER_ADAM
                                                           : v1::OPTIMIZER_ADAMW);
      o->set_lr(spec.adam.lr);
      o->set_beta1(spec.adam.beta1);
      o->set_beta2(spec.adam.beta2);
      o->set_eps(spec.adam.eps);
      o->set_weight_decay(spec.adam.weight_decay);
      break;
  }
  o->set_max_grad_norm(spec.max_grad_norm);
  // The constant schedule leaves lr_schedule at its zero value, which means
  // constant, so that a constant job's config is what it was before
  // schedules existed; warmup-cosine sets every field it reads.
  if (spec.lr_schedule.kind == optim::LrScheduleKind::kWarmupCosine) {
    o->set_lr_schedule(v1::LR_SCHEDULE_WARMUP_COSINE);
    o->set_warmup_steps(spec.lr_schedule.warmup_steps);
    o->set_decay_steps(spec.lr_schedule.decay_steps);
    o->set_min_lr(spec.lr_schedule.min_lr);
  }

  v1::ScalerConfig* s = proto.mutable_scaler();
  const amp::ScalerConfig& c = config.scaler;
  s->set_policy(PolicyToProto(c.policy));
  s->set_enabled(c.enabled);
  s->set_dynamic(c.dynamic);
  s->set_init_scale(c.init_scale);
  s->set_growth_factor(c.growth_factor);
  s->set_backoff_factor(c.backoff_factor);
  s->set_growth_interval(c.growth_interval);
  s->set_hysteresis(c.hysteresis);
  s->set_consecutive_hysteresis(c.consecutive_hysteresis);
  s->set_raise_at_min_scale(c.raise_at_min_scale);
  if (c.min_scale.has_value()) s->set_min_scale(*c.min_scale);
  if (c.max_scale.has_value()) s->set_max_scale(*c.max_scale);
  if (c.policy == amp::ScalerPolicy::kAdaptive) {
    s->set_overflow_margin_log2(c.overflow_margin_log2);
    s->set_underflow_threshold(c.underflow_threshold);
    if (c.per_layer_scales) s->set_per_layer_scales(true);
  }
  return proto;
}

v1::Job JobToProto(const engine::JobSnapshot& snapshot) {
  v1::Job job;
  job.set_job_id(snapshot.job_id);
  *job.mutable_config() = JobConfigToProto(snapshot.config);
  job.set_step(snapshot.step);
  job.set_applied_steps(snapshot.applied_steps);
  job.set_loss_scale(snapshot.scaler.scale);
  for (const float s : snapshot.scaler.layer_scales) job.add_layer_scales(s);
  job.mutable_scaler_counters()->set_growth_tracker(snapshot.scaler.counters.growth_tracker);
  job.mutable_scaler_counters()->set_overflows_until_backoff(
      snapshot.scaler.counters.overflows_until_backoff);
  job.set_parameter_count(snapshot.parameter_count);
  job.set_estimated_bytes(snapshot.estimated_bytes);
  job.set_request_id(snapshot.request_id);
  if (snapshot.grad_norm.has_value()) job.set_grad_norm(*snapshot.grad_norm);
  // Empty where no family writes the model (a layer stack).
  if (absl::StatusOr<std::string> hf = engine::model::HfConfigOfModelSpec(snapshot.config.model);
      hf.ok()) {
    job.set_hf_config_json(*std::move(hf));
  }
  switch (snapshot.state) {
    case engine::JobState::kActive:
      job.set_state(v1::JOB_STATE_ACTIVE);
      break;
    case engine::JobState::kFailed:
      job.set_state(v1::JOB_STATE_FAILED);
      job.set_failure(snapshot.failure);
      break;
  }
  return job;
}

namespace {

// The micro-batches of a Step or Evaluate, each tensor decoded and named by
// its field (micro_batches[i].inputs / .targets).
// Takes the tensors' bytes out of the messages (TakeTensorFromProto): the
// batch is not copied once more on its way to the engine.
absl::StatusOr<std::vector<engine::MicroBatch>> MicroBatchesFromProto(
    google::protobuf::RepeatedPtrField<v1::MicroBatch>* micro_batches) {
  std::vector<engine::MicroBatch> out;
  out.reserve(static_cast<size_t>(micro_batches->size()));
  for (int i = 0; i < micro_batches->size(); ++i) {
    v1::MicroBatch* mb = micro_batches->Mutable(i);
    const std::string field = absl::StrCat("micro_batches[", i, "]");
    AMPD_ASSIGN_OR_RETURN(
        engine::HostTensor inputs,
        codec::TakeTensorFromProto(mb->mutable_inputs(), absl::StrCat(field, ".inputs")));
    AMPD_ASSIGN_OR_RETURN(
        engine::HostTensor targets,
        codec::TakeTensorFromProto(mb->mutable_targets(), absl::StrCat(field, ".targets")));
    engine::MicroBatch batch{std::move(inputs), std::move(targets)};
    // A token loss's per-token inputs, each when sent (the engine checks
    // which the step's loss_fn reads). has_* is read before mutable_*,
    // which would create the field.
    auto take = [&](bool has, v1::Tensor* (v1::MicroBatch::*mutable_field)(),
                    absl::string_view name,
                    std::optional<engine::HostTensor>& dst) -> absl::Status {
      if (!has) return absl::OkStatus();
      AMPD_ASSIGN_OR_RETURN(
          dst, codec::TakeTensorFromProto((mb->*mutable_field)(), absl::StrCat(field, ".", name)));
      return absl::OkStatus();
    };
    AMPD_RETURN_IF_ERROR(
        take(mb->has_weights(), &v1::MicroBatch::mutable_weights, "weights", batch.weights));
    AMPD_RETURN_IF_ERROR(take(mb->has_advantages(), &v1::MicroBatch::mutable_advantages,
                              "advantages", batch.advantages));
    AMPD_RETURN_IF_ERROR(take(mb->has_sampling_logprobs(),
                              &v1::MicroBatch::mutable_sampling_logprobs, "sampling_logprobs",
                              batch.sampling_logprobs));
    out.push_back(std::move(batch));
  }
  return out;
}

}  // namespace

namespace {

// A Step's or a ForwardBackward call's micro-batches (their bytes moved
// out), loss_fn and return_logprobs: the fields the two requests share.
template <typename Request>
absl::StatusOr<engine::StepInput> BatchFromProto(Request* request) {
  engine::StepInput input;
  AMPD_ASSIGN_OR_RETURN(input.micro_batches,
                        MicroBatchesFromProto(request->mutable_micro_batches()));
  switch (request->loss_fn()) {
    case v1::LOSS_FN_MODEL:
      break;
    case v1::LOSS_FN_CROSS_ENTROPY:
      input.loss_fn.kind = engine::LossFnKind::kCrossEntropy;
      break;
    case v1::LOSS_FN_IMPORTANCE_SAMPLING:
      input.loss_fn.kind = engine::LossFnKind::kImportanceSampling;
      break;
    case v1::LOSS_FN_PPO:
      input.loss_fn.kind = engine::LossFnKind::kPpo;
      break;
    case v1::LOSS_FN_CISPO:
      input.loss_fn.kind = engine::LossFnKind::kCispo;
      break;
    case v1::LOSS_FN_DRO:
      input.loss_fn.kind = engine::LossFnKind::kDro;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn: unknown value ", static_cast<int>(request->loss_fn())));
  }
  if (request->has_ppo_clip_low()) input.loss_fn.ppo_clip_low = request->ppo_clip_low();
  if (request->has_ppo_clip_high()) input.loss_fn.ppo_clip_high = request->ppo_clip_high();
  if (request->has_cispo_clip_low()) input.loss_fn.cispo_clip_low = request->cispo_clip_low();
  if (request->has_cispo_clip_high()) input.loss_fn.cispo_clip_high = request->cispo_clip_high();
  if (request->has_dro_beta()) input.loss_fn.dro_beta = request->dro_beta();
  if (request->has_temperature()) input.loss_fn.temperature = request->temperature();
  // Which of them the loss reads (a parameter another loss does not read
  // is refused, as an unread per-token input is) and their ranges are the
  // engine's to say (CheckLossFn, with the rest of the step's input).
  input.return_logprobs = request->return_logprobs();
  return input;
}

void PhaseSecondsToProto(const engine::PhaseSeconds& s, v1::PhaseTimings* t) {
  t->set_forward_seconds(s.forward);
  t->set_backward_seconds(s.backward);
  t->set_unscale_seconds(s.unscale);
  t->set_optimizer_seconds(s.optimizer);
  t->set_total_seconds(s.total);
  t->set_allreduce_seconds(s.allreduce);
  t->set_wait_seconds(s.wait);
}

}  // namespace

absl::StatusOr<engine::StepRequest> StepRequestFromProto(v1::StepRequest* request) {
  engine::StepRequest step;
  step.sequence = request->sequence();
  AMPD_ASSIGN_OR_RETURN(step.input, BatchFromProto(request));
  if (request->has_learning_rate()) step.input.learning_rate = request->learning_rate();
  return step;
}

absl::StatusOr<engine::ForwardBackwardRequest> ForwardBackwardRequestFromProto(
    v1::ForwardBackwardRequest* request) {
  engine::ForwardBackwardRequest call;
  call.sequence = request->sequence();
  call.index = request->index();
  AMPD_ASSIGN_OR_RETURN(call.input.batch, BatchFromProto(request));
  call.input.micro_batches_in_update = request->micro_batches_in_update();
  return call;
}

void ForwardBackwardReportToProto(const engine::ForwardBackwardReport& r,
                                  v1::ForwardBackwardResponse* response) {
  response->set_sequence(r.sequence);
  response->set_index(r.index);
  response->set_loss(r.loss);
  response->set_loss_scale(r.loss_scale);
  response->set_samples(r.samples);
  response->set_pending(r.pending);
  PhaseSecondsToProto(r.seconds, response->mutable_timings());
  for (const engine::HostTensor& logprobs : r.logprobs) {
    *response->add_logprobs() = codec::TensorToProto(logprobs);
  }
  for (const engine::HostTensor& ratios : r.ratios) {
    *response->add_ratios() = codec::TensorToProto(ratios);
  }
  if (r.logprob_mismatch.has_value()) response->set_logprob_mismatch(*r.logprob_mismatch);
  for (const engine::HostTensor& losses : r.token_losses) {
    *response->add_token_losses() = codec::TensorToProto(losses);
  }
}

engine::OptimStepRequest OptimStepRequestFromProto(const v1::OptimStepRequest& request) {
  engine::OptimStepRequest update;
  update.sequence = request.sequence();
  engine::OptimStepInput& input = update.input;
  input.forward_backward_calls = request.forward_backward_calls();
  if (request.has_learning_rate()) input.learning_rate = request.learning_rate();
  if (request.has_beta1()) input.beta1 = request.beta1();
  if (request.has_beta2()) input.beta2 = request.beta2();
  if (request.has_eps()) input.eps = request.eps();
  if (request.has_weight_decay()) input.weight_decay = request.weight_decay();
  if (request.has_max_grad_norm()) input.max_grad_norm = request.max_grad_norm();
  return update;
}

void StepReportToProto(const engine::StepReport& r, v1::StepResponse* response) {
  response->set_global_step(r.step);
  response->set_applied_steps(r.applied_steps);
  response->set_loss(r.loss);
  response->set_scale_before(r.scaler.scale_before);
  response->set_scale_after(r.scaler.scale_after);
  response->set_found_inf(r.scaler.found_inf);
  response->set_skipped(r.scaler.skipped);
  response->set_scale_grew(r.scaler.grew);
  response->set_scale_backed_off(r.scaler.backed_off);
  response->set_scale_growth_deferred(r.scaler.growth_deferred);
  for (const float s : r.scaler.layer_scales_after) response->add_layer_scales_after(s);
  response->mutable_scaler_counters()->set_growth_tracker(r.scaler.counters.growth_tracker);
  response->mutable_scaler_counters()->set_overflows_until_backoff(
      r.scaler.counters.overflows_until_backoff);
  if (r.grad_norm.has_value()) response->set_grad_norm(*r.grad_norm);
  PhaseSecondsToProto(r.seconds, response->mutable_timings());
  response->set_samples(r.samples);
  response->set_learning_rate(r.learning_rate);
  for (const engine::HostTensor& logprobs : r.logprobs) {
    *response->add_logprobs() = codec::TensorToProto(logprobs);
  }
  for (const engine::HostTensor& ratios : r.ratios) {
    *response->add_ratios() = codec::TensorToProto(ratios);
  }
  for (const engine::HostTensor& losses : r.token_losses) {
    *response->add_token_losses() = codec::TensorToProto(losses);
  }
  if (r.logprob_mismatch.has_value()) response->set_logprob_mismatch(*r.logprob_mismatch);
}

absl::StatusOr<engine::EvaluateRequest> EvaluateRequestFromProto(v1::EvaluateRequest* request) {
  engine::EvaluateRequest evaluate;
  engine::EvaluateInput& input = evaluate.input;
  AMPD_ASSIGN_OR_RETURN(input.micro_batches,
                        MicroBatchesFromProto(request->mutable_micro_batches()));
  input.return_logprobs = request->return_logprobs();
  if (request->has_temperature()) input.temperature = request->temperature();
  return evaluate;
}

void EvaluateReportToProto(const engine::EvaluateReport& r, v1::EvaluateResponse* response) {
  response->set_loss(r.loss);
  response->set_samples(r.samples);
  response->set_seconds(r.seconds);
  for (const engine::HostTensor& logprobs : r.logprobs) {
    *response->add_logprobs() = codec::TensorToProto(logprobs);
  }
}

absl::StatusOr<engine::JobConfigRecord> DecodeCreateRequest(absl::string_view bytes) {
  v1::CreateJobRequest request;
  if (bytes.size() > static_cast<size_t>(INT32_MAX) ||
      !request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::DataLossError("ampd.create_request: not a CreateJobRequest");
  }
  AMPD_ASSIGN_OR_RETURN(JobConfig config, JobConfigFromProto(request.config()));
  return engine::JobConfigRecord{std::move(config), request.request_id()};
}

absl::StatusOr<engine::StateView> StateViewFromProto(int view) {
  switch (view) {
    case v1::STATE_VIEW_FULL:
      return engine::StateView::kFull;
    case v1::STATE_VIEW_ADAPTER:
      return engine::StateView::kAdapter;
    case v1::STATE_VIEW_MERGED:
      return engine::StateView::kMerged;
    default:
      return absl::InvalidArgumentError(absl::StrCat("view: unknown value ", view));
  }
}

engine::SampleRequest SampleRequestFromProto(const v1::SampleRequest& request) {
  engine::SampleRequest sample;
  engine::SampleInput& input = sample.input;
  input.prompts.reserve(static_cast<size_t>(request.prompts_size()));
  bool any_seed = false;
  for (const v1::TokenSequence& prompt : request.prompts()) {
    input.prompts.emplace_back(prompt.tokens().begin(), prompt.tokens().end());
    any_seed = any_seed || prompt.has_seed();
  }
  if (any_seed) {
    input.prompt_seeds.reserve(input.prompts.size());
    for (const v1::TokenSequence& prompt : request.prompts()) {
      input.prompt_seeds.push_back(prompt.has_seed() ? std::optional<uint64_t>(prompt.seed())
                                                     : std::nullopt);
    }
  }
  input.num_samples = request.num_samples() == 0 ? 1 : request.num_samples();
  // Unset: 16. An explicit 0 is kept, for CheckSampleInput to refuse.
  if (request.has_max_tokens()) input.max_tokens = request.max_tokens();
  if (request.has_temperature()) input.temperature = request.temperature();
  input.top_k = request.top_k();
  if (request.has_top_p()) input.top_p = request.top_p();
  input.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  input.seed = request.seed();
  input.snapshot = request.snapshot();
  return sample;
}

v1::SamplerSnapshot SamplerSnapshotToProto(const engine::SamplerSnapshotInfo& info) {
  v1::SamplerSnapshot out;
  out.set_name(info.name);
  out.set_step(info.step);
  out.set_applied_steps(info.applied_steps);
  out.set_bytes(info.bytes);
  return out;
}

void SampleReportToProto(const engine::SampleReport& report, v1::SampleResponse* response) {
  for (const auto& per_prompt : report.completions) {
    v1::PromptCompletions* out = response->add_prompts();
    for (const engine::Completion& c : per_prompt) {
      v1::Completion* completion = out->add_completions();
      completion->mutable_tokens()->Assign(c.tokens.begin(), c.tokens.end());
      completion->mutable_logprobs()->Assign(c.logprobs.begin(), c.logprobs.end());
      completion->mutable_sampling_logprobs()->Assign(c.sampling_logprobs.begin(),
                                                      c.sampling_logprobs.end());
      completion->set_stop_reason(c.stop == engine::StopReason::kStopToken
                                      ? v1::STOP_REASON_STOP_TOKEN
                                      : v1::STOP_REASON_LENGTH);
    }
  }
  response->set_tokens(report.tokens);
  response->set_seconds(report.seconds);
}

}  // namespace ampd::rpc
