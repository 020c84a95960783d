// nanoGPT's train.py get_lr, transcribed line for line (Python floats are
// doubles), the reference the learning-rate schedule tests compare with:
// learning_rate, warmup_iters, lr_decay_iters, min_lr as nanoGPT names them.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <numbers>

namespace ampd::test_support {

inline double NanoGptGetLr(int64_t it, double learning_rate, int64_t warmup_iters,
                           int64_t lr_decay_iters, double min_lr) {
  // 1) linear warmup for warmup_iters steps
  if (it < warmup_iters) {
    return learning_rate * static_cast<double>(it + 1) / static_cast<double>(warmup_iters + 1);
  }
  // 2) if it > lr_decay_iters, return min learning rate
  if (it > lr_decay_iters) return min_lr;
  // 3) in between, use cosine decay down to min learning rate
  const double decay_ratio =
      static_cast<double>(it - warmup_iters) / static_cast<double>(lr_decay_iters - warmup_iters);
  EXPECT_TRUE(0 <= decay_ratio && decay_ratio <= 1);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * decay_ratio));  // 0..1
  return min_lr + coeff * (learning_rate - min_lr);
}

}  // namespace ampd::test_support
