// TransformerPartsOf: a transformer spec's family, by the spec's kind.
#include "common/overloaded.h"
#include "server/engine/model/transformer/parts.h"

namespace ampd::engine::model {

std::optional<TransformerParts> TransformerPartsOf(const ModelSpec& spec) {
  return std::visit(
      Overloaded{
          [](const LayerStack&) -> std::optional<TransformerParts> { return std::nullopt; },
          [](const GptSpec& g) -> std::optional<TransformerParts> { return Gpt2Parts(g); },
          [](const DecoderSpec& d) -> std::optional<TransformerParts> { return DecoderParts(d); }},
      spec.kind);
}

}  // namespace ampd::engine::model
