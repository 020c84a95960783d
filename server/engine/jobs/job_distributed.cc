// Job's distributed side (docs/DISTRIBUTED.md): forming the group, the
// state every rank starts a formed group from, and the agreement on each
// step before its share runs.
//
// Forming: the rank meets the others at the group's rendezvous (one round of
// its barrier, with a fingerprint of the job's config so that ranks of
// different jobs never form a group), connects Gloo's mesh, then the ranks
// exchange (steps run, hash of their state). Every rank must end at the most
// advanced rank's state: a rank that restarted from an older checkpoint
// copies it (the lowest such rank broadcasts a checkpoint of its state), so
// no acknowledged step is lost and none is applied twice, whichever ranks
// died. Ranks at the same step with different states are an error, not
// something to paper over by copying (a LoadStateDict sent to one rank only).
//
// Each step: the ranks all-gather (sequence, micro-batches, input valid,
// loss_fn, learning-rate override) and decide together: a rank whose share
// is invalid refuses the step on every rank; ranks sent different
// sequences, different loss functions (a token loss's gradients and loss
// are sums, the model's means: a mix would be neither) or different
// learning rates (the ranks' weights would part), refuse it on every rank;
// otherwise every rank, holding the same state, takes the same exactly-once
// decision (run it, answer the recorded report, or refuse the sequence) and
// runs its share with the all-reduces of Trainer::Step.
#include <openssl/sha.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "server/engine/config/job_config_codec.h"
#include "server/engine/jobs/job.h"

namespace ampd::engine {

namespace {

using Clock = std::chrono::steady_clock;

// Positions in the step header every rank contributes.
constexpr size_t kHeaderSequence = 0;
constexpr size_t kHeaderMicroBatches = 1;
constexpr size_t kHeaderInputOk = 2;
constexpr size_t kHeaderLossFn = 3;        // LossKindWord
constexpr size_t kHeaderLossParams = 4;    // LossParamsWord
constexpr size_t kHeaderLearningRate = 5;  // LearningRateWord
constexpr size_t kHeaderSize = 6;

// A step's learning-rate override as one int64: 1 << 32 | its bits, or 0
// without one (the schedule's, which every rank computes alike), so the
// ranks agree on the exact value or on its absence.
int64_t LearningRateWord(const std::optional<float>& lr) {
  if (!lr.has_value()) return 0;
  uint32_t bits = 0;
  std::memcpy(&bits, &*lr, sizeof(bits));
  return static_cast<int64_t>((uint64_t{1} << 32) | bits);
}

// One rank's learning rate as its header carries it, for an error.
std::string LearningRateText(const int64_t* header) {
  const auto word = static_cast<uint64_t>(header[kHeaderLearningRate]);
  if ((word >> 32) == 0) return "the schedule's";
  const auto bits = static_cast<uint32_t>(word);
  float lr = 0;
  std::memcpy(&lr, &bits, sizeof(lr));
  return absl::StrCat(lr);
}

// A step's loss parameters as one int64, so that the ranks agree on the
// exact values: a ppo or cispo step's clip range (both bounds' bit
// patterns), a dro step's beta (its bits). 0 for the other losses, which
// read none. Defaults are filled first: a rank that sent Tinker's default
// agrees with one that left it out.
int64_t LossParamsWord(const LossFn& fn) {
  auto bits = [](float v) {
    uint32_t b = 0;
    std::memcpy(&b, &v, sizeof(b));
    return b;
  };
  if (fn.kind == LossFnKind::kPpo || fn.kind == LossFnKind::kCispo) {
    return static_cast<int64_t>((static_cast<uint64_t>(bits(fn.clip_high())) << 32) |
                                bits(fn.clip_low()));
  }
  if (fn.kind == LossFnKind::kDro) return static_cast<int64_t>(bits(fn.beta()));
  return 0;
}

// A step's loss kind and temperature as one int64: the temperature's bits
// (1 when absent: a rank that sent 1 agrees with one that sent none) << 32
// | the kind.
int64_t LossKindWord(const LossFn& fn) {
  const float t = fn.logit_temperature();
  uint32_t bits = 0;
  std::memcpy(&bits, &t, sizeof(bits));
  return static_cast<int64_t>((static_cast<uint64_t>(bits) << 32) | static_cast<uint32_t>(fn.kind));
}

// One rank's loss function as its header carries it, for an error.
std::string LossFnText(const int64_t* header) {
  const auto kind_word = static_cast<uint64_t>(header[kHeaderLossFn]);
  const auto kind = static_cast<LossFnKind>(static_cast<uint32_t>(kind_word));
  const auto temperature_bits = static_cast<uint32_t>(kind_word >> 32);
  float temperature = 1.0f;
  std::memcpy(&temperature, &temperature_bits, sizeof(temperature));
  const std::string at =
      temperature == 1.0f ? std::string() : absl::StrCat(" at temperature ", temperature);
  const auto word = static_cast<uint64_t>(header[kHeaderLossParams]);
  auto value = [](uint32_t bits) {
    float v = 0;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  };
  const float low = value(static_cast<uint32_t>(word));
  const float high = value(static_cast<uint32_t>(word >> 32));
  if (kind == LossFnKind::kPpo || kind == LossFnKind::kCispo) {
    return absl::StrCat(LossFnName(kind), " (clip ", low, ", ", high, ")", at);
  }
  if (kind == LossFnKind::kDro) return absl::StrCat("dro (beta ", low, ")", at);
  return absl::StrCat(LossFnName(kind), at);
}

std::string Sha256(absl::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

// The first 8 bytes of a digest as an int64 (what AllGather carries).
int64_t Prefix64(const std::string& digest) {
  int64_t v = 0;
  std::memcpy(&v, digest.data(), sizeof(v));
  return v;
}

// What every rank of one job shares: its config but for the rank, the
// display name and the request id, which may differ per replica, and its
// owner, so that ranks of different tenants never meet even under one
// group name.
std::string Fingerprint(const JobConfig& config, const std::string& owner) {
  JobConfig shared = config;
  shared.display_name.clear();
  shared.distributed.rank = 0;
  return Sha256(absl::StrCat(EncodeJobConfig(shared, ""), "\n", owner));
}

// The ranks' headers (`all`, kHeaderSize words each) agree on the step:
// every share valid, the same sequence, loss and learning rate. The step's
// micro-batches over every rank, or the refusal every rank answers.
absl::StatusOr<int64_t> AgreedMicroBatches(const std::vector<int64_t>& all, int64_t sequence,
                                           const dist::DistributedSpec& spec) {
  int64_t global_micro_batches = 0;
  std::vector<std::string> refused;
  bool same_sequence = true;
  bool same_loss_fn = true;
  bool same_learning_rate = true;
  for (int32_t r = 0; r < spec.world_size; ++r) {
    const int64_t* h = all.data() + static_cast<size_t>(r) * kHeaderSize;
    global_micro_batches += h[kHeaderMicroBatches];
    if (h[kHeaderInputOk] == 0) refused.push_back(absl::StrCat(r));
    if (h[kHeaderSequence] != sequence) same_sequence = false;
    if (h[kHeaderLossFn] != all[kHeaderLossFn] || h[kHeaderLossParams] != all[kHeaderLossParams]) {
      same_loss_fn = false;
    }
    if (h[kHeaderLearningRate] != all[kHeaderLearningRate]) same_learning_rate = false;
  }
  if (!refused.empty()) {
    return WithReason(absl::InvalidArgumentError(absl::StrCat(
                          "micro_batches: the share of rank(s) ", absl::StrJoin(refused, ", "),
                          " of group ", spec.group, " is invalid, so no rank ran this step")),
                      reason::kReplicasDiffer, {{"group", spec.group}});
  }
  if (!same_sequence) {
    // Spelled out only for the error, not on every step.
    std::vector<std::string> sequences;
    for (int32_t r = 0; r < spec.world_size; ++r) {
      sequences.push_back(absl::StrCat(
          "rank ", r, ": ", all[static_cast<size_t>(r) * kHeaderSize + kHeaderSequence]));
    }
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "sequence: the ranks of group ", spec.group, " were sent different sequences (",
            absl::StrJoin(sequences, ", "), "); send every rank the same step")),
        reason::kReplicasDiffer, {{"group", spec.group}});
  }
  if (!same_loss_fn) {
    std::vector<std::string> loss_fns;
    for (int32_t r = 0; r < spec.world_size; ++r) {
      loss_fns.push_back(absl::StrCat(
          "rank ", r, ": ", LossFnText(all.data() + static_cast<size_t>(r) * kHeaderSize)));
    }
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "loss_fn: the ranks of group ", spec.group, " were sent different loss functions (",
            absl::StrJoin(loss_fns, ", "), "); send every rank the same loss_fn")),
        reason::kReplicasDiffer, {{"group", spec.group}, {"field", "loss_fn"}});
  }
  if (!same_learning_rate) {
    std::vector<std::string> rates;
    for (int32_t r = 0; r < spec.world_size; ++r) {
      rates.push_back(absl::StrCat(
          "rank ", r, ": ", LearningRateText(all.data() + static_cast<size_t>(r) * kHeaderSize)));
    }
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "learning_rate: the ranks of group ", spec.group,
                          " were sent different learning rates (", absl::StrJoin(rates, ", "),
                          "); send every rank the same learning_rate")),
                      reason::kReplicasDiffer, {{"group", spec.group}, {"field", "learning_rate"}});
  }
  return global_micro_batches;
}

}  // namespace

absl::Status Job::PeerUnavailable(absl::string_view what) const {
  const dist::DistributedSpec& spec = config_.get().distributed;
  return WithReason(
      absl::UnavailableError(absl::StrCat(
          "distributed job ", id_, " (rank ", spec.rank, " of ", spec.world_size, ", group ",
          spec.group, "): ", what,
          "; nothing was applied, and the step succeeds once every rank is sent it again")),
      reason::kPeerUnavailable, {{"group", spec.group}, {"rank", absl::StrCat(spec.rank)}});
}

void Job::DropGroup() {
  all_reduce_.reset();
  group_.reset();
}

absl::Status Job::EnsureGroup() {
  if (group_ != nullptr) return absl::OkStatus();
  const dist::DistributedSpec& spec = config_.get().distributed;
  if (!context_->rendezvous) {
    return absl::FailedPreconditionError(
        "distributed: this ampd was started without --peer-address and takes no distributed job");
  }
  if (rendezvous_ == nullptr) {
    absl::StatusOr<std::unique_ptr<dist::Rendezvous>> r =
        context_->rendezvous(spec.rendezvous, spec.group, spec.secret);
    if (!r.ok()) return PeerUnavailable(r.status().message());
    rendezvous_ = *std::move(r);
  }
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::unique_ptr<dist::ProcessGroup>> group = dist::ProcessGroup::Connect(
      spec, Fingerprint(config_.get(), owner_), context_->peer_host, *rendezvous_);
  if (!group.ok()) {
    if (group.status().code() == absl::StatusCode::kFailedPrecondition) {
      return WithReason(group.status(), reason::kReplicasDiffer, {{"group", spec.group}});
    }
    if (group.status().code() == absl::StatusCode::kUnauthenticated) {
      // Rank 0 holds the group under another secret: the ranks' configs
      // differ, which no retry mends.
      return WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "distributed job ", id_, ": rank 0 of group ", spec.group,
              " refused this rank's proof; every rank needs the same distributed.secret (",
              group.status().message(), ")")),
          reason::kReplicasDiffer, {{"group", spec.group}});
    }
    return PeerUnavailable(group.status().message());
  }
  bool copied = false;
  int32_t source = 0;
  if (absl::Status s = SyncState(**group, &copied, &source); !s.ok()) {
    if (s.code() == absl::StatusCode::kUnavailable) return PeerUnavailable(s.message());
    return s;
  }
  absl::StatusOr<std::unique_ptr<dist::GradientAllReduce>> all_reduce =
      dist::MakeGradientAllReduce(**group, trainer_->backend(), trainer_->gradient_tensors());
  if (!all_reduce.ok()) {
    if (all_reduce.status().code() == absl::StatusCode::kUnavailable) {
      return PeerUnavailable(all_reduce.status().message());
    }
    return all_reduce.status();
  }
  group_ = *std::move(group);
  all_reduce_ = *std::move(all_reduce);
  std::fprintf(stderr, "ampd: job %s formed group %s round %lld (rank %d of %d)%s\n", id_.c_str(),
               spec.group.c_str(), static_cast<long long>(group_->round()), spec.rank,
               spec.world_size,
               copied ? absl::StrCat(", copied the state of rank ", source).c_str() : "");
  if (context_->observer != nullptr) {
    GroupFormation formation;
    formation.round = group_->round();
    formation.copied_state = copied;
    formation.source_rank = source;
    formation.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    context_->observer->OnGroupFormed(id_, formation);
  }
  return absl::OkStatus();
}

absl::Status Job::SyncState(dist::ProcessGroup& group, bool* copied, int32_t* source) {
  const std::string& group_name = config_.get().distributed.group;
  AMPD_ASSIGN_OR_RETURN(checkpoint::StateDict mine, trainer_->ExportState());
  const int64_t hash = Prefix64(Sha256(checkpoint::EncodeSafetensors(mine)));
  const int64_t header[2] = {trainer_->steps_run(), hash};
  AMPD_ASSIGN_OR_RETURN(const std::vector<int64_t> all, group.AllGather(header));
  // The most advanced rank, the lowest of them if several.
  int32_t src = 0;
  for (int32_t r = 1; r < group.world_size(); ++r) {
    if (all[2 * r] > all[2 * src]) src = r;
  }
  bool behind = false;
  std::vector<std::string> differing;
  for (int32_t r = 0; r < group.world_size(); ++r) {
    if (all[2 * r] < all[2 * src]) {
      behind = true;
    } else if (all[2 * r + 1] != all[2 * src + 1]) {
      differing.push_back(absl::StrCat(r));
    }
  }
  if (!differing.empty()) {
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "distributed job ", id_, ": ranks ", src, " and ", absl::StrJoin(differing, ", "),
            " of group ", group_name, " hold different states at step ", all[2 * src],
            "; load the same state dict into every rank (LoadStateDict on each)")),
        reason::kReplicasDiffer, {{"group", group_name}});
  }
  *copied = false;
  *source = src;
  if (!behind) return absl::OkStatus();
  // The source's checkpoint (state, recorded report, failure) to every
  // rank: the state it exported above, with the job's metadata.
  std::string bytes;
  if (group.rank() == src) {
    AddJobMetadata(mine);
    bytes = checkpoint::EncodeSafetensors(mine);
  }
  AMPD_RETURN_IF_ERROR(group.Broadcast(bytes, src));
  if (trainer_->steps_run() == all[2 * src]) return absl::OkStatus();
  AMPD_ASSIGN_OR_RETURN(const checkpoint::StateDict state, checkpoint::DecodeSafetensors(bytes));
  initial_state_ = false;
  AMPD_RETURN_IF_ERROR(trainer_->LoadState(state, Trainer::StepCount::kFromState));
  ++weights_version_;
  last_report_.reset();
  if (auto it = state.metadata.find(kMetaLastReport); it != state.metadata.end()) {
    absl::StatusOr<StepReport> report = DecodeStepReport(it->second);
    if (report.ok() && report->step == trainer_->steps_run()) last_report_ = *std::move(report);
  }
  auto failure = state.metadata.find(kMetaFailure);
  SetFailure(failure == state.metadata.end() ? "" : failure->second);
  {
    absl::MutexLock lock(&mu_);
    RefreshSnapshot();
  }
  *copied = true;
  // On disk too, so a restart of this rank starts from here.
  if (absl::Status s = Checkpoint(); !s.ok()) {
    std::fprintf(stderr, "ampd: job %s checkpoint after copying rank %d's state failed: %s\n",
                 id_.c_str(), src, s.ToString().c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<StepReport> Job::DistributedStep(const Valid<StepRequest>& request) {
  AMPD_RETURN_IF_ERROR(EnsureGroup());
  const dist::DistributedSpec& spec = config_.get().distributed;
  const int64_t sequence = request->sequence;
  const auto micro_batches = static_cast<int64_t>(request->input.micro_batches.size());
  const LossFn loss_fn = request->input.loss_fn;
  const std::optional<float> learning_rate = request->input.learning_rate;
  // The share's one check against the model: the ranks agree on it below.
  const absl::StatusOr<FittedStepInput> fitted = trainer_->CheckInput(request);
  const int64_t header[kHeaderSize] = {sequence,
                                       micro_batches,
                                       fitted.ok() ? 1 : 0,
                                       LossKindWord(loss_fn),
                                       LossParamsWord(loss_fn),
                                       LearningRateWord(learning_rate)};
  const Clock::time_point wait_start = Clock::now();
  absl::StatusOr<std::vector<int64_t>> all = group_->AllGather(header);
  const double wait_seconds = std::chrono::duration<double>(Clock::now() - wait_start).count();
  if (!all.ok()) {
    DropGroup();
    return PeerUnavailable(
        absl::StrCat("the ranks did not all come to this step: ", all.status().message()));
  }
  if (!fitted.ok()) return fitted.status();
  AMPD_ASSIGN_OR_RETURN(const int64_t global_micro_batches,
                        AgreedMicroBatches(*all, sequence, spec));
  // Every rank holds the same state, so every rank decides alike.
  AMPD_ASSIGN_OR_RETURN(std::optional<StepReport> recorded, CheckSequence(sequence));
  if (recorded.has_value()) return *std::move(recorded);
  DataParallelStep data_parallel;
  data_parallel.global_micro_batches = global_micro_batches;
  data_parallel.all_reduce = all_reduce_.get();
  data_parallel.wait_seconds = wait_seconds;
  return RunStep(sequence, *fitted, &data_parallel);
}

}  // namespace ampd::engine
