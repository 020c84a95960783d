// libFuzzer target: LoadStateDict from the wire into a live job. The bytes
// are a safetensors file; what decodes is loaded into one of two fixed jobs
// (the one whose tensor names it carries), which exercises the tensor
// checks and the scaler-state loader (every "scaler.*" metadata value). A
// load is all or nothing: refused, the job's exported state is unchanged;
// accepted, the job exports exactly the tensors loaded, and its loss scale
// is finite and positive.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "codec/safetensors.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {

using ampd::codec::StateDict;

bool SameTensors(const StateDict& a, const StateDict& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].name != b.tensors[i].name ||
        a.tensors[i].tensor.data != b.tensors[i].tensor.data) {
      return false;
    }
  }
  return true;
}

// Every tensor the job exports carries the bytes `loaded` gave it.
bool HoldsWhatWasLoaded(const StateDict& exported, const StateDict& loaded) {
  for (const auto& t : exported.tensors) {
    const ampd::codec::HostTensor* source = loaded.Find(t.name);
    if (source == nullptr || source->data != t.tensor.data) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<StateDict> state =
      ampd::codec::DecodeSafetensors(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!state.ok()) return 0;
  // The Embedding job's second layer is a Linear; the MLP's is a GELU.
  const bool embedding = state->Find("model.1.weight") != nullptr;
  ampd::engine::Trainer& trainer = ampd::fuzz::TrainerFor(
      embedding ? ampd::fuzz::FuzzJob::kEmbedding : ampd::fuzz::FuzzJob::kMlp);
  absl::StatusOr<StateDict> before = trainer.ExportState();
  ampd::fuzz::Check(before.ok(), "the job exports its state");
  const absl::Status loaded = trainer.LoadState(*state);
  absl::StatusOr<StateDict> after = trainer.ExportState();
  ampd::fuzz::Check(after.ok(), "the job exports its state after a load");
  if (!loaded.ok()) {
    ampd::fuzz::Check(SameTensors(*before, *after) && before->metadata == after->metadata,
                      "a refused load changes nothing");
    return 0;
  }
  ampd::fuzz::Check(std::isfinite(trainer.scaler().scale) && trainer.scaler().scale > 0.0f,
                    "a loaded loss scale is finite and positive");
  ampd::fuzz::Check(HoldsWhatWasLoaded(*after, *state), "the job holds what was loaded");
  return 0;
}
