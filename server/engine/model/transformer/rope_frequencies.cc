// RopeInverseFrequencies: transformers' _compute_default_rope_parameters,
// _compute_linear_scaling_rope_parameters and _compute_llama3_parameters
// (modeling_rope_utils.py), step by step in fp32 as torch evaluates them on
// float32 tensors with Python-float scalars (a scalar takes the tensor's
// dtype), so the frequencies match to the last bit or nearly.
#include "server/engine/model/transformer/rope_frequencies.h"

#include <cmath>
#include <cstdint>

namespace ampd::engine::model {
namespace {

// Llama 3.1's scaling of one default frequency. torch evaluates
// `scalar / tensor` as reciprocal(tensor) * scalar, and Python-float
// arithmetic (the wavelength bounds, high - low) in double.
float Llama3Frequency(float inv_freq, const RopeScaling& r) {
  const double old_context = static_cast<double>(r.original_max_position_embeddings);
  const double low = r.low_freq_factor;
  const double high = r.high_freq_factor;
  const auto low_freq_wavelen = static_cast<float>(old_context / low);
  const auto high_freq_wavelen = static_cast<float>(old_context / high);
  const float wavelen = (1.0f / inv_freq) * static_cast<float>(2.0 * M_PI);
  // Long wavelengths (low frequencies) are divided by factor.
  const float scaled = wavelen > low_freq_wavelen ? inv_freq / r.factor : inv_freq;
  const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
  if (!medium) return scaled;
  const float smooth =
      ((1.0f / wavelen) * static_cast<float>(old_context) - static_cast<float>(low)) /
      static_cast<float>(high - low);
  return (1.0f - smooth) * scaled / r.factor + smooth * scaled;
}

}  // namespace

std::vector<float> RopeInverseFrequencies(const DecoderSpec& d) {
  const int64_t dim = DecoderHeadDim(d);
  const float base = d.rope_theta;
  std::vector<float> inv_freq;
  inv_freq.reserve(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim; i += 2) {
    // 1 / (base ** (arange(0, D, 2).float() / D)).
    const float exponent = static_cast<float>(i) / static_cast<float>(dim);
    float f = 1.0f / std::pow(base, exponent);
    switch (d.rope_scaling.type) {
      case RopeType::kDefault:
        break;
      case RopeType::kLinear:
        f = f / d.rope_scaling.factor;
        break;
      case RopeType::kLlama3:
        f = Llama3Frequency(f, d.rope_scaling);
        break;
    }
    inv_freq.push_back(f);
  }
  return inv_freq;
}

}  // namespace ampd::engine::model
