// TransformerModel's state-dict names beside Hugging Face's: what a
// family's model.safetensors (or an older PyTorch export of it) may carry
// that this model's own names do not (its family's buffers, GPT-2's names
// without "transformer."), rewritten or dropped before the Trainer checks
// the state against its parameters; and a LoRA job's PEFT adapter config.
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine::model {

absl::StatusOr<std::vector<std::string>> TransformerModel::CanonicalNames(
    const codec::StateDict& state) const {
  const TransformerNames& n = parts_.names;
  const std::string lm_head_name = n.lm_head + ".weight";
  const std::string embed_name = n.embed + ".weight";
  std::set<std::string, std::less<>> own;
  if (!n.optional_prefix.empty()) {
    for (const Parameter& p : params()) own.insert(p.name);
  }
  std::vector<std::string> names;
  names.reserve(state.tensors.size());
  const codec::HostTensor* embed = nullptr;
  const codec::HostTensor* lm_head = nullptr;
  for (const codec::NamedTensor& t : state.tensors) {
    std::string name = t.name;
    if (parts_.ignored != nullptr && parts_.ignored(name)) {
      name.clear();
    } else if (name == lm_head_name && parts_.tied_head) {
      lm_head = &t.tensor;  // checked against the embedding below, then dropped
      name.clear();
    } else if (!n.optional_prefix.empty() && !absl::StartsWith(name, n.optional_prefix) &&
               own.contains(absl::StrCat(n.optional_prefix, name))) {
      name = absl::StrCat(n.optional_prefix, name);
    }
    if (name == embed_name) embed = &t.tensor;
    names.push_back(std::move(name));
  }
  // A tied model has one matrix for both; a head that differs from the
  // embedding belongs to another model, and loading half of it would be
  // wrong. A shard that holds the head without the embedding is checked by
  // the shard that holds both, or not at all.
  if (lm_head != nullptr && embed != nullptr &&
      (embed->dtype != lm_head->dtype || embed->shape != lm_head->shape ||
       embed->data != lm_head->data)) {
    return absl::InvalidArgumentError(absl::StrCat(
        lm_head_name, ": differs from ", embed_name, ", and this model ties them (", n.tie_field,
        "); create the job with ", n.tie_field, " false to load a separate head"));
  }
  return names;
}

void TransformerModel::AnnotateExport(codec::StateDict& state) const {
  state.metadata["format"] = "pt";
}

std::vector<Network::AdapterRef> TransformerModel::Adapters() const {
  std::vector<AdapterRef> adapters;
  for (const BlockParams& p : blocks_) {
    const int weights[kModules] = {p.q_weight, p.k_weight, p.v_weight, p.o_weight,
                                   p.gate,     p.up,       p.down};
    for (int module = 0; module < kModules; ++module) {
      const Adapter& adapter = p.lora[static_cast<size_t>(module)];
      if (adapter.present()) adapters.push_back({weights[module], adapter.a, adapter.b});
    }
  }
  return adapters;
}

std::string TransformerModel::AdapterConfigJson() const {
  if (!lora()) return "";
  const LoraSpec& spec = *parts_.lora;
  // The module names are kLoraModules' (validated): no escaping needed.
  std::vector<std::string> quoted;
  for (const std::string& m : spec.target_modules) quoted.push_back(absl::StrCat("\"", m, "\""));
  return absl::StrCat(
      "{\"peft_type\": \"LORA\", \"task_type\": \"CAUSAL_LM\", \"r\": ", spec.rank,
      ", \"lora_alpha\": ", spec.alpha, ", \"target_modules\": [", absl::StrJoin(quoted, ", "),
      "], \"lora_dropout\": 0.0, \"bias\": \"none\", \"fan_in_fan_out\": false, "
      "\"use_rslora\": false, \"init_lora_weights\": true, \"inference_mode\": true, "
      "\"base_model_name_or_path\": null}");
}

}  // namespace ampd::engine::model
