// TransformerModel's state-dict names beside Hugging Face's: what a Llama or
// Qwen2 model.safetensors may carry that this model's own names do not,
// dropped before the Trainer checks the state against its parameters.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine::model {

namespace {

constexpr absl::string_view kLmHead = "lm_head.weight";
constexpr absl::string_view kEmbed = "model.embed_tokens.weight";

// model.layers.{i}.self_attn.rotary_emb.inv_freq: a buffer older Llama
// checkpoints saved; the frequencies come from rope_theta here.
bool IsRotaryBuffer(absl::string_view name) {
  return absl::StartsWith(name, "model.layers.") &&
         absl::EndsWith(name, ".self_attn.rotary_emb.inv_freq");
}

}  // namespace

absl::StatusOr<std::vector<std::string>> TransformerModel::CanonicalNames(
    const codec::StateDict& state) const {
  std::vector<std::string> names;
  names.reserve(state.tensors.size());
  const codec::HostTensor* embed = nullptr;
  const codec::HostTensor* lm_head = nullptr;
  for (const codec::NamedTensor& t : state.tensors) {
    std::string name = t.name;
    if (IsRotaryBuffer(name)) {
      name.clear();
    } else if (name == kLmHead && decoder().tie_word_embeddings) {
      lm_head = &t.tensor;  // checked against the embedding below, then dropped
      name.clear();
    }
    if (name == kEmbed) embed = &t.tensor;
    names.push_back(std::move(name));
  }
  // A tied model has one matrix for both; a head that differs from the
  // embedding belongs to another model. A shard that holds the head without
  // the embedding is checked by the shard that holds both, or not at all.
  if (lm_head != nullptr && embed != nullptr &&
      (embed->dtype != lm_head->dtype || embed->shape != lm_head->shape ||
       embed->data != lm_head->data)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kLmHead, ": differs from ", kEmbed,
                     ", and this model ties them (tie_word_embeddings); create the job with "
                     "tie_word_embeddings false to load a separate head"));
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
  const LoraSpec& spec = *decoder().lora;
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
