// The engine's face: the plain types every layer around it (rpc, metrics,
// main, and the tests of those) reads and writes, with a job's config
// (config/job_config.h) and, for those that run jobs, JobRegistry
// (jobs/job_registry.h) and JobObserver (jobs/job_observer.h): each job
// call's request and report, the one checked form of a request
// (Valid<Request>), what a job and its scaler look like from outside. The
// checks declared here are defined beside it (api_checks.cc). No Backend,
// Trainer or checkpoint internals.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "codec/safetensors.h"
#include "codec/state_dict.h"
#include "common/grad_histogram.h"
#include "server/engine/config/job_config.h"
#include "server/engine/host_tensor.h"

namespace ampd::engine {

// ---- one step ----------------------------------------------------------------

// One micro-batch. inputs: (N, in_features) float (any float dtype, cast to
// the working dtype) or (N) I32/I64 ids when the first layer is Embedding;
// targets: (N, out) F32 for MSE, (N) I32/I64 labels for cross-entropy.
// A language model's token losses (LossFn) also read per-token F32 inputs of the
// targets' shape (B, T): weights, advantages and sampling_logprobs (the
// sampler's log-prob of each target token).
struct MicroBatch {
  HostTensor inputs;
  HostTensor targets;
  // Brace-initialised so that {inputs, targets} leaves them out.
  std::optional<HostTensor> weights{};
  std::optional<HostTensor> advantages{};
  std::optional<HostTensor> sampling_logprobs{};
};

// What a step trains on. kModel: the model's own loss (a GPT's mean token
// cross-entropy over the targets not ignored; the mean over micro-batches).
// The others are a language model's token losses as Tinker defines them, sums
// over every target token of every micro-batch (never means), with logp a
// token's log-prob under the model, q its sampling_logprob, A its advantage,
// r = exp(logp - q) and sg a stop-gradient (kernels/token_loss.h):
//   kCrossEntropy:       -sum w * logp              (weights optional: 1)
//   kImportanceSampling: -sum r * A
//   kPpo:                -sum min(r * A, clip(r, ppo_clip_low, ppo_clip_high) * A)
//   kCispo:              -sum sg(clip(r, cispo_clip_low, cispo_clip_high)) * logp * A
//   kDro:                -sum (logp * A - 0.5 * dro_beta * (logp - q)^2)
// Tokens whose target is kIgnoreIndex add nothing. A distributed job's step
// sums over every rank's tokens (its ranks agree on the LossFn first).
enum class LossFnKind { kModel, kCrossEntropy, kImportanceSampling, kPpo, kCispo, kDro };

// "model", "cross_entropy", "importance_sampling", "ppo", "cispo", "dro"
// (the Python client's names).
inline absl::string_view LossFnName(LossFnKind kind) {
  switch (kind) {
    case LossFnKind::kModel:
      return "model";
    case LossFnKind::kCrossEntropy:
      return "cross_entropy";
    case LossFnKind::kImportanceSampling:
      return "importance_sampling";
    case LossFnKind::kPpo:
      return "ppo";
    case LossFnKind::kCispo:
      return "cispo";
    case LossFnKind::kDro:
      return "dro";
  }
  return "unknown";
}

// Whether a loss reads advantages and sampling_logprobs (every token loss
// but cross_entropy); its steps report the log-prob mismatch.
inline bool ReadsSamplingLogprobs(LossFnKind kind) {
  return kind == LossFnKind::kImportanceSampling || kind == LossFnKind::kPpo ||
         kind == LossFnKind::kCispo || kind == LossFnKind::kDro;
}

// A token loss's parameters: each is read by one kind only, and given to
// another kind it is refused (CheckLossFn), as a per-token input the
// loss does not read is; absent, Tinker's default.
struct LossFn {
  LossFnKind kind = LossFnKind::kModel;
  // kPpo: the ratio's clip range, 0 <= ppo_clip_low <= 1 <= ppo_clip_high
  // (Tinker's defaults 0.8 and 1.2).
  std::optional<float> ppo_clip_low;
  std::optional<float> ppo_clip_high;
  // kCispo: the clip range of the ratio's coefficient, finite, 0 <=
  // cispo_clip_low <= cispo_clip_high (defaults 0 and 4: one-sided, as
  // Tinker's cispo and MiniMax-M1's CISPO).
  std::optional<float> cispo_clip_low;
  std::optional<float> cispo_clip_high;
  // kDro: the quadratic penalty's weight, finite and >= 0 (default 0.05).
  std::optional<float> dro_beta;
  // Every loss of a language model: logp is log_softmax(logits / temperature),
  // the log-prob a sampler at that temperature (top_k 0, top_p 1) reports
  // as its sampling log-prob, bit for bit on a batch-invariant job; the
  // reported log-probs and the model's own loss are then at it too. Finite
  // and > 0; absent: 1 (the logits as they are).
  std::optional<float> temperature;

  static constexpr float kPpoClipLow = 0.8f;
  static constexpr float kPpoClipHigh = 1.2f;
  static constexpr float kCispoClipLow = 0.0f;
  static constexpr float kCispoClipHigh = 4.0f;
  static constexpr float kDroBeta = 0.05f;

  // The clip range the kind reads (kPpo's or kCispo's, defaults filled; 0
  // and 0 for the others) and kDro's beta (0 for the others).
  float clip_low() const {
    if (kind == LossFnKind::kPpo) return ppo_clip_low.value_or(kPpoClipLow);
    if (kind == LossFnKind::kCispo) return cispo_clip_low.value_or(kCispoClipLow);
    return 0.0f;
  }
  float clip_high() const {
    if (kind == LossFnKind::kPpo) return ppo_clip_high.value_or(kPpoClipHigh);
    if (kind == LossFnKind::kCispo) return cispo_clip_high.value_or(kCispoClipHigh);
    return 0.0f;
  }
  float beta() const { return kind == LossFnKind::kDro ? dro_beta.value_or(kDroBeta) : 0.0f; }
  float logit_temperature() const { return temperature.value_or(1.0f); }
};

// A LossFn's parameters: only those its kind reads, each in the range
// above. InvalidArgument naming the field ("ppo_clip_low", "dro_beta",
// "temperature", ...).
absl::Status CheckLossFn(const LossFn& fn);

struct StepInput {
  std::vector<MicroBatch> micro_batches;  // >= 1; gradients accumulate over them
  std::optional<float> learning_rate;     // overrides the optimizer's lr for this step
  bool sample_grad_histogram = false;     // fill StepReport::grad_histogram (costs a pass)
  LossFn loss_fn;
  // A language model's per-token log-probs (and, for a loss with
  // sampling_logprobs, the ratios; for a token loss, each token's loss)
  // back in the report (StepReport::logprobs).
  bool return_logprobs = false;
};

// The checks of a step's input that need no model: at least one
// micro-batch, a learning rate (when given) finite and >= 0, and the loss's
// parameters: only those its kind reads, each in range. InvalidArgument
// naming the field ("micro_batches", "learning_rate", "ppo_clip_low",
// "cispo_clip_high", "dro_beta", ...).
absl::Status CheckStepInput(const StepInput& input);

struct PhaseSeconds {
  double forward = 0;
  double backward = 0;
  double unscale = 0;  // non-finite check (+ norm)
  double optimizer = 0;
  double total = 0;
  // A distributed job's rank only: the gradients' and scalars' all-reduce,
  // and the wait at the step's start for the slowest rank.
  double allreduce = 0;
  double wait = 0;
};

struct StepReport {
  int64_t step = 0;                // 1-based number of this Step call in the job
  int64_t applied_steps = 0;       // optimizer updates applied so far, this one included
  float loss = 0;                  // mean over micro-batches, unscaled fp32 (multiplier included);
                                   // a token loss (LossFn): the sum over every token; a
                                   // distributed step's: over every rank's micro-batches
  amp::ScalerUpdate scaler;        // scale before/after, found_inf, skipped, grew, backed_off
  std::optional<float> grad_norm;  // L2 of unscaled grads (before clipping): every applied
                                   // step, and skipped ones when clipping
  float grad_max_abs = 0;          // max |g| of the unscaled grads (inf when they overflowed);
                                   // with per-layer scales, also of the groups' entry gradients
  PhaseSeconds seconds;
  int64_t samples = 0;                  // rows over all micro-batches
  std::vector<int64_t> grad_histogram;  // kGradHistogramBins counts, when sampled
  // Fraction of the sampled (scaled) gradient elements at zero or below
  // fp16's smallest normal 2^-14, when sampled (amp::UnderflowFraction).
  std::optional<double> grad_underflow_fraction;
  // The lr the update used (or would have, when skipped): the schedule's
  // for the applied count before the step, or the input's override.
  float learning_rate = 0;
  // return_logprobs: per micro-batch, (B, T) F32: entry [b, t] is the
  // log-prob of targets[b, t] that this step's forward computed (the
  // weights before its update), 0 where the target is ignored; the values
  // Evaluate with return_logprobs reports for the same weights.
  std::vector<HostTensor> logprobs{};
  // return_logprobs with a loss with sampling_logprobs (every token loss
  // but cross_entropy): per micro-batch, (B, T) F32 r = exp(logprobs -
  // sampling_logprobs), formed on the host in fp32 from the two (the loss's
  // own exp runs on the device: on CUDA its last place may differ), 0 where
  // the target is ignored.
  std::vector<HostTensor> ratios{};
  // return_logprobs with a token loss (not kModel): per micro-batch, (B, T)
  // F32: what each target token added to `loss` (its term, times the
  // model's loss_multiplier; Tinker's elementwise loss), as the device
  // computed it, 0 where the target is ignored. They sum to `loss` up to
  // the order of the fp32 additions.
  std::vector<HostTensor> token_losses{};
  // A loss with sampling_logprobs: max |logp - sampling_logprob| over every
  // kept target token of the step, logp from this step's forward. When the
  // samples came from these same weights it is the sampler-trainer
  // mismatch (exactly 0 on a batch-invariant job); after updates on the
  // same samples it also holds how far the policy has moved.
  std::optional<float> logprob_mismatch{};
};

// ---- accumulate, then apply ---------------------------------------------------

// One ForwardBackward call (Tinker's forward_backward): a step's forward,
// loss and backward over `batch` (its micro_batches, loss_fn and
// return_logprobs; a learning_rate or histogram there is refused), its
// gradients added to those the job accumulated since its last update,
// scaled by the job's loss scale now, as Step scales them. The model's own
// (mean) loss divides each micro-batch's gradient by
// micro_batches_in_update: the micro-batches the update averages over, in
// every call of it (0: this call's own). Token losses are sums and ignore
// it. K calls over a partition of a Step's micro-batches, in order, with
// micro_batches_in_update the Step's count, followed by an OptimStep of the
// Step's learning rate, train exactly as that Step does, bit for bit.
struct ForwardBackwardInput {
  StepInput batch;
  int64_t micro_batches_in_update = 0;
};

// CheckStepInput's checks of the batch, no learning_rate, and
// micro_batches_in_update >= 0 (InvalidArgument naming the field).
absl::Status CheckForwardBackwardInput(const ForwardBackwardInput& input);

struct ForwardBackwardReport {
  int64_t sequence = 0;  // the update the gradients go into (the job's next sequence)
  int64_t index = 0;     // this call's 1-based position among that update's calls
  // Unscaled: the mean over this call's micro-batches of the model's loss,
  // or a token loss's sum over this call's tokens.
  float loss = 0;
  float loss_scale = 1;  // the scale the call's gradients carry
  int64_t samples = 0;   // rows over this call's micro-batches
  int64_t pending = 0;   // calls accumulated now, this one included
  PhaseSeconds seconds;  // forward, backward and total
  // As StepReport's, for this call's micro-batches.
  std::vector<HostTensor> logprobs{};
  std::vector<HostTensor> ratios{};
  std::vector<HostTensor> token_losses{};
  std::optional<float> logprob_mismatch{};
};

// One OptimStep (Tinker's optim_step): the update from every gradient
// accumulated since the last one. Each hyperparameter, when given, replaces
// the job's for this update only (torch.optim.AdamW's names; max_grad_norm
// <= 0 disables clipping); betas and eps apply to Adam and AdamW jobs only.
struct OptimStepInput {
  // The ForwardBackward calls the client sent for this update: an update
  // of fewer than it expects (gradients lost to a restart) is refused.
  int64_t forward_backward_calls = 0;
  std::optional<float> learning_rate;
  std::optional<float> beta1;
  std::optional<float> beta2;
  std::optional<float> eps;
  std::optional<float> weight_decay;
  std::optional<float> max_grad_norm;
  bool sample_grad_histogram = false;  // the job's choice, as a step's
};

// forward_backward_calls >= 1 and each given hyperparameter in PyTorch's
// range (lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0, all finite):
// InvalidArgument naming the field.
absl::Status CheckOptimStepInput(const OptimStepInput& input);

// A distributed job's group formed (docs/DISTRIBUTED.md): its round at the
// rendezvous, and whether this rank copied the state of a rank ahead of it.
struct GroupFormation {
  int64_t round = 0;
  bool copied_state = false;
  int32_t source_rank = 0;  // the rank whose state every rank holds now
  double seconds = 0;       // meeting, connecting and copying
};

// ---- evaluation ----------------------------------------------------------------

// Forward and loss only, on micro-batches checked as a step's are.
struct EvaluateInput {
  std::vector<MicroBatch> micro_batches;  // >= 1
  // A language model's per-token log-probs back (EvaluateReport::logprobs),
  // what Tinker calls compute_logprobs.
  bool return_logprobs = false;
  // As LossFn::temperature: the log-probs (and the loss) of
  // softmax(logits / temperature); absent: 1.
  std::optional<float> temperature{};
};

// At least one micro-batch, a temperature (when given) finite and > 0;
// InvalidArgument naming "micro_batches" or "temperature".
absl::Status CheckEvaluateInput(const EvaluateInput& input);

struct EvaluateReport {
  float loss = 0;       // mean over micro-batches, unscaled fp32 (multiplier included)
  int64_t samples = 0;  // rows over all micro-batches
  double seconds = 0;   // wall time of the evaluation on the job's worker
  // return_logprobs: per micro-batch, (B, T) F32: entry [b, t] is the
  // log-prob of targets[b, t] given inputs[b, 0..t], computed by the
  // training forward's own kernels (0 where the target is ignored).
  std::vector<HostTensor> logprobs{};  // brace-initialised: {loss, samples, seconds} leaves it out
};

// ---- sampling -----------------------------------------------------------------

// Completions of prompts from a language model's current weights (Tinker's
// sample): every prompt gets num_samples completions of up to max_tokens
// tokens, each token drawn from softmax(logits / temperature) restricted
// to the top_k most likely tokens (0: all) and to the smallest set whose
// probability reaches top_p (1: all); temperature 0 takes the most likely
// token. A completion ends after max_tokens tokens or after a token in
// stop_token_ids (which it keeps). Draws come from Philox, one stream per
// completion (SampleStream), so a request gives the same tokens every time;
// a prompt with a seed of its own draws the same tokens wherever it sits.
// top_k >= the vocabulary truncates nothing: it draws as top_k 0 does.
struct SampleInput {
  std::vector<std::vector<int64_t>> prompts;  // each 1 .. context tokens, in [0, vocab)
  // Empty, or one per prompt: that prompt's own Philox key, or none (the
  // request's seed, split by position).
  std::vector<std::optional<uint64_t>> prompt_seeds{};
  int64_t num_samples = 1;
  int64_t max_tokens = 16;
  float temperature = 1.0f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  std::vector<int64_t> stop_token_ids{};
  uint64_t seed = 0;
  // Empty: the job's current weights; else the sampler snapshot of this
  // name (SaveSamplerSnapshot), whatever the job trained since.
  std::string snapshot{};
};

// The Philox key and stream of completion j of prompt i: (its own seed, j)
// for a prompt with one, else (seed, i x num_samples + j), so prompt 0 of a
// request draws what the same prompt sent with its own seed = seed draws.
struct SampleStream {
  uint64_t key = 0;
  uint64_t stream = 0;
};
SampleStream SampleStreamOf(const SampleInput& input, int64_t prompt, int64_t sample);

// The limits CheckSampleInput enforces before anything else runs.
inline constexpr int64_t kMaxSamplePrompts = 1024;
inline constexpr int64_t kMaxSamplesPerPrompt = 256;
inline constexpr int64_t kMaxSampleSequences = 4096;  // prompts x num_samples
inline constexpr int64_t kMaxStopTokens = 64;

// What can be checked without the model: counts and ranges, sizes
// overflow-checked (InvalidArgument naming the field: "prompts[3]",
// "num_samples", "temperature"...).
absl::Status CheckSampleInput(const SampleInput& input);

enum class StopReason { kLength, kStopToken };

struct Completion {
  std::vector<int64_t> tokens;
  // logprobs[i]: the log-prob of tokens[i] given the prompt and tokens[0..i)
  // under the model at temperature 1, from the training forward's kernels:
  // on a batch-invariant job (JobConfig::batch_invariant) the value a Step
  // or Evaluate computes for that token, bit for bit.
  std::vector<float> logprobs;
  // sampling_logprobs[i]: the log-prob of tokens[i] under the distribution
  // it was drawn from: log_softmax(logits / temperature) at the token (the
  // training forward's kernels, as a loss with that temperature computes
  // it: bit for bit on a batch-invariant job), minus the log of the mass
  // top_k and top_p kept (0 when they keep every token: then exactly a
  // temperature loss's logp). Temperature 0 draws the most likely token
  // with certainty: 0.
  std::vector<float> sampling_logprobs{};
  StopReason stop = StopReason::kLength;
};

struct SampleReport {
  // completions[p][i]: prompt p's i-th completion.
  std::vector<std::vector<Completion>> completions;
  int64_t tokens = 0;  // sampled tokens over all completions
  double seconds = 0;  // wall time on the job's worker
};

// ---- sampler snapshots ------------------------------------------------------------

// A named, immutable copy of the weights Sample reads (Tinker's
// save_weights_for_sampler): every trainable parameter's working copy (a
// LoRA job's adapters alone: its frozen base is the job's own, shared), on
// the job's device. Sample with SampleInput::snapshot reads it while the
// job trains on; on a batch_invariant job its log-probs are, bit for bit,
// those the training forward computed at the step it was taken.
struct SamplerSnapshotInfo {
  std::string name;
  int64_t step = 0;           // the job's Step count (sequence) when it was taken
  int64_t applied_steps = 0;  // optimizer updates applied by then
  int64_t bytes = 0;          // device bytes it holds
};

// The most snapshots one job holds; SaveSamplerSnapshot beyond it is
// RESOURCE_EXHAUSTED (SNAPSHOT_LIMIT) until one is deleted.
inline constexpr int64_t kMaxSamplerSnapshots = 32;
inline constexpr size_t kMaxSnapshotNameBytes = 64;

// A snapshot's name: 1 to 64 bytes of [A-Za-z0-9_-] (it names a file
// beside the job's checkpoint). InvalidArgument naming `field`.
absl::Status CheckSnapshotName(absl::string_view field, absl::string_view name);

// StepReport::grad_histogram's bins (common/grad_histogram.h, where the
// kernels that count them read them too).
using ::ampd::kGradHistogramBins;
using ::ampd::kGradHistogramMaxLog2;
using ::ampd::kGradHistogramMinLog2;

// ---- job calls: one request type each, checked once ----------------------------

// Every call a job serves on its strand is one request type: what it
// carries, where it sits in the job's order (an update's sequence number,
// a call's index, a snapshot's name), and its Report. The registry takes
// them all by one path (JobRegistry::Submit): the request is checked where
// it is accepted, before it waits behind other work, into a
// Valid<Request>; the job's strand and the Trainer take that proof and
// never check the same fields again; the checks against the job's model
// run on the strand, once. A new call is a request type here, its
// CheckRequest (api_checks.cc), its Job::Run (server/engine/jobs/) and its
// work in the Trainer.
struct StepRequest {
  using Report = StepReport;
  static constexpr absl::string_view kName = "step";
  int64_t sequence = 0;  // exactly once: the job's next (Job::Run's rules)
  StepInput input;
};
struct ForwardBackwardRequest {
  using Report = ForwardBackwardReport;
  static constexpr absl::string_view kName = "forward_backward";
  int64_t sequence = 0;  // the update its gradients go into
  int64_t index = 0;     // its 1-based position among the update's calls
  ForwardBackwardInput input;
};
struct OptimStepRequest {
  using Report = StepReport;
  static constexpr absl::string_view kName = "optim_step";
  int64_t sequence = 0;
  OptimStepInput input;
};
struct EvaluateRequest {
  using Report = EvaluateReport;
  static constexpr absl::string_view kName = "evaluate";
  EvaluateInput input;
};
struct SampleRequest {
  using Report = SampleReport;
  static constexpr absl::string_view kName = "sample";
  SampleInput input;
};
struct SaveSamplerSnapshotRequest {
  using Report = SamplerSnapshotInfo;
  static constexpr absl::string_view kName = "sampler snapshot";
  std::string name;  // empty: "step-N" (Job::Run's naming)
};
// What a call that answers nothing but its status reports.
struct NoReport {};
struct DeleteSamplerSnapshotRequest {
  using Report = NoReport;
  static constexpr absl::string_view kName = "delete sampler snapshot";
  std::string name;
};

// The job's state as a safetensors file (header and host tensors), or a
// view of it (StateView, below); and a decoded file loaded into the job
// (partial: some of the model's weights only). Nothing to check before the
// strand: the view is an enum, the file was checked as it arrived.
enum class StateView;
struct ExportStateRequest {
  using Report = codec::EncodedSafetensors;
  static constexpr absl::string_view kName = "export";
  StateView view{};
};
struct ImportStateRequest {
  using Report = int64_t;  // the tensors loaded
  static constexpr absl::string_view kName = "import";
  codec::StateDict state;
  bool partial = false;
};

// Each request's checks that need no model (InvalidArgument naming the
// field): its input's (CheckStepInput, CheckSampleInput, ...) and its own
// (a ForwardBackward call's index >= 1, a snapshot's name).
absl::Status CheckRequest(const StepRequest& request);
absl::Status CheckRequest(const ForwardBackwardRequest& request);
absl::Status CheckRequest(const OptimStepRequest& request);
absl::Status CheckRequest(const EvaluateRequest& request);
absl::Status CheckRequest(const SampleRequest& request);
absl::Status CheckRequest(const SaveSamplerSnapshotRequest& request);
absl::Status CheckRequest(const DeleteSamplerSnapshotRequest& request);
inline absl::Status CheckRequest(const ExportStateRequest&) { return absl::OkStatus(); }
inline absl::Status CheckRequest(const ImportStateRequest&) { return absl::OkStatus(); }

// A request that passed CheckRequest. Only Check makes one, so what takes
// a Valid<Request> never runs unchecked input and never checks it again.
template <typename Request>
class Valid {
 public:
  // CheckRequest's error, or the request.
  static absl::StatusOr<Valid> Check(Request request) {
    if (absl::Status s = CheckRequest(request); !s.ok()) return s;
    return Valid(std::move(request));
  }

  const Request& get() const { return request_; }
  const Request* operator->() const { return &request_; }
  // The request moved out by its last reader (a load taking the file's
  // buffers): the proof ends with it.
  Request Take() && { return std::move(request_); }
  // Which updates sample the gradient histogram is the job's choice
  // (every --grad-histogram-every steps), and no check covers it.
  void set_sample_grad_histogram(bool sample) requires requires(Request r) {
    r.input.sample_grad_histogram;
  }
  { request_.input.sample_grad_histogram = sample; }

 private:
  explicit Valid(Request request) : request_(std::move(request)) {}
  Request request_;
};

// ---- a job from outside ---------------------------------------------------------

// Where a job's loss scaler stands before its next step.
struct ScalerSnapshot {
  float scale = 1.0f;  // the scale the next step uses (1 when scaling is disabled)
  amp::ScalerCounters counters;
  // Per-layer scales: each layer group's S_g the next step uses (group g at
  // index g; the last is `scale`); empty for a job-wide scale.
  std::vector<float> layer_scales;
};

// A job trains (kActive) until its loss scaler gives up at its minimum scale
// (deepspeed's raise_at_min_scale): it is then kFailed, refuses steps, and a
// LoadStateDict of a good state makes it active again.
// What a GetStateDict exports. kFull: the whole training state (weights,
// optimizer, scaler, counts), what a checkpoint holds and LoadStateDict
// restores. kAdapter: a LoRA job's adapters alone, F32, in PEFT's names,
// with PEFT's adapter_config (JSON) in the metadata. kMerged: the model's
// weights alone, every one F32, a LoRA job's adapters merged into the
// weights they adapt (W + (alpha/r) B A): a plain model that transformers
// loads without PEFT, or that a partial load puts under another job (a
// pretrained base for a LoRA job).
enum class StateView { kFull, kAdapter, kMerged };  // declared above, for ExportStateRequest

enum class JobState { kActive, kFailed };

// What GetJob/ListJobs report, readable from any thread.
struct JobSnapshot {
  std::string job_id;
  std::string request_id;
  JobConfig config;  // effective (defaults filled in)
  int64_t step = 0;  // Step calls applied; the next sequence is step + 1
  int64_t applied_steps = 0;
  ScalerSnapshot scaler;
  int64_t parameter_count = 0;
  int64_t estimated_bytes = 0;
  JobState state = JobState::kActive;
  std::string failure;  // why, when kFailed
  // The last applied step's L2 norm of the unscaled gradients, when the
  // Trainer reported one.
  std::optional<float> grad_norm;
};

}  // namespace ampd::engine
