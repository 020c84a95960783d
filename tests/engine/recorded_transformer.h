// A TransformerModel built on a RecordingBackend over the CPU oracle, for
// the tests that judge which ops and operands a model's passes ask for
// (scratch_extents_test, lm_head_grad_test): the model, its recorder, a
// one-element loss and a batch of tokens loaded into its workspace.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "recording_backend.h"
#include "server/engine/model/network.h"
#include "server/engine/model/transformer/transformer_model.h"

namespace ampd::engine::testing {

class RecordedTransformer {
 public:
  RecordedTransformer(const model::ModelSpec& spec, model::Precision precision, uint64_t seed,
                      int64_t lm_head_chunk_bytes) {
    auto cpu = kernels::CreateBackend("cpu");
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
    recording_ = std::make_unique<RecordingBackend>(*cpu_);
    auto net =
        model::TransformerModel::Create(spec, precision, seed, *recording_, lm_head_chunk_bytes);
    EXPECT_TRUE(net.ok()) << net.status();
    net_ = *std::move(net);
    auto loss = recording_->Allocate(kernels::DType::kF32, {1, 1});
    EXPECT_TRUE(loss.ok());
    loss_ = *std::move(loss);
  }

  RecordingBackend& recording() { return *recording_; }
  model::Network& net() { return *net_; }
  kernels::Tensor& loss() { return loss_; }

  // A (B, T) batch of tokens drawn from `seed` over the head's vocabulary,
  // every `ignore_every`-th target ignored, loaded into the (B, T) workspace.
  absl::StatusOr<model::Workspace*> LoadTokens(int64_t batch, int64_t seq, uint64_t seed,
                                               int64_t ignore_every) {
    const auto vocab = static_cast<int32_t>(net_->LmHead()->value().dim(0));
    std::vector<int32_t> ids, targets;
    DataRng rng(seed);
    for (int64_t i = 0; i < batch * seq; ++i) {
      ids.push_back(rng.Index(vocab));
      targets.push_back(i % ignore_every == ignore_every - 1 ? -100 : rng.Index(vocab));
    }
    absl::StatusOr<model::Workspace*> ws = net_->GetWorkspace({batch, seq});
    if (!ws.ok()) return ws.status();
    absl::Status status = net_->LoadBatch(I32({batch, seq}, ids), I32({batch, seq}, targets), **ws);
    if (!status.ok()) return status;
    return ws;
  }

 private:
  std::unique_ptr<kernels::Backend> cpu_;
  std::unique_ptr<RecordingBackend> recording_;
  std::unique_ptr<model::Network> net_;
  kernels::Tensor loss_;
};

}  // namespace ampd::engine::testing
