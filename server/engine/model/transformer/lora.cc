// LoraForward and LoraBackward: GEMMs (lora.h has the
// algebra), their operands' shapes checked first.
#include "server/engine/model/transformer/lora.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

namespace {

using kernels::Shape;
using kernels::ShapeToString;
using kernels::Tensor;

bool Is2D(const Tensor& t) { return t.shape().size() == 2; }

// a (r, in), b (out, r); x (N, in) and y (N, out) when given.
absl::Status CheckAdapter(const Tensor& a, const Tensor& b, const Tensor* x, const Tensor* y,
                          const char* x_name, const char* y_name) {
  const Shape& sa = a.shape();
  const Shape& sb = b.shape();
  bool ok = Is2D(a) && Is2D(b) && sb[1] == sa[0];
  if (ok && x != nullptr) ok = Is2D(*x) && x->dim(1) == sa[1];
  if (ok && y != nullptr) ok = Is2D(*y) && y->dim(1) == sb[0];
  if (ok && x != nullptr && y != nullptr) ok = x->dim(0) == y->dim(0);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("lora: A ", ShapeToString(sa), ", B ", ShapeToString(sb),
                   x != nullptr ? absl::StrCat(", ", x_name, " ", ShapeToString(x->shape())) : "",
                   y != nullptr ? absl::StrCat(", ", y_name, " ", ShapeToString(y->shape())) : "",
                   " are not (r, in), (out, r), (N, in), (N, out)"));
}

absl::Status CheckSame(const Tensor& t, const Shape& shape, const char* name) {
  if (t.shape() == shape) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("lora: ", name, " is ", ShapeToString(t.shape()),
                                                 ", expected ", ShapeToString(shape)));
}

}  // namespace

absl::Status LoraForward(kernels::Backend& backend, float scale, const Tensor& x, const Tensor& a,
                         const Tensor& b, Tensor& u, Tensor& y) {
  AMPD_RETURN_IF_ERROR(CheckAdapter(a, b, &x, &y, "x", "y"));
  AMPD_RETURN_IF_ERROR(CheckSame(u, {x.dim(0), a.dim(0)}, "u"));
  AMPD_RETURN_IF_ERROR(backend.Gemm(false, true, 1.0f, x, a, 0.0f, u));
  return backend.Gemm(false, true, scale, u, b, 1.0f, y);
}

absl::Status LoraBackward(kernels::Backend& backend, float scale, const Tensor& x, const Tensor& u,
                          const Tensor& dy, const Tensor& a, const Tensor& b, float beta,
                          Tensor& du, Tensor& da, Tensor& db, Tensor& dx) {
  AMPD_RETURN_IF_ERROR(CheckAdapter(a, b, &x, &dy, "x", "dy"));
  const Shape rows_by_rank = {x.dim(0), a.dim(0)};
  AMPD_RETURN_IF_ERROR(CheckSame(u, rows_by_rank, "u"));
  AMPD_RETURN_IF_ERROR(CheckSame(du, rows_by_rank, "du"));
  AMPD_RETURN_IF_ERROR(CheckSame(da, a.shape(), "dA"));
  AMPD_RETURN_IF_ERROR(CheckSame(db, b.shape(), "dB"));
  AMPD_RETURN_IF_ERROR(CheckSame(dx, x.shape(), "dx"));
  AMPD_RETURN_IF_ERROR(backend.Gemm(true, false, scale, dy, u, beta, db));
  AMPD_RETURN_IF_ERROR(backend.Gemm(false, false, scale, dy, b, 0.0f, du));
  AMPD_RETURN_IF_ERROR(backend.Gemm(true, false, 1.0f, du, x, beta, da));
  return backend.Gemm(false, false, 1.0f, du, a, 1.0f, dx);
}

}  // namespace ampd::engine::model
