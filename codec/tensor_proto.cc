// Tensor wire encoding shared by ampctl and the server (tensor_proto.h).
#include "codec/tensor_proto.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"

namespace ampd::codec {

namespace {

// dtype and shape of `proto`, checked against its byte length; the data is
// left to the caller.
absl::StatusOr<HostTensor> CheckedHeader(const v1::Tensor& proto, absl::string_view field) {
  HostTensor t;
  switch (proto.dtype()) {
    case v1::DTYPE_F32:
      t.dtype = DType::kF32;
      break;
    case v1::DTYPE_F16:
      t.dtype = DType::kF16;
      break;
    case v1::DTYPE_BF16:
      t.dtype = DType::kBF16;
      break;
    case v1::DTYPE_I32:
      t.dtype = DType::kI32;
      break;
    case v1::DTYPE_I64:
      t.dtype = DType::kI64;
      break;
    default:
      return FieldError(absl::StrCat(field, ".dtype"),
                        absl::StrCat("unset or unknown dtype ", proto.dtype()));
  }
  t.shape.assign(proto.shape().begin(), proto.shape().end());
  // Check each dim before their product: a hostile shape must not overflow.
  int64_t elements = 1;
  for (int i = 0; i < proto.shape_size(); ++i) {
    const int64_t d = proto.shape(i);
    if (d < 0 || (d > 0 && elements > (int64_t{1} << 40) / d)) {
      return FieldError(absl::StrCat(field, ".shape"),
                        absl::StrCat("dim ", i, " = ", d, " is negative or too large"));
    }
    elements *= d;
  }
  const int64_t want = elements * static_cast<int64_t>(SizeOf(t.dtype));
  if (static_cast<int64_t>(proto.data().size()) != want) {
    return FieldError(
        absl::StrCat(field, ".data"),
        absl::StrCat("has ", proto.data().size(), " bytes, shape ", ShapeToString(t.shape), " of ",
                     DTypeName(t.dtype), " needs ", want));
  }
  return t;
}

}  // namespace

absl::StatusOr<HostTensor> TensorFromProto(const v1::Tensor& proto, absl::string_view field) {
  absl::StatusOr<HostTensor> t = CheckedHeader(proto, field);
  if (t.ok()) t->data = proto.data();
  return t;
}

absl::StatusOr<HostTensor> TakeTensorFromProto(v1::Tensor* proto, absl::string_view field) {
  absl::StatusOr<HostTensor> t = CheckedHeader(*proto, field);
  if (t.ok()) t->data = std::move(*proto->mutable_data());
  return t;
}

v1::Tensor TensorToProto(const HostTensor& tensor) {
  v1::Tensor proto;
  switch (tensor.dtype) {
    case DType::kF32:
      proto.set_dtype(v1::DTYPE_F32);
      break;
    case DType::kF16:
      proto.set_dtype(v1::DTYPE_F16);
      break;
    case DType::kBF16:
      proto.set_dtype(v1::DTYPE_BF16);
      break;
    case DType::kI32:
      proto.set_dtype(v1::DTYPE_I32);
      break;
    case DType::kI64:
      proto.set_dtype(v1::DTYPE_I64);
      break;
    case DType::kU8:
    case DType::kBool:
      // The wire has no such dtype: left unset, which a server refuses
      // naming the field.
      break;
  }
  for (int64_t d : tensor.shape) proto.add_shape(d);
  proto.set_data(tensor.data);
  return proto;
}

}  // namespace ampd::codec
