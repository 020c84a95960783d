// Tensor::View: a borrowed window onto another tensor's elements, with its
// range checked against the tensor it was cut from.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/tensor.h"

namespace ampd::kernels {
namespace {

TEST(TensorViewTest, WritesThroughToTheBaseTensor) {
  auto backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<Tensor> base = (*backend)->Allocate(DType::kF32, {4, 3});
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE((*backend)->Fill(*base, 1.0f).ok());

  // Rows 1..2 as a (2, 3) tensor.
  absl::StatusOr<Tensor> rows = base->View(3, {2, 3});
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->DebugString(), "F32(2, 3)");
  ASSERT_TRUE((*backend)->Fill(*rows, 5.0f).ok());

  std::vector<float> host(12);
  ASSERT_TRUE((*backend)->CopyToHost(*base, host.data(), host.size() * sizeof(float)).ok());
  const std::vector<float> expected = {1, 1, 1, 5, 5, 5, 5, 5, 5, 1, 1, 1};
  EXPECT_EQ(host, expected);
}

TEST(TensorViewTest, RefusesRangesOutsideTheBase) {
  auto backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<Tensor> base = (*backend)->Allocate(DType::kF16, {4, 3});
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_TRUE(base->View(0, {4, 3}).ok());
  EXPECT_TRUE(base->View(12, {0}).ok());
  EXPECT_EQ(base->View(1, {4, 3}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(base->View(-1, {1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(base->View(13, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor().View(0, {0}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ampd::kernels
