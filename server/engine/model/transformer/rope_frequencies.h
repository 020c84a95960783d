// RoPE's inverse frequencies of a decoder, computed once on the host (the
// CPU and CUDA backends both read the uploaded vector, so no kernel knows
// about scaling).
#pragma once

#include <vector>

#include "server/engine/config/model_spec.h"

namespace ampd::engine::model {

// inv_freq (D/2) for head width D = DecoderHeadDim(d), as Hugging Face's
// ROPE_INIT_FUNCTIONS compute it in fp32: the default 1 / rope_theta^(2i /
// D), then d.rope_scaling's "linear" (/ factor) or "llama3" (Llama 3.1's
// wavelength-dependent blend) scaling. The spec must be valid.
std::vector<float> RopeInverseFrequencies(const DecoderSpec& d);

}  // namespace ampd::engine::model
