// GptModel's state-dict names beside Hugging Face's: what a GPT-2
// model.safetensors (or an older PyTorch export of it) may carry that this
// model's own names do not, rewritten or dropped before the Trainer checks
// the state against its parameters.
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/engine/model/gpt/gpt_model.h"

namespace ampd::engine::model {

namespace {

constexpr absl::string_view kPrefix = "transformer.";
constexpr absl::string_view kLmHead = "lm_head.weight";
constexpr absl::string_view kWte = "transformer.wte.weight";

// transformer.h.{i}.attn.bias / .attn.masked_bias: the causal mask buffers
// older GPT-2 checkpoints carry, in whatever dtype they were saved (F32,
// or U8 / BOOL in some transformers versions); the mask is not a parameter
// here.
bool IsMaskBuffer(absl::string_view name) {
  if (absl::StartsWith(name, kPrefix)) name.remove_prefix(kPrefix.size());
  return absl::StartsWith(name, "h.") &&
         (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias"));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> GptModel::CanonicalNames(
    const codec::StateDict& state) const {
  std::set<std::string, std::less<>> own;
  for (const Parameter& p : params()) own.insert(p.name);
  std::vector<std::string> names;
  names.reserve(state.tensors.size());
  const codec::HostTensor* wte = nullptr;
  const codec::HostTensor* lm_head = nullptr;
  for (const codec::NamedTensor& t : state.tensors) {
    std::string name = t.name;
    if (IsMaskBuffer(name)) {
      name.clear();
    } else if (name == kLmHead && gpt().tie_embeddings) {
      lm_head = &t.tensor;  // checked against wte below, then dropped
      name.clear();
    } else if (!absl::StartsWith(name, kPrefix) && own.contains(absl::StrCat(kPrefix, name))) {
      name = absl::StrCat(kPrefix, name);
    }
    if (name == kWte) wte = &t.tensor;
    names.push_back(std::move(name));
  }
  if (lm_head != nullptr) {
    // A tied model has one matrix for both; a file whose head differs from
    // its embedding is another model, and loading half of it would be wrong.
    if (wte == nullptr || wte->dtype != lm_head->dtype || wte->shape != lm_head->shape ||
        wte->data != lm_head->data) {
      return absl::InvalidArgumentError(
          absl::StrCat(kLmHead, ": differs from ", kWte,
                       ", and this model ties them (tie_embeddings); create the job with "
                       "tie_embeddings false to load a separate head"));
    }
  }
  return names;
}

void GptModel::AnnotateExport(codec::StateDict& state) const { state.metadata["format"] = "pt"; }

}  // namespace ampd::engine::model
