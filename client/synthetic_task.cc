// SyntheticTask: the teacher MLP and its batches.
#include "client/synthetic_task.h"

#include <cmath>
#include <cstring>

namespace ampd {

SyntheticTask::SyntheticTask(const SyntheticTaskOptions& options)
    : options_(options), rng_(options.seed ^ 0x5eed'7eac'4e55ULL) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Teacher weights ~ N(0, 1/fan_in) keep its hidden units in tanh's range.
  const float s1 = 1.0f / std::sqrt(static_cast<float>(options_.in_features));
  const float s2 = 1.0f / std::sqrt(static_cast<float>(options_.hidden));
  w1_.resize(static_cast<size_t>(options_.hidden * options_.in_features));
  for (float& w : w1_) w = normal(rng_) * s1;
  w2_.resize(static_cast<size_t>(options_.out_features * options_.hidden));
  for (float& w : w2_) w = normal(rng_) * s2;
}

v1::ModelSpec SyntheticTask::Model() const {
  v1::ModelSpec model;
  v1::Linear* l1 = model.add_layers()->mutable_linear();
  l1->set_in_features(options_.in_features);
  l1->set_out_features(options_.hidden);
  model.add_layers()->mutable_gelu();
  v1::Linear* l2 = model.add_layers()->mutable_linear();
  l2->set_in_features(options_.hidden);
  l2->set_out_features(options_.out_features);
  model.set_loss(v1::LOSS_MSE);
  return model;
}

v1::MicroBatch SyntheticTask::NextBatch() {
  const int64_t n = options_.batch_size;
  const int64_t in = options_.in_features;
  const int64_t hidden = options_.hidden;
  const int64_t out = options_.out_features;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * in));
  for (float& v : x) v = normal(rng_);
  std::vector<float> y(static_cast<size_t>(n * out), 0.0f);
  std::vector<float> h(static_cast<size_t>(hidden));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < hidden; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < in; ++k) acc += w1_[j * in + k] * x[r * in + k];
      h[j] = std::tanh(acc);
    }
    for (int64_t o = 0; o < out; ++o) {
      float acc = 0;
      for (int64_t j = 0; j < hidden; ++j) acc += w2_[o * hidden + j] * h[j];
      y[r * out + o] = options_.target_scale * acc;
    }
  }
  v1::MicroBatch batch;
  v1::Tensor* inputs = batch.mutable_inputs();
  inputs->set_dtype(v1::DTYPE_F32);
  inputs->add_shape(n);
  inputs->add_shape(in);
  inputs->set_data(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  v1::Tensor* targets = batch.mutable_targets();
  targets->set_dtype(v1::DTYPE_F32);
  targets->add_shape(n);
  targets->add_shape(out);
  targets->set_data(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(float));
  return batch;
}

}  // namespace ampd
