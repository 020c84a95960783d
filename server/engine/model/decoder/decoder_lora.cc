// LoraMerge and LoraGrads: three GEMMs (decoder_lora.h has the algebra).
#include "server/engine/model/decoder/decoder_lora.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::engine::model {

namespace {

// a (r, in), b (out, r) and an (out, in) operand named `what`.
absl::Status CheckShapes(const kernels::Tensor& a, const kernels::Tensor& b,
                         const kernels::Tensor& w, const char* what) {
  const kernels::Shape& sa = a.shape();
  const kernels::Shape& sb = b.shape();
  const kernels::Shape& sw = w.shape();
  if (sa.size() != 2 || sb.size() != 2 || sw.size() != 2 || sb[1] != sa[0] || sw[0] != sb[0] ||
      sw[1] != sa[1]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lora: A ", kernels::ShapeToString(sa), ", B ", kernels::ShapeToString(sb), " and ", what,
        " ", kernels::ShapeToString(sw), " are not (r, in), (out, r) and (out, in)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoraMerge(kernels::Backend& backend, float scale, const kernels::Tensor& a,
                       const kernels::Tensor& b, kernels::Tensor& w_eff) {
  AMPD_RETURN_IF_ERROR(CheckShapes(a, b, w_eff, "W"));
  return backend.Gemm(false, false, scale, b, a, 1.0f, w_eff);
}

absl::Status LoraGrads(kernels::Backend& backend, float scale, const kernels::Tensor& g,
                       const kernels::Tensor& a, const kernels::Tensor& b, float beta,
                       kernels::Tensor& da, kernels::Tensor& db) {
  AMPD_RETURN_IF_ERROR(CheckShapes(a, b, g, "dW"));
  if (da.shape() != a.shape() || db.shape() != b.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("lora: dA ", kernels::ShapeToString(da.shape()),
                                                   " and dB ", kernels::ShapeToString(db.shape()),
                                                   " must be shaped as A and B"));
  }
  AMPD_RETURN_IF_ERROR(backend.Gemm(false, true, scale, g, a, beta, db));
  return backend.Gemm(true, false, scale, b, g, beta, da);
}

}  // namespace ampd::engine::model
