// ampd_bench_engine: median Trainer::Step time and samples/s of the
// reference MLP (4 x Linear(1024, 1024), GELU between, batch 256, MSE,
// AdamW) in fp32, fp16 and bf16, and the fused AdamUpdate's bandwidth over
// the same parameters, on the backend --device names. Prints figures; it
// never passes or fails. --create times Trainer::Create (what CreateJob
// runs: weight initialisation, optimizer state) for a ~100M-parameter MLP
// instead.
//
//   ampd_bench_engine [--device=cpu|cuda|cuda:N] [--steps=N] [--warmup=N] [--create]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend_factory.h"
#include "server/engine/jobs/job_config.h"
#include "server/engine/trainer/trainer.h"

namespace {

using ampd::engine::JobConfig;
using ampd::engine::MicroBatch;
using ampd::engine::StepInput;
using ampd::engine::model::Precision;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWidth = 1024, kBatch = 256, kLayers = 4;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

JobConfig ReferenceConfig(Precision precision) {
  JobConfig config = ampd::engine::DefaultJobConfig(precision);
  for (int64_t i = 0; i < kLayers; ++i) {
    if (i > 0) {
      ampd::engine::model::LayerSpec gelu;
      gelu.kind = ampd::engine::model::LayerKind::kGELU;
      config.model.layers.push_back(gelu);
    }
    ampd::engine::model::LayerSpec linear;
    linear.kind = ampd::engine::model::LayerKind::kLinear;
    linear.in_features = kWidth;
    linear.out_features = kWidth;
    config.model.layers.push_back(linear);
  }
  config.model.loss = ampd::engine::model::LossKind::kMse;
  config.optimizer.adam.lr = 1e-4f;
  return config;
}

ampd::engine::HostTensor RandomF32(int64_t rows, int64_t cols, std::mt19937_64& rng, float amp) {
  ampd::engine::HostTensor t;
  t.dtype = ampd::kernels::DType::kF32;
  t.shape = {rows, cols};
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = amp * (static_cast<float>(rng() >> 40) / 16777216.0f * 2.0f - 1.0f);
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

// Times AdamUpdate alone over tensors shaped like the model's parameters.
int BenchAdam(const std::string& device, Precision precision, int warmup, int steps) {
  namespace k = ampd::kernels;
  auto backend_or = k::CreateBackend(device);
  if (!backend_or.ok())
    return std::fprintf(stderr, "%s\n", backend_or.status().ToString().c_str()), 1;
  k::Backend& b = **backend_or;
  const k::DType wd = ampd::engine::model::WorkingDType(precision);
  std::vector<k::Shape> shapes;
  for (int64_t i = 0; i < kLayers; ++i) {
    shapes.push_back({kWidth, kWidth});
    shapes.push_back({kWidth});
  }
  std::vector<k::Tensor> tensors;
  tensors.reserve(shapes.size() * 5 + 1);
  std::vector<k::ParamRef> refs;
  int64_t params = 0;
  auto alloc = [&](k::DType dt, const k::Shape& s) -> k::Tensor* {
    auto t = b.Allocate(dt, s);
    if (!t.ok() || !b.Fill(*t, 1e-3f).ok()) return nullptr;
    tensors.push_back(*std::move(t));
    return &tensors.back();
  };
  for (const k::Shape& s : shapes) {
    k::ParamRef r{};
    r.master = alloc(k::DType::kF32, s);
    r.working = wd == k::DType::kF32 ? nullptr : alloc(wd, s);
    r.grad = alloc(wd, s);
    r.state0 = alloc(k::DType::kF32, s);
    r.state1 = alloc(k::DType::kF32, s);
    refs.push_back(r);
    params += k::NumElements(s);
  }
  k::Tensor* found_inf = alloc(k::DType::kF32, {1});
  if (found_inf == nullptr || !b.Fill(*found_inf, 0.0f).ok()) return 1;
  k::GradTransform transform;
  transform.inv_scale = 1.0f / 65536.0f;
  transform.found_inf = found_inf;
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = Clock::now();
    if (!b.AdamUpdate(refs, k::AdamConfig{}, s + 1, transform).ok() || !b.Synchronize().ok()) {
      return 1;
    }
    if (s >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // grad read + master/m/v read and written + working copy written.
  const double bytes_per_param =
      static_cast<double>(k::SizeOf(wd)) + 24.0 + (wd == k::DType::kF32 ? 0.0 : k::SizeOf(wd));
  const double t = Median(times);
  std::printf("  fused AdamUpdate: %lld params, %.0f B/param, median %.3f ms, %.2f GB/s\n",
              static_cast<long long>(params), bytes_per_param, t * 1e3,
              bytes_per_param * static_cast<double>(params) / t / 1e9);
  return 0;
}

// Median wall time of Trainer::Create for 8 x Linear(3584, 3584) with bias
// (102.8M parameters), per precision: allocation, initialisation of every
// weight from the seed, the working copy and the optimizer state.
int BenchCreate(const std::string& device, int repeats) {
  constexpr int64_t kBigWidth = 3584, kBigLayers = 8;
  for (Precision precision : {Precision::kFp32, Precision::kFp16}) {
    JobConfig config = ampd::engine::DefaultJobConfig(precision);
    for (int64_t i = 0; i < kBigLayers; ++i) {
      ampd::engine::model::LayerSpec linear;
      linear.kind = ampd::engine::model::LayerKind::kLinear;
      linear.in_features = kBigWidth;
      linear.out_features = kBigWidth;
      config.model.layers.push_back(linear);
    }
    config.model.loss = ampd::engine::model::LossKind::kMse;
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
      auto backend = ampd::kernels::CreateBackend(device);
      if (!backend.ok()) {
        std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
        return 1;
      }
      const auto t0 = Clock::now();
      auto trainer = ampd::engine::Trainer::Create(config, *std::move(backend));
      if (!trainer.ok()) {
        std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
        return 1;
      }
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::printf(
        "%s: Trainer::Create of %lld x Linear(%lld, %lld), %.1fM parameters: median %.3f s\n",
        std::string(ampd::engine::model::PrecisionName(precision)).c_str(),
        static_cast<long long>(kBigLayers), static_cast<long long>(kBigWidth),
        static_cast<long long>(kBigWidth),
        static_cast<double>(kBigLayers * (kBigWidth * kBigWidth + kBigWidth)) / 1e6, Median(times));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cpu";
  int steps = 10, warmup = 3;
  bool create = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--device=", 0) == 0) {
      device = a.substr(9);
    } else if (a.rfind("--steps=", 0) == 0) {
      steps = std::max(1, std::atoi(a.c_str() + 8));
    } else if (a.rfind("--warmup=", 0) == 0) {
      warmup = std::max(0, std::atoi(a.c_str() + 9));
    } else if (a == "--create") {
      create = true;
    } else {
      std::fprintf(stderr, "usage: %s [--device=cpu|cuda:N] [--steps=N] [--warmup=N] [--create]\n",
                   argv[0]);
      return 2;
    }
  }
  if (create) return BenchCreate(device, std::max(1, steps));
  std::printf(
      "reference MLP: %lld x Linear(%lld, %lld), GELU between, batch %lld, MSE, AdamW; "
      "device %s, %d warm-up + %d timed steps\n",
      static_cast<long long>(kLayers), static_cast<long long>(kWidth),
      static_cast<long long>(kWidth), static_cast<long long>(kBatch), device.c_str(), warmup,
      steps);
  std::mt19937_64 rng(1);
  StepInput input;
  input.micro_batches.push_back(
      MicroBatch{RandomF32(kBatch, kWidth, rng, 1.0f), RandomF32(kBatch, kWidth, rng, 0.1f)});
  for (Precision precision : {Precision::kFp32, Precision::kFp16, Precision::kBf16}) {
    auto backend = ampd::kernels::CreateBackend(device);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return 1;
    }
    auto trainer = ampd::engine::Trainer::Create(ReferenceConfig(precision), *std::move(backend));
    if (!trainer.ok()) {
      std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
      return 1;
    }
    std::vector<double> total, fwd, bwd, unscale, opt;
    float last_loss = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      auto r = (*trainer)->Step(input);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      last_loss = r->loss;
      if (s < warmup) continue;
      total.push_back(r->seconds.total);
      fwd.push_back(r->seconds.forward);
      bwd.push_back(r->seconds.backward);
      unscale.push_back(r->seconds.unscale);
      opt.push_back(r->seconds.optimizer);
    }
    const double t = Median(total);
    std::printf(
        "%s: median step %.2f ms, %.1f samples/s (forward %.2f, backward %.2f, "
        "unscale %.2f, optimizer %.2f ms; last loss %.5f)\n",
        std::string(ampd::engine::model::PrecisionName(precision)).c_str(), t * 1e3,
        static_cast<double>(kBatch) / t, Median(fwd) * 1e3, Median(bwd) * 1e3,
        Median(unscale) * 1e3, Median(opt) * 1e3, static_cast<double>(last_loss));
    if (BenchAdam(device, precision, warmup, steps) != 0) return 1;
  }
  return 0;
}
