// The tensor wire encoding ampctl and the server share: every dtype survives
// a round trip bit for bit, and each malformed tensor is refused with
// INVALID_ARGUMENT naming the field it came in (dtype, shape or data), the
// shape checked dim by dim before anything is multiplied or allocated.
#include "codec/tensor_proto.h"

#include <cstdint>
#include <string>

#include "common/error_reason.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ampd::codec {
namespace {

using ::testing::HasSubstr;

TEST(TensorProtoTest, EveryDtypeRoundTrips) {
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kI32, DType::kI64}) {
    SCOPED_TRACE(DTypeName(dtype));
    HostTensor t;
    t.dtype = dtype;
    t.shape = {2, 3};
    for (size_t i = 0; i < 6 * SizeOf(dtype); ++i) t.data.push_back(static_cast<char>(i * 37 + 1));
    const v1::Tensor proto = TensorToProto(t);
    absl::StatusOr<HostTensor> back = TensorFromProto(proto, "inputs");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype, t.dtype);
    EXPECT_EQ(back->shape, t.shape);
    EXPECT_EQ(back->data, t.data);
  }
}

// TakeTensorFromProto: the same tensor, its bytes moved out of the message
// (left empty); a malformed tensor's error leaves the message as it was.
TEST(TensorProtoTest, TakeMovesTheBytesAndLeavesARefusedMessageAlone) {
  HostTensor t;
  t.dtype = DType::kF32;
  t.shape = {4, 1024};
  t.data.assign(4 * 1024 * 4, 'z');
  v1::Tensor proto = TensorToProto(t);
  const void* bytes = proto.data().data();
  absl::StatusOr<HostTensor> taken = TakeTensorFromProto(&proto, "inputs");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->shape, t.shape);
  EXPECT_EQ(taken->data, t.data);
  EXPECT_EQ(static_cast<const void*>(taken->data.data()), bytes) << "copied, not moved";
  EXPECT_TRUE(proto.data().empty());

  v1::Tensor short_data = TensorToProto(t);
  short_data.mutable_data()->pop_back();
  const std::string before = short_data.SerializeAsString();
  absl::StatusOr<HostTensor> refused = TakeTensorFromProto(&short_data, "inputs");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_data.SerializeAsString(), before);
}

// The status a malformed tensor decodes to, with its INVALID_FIELD field.
void ExpectFieldError(const v1::Tensor& proto, const std::string& field, const std::string& what) {
  absl::StatusOr<HostTensor> t = TensorFromProto(proto, "micro_batches[0].inputs");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(field + ": " + what));
  const std::optional<ErrorReason> reason = GetErrorReason(t.status());
  ASSERT_TRUE(reason.has_value());
  EXPECT_EQ(reason->reason, reason::kInvalidField);
  EXPECT_EQ(reason->metadata.at("field"), field);
}

TEST(TensorProtoTest, MalformedTensorsNameTheirField) {
  v1::Tensor unset;
  ExpectFieldError(unset, "micro_batches[0].inputs.dtype", "unset or unknown dtype 0");

  v1::Tensor negative;
  negative.set_dtype(v1::DTYPE_F32);
  negative.add_shape(2);
  negative.add_shape(-1);
  ExpectFieldError(negative, "micro_batches[0].inputs.shape",
                   "dim 1 = -1 is negative or too large");

  // 2^31 * 2^31 elements: the product would wrap int64 at 4 bytes each; the
  // check refuses the second dim before multiplying.
  v1::Tensor huge;
  huge.set_dtype(v1::DTYPE_F32);
  huge.add_shape(int64_t{1} << 31);
  huge.add_shape(int64_t{1} << 31);
  ExpectFieldError(huge, "micro_batches[0].inputs.shape", "dim 1 = 2147483648");

  v1::Tensor short_data;
  short_data.set_dtype(v1::DTYPE_BF16);
  short_data.add_shape(3);
  short_data.set_data(std::string(5, '\0'));
  ExpectFieldError(short_data, "micro_batches[0].inputs.data",
                   "has 5 bytes, shape (3) of BF16 needs 6");
}

}  // namespace
}  // namespace ampd::codec
