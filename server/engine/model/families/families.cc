// TransformerPartsOf: a transformer spec's family, by the spec's kind.
#include "server/engine/model/transformer/parts.h"

namespace ampd::engine::model {

std::optional<TransformerParts> TransformerPartsOf(const ModelSpec& spec) {
  if (spec.gpt.has_value()) return Gpt2Parts(*spec.gpt);
  if (spec.decoder.has_value()) return DecoderParts(*spec.decoder);
  return std::nullopt;
}

}  // namespace ampd::engine::model
