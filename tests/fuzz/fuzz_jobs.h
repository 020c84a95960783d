// The small fixed jobs the fuzz targets aim hostile bytes at: an MLP with
// an MSE loss (fp16, pytorch scaler), an Embedding model with cross-entropy
// (bf16, deepspeed scaler) and a tiny GPT (fp16) whose steps may carry token
// losses, all on the CPU backend, and the well-formed requests and state
// dicts the seed corpus starts from.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ampd/v1/trainer.pb.h"
#include "server/engine/config/job_config.h"
#include "server/engine/trainer/trainer.h"

namespace ampd::fuzz {

// The job a StepRequest's job_id names: "ce" is the Embedding model, "gpt"
// the GPT, any other id the MLP.
enum class FuzzJob { kMlp, kEmbedding, kGpt };
FuzzJob JobFor(const std::string& job_id);

// The job's config as CreateJob would carry it.
v1::CreateJobRequest CreateRequestFor(FuzzJob job);

// A trainer for the job, built once per process: the targets share it
// across inputs, so a step or a load that corrupts it shows up in later
// inputs as a crash or a failed invariant. Aborts when it cannot be built
// (the fuzz binary is then broken, not the input).
engine::Trainer& TrainerFor(FuzzJob job);

// A well-formed step for the job: `rows` rows (the GPT: `rows` sequences
// of 4 tokens), finite values.
v1::StepRequest StepRequestFor(FuzzJob job, int rows);

// A well-formed GPT step on a token loss: `loss_fn` with the per-token
// inputs it reads.
v1::StepRequest TokenLossStepFor(v1::LossFn loss_fn, int rows);

// The peer target's input (peer_fuzz.cc): one byte, then a serialized
// ampd.v1.Peer request. The byte's low two bits pick the method (0 Join,
// 1 Set, 2 Get, 3 Join), bit 2 signs the request with the key of
// kPeerSecret (the only group the target's meeting point hosts is
// kPeerGroup), so fuzzed requests reach the table as well as the refusals.
inline constexpr char kPeerGroup[] = "fuzz-group";
inline constexpr char kPeerSecret[] = "fuzz-secret-0123456789abcdef";
inline constexpr uint8_t kPeerJoin = 0;
inline constexpr uint8_t kPeerSet = 1;
inline constexpr uint8_t kPeerGet = 2;
inline constexpr uint8_t kPeerSigned = 4;

// Aborts with `what` when `ok` is false: a broken invariant is a finding.
void Check(bool ok, const char* what);

}  // namespace ampd::fuzz
