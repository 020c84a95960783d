// RoPE's inverse frequencies (rope_frequencies.h): Llama 3.1's scaled
// frequencies equal transformers' to the bit, and each rope type keeps to
// its definition (linear divides every default frequency; llama3 keeps the
// high ones, divides the low ones and blends the band between).
#include "server/engine/model/transformer/rope_frequencies.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace ampd::engine::model {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

DecoderSpec Llama31(RopeType type) {
  DecoderSpec d;
  d.hidden_size = 4096;
  d.num_attention_heads = 32;  // head_dim 128
  d.rope_theta = 500000.0f;
  d.rope_scaling = {type, 8.0f, 1.0f, 4.0f, 8192};
  return d;
}

// Llama 3.1's config.json rope (theta 500000, head_dim 128, llama3 with
// factor 8, low 1, high 4, original 8192), as transformers 5.24.0's
// _compute_llama3_parameters returns it (float.hex of each element).
constexpr float kLlama31InvFreq[64] = {
    0x1.000000p+0f,  0x1.a11582p-1f,  0x1.53c38cp-1f,  0x1.14c708p-1f,  0x1.c2ef78p-2f,
    0x1.6f56fap-2f,  0x1.2b3dc6p-2f,  0x1.e788c2p-3f,  0x1.8d2760p-3f,  0x1.438740p-3f,
    0x1.078d40p-3f,  0x1.ad6338p-4f,  0x1.5dc95ap-4f,  0x1.1cf130p-4f,  0x1.d03ccep-5f,
    0x1.7a2d08p-5f,  0x1.341190p-5f,  0x1.f5ea7ep-6f,  0x1.98de92p-6f,  0x1.4d1272p-6f,
    0x1.0f5386p-6f,  0x1.ba0dd8p-7f,  0x1.681adap-7f,  0x1.2558fep-7f,  0x1.ddee9ep-8f,
    0x1.8554ecp-8f,  0x1.3d2804p-8f,  0x1.025c6ap-8f,  0x1.a4ee40p-9f,  0x1.1bfa0cp-9f,
    0x1.67a23ap-10f, 0x1.c12f3cp-11f, 0x1.132ba4p-11f, 0x1.47e210p-12f, 0x1.765ba4p-13f,
    0x1.90d10cp-14f, 0x1.46831ap-14f, 0x1.09fb7ep-14f, 0x1.b15902p-15f, 0x1.610332p-15f,
    0x1.1f91f0p-15f, 0x1.d484dep-16f, 0x1.7da9e8p-16f, 0x1.36e8eap-16f, 0x1.fa8b86p-17f,
    0x1.9ca3eap-17f, 0x1.5024d6p-17f, 0x1.11d41ep-17f, 0x1.be2188p-18f, 0x1.6b6d0ep-18f,
    0x1.280d96p-18f, 0x1.e25700p-19f, 0x1.88ec20p-19f, 0x1.4014d2p-19f, 0x1.04be68p-19f,
    0x1.a8d010p-20f, 0x1.5a0f4ep-20f, 0x1.19e800p-20f, 0x1.cb4a9ap-21f, 0x1.76258ep-21f,
    0x1.30c94ep-21f, 0x1.f09184p-22f, 0x1.948360p-22f, 0x1.4985fep-22f,
};

TEST(RopeFrequencies, Llama31EqualsTransformersBitForBit) {
  const std::vector<float> f = RopeInverseFrequencies(Llama31(RopeType::kLlama3));
  ASSERT_EQ(f.size(), 64u);
  for (size_t i = 0; i < f.size(); ++i) {
    EXPECT_EQ(Bits(f[i]), Bits(kLlama31InvFreq[i]))
        << i << ": " << f[i] << " vs " << kLlama31InvFreq[i];
  }
}

TEST(RopeFrequencies, EachTypeKeepsToItsDefinition) {
  const std::vector<float> plain = RopeInverseFrequencies(Llama31(RopeType::kDefault));
  const std::vector<float> linear = RopeInverseFrequencies(Llama31(RopeType::kLinear));
  const std::vector<float> llama3 = RopeInverseFrequencies(Llama31(RopeType::kLlama3));
  ASSERT_EQ(plain.size(), 64u);
  EXPECT_EQ(plain[0], 1.0f);
  int high = 0, low = 0, medium = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(linear[i], plain[i] / 8.0f) << i;
    const double wavelen = 2.0 * M_PI / plain[i];
    if (wavelen < 8192.0 / 4.0) {
      EXPECT_EQ(llama3[i], plain[i]) << i;  // high frequencies kept
      ++high;
    } else if (wavelen > 8192.0 / 1.0) {
      EXPECT_EQ(llama3[i], plain[i] / 8.0f) << i;  // low ones divided
      ++low;
    } else {
      EXPECT_LT(llama3[i], plain[i]) << i;  // a blend of the two
      EXPECT_GT(llama3[i], plain[i] / 8.0f) << i;
      ++medium;
    }
  }
  // All three bands occur at these sizes, so the checks above each count.
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
}

}  // namespace
}  // namespace ampd::engine::model
