// The argument checks of kernels/op_checks.h. The messages are the CPU
// oracle's, which the tests assert and the engine forwards to clients; the
// order of checks inside each op fixes which error a call with several
// faults reports, so both backends report the same one.
#include "kernels/op_checks.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ampd::kernels {
namespace {

// "<op>: <name> is <t>; expected <what>"
absl::Status Expected(absl::string_view op, absl::string_view name, const Tensor& t,
                      absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", name, " is ", t.DebugString(), "; expected ", what));
}

// "<op>: <name> is <t> but <ref_name> is <ref>; <what> differ"
absl::Status Differs(absl::string_view op, absl::string_view name, const Tensor& t,
                     absl::string_view ref_name, const Tensor& ref, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but ",
                                                 ref_name, " is ", ref.DebugString(), "; ", what,
                                                 " differ"));
}

// A vector beside an (N, C) x must be (want): "<name> is ... but x is ...;
// expected (want)".
absl::Status CheckVectorBesideX(absl::string_view op, absl::string_view name, const Tensor& t,
                                const Tensor& x, int64_t want) {
  if (t.rank() != 1 || t.dim(0) != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", t.DebugString(),
                                                   " but x is ", x.DebugString(), "; expected (",
                                                   want, ")"));
  }
  return absl::OkStatus();
}

// gamma/beta when given: (C) of x's dtype, with memory.
absl::Status CheckAffine(absl::string_view op, absl::string_view name, const Tensor* p,
                         const Tensor& x) {
  if (p == nullptr) return absl::OkStatus();
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, name, *p, "x", x));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(op, name, *p));
  return CheckVectorBesideX(op, name, *p, x, x.dim(1));
}

// mean/rstd: (N) F32, one statistic per row of x.
absl::Status CheckStat(absl::string_view op, absl::string_view name, const Tensor& t,
                       const Tensor& x) {
  AMPD_RETURN_IF_ERROR(CheckDType(op, name, t, DType::kF32));
  return CheckVectorBesideX(op, name, t, x, x.dim(0));
}

// dgamma/dbeta when given: (C), any float dtype (they are accumulated into).
absl::Status CheckParamGrad(absl::string_view op, absl::string_view name, const Tensor* p,
                            const Tensor& x) {
  if (p == nullptr) return absl::OkStatus();
  AMPD_RETURN_IF_ERROR(CheckFloat(op, name, *p));
  return CheckVectorBesideX(op, name, *p, x, x.dim(1));
}

// A list of gradients, each present and float. A template because
// UnscaleAndCheck hands mutable tensors and the histogram const ones, and a
// span of Tensor* does not convert to one of const Tensor*.
template <typename T>
absl::Status CheckGradList(absl::string_view op, absl::Span<T* const> grads) {
  for (size_t t = 0; t < grads.size(); ++t) {
    const std::string name = absl::StrCat("grads[", t, "]");
    if (grads[t] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
    }
    AMPD_RETURN_IF_ERROR(CheckFloat(op, name, *grads[t]));
  }
  return absl::OkStatus();
}

absl::Status CheckTransform(absl::string_view op, const GradTransform& tr) {
  if (tr.found_inf == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": transform.found_inf is null"));
  }
  AMPD_RETURN_IF_ERROR(CheckScalarF32(op, "transform.found_inf", *tr.found_inf));
  if (tr.norm_sq != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckScalarF32(op, "transform.norm_sq", *tr.norm_sq));
  }
  return absl::OkStatus();
}

absl::Status CheckParam(absl::string_view op, size_t index, const ParamRef& p, bool needs_state0,
                        bool needs_state1) {
  const std::string prefix = absl::StrCat("params[", index, "].");
  if (p.master == nullptr || p.grad == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", prefix, (p.master == nullptr ? "master" : "grad"), " is null"));
  }
  const Tensor& master = *p.master;
  AMPD_RETURN_IF_ERROR(CheckDType(op, prefix + "master", master, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckFloat(op, prefix + "grad", *p.grad));
  AMPD_RETURN_IF_ERROR(CheckSameNumel(op, prefix + "grad", *p.grad, prefix + "master", master));
  if (p.working != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckFloat(op, prefix + "working", *p.working));
    AMPD_RETURN_IF_ERROR(
        CheckSameNumel(op, prefix + "working", *p.working, prefix + "master", master));
  }
  const struct {
    const Tensor* t;
    bool needed;
    const char* name;
  } states[] = {{p.state0, needs_state0, "state0"}, {p.state1, needs_state1, "state1"}};
  for (const auto& st : states) {
    if (!st.needed) continue;  // an unused buffer is not touched, so not checked
    if (st.t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", prefix, st.name, " is null"));
    }
    AMPD_RETURN_IF_ERROR(CheckDType(op, prefix + st.name, *st.t, DType::kF32));
    AMPD_RETURN_IF_ERROR(CheckSameNumel(op, prefix + st.name, *st.t, prefix + "master", master));
  }
  return absl::OkStatus();
}

// An Activation cast from an out-of-range integer (a corrupt spec, a newer
// client) is refused rather than falling through a switch.
absl::Status CheckActivation(absl::string_view op, Activation act) {
  if (act != Activation::kReLU && act != Activation::kGELU && act != Activation::kTanh &&
      act != Activation::kGELUTanh) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": unknown activation ", static_cast<int>(act)));
  }
  return absl::OkStatus();
}

// A float (C) vector beside a float (N, C) matrix: the bias and y of AddBias,
// dbias and dy of BiasGrad (same rule, same wording).
absl::Status CheckColumnVector(absl::string_view op, absl::string_view mat_name, const Tensor& mat,
                               absl::string_view vec_name, const Tensor& vec) {
  AMPD_RETURN_IF_ERROR(CheckFloat(op, mat_name, mat));
  AMPD_RETURN_IF_ERROR(CheckFloat(op, vec_name, vec));
  AMPD_RETURN_IF_ERROR(CheckRank(op, mat_name, mat, 2));
  AMPD_RETURN_IF_ERROR(CheckRank(op, vec_name, vec, 1));
  if (vec.dim(0) != mat.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", vec_name, " is ", vec.DebugString(), " but ", mat_name, " is ", mat.DebugString(),
        "; ", vec_name, " length must equal ", mat_name, "'s columns"));
  }
  return absl::OkStatus();
}

// Whether two tensors' bytes intersect (tensors without bytes never do).
// Both live on the backend being called, so their addresses are comparable.
bool Overlap(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0 || a.data() == nullptr || b.data() == nullptr) {
    return false;
  }
  const auto a0 = reinterpret_cast<uintptr_t>(a.data());
  const auto b0 = reinterpret_cast<uintptr_t>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// An output that an op writes while it still reads `other` must not share
// bytes with it (views of one workspace make that possible).
absl::Status CheckNoOverlap(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view other_name, const Tensor& other) {
  if (Overlap(t, other)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " ", t.DebugString(), " overlaps ", other_name, " ", other.DebugString()));
  }
  return absl::OkStatus();
}

// t is exactly `want` in shape (dtype checked by the caller), with memory.
absl::Status CheckShapeIs(absl::string_view op, absl::string_view name, const Tensor& t,
                          const Shape& want, absl::string_view what) {
  if (t.shape() != want) {
    return Expected(op, name, t, absl::StrCat(what, " = ", ShapeToString(want)));
  }
  return CheckHasMemory(op, name, t);
}

// t has ref's dtype and shape, with memory (an output or a second input
// shaped like the op's main operand).
absl::Status CheckLike(absl::string_view op, absl::string_view name, const Tensor& t,
                       absl::string_view ref_name, const Tensor& ref) {
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, name, t, ref_name, ref));
  AMPD_RETURN_IF_ERROR(CheckSameShape(op, name, t, ref_name, ref));
  return CheckHasMemory(op, name, t);
}

// The dimensions of a qkv (B, T, 3C) tensor split into n_head heads.
struct AttentionDims {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t channels = 0;  // C
};

// qkv float (B, T, 3C), C >= 1 a multiple of n_head >= 1; T, 3C and
// n_head within int (the kernels' row and column indices).
absl::Status CheckQkv(absl::string_view op, const Tensor& qkv, int64_t n_head,
                      AttentionDims* dims) {
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "qkv", qkv, 3));
  if (qkv.dim(2) < 3 || qkv.dim(2) % 3 != 0) {
    return Expected(op, "qkv", qkv, "(B, T, 3 * C) with C >= 1");
  }
  const int64_t c = qkv.dim(2) / 3;
  if (n_head < 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": n_head is ", n_head, "; expected >= 1"));
  }
  if (c % n_head != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": n_head is ", n_head, " but qkv is ",
                                                   qkv.DebugString(), " (C = ", c,
                                                   "); n_head must divide C"));
  }
  constexpr int64_t kMaxDim = 0x7fffffff;
  if (qkv.dim(1) > kMaxDim || qkv.dim(2) > kMaxDim || n_head > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": qkv ", qkv.DebugString(), " is too large (T, 3C and n_head must fit int)"));
  }
  *dims = {qkv.dim(0), qkv.dim(1), c};
  return absl::OkStatus();
}

}  // namespace

// ---- generic checks -----------------------------------------------------------

absl::Status CheckHasMemory(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.empty() && t.numel() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", t.DebugString(), " but holds no memory"));
  }
  return absl::OkStatus();
}

absl::Status CheckFloat(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (!IsFloating(t.dtype())) return Expected(op, name, t, "F32, F16 or BF16");
  return CheckHasMemory(op, name, t);
}

absl::Status CheckDType(absl::string_view op, absl::string_view name, const Tensor& t, DType want) {
  if (t.dtype() != want) return Expected(op, name, t, DTypeName(want));
  return CheckHasMemory(op, name, t);
}

absl::Status CheckIndex(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.dtype() != DType::kI32 && t.dtype() != DType::kI64) {
    return Expected(op, name, t, "I32 or I64");
  }
  return CheckHasMemory(op, name, t);
}

absl::Status CheckRank(absl::string_view op, absl::string_view name, const Tensor& t,
                       int64_t rank) {
  if (t.rank() != rank) return Expected(op, name, t, absl::StrCat("rank ", rank));
  return absl::OkStatus();
}

absl::Status CheckSameShape(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.shape() != ref.shape()) return Differs(op, name, t, ref_name, ref, "shapes");
  return absl::OkStatus();
}

absl::Status CheckSameDType(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.dtype() != ref.dtype()) return Differs(op, name, t, ref_name, ref, "dtypes");
  return absl::OkStatus();
}

absl::Status CheckSameNumel(absl::string_view op, absl::string_view name, const Tensor& t,
                            absl::string_view ref_name, const Tensor& ref) {
  if (t.numel() != ref.numel()) return Differs(op, name, t, ref_name, ref, "element counts");
  return absl::OkStatus();
}

absl::Status CheckScalarF32(absl::string_view op, absl::string_view name, const Tensor& t) {
  if (t.dtype() != DType::kF32 || t.numel() != 1) return Expected(op, name, t, "one F32 element");
  return CheckHasMemory(op, name, t);
}

// ---- memory -----------------------------------------------------------------------

absl::Status ValidateAllocate(const Shape& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Allocate: shape ", ShapeToString(shape), " has a negative dimension"));
    }
    // Caps the element count at 2^56 before multiplying, so neither the
    // count nor its byte size (at most 8 bytes an element) overflows int64.
    if (d != 0 && numel > (int64_t{1} << 56) / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("Allocate: shape ", ShapeToString(shape), " is too large"));
    }
    numel *= d;
  }
  return absl::OkStatus();
}

absl::Status ValidateCopyFromHost(const void* src, size_t bytes, const Tensor& dst) {
  if (bytes != dst.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFromHost: dst is ", dst.DebugString(), " (",
                                                   dst.nbytes(), " bytes) but ", bytes,
                                                   " bytes were given"));
  }
  AMPD_RETURN_IF_ERROR(CheckHasMemory("CopyFromHost", "dst", dst));
  if (bytes != 0 && src == nullptr) return absl::InvalidArgumentError("CopyFromHost: src is null");
  return absl::OkStatus();
}

absl::Status ValidateCopyToHost(const Tensor& src, const void* dst, size_t bytes) {
  if (bytes != src.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyToHost: src is ", src.DebugString(), " (",
                                                   src.nbytes(), " bytes) but ", bytes,
                                                   " bytes were asked for"));
  }
  AMPD_RETURN_IF_ERROR(CheckHasMemory("CopyToHost", "src", src));
  if (bytes != 0 && dst == nullptr) return absl::InvalidArgumentError("CopyToHost: dst is null");
  return absl::OkStatus();
}

absl::Status ValidateCopy(const Tensor& src, const Tensor& dst) {
  AMPD_RETURN_IF_ERROR(CheckSameDType("Copy", "dst", dst, "src", src));
  AMPD_RETURN_IF_ERROR(CheckSameNumel("Copy", "dst", dst, "src", src));
  AMPD_RETURN_IF_ERROR(CheckHasMemory("Copy", "src", src));
  return CheckHasMemory("Copy", "dst", dst);
}

absl::Status ValidateCopyColumns(const Tensor& src, int64_t src_col, int64_t cols,
                                 const Tensor& dst, int64_t dst_col) {
  constexpr absl::string_view kOp = "CopyColumns";
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "src", src, 2));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "dst", dst, 2));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dst", dst, "src", src));
  if (dst.dim(0) != src.dim(0)) return Differs(kOp, "dst", dst, "src", src, "row counts");
  if (cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": cols is ", cols, "; expected >= 0"));
  }
  // col > C - cols rather than col + cols > C: no overflow for any int64.
  const struct {
    const char* name;
    int64_t col;
    const char* tensor_name;
    const Tensor* t;
  } blocks[] = {{"src_col", src_col, "src", &src}, {"dst_col", dst_col, "dst", &dst}};
  for (const auto& b : blocks) {
    const int64_t width = b.t->dim(1);
    if (b.col < 0 || cols > width || b.col > width - cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": ", b.name, " is ", b.col, " with cols ", cols, " but ", b.tensor_name, " is ",
          b.t->DebugString(), "; expected 0 <= ", b.name, " and ", b.name, " + cols <= ", width));
    }
  }
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "src", src));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dst", dst));
  return CheckNoOverlap(kOp, "dst", dst, "src", src);
}

absl::Status ValidateFill(const Tensor& dst) { return CheckFloat("Fill", "dst", dst); }

absl::Status ValidateFillTensors(absl::Span<Tensor* const> dsts) {
  constexpr absl::string_view kOp = "FillTensors";
  for (size_t i = 0; i < dsts.size(); ++i) {
    const std::string name = absl::StrCat("dsts[", i, "]");
    if (dsts[i] == nullptr)
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " is null"));
    AMPD_RETURN_IF_ERROR(CheckFloat(kOp, name, *dsts[i]));
  }
  return absl::OkStatus();
}

absl::Status ValidateFillRandom(const Tensor& dst, const RandomFill& fill) {
  constexpr absl::string_view kOp = "FillRandom";
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "dst", dst, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "dst", dst));
  switch (fill.distribution) {
    case RandomDistribution::kUniform:
      // Negated comparisons so that NaN bounds fail too.
      if (!(std::isfinite(fill.lo) && std::isfinite(fill.hi) && fill.lo <= fill.hi)) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": uniform bounds [", fill.lo, ", ",
                                                       fill.hi, ") must be finite with lo <= hi"));
      }
      break;
    case RandomDistribution::kNormal:
      if (!(std::isfinite(fill.mean) && std::isfinite(fill.stddev) && fill.stddev >= 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": normal mean ", fill.mean,
                                                       " and stddev ", fill.stddev,
                                                       " must be finite with stddev >= 0"));
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": unknown distribution ", static_cast<int>(fill.distribution)));
  }
  const auto n = static_cast<uint64_t>(dst.numel());
  if (fill.offset > std::numeric_limits<uint64_t>::max() - n) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": offset ", fill.offset, " + ", n,
                                                   " elements overflows the draw index"));
  }
  return absl::OkStatus();
}

absl::Status ValidateCast(const Tensor& src, const Tensor& dst) {
  AMPD_RETURN_IF_ERROR(CheckFloat("Cast", "src", src));
  AMPD_RETURN_IF_ERROR(CheckFloat("Cast", "dst", dst));
  return CheckSameNumel("Cast", "dst", dst, "src", src);
}

absl::Status ValidateReadBack(absl::Span<const Tensor* const> scalars, size_t out_size,
                              absl::Span<const HostCopy> copies) {
  constexpr absl::string_view kOp = "ReadScalars";
  for (size_t i = 0; i < copies.size(); ++i) {
    const HostCopy& c = copies[i];
    if (c.src == nullptr || (c.dst == nullptr && c.bytes > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": copies[", i, "] has a null ", c.src == nullptr ? "src" : "dst"));
    }
    if (c.bytes != c.src->nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": copies[", i, "] asks for ", c.bytes,
                                                     " bytes of a ", c.src->nbytes(),
                                                     "-byte tensor"));
    }
  }
  if (scalars.size() != out_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": out has ", out_size, " elements but scalars has ", scalars.size()));
  }
  for (size_t i = 0; i < scalars.size(); ++i) {
    const std::string name = absl::StrCat("scalars[", i, "]");
    if (scalars[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " is null"));
    }
    AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, name, *scalars[i]));
  }
  return absl::OkStatus();
}

// ---- dense algebra ----------------------------------------------------------------

absl::Status ValidateAdd(const Tensor& x, const Tensor& y) {
  AMPD_RETURN_IF_ERROR(CheckFloat("Add", "x", x));
  AMPD_RETURN_IF_ERROR(CheckFloat("Add", "y", y));
  return CheckSameShape("Add", "x", x, "y", y);
}

namespace {

// The operands of a 2-D GEMM c (M, N) = op(a) (M, K) @ op(b) (K, N): float,
// rank 2, a and b of one dtype, c F32 or a's dtype, the dims chained and
// within BLAS's int; the dims are returned for the callers' own checks.
struct GemmDims {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
};
absl::Status CheckGemm(absl::string_view op, bool trans_a, bool trans_b, const Tensor& a,
                       const Tensor& b, const Tensor& c, GemmDims* dims) {
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "a", a));
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "b", b));
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "c", c));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "a", a, 2));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "b", b, 2));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "c", c, 2));
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, "b", b, "a", a));
  if (c.dtype() != DType::kF32 && c.dtype() != a.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": c is ", c.DebugString(), " but a is ",
                                                   a.DebugString(), "; c must be F32 or ",
                                                   DTypeName(a.dtype())));
  }
  // op(a): (M, K), op(b): (K, N), c: (M, N).
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  if (k != kb) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": b is ", b.DebugString(), (trans_b ? " (transposed)" : ""), " but a is ",
                     a.DebugString(), (trans_a ? " (transposed)" : ""), "; inner dims differ (", k,
                     " vs ", kb, ")"));
  }
  if (c.dim(0) != m || c.dim(1) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": c is ", c.DebugString(), " but op(a) @ op(b) is (", m, ", ", n, ")"));
  }
  // BLAS and cuBLAS take int dimensions (and int leading dimensions, which
  // are the stored column counts of a and b, each one of m, n or k).
  constexpr int64_t kMaxDim = 0x7fffffff;
  if (m > kMaxDim || n > kMaxDim || k > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": a ", a.DebugString(), " or b ",
                                                   b.DebugString(), " is too large for BLAS"));
  }
  *dims = {m, n, k};
  return absl::OkStatus();
}

absl::Status CheckGemmActivation(absl::string_view op, GemmActivation act) {
  if (act != GemmActivation::kNone && act != GemmActivation::kGELUTanh) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": unknown activation ", static_cast<int>(act)));
  }
  return absl::OkStatus();
}

// pre beside an (M, N) c: absent exactly when act is kNone, else c's dtype
// and shape, with memory.
absl::Status CheckPreActivation(absl::string_view op, GemmActivation act, const Tensor* pre,
                                const Tensor& c) {
  if (act == GemmActivation::kNone) {
    if (pre != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": pre is ", pre->DebugString(), " but act is none; expected nullptr"));
    }
    return absl::OkStatus();
  }
  if (pre == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": pre is null but act is gelu_tanh; expected ", c.DebugString()));
  }
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, "pre", *pre, "c", c));
  AMPD_RETURN_IF_ERROR(CheckSameShape(op, "pre", *pre, "c", c));
  return CheckHasMemory(op, "pre", *pre);
}

}  // namespace

absl::Status ValidateGemm(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                          const Tensor& c) {
  GemmDims dims;
  return CheckGemm("Gemm", trans_a, trans_b, a, b, c, &dims);
}

absl::Status ValidateGemmBiasActivation(bool trans_a, bool trans_b, const Tensor& a,
                                        const Tensor& b, const Tensor* bias, GemmActivation act,
                                        const Tensor& c, const Tensor* pre) {
  constexpr absl::string_view kOp = "GemmBiasActivation";
  AMPD_RETURN_IF_ERROR(CheckGemmActivation(kOp, act));
  GemmDims d;
  AMPD_RETURN_IF_ERROR(CheckGemm(kOp, trans_a, trans_b, a, b, c, &d));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "c", c, "a", a));
  if (bias != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "bias", *bias, "a", a));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, "bias", *bias, 1));
    if (bias->dim(0) != d.n) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": bias is ", bias->DebugString(),
                                                     " but c is ", c.DebugString(),
                                                     "; bias length must equal c's columns"));
    }
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "bias", *bias));
  }
  AMPD_RETURN_IF_ERROR(CheckPreActivation(kOp, act, pre, c));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "a", a));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "b", b));
  if (bias != nullptr) AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "bias", *bias));
  if (pre != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "pre", *pre, "a", a));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "pre", *pre, "b", b));
    if (bias != nullptr) AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "pre", *pre, "bias", *bias));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "pre", *pre, "c", c));
  }
  return absl::OkStatus();
}

absl::Status ValidateGemmBiasGrad(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b,
                                  const Tensor& c, BiasGradOf of, const Tensor& dbias) {
  constexpr absl::string_view kOp = "GemmBiasGrad";
  if (of != BiasGradOf::kA && of != BiasGradOf::kB) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": unknown bias gradient operand ", static_cast<int>(of)));
  }
  GemmDims d;
  AMPD_RETURN_IF_ERROR(CheckGemm(kOp, trans_a, trans_b, a, b, c, &d));
  // The bias gradient is the column sums of the dy operand as stored,
  // (K, width): a transposed a, or an untransposed b.
  const bool of_a = of == BiasGradOf::kA;
  if (of_a ? !trans_a : trans_b) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": the bias gradient of ", (of_a ? "a" : "b"), " needs ", (of_a ? "a" : "b"),
        " stored (K, ", (of_a ? "M" : "N"), "), i.e. trans_", (of_a ? "a true" : "b false"),
        "; got ", (of_a ? a.DebugString() : b.DebugString()),
        (of_a ? (trans_a ? " (transposed)" : "") : (trans_b ? " (transposed)" : ""))));
  }
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dbias", dbias));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "dbias", dbias, 1));
  const int64_t width = of_a ? d.m : d.n;
  if (dbias.dim(0) != width) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": dbias is ", dbias.DebugString(), " but ", (of_a ? "a" : "b"), " is ",
                     (of_a ? a.DebugString() : b.DebugString()),
                     "; dbias length must equal its columns (", width, ")"));
  }
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "a", a));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "b", b));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dbias", dbias, "a", a));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dbias", dbias, "b", b));
  return CheckNoOverlap(kOp, "dbias", dbias, "c", c);
}

absl::Status ValidateGemmActivationBackward(bool trans_a, bool trans_b, const Tensor& a,
                                            const Tensor& b, GemmActivation act, const Tensor* pre,
                                            const Tensor& c) {
  constexpr absl::string_view kOp = "GemmActivationBackward";
  AMPD_RETURN_IF_ERROR(CheckGemmActivation(kOp, act));
  GemmDims d;
  AMPD_RETURN_IF_ERROR(CheckGemm(kOp, trans_a, trans_b, a, b, c, &d));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "c", c, "a", a));
  AMPD_RETURN_IF_ERROR(CheckPreActivation(kOp, act, pre, c));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "a", a));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "b", b));
  if (pre != nullptr) AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "c", c, "pre", *pre));
  return absl::OkStatus();
}

absl::Status ValidateAddBias(const Tensor& bias, const Tensor& y) {
  return CheckColumnVector("AddBias", "y", y, "bias", bias);
}

absl::Status ValidateBiasGrad(const Tensor& dy, const Tensor& dbias) {
  return CheckColumnVector("BiasGrad", "dy", dy, "dbias", dbias);
}

// ---- activations ------------------------------------------------------------------

absl::Status ValidateActivationForward(Activation act, const Tensor& x, const Tensor& y) {
  constexpr absl::string_view kOp = "ActivationForward";
  AMPD_RETURN_IF_ERROR(CheckActivation(kOp, act));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "y", y));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "y", y, "x", x));
  return CheckSameShape(kOp, "y", y, "x", x);
}

absl::Status ValidateActivationBackward(Activation act, const Tensor& x, const Tensor& dy,
                                        const Tensor& dx) {
  constexpr absl::string_view kOp = "ActivationBackward";
  AMPD_RETURN_IF_ERROR(CheckActivation(kOp, act));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dy", dy));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dx", dx));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dy", dy, "x", x));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dx", dx, "x", x));
  AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "dy", dy, "x", x));
  return CheckSameShape(kOp, "dx", dx, "x", x);
}

// ---- causal self-attention --------------------------------------------------------

absl::Status ValidateAttentionOptions(const AttentionOptions& options, const char* op) {
  if (options.window < 0 || options.window > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": window is ", options.window,
                                                   "; expected 0 (none) or 1 .. 2^31 - 1 keys"));
  }
  if (options.scale.has_value() && !(std::isfinite(*options.scale) && *options.scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": scale is ", *options.scale, "; expected finite and > 0"));
  }
  return absl::OkStatus();
}

absl::Status ValidateRmsNormOffset(float weight_offset, const char* op) {
  if (!std::isfinite(weight_offset)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": weight_offset is ", weight_offset, "; expected finite"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEmbeddingScale(float scale, const char* op) {
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": scale is ", scale, "; expected finite"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGluActivation(GluActivation act, const char* op) {
  switch (act) {
    case GluActivation::kSiLU:
    case GluActivation::kGELUTanh:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": unknown gate activation ", static_cast<int>(act)));
}

absl::Status ValidateAttentionForward(const Tensor& qkv, int64_t n_head, const Tensor& out,
                                      const Tensor& lse) {
  constexpr absl::string_view kOp = "AttentionForward";
  AttentionDims d;
  AMPD_RETURN_IF_ERROR(CheckQkv(kOp, qkv, n_head, &d));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "out", out, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "out", out, {d.batch, d.seq, d.channels}, "(B, T, C)"));
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "lse", lse, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "lse", lse, {d.batch, n_head, d.seq}, "(B, n_head, T)"));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "out", out, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "lse", lse, "qkv", qkv));
  return CheckNoOverlap(kOp, "lse", lse, "out", out);
}

absl::Status ValidateAttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& dout,
                                       const Tensor& lse, int64_t n_head, const Tensor& dqkv) {
  constexpr absl::string_view kOp = "AttentionBackward";
  AttentionDims d;
  AMPD_RETURN_IF_ERROR(CheckQkv(kOp, qkv, n_head, &d));
  const Shape rows_shape = {d.batch, d.seq, d.channels};
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "out", out, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "out", out, rows_shape, "(B, T, C)"));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dout", dout, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "dout", dout, rows_shape, "(B, T, C)"));
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "lse", lse, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "lse", lse, {d.batch, n_head, d.seq}, "(B, n_head, T)"));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "dqkv", dqkv, "qkv", qkv));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "dqkv", dqkv, qkv.shape(), "qkv's shape"));
  const struct {
    const char* name;
    const Tensor* t;
  } inputs[] = {{"qkv", &qkv}, {"out", &out}, {"dout", &dout}, {"lse", &lse}};
  for (const auto& in : inputs) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dqkv", dqkv, in.name, *in.t));
  }
  return absl::OkStatus();
}

absl::Status ValidateWriteKvRows(const Tensor& rows, int64_t k_col, int64_t v_col,
                                 const Tensor& positions, const Tensor& k_cache,
                                 const Tensor& v_cache) {
  constexpr absl::string_view kOp = "WriteKvRows";
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "rows", rows, 2));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "rows", rows));
  const int64_t seqs = rows.dim(0);
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "k_cache", k_cache, 3));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "k_cache", k_cache, "rows", rows));
  if (k_cache.dim(0) != seqs || k_cache.dim(1) < 1) {
    return Expected(kOp, "k_cache", k_cache,
                    absl::StrCat("(S, T_max, W) with S = ", seqs, " and T_max >= 1"));
  }
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "k_cache", k_cache));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "v_cache", v_cache, "k_cache", k_cache));
  const int64_t width = k_cache.dim(2);
  const int64_t row_width = rows.dim(1);
  const struct {
    const char* name;
    int64_t col;
  } blocks[] = {{"k_col", k_col}, {"v_col", v_col}};
  for (const auto& b : blocks) {
    // col > R - W rather than col + W > R: no overflow for any int64.
    if (b.col < 0 || width > row_width || b.col > row_width - width) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": ", b.name, " is ", b.col, " with the caches' W = ", width, " but rows is ",
          rows.DebugString(), "; expected 0 <= ", b.name, " and ", b.name, " + W <= ", row_width));
    }
  }
  AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "positions", positions));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "positions", positions, {seqs}, "(S)"));
  const struct {
    const char* name;
    const Tensor* t;
  } inputs[] = {{"rows", &rows}, {"positions", &positions}, {"v_cache", &v_cache}};
  for (const auto& in : inputs) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "k_cache", k_cache, in.name, *in.t));
  }
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "v_cache", v_cache, "rows", rows));
  return CheckNoOverlap(kOp, "v_cache", v_cache, "positions", positions);
}

absl::Status ValidateSampleTokens(const Tensor& logits, const Tensor& live,
                                  const SampleParams& params, const Tensor& tokens) {
  constexpr absl::string_view kOp = "SampleTokens";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "logits", logits, 2));
  // Ids fit an int (the CUDA kernel's loop index) and a key's low 32 bits.
  constexpr int64_t kMaxVocab = 0x7fffffff;
  if (logits.dim(1) < 1 || logits.dim(1) > kMaxVocab) {
    return Expected(kOp, "logits", logits, absl::StrCat("(S, V) with 1 <= V <= ", kMaxVocab));
  }
  const int64_t seqs = logits.dim(0);
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "live", live, DType::kI64));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "live", live, {seqs}, "(S)"));
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "tokens", tokens, DType::kI64));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "tokens", tokens, {seqs}, "(S)"));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "tokens", tokens, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "tokens", tokens, "live", live));
  if (params.keys != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckDType(kOp, "keys", *params.keys, DType::kI64));
    AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "keys", *params.keys, {seqs, 2}, "(S, 2)"));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "tokens", tokens, "keys", *params.keys));
  }
  if (params.log_kept != nullptr) {
    const Tensor& kept = *params.log_kept;
    AMPD_RETURN_IF_ERROR(CheckDType(kOp, "log_kept", kept, DType::kF32));
    AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "log_kept", kept, {seqs}, "(S)"));
    AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "log_kept", kept));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "log_kept", kept, "logits", logits));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "log_kept", kept, "live", live));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "log_kept", kept, "tokens", tokens));
    if (params.keys != nullptr) {
      AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "log_kept", kept, "keys", *params.keys));
    }
  }
  if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": temperature is ", params.temperature, "; expected finite and >= 0"));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": top_k is ", params.top_k, "; expected >= 0"));
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": top_p is ", params.top_p, "; expected in (0, 1]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateAttentionDecode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     const Tensor& positions, int64_t heads, int64_t kv_heads,
                                     const Tensor& out) {
  constexpr absl::string_view kOp = "AttentionDecode";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "q", q));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "q", q, 2));
  // Bounded first, so that Hkv D and the kernels' int arithmetic cannot
  // overflow.
  constexpr int64_t kMaxHeads = int64_t{1} << 20;
  if (heads < 1 || heads > kMaxHeads || kv_heads < 1 || kv_heads > heads || heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": heads ", heads, ", kv_heads ", kv_heads,
        "; expected 1 <= kv_heads <= heads <= ", kMaxHeads, " with kv_heads dividing heads"));
  }
  constexpr int64_t kMaxDim = 0x7fffffff;
  const int64_t width = q.dim(1);
  if (width == 0 || width % heads != 0 || width > kMaxDim) {
    return Expected(kOp, "q", q, absl::StrCat("(S, heads D) with heads = ", heads, ", D >= 1"));
  }
  const int64_t seqs = q.dim(0);
  const int64_t head_dim = width / heads;
  const struct {
    const char* name;
    const Tensor* t;
  } caches[] = {{"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (const auto& c : caches) {
    AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, c.name, *c.t, "q", q));
    AMPD_RETURN_IF_ERROR(CheckRank(kOp, c.name, *c.t, 3));
    if (c.t->dim(1) > kMaxDim) return Expected(kOp, c.name, *c.t, "T_max within int");
    AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, c.name, *c.t, {seqs, c.t->dim(1), kv_heads * head_dim},
                                      "(S, T_max, kv_heads D)"));
  }
  AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "v_cache", v_cache, "k_cache", k_cache));
  AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "positions", positions));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "positions", positions, {seqs}, "(S)"));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "out", out, "q", q));
  const struct {
    const char* name;
    const Tensor* t;
  } inputs[] = {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"positions", &positions}};
  for (const auto& in : inputs) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "out", out, in.name, *in.t));
  }
  return absl::OkStatus();
}

// ---- normalisation ----------------------------------------------------------------

absl::Status ValidateLayerNormForward(const Tensor& x, const Tensor* gamma, const Tensor* beta,
                                      const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  constexpr absl::string_view kOp = "LayerNormForward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "y", y, "x", x));
  AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "gamma", gamma, x));
  AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "beta", beta, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "mean", mean, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
  // The mean of zero columns is 0/0: refused rather than saving NaN stats.
  if (x.dim(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x is ", x.DebugString(), "; cannot normalise zero columns"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayerNormBackward(const Tensor& x, const Tensor* gamma, const Tensor& mean,
                                       const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                       const Tensor* dgamma, const Tensor* dbeta) {
  constexpr absl::string_view kOp = "LayerNormBackward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dy", dy, "x", x));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dx", dx, "x", x));
  AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "gamma", gamma, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "mean", mean, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
  AMPD_RETURN_IF_ERROR(CheckParamGrad(kOp, "dgamma", dgamma, x));
  AMPD_RETURN_IF_ERROR(CheckParamGrad(kOp, "dbeta", dbeta, x));
  // Without gamma the forward pass had no scale to differentiate.
  if (dgamma != nullptr && gamma == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": dgamma is ", dgamma->DebugString(), " but gamma is null"));
  }
  return absl::OkStatus();
}

absl::Status ValidateKvHeads(absl::string_view op, const Tensor& compact, int64_t heads,
                             int64_t kv_heads, const Tensor& expanded) {
  const absl::string_view compact_name = op == "ExpandKvHeads" ? "src" : "dsrc";
  const absl::string_view expanded_name = op == "ExpandKvHeads" ? "dst" : "dexpanded";
  AMPD_RETURN_IF_ERROR(CheckFloat(op, compact_name, compact));
  AMPD_RETURN_IF_ERROR(CheckRank(op, compact_name, compact, 3));
  // Bounded first, so that heads + 2 kv_heads and 3 heads D cannot overflow.
  constexpr int64_t kMaxHeads = int64_t{1} << 20;
  if (heads < 1 || heads > kMaxHeads || kv_heads < 1 || kv_heads > heads || heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": heads ", heads, ", kv_heads ", kv_heads,
        "; expected 1 <= kv_heads <= heads <= ", kMaxHeads, " with kv_heads dividing heads"));
  }
  const int64_t width = compact.dim(2);
  const int64_t fused = heads + 2 * kv_heads;
  if (width == 0 || width % fused != 0) {
    return Expected(op, compact_name, compact,
                    absl::StrCat("a last dim of (heads + 2 kv_heads) = ", fused, " heads of D"));
  }
  const int64_t head_dim = width / fused;
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, expanded_name, expanded, compact_name, compact));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(op, expanded_name, expanded,
                                    {compact.dim(0), compact.dim(1), 3 * heads * head_dim},
                                    "(B, T, 3 heads D)"));
  return CheckNoOverlap(op, expanded_name, expanded, compact_name, compact);
}

absl::Status ValidateRmsNormForward(const Tensor& x, const Tensor& weight, const Tensor& y,
                                    const Tensor& rstd) {
  constexpr absl::string_view kOp = "RmsNormForward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "y", y, "x", x));
  AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "weight", &weight, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
  if (x.dim(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x is ", x.DebugString(), "; cannot normalise zero columns"));
  }
  return absl::OkStatus();
}

absl::Status ValidateRmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                     const Tensor& dy, const Tensor& dx, const Tensor* dweight) {
  constexpr absl::string_view kOp = "RmsNormBackward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dy", dy, "x", x));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dx", dx, "x", x));
  AMPD_RETURN_IF_ERROR(CheckAffine(kOp, "weight", &weight, x));
  AMPD_RETURN_IF_ERROR(CheckStat(kOp, "rstd", rstd, x));
  return CheckParamGrad(kOp, "dweight", dweight, x);
}

namespace {

// The columns of a per-head norm: x (R, W) float; weight (D) x's dtype,
// D >= 1; heads >= 1 heads of D from column col, inside W; rstd (R, heads)
// F32. The products are formed only once each factor is known to fit.
absl::Status CheckHeadNorm(absl::string_view op, const Tensor& x, int64_t col, int64_t heads,
                           const Tensor& weight, const Tensor& rstd) {
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "x", x, 2));
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, "weight", weight, "x", x));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(op, "weight", weight));
  if (weight.rank() != 1 || weight.dim(0) < 1) {
    return Expected(op, "weight", weight, "(D) with D >= 1, one head's width");
  }
  const int64_t width = x.dim(1);
  const int64_t d = weight.dim(0);
  if (col < 0 || col > width || heads < 1 || heads > (width - col) / d) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", heads, " heads of ", d, " from column ", col, " do not fit in x ",
                     x.DebugString(), "; expected heads >= 1 and col + heads * D <= W"));
  }
  AMPD_RETURN_IF_ERROR(CheckDType(op, "rstd", rstd, DType::kF32));
  return CheckShapeIs(op, "rstd", rstd, {x.dim(0), heads}, "(R, heads)");
}

}  // namespace

absl::Status ValidateHeadRmsNormForward(const Tensor& x, int64_t col, int64_t heads,
                                        const Tensor& weight, const Tensor& y, const Tensor& rstd) {
  constexpr absl::string_view kOp = "HeadRmsNormForward";
  AMPD_RETURN_IF_ERROR(CheckHeadNorm(kOp, x, col, heads, weight, rstd));
  return CheckLike(kOp, "y", y, "x", x);
}

absl::Status ValidateHeadRmsNormBackward(const Tensor& x, int64_t col, int64_t heads,
                                         const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                                         const Tensor& dx, const Tensor* dweight) {
  constexpr absl::string_view kOp = "HeadRmsNormBackward";
  AMPD_RETURN_IF_ERROR(CheckHeadNorm(kOp, x, col, heads, weight, rstd));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dy", dy, "x", x));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dx", dx, "x", x));
  if (dweight == nullptr) return absl::OkStatus();
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dweight", *dweight));
  return CheckShapeIs(kOp, "dweight", *dweight, weight.shape(), "(D), weight's shape");
}

absl::Status ValidateRope(const Tensor& x, int64_t heads, int64_t head_dim, const Tensor& inv_freq,
                          const Tensor* positions) {
  constexpr absl::string_view kOp = "Rope";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "x", x));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "x", x, 3));
  if (head_dim < 2 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": head_dim is ", head_dim, "; expected an even number >= 2"));
  }
  // heads * head_dim formed only once heads is known to fit beside W.
  if (heads < 0 || heads > x.dim(2) / head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": heads is ", heads, "; x is ",
                                                   x.DebugString(), ", which holds at most ",
                                                   x.dim(2) / head_dim, " heads of ", head_dim));
  }
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "inv_freq", inv_freq, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "inv_freq", inv_freq, {head_dim / 2}, "(head_dim / 2)"));
  if (positions != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "positions", *positions));
    AMPD_RETURN_IF_ERROR(
        CheckShapeIs(kOp, "positions", *positions, {x.dim(0), x.dim(1)}, "(B, T)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGatedMulForward(const Tensor& gate, const Tensor& up, const Tensor& y) {
  constexpr absl::string_view kOp = "GatedMulForward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "gate", gate));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "up", up, "gate", gate));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "y", y, "gate", gate));
  AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "y", y, "gate", gate));
  return CheckHasMemory(kOp, "y", y);
}

absl::Status ValidateGatedMulBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                      const Tensor& dgate, const Tensor& dup) {
  constexpr absl::string_view kOp = "GatedMulBackward";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "gate", gate));
  const std::pair<absl::string_view, const Tensor*> same[] = {
      {"up", &up}, {"dy", &dy}, {"dgate", &dgate}, {"dup", &dup}};
  for (const auto& [name, t] : same) {
    AMPD_RETURN_IF_ERROR(CheckLike(kOp, name, *t, "gate", gate));
  }
  // Elementwise, but dgate is written before dup's inputs are all read.
  for (const auto& [name, t] :
       {std::pair<absl::string_view, const Tensor*>{"gate", &gate}, {"up", &up}, {"dy", &dy}}) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dgate", dgate, name, *t));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dup", dup, name, *t));
  }
  return CheckNoOverlap(kOp, "dup", dup, "dgate", dgate);
}

// ---- embedding --------------------------------------------------------------------

absl::Status ValidateEmbeddingForward(const Tensor& ids, const Tensor& table, const Tensor& out) {
  constexpr absl::string_view kOp = "EmbeddingForward";
  AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "ids", ids));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "ids", ids, 1));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "table", table));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "table", table, 2));
  AMPD_RETURN_IF_ERROR(CheckSameDType(kOp, "out", out, "table", table));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "out", out));
  if (out.rank() != 2 || out.dim(0) != ids.dim(0) || out.dim(1) != table.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": out is ", out.DebugString(), " but ids is ", ids.DebugString(), " and table is ",
        table.DebugString(), "; expected (", ids.dim(0), ", ", table.dim(1), ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEmbeddingBackward(const Tensor& ids, const Tensor& dout,
                                       const Tensor& dtable) {
  constexpr absl::string_view kOp = "EmbeddingBackward";
  AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "ids", ids));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "ids", ids, 1));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dout", dout));
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "dtable", dtable));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "dtable", dtable, 2));
  if (dout.rank() != 2 || dout.dim(0) != ids.dim(0) || dout.dim(1) != dtable.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": dout is ", dout.DebugString(), " but ids is ", ids.DebugString(), " and dtable is ",
        dtable.DebugString(), "; expected (", ids.dim(0), ", ", dtable.dim(1), ")"));
  }
  return absl::OkStatus();
}

// ---- losses -----------------------------------------------------------------------

absl::Status ValidateMseLoss(const Tensor& pred, const Tensor& target, const Tensor& loss,
                             const Tensor& dpred) {
  constexpr absl::string_view kOp = "MseLoss";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "pred", pred));
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "target", target, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckSameShape(kOp, "target", target, "pred", pred));
  AMPD_RETURN_IF_ERROR(CheckLike(kOp, "dpred", dpred, "pred", pred));
  AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "loss", loss));
  if (pred.numel() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": pred is ", pred.DebugString(), "; the mean of no elements"));
  }
  return absl::OkStatus();
}

namespace {

// What both cross-entropy ops need: float logits (N, V), labels (N) of an
// index dtype, dlogits shaped and typed as logits, an F32 scalar loss.
absl::Status CheckCrossEntropyOperands(absl::string_view op, const Tensor& logits,
                                       const Tensor& labels, const Tensor& loss,
                                       const Tensor& dlogits) {
  AMPD_RETURN_IF_ERROR(CheckFloat(op, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckRank(op, "logits", logits, 2));
  AMPD_RETURN_IF_ERROR(CheckIndex(op, "labels", labels));
  if (labels.rank() != 1 || labels.dim(0) != logits.dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": labels is ", labels.DebugString(),
                                                   " but logits is ", logits.DebugString(),
                                                   "; expected (", logits.dim(0), ")"));
  }
  AMPD_RETURN_IF_ERROR(CheckSameDType(op, "dlogits", dlogits, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckSameShape(op, "dlogits", dlogits, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(op, "dlogits", dlogits));
  AMPD_RETURN_IF_ERROR(CheckScalarF32(op, "loss", loss));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCrossEntropyLoss(const Tensor& logits, const Tensor& labels,
                                      const Tensor& loss, const Tensor& dlogits) {
  constexpr absl::string_view kOp = "CrossEntropyLoss";
  AMPD_RETURN_IF_ERROR(CheckCrossEntropyOperands(kOp, logits, labels, loss, dlogits));
  // A mean over no rows is 0/0, and a softmax over no classes has no label.
  if (logits.dim(0) == 0 || logits.dim(1) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": logits is ", logits.DebugString(),
                                                   "; need at least one row and one class"));
  }
  return absl::OkStatus();
}

namespace {

// A token loss's per-row input or output: (N) F32 with memory, beside
// logits (N, V); `required` by the kind, or refused when the kind does not
// read it.
absl::Status CheckTokenRow(absl::string_view op, absl::string_view name, const Tensor* t,
                           const Tensor& logits, bool read) {
  if (t == nullptr) return absl::OkStatus();
  if (!read) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": terms.", name, " is given but this loss kind does not read it"));
  }
  AMPD_RETURN_IF_ERROR(CheckDType(op, name, *t, DType::kF32));
  if (t->rank() != 1 || t->dim(0) != logits.dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": terms.", name, " is ", t->DebugString(),
                                                   " but logits is ", logits.DebugString(),
                                                   "; expected (", logits.dim(0), ")"));
  }
  return CheckHasMemory(op, name, *t);
}

absl::Status CheckTokenLossTerms(absl::string_view op, const Tensor& logits,
                                 const TokenLossTerms& terms) {
  switch (terms.kind) {
    case TokenLossKind::kCrossEntropy:
    case TokenLossKind::kImportanceSampling:
    case TokenLossKind::kPpo:
    case TokenLossKind::kCispo:
    case TokenLossKind::kDro:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(op, ": terms.kind is not a token loss kind"));
  }
  const bool policy = ReadsSamplingLogprobs(terms.kind);
  if (policy && (terms.advantages == nullptr || terms.sampling_logprobs == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op,
                     ": terms.advantages and terms.sampling_logprobs are required by the "
                     "importance_sampling, ppo, cispo and dro losses"));
  }
  const bool finite_clip = std::isfinite(terms.clip_low) && std::isfinite(terms.clip_high);
  if (terms.kind == TokenLossKind::kPpo &&
      !(finite_clip && terms.clip_low >= 0 && terms.clip_low <= 1.0f && terms.clip_high >= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": terms.clip_low must be in [0, 1] and terms.clip_high >= 1, got ",
                     terms.clip_low, " and ", terms.clip_high));
  }
  if (terms.kind == TokenLossKind::kCispo &&
      !(finite_clip && terms.clip_low >= 0 && terms.clip_low <= terms.clip_high)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op,
                     ": terms.clip_low and terms.clip_high must be finite with 0 <= clip_low <= "
                     "clip_high, got ",
                     terms.clip_low, " and ", terms.clip_high));
  }
  if (!(std::isfinite(terms.temperature) && terms.temperature > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": terms.temperature must be finite and > 0, got ", terms.temperature));
  }
  if (terms.kind == TokenLossKind::kDro && !(std::isfinite(terms.beta) && terms.beta >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": terms.beta must be finite and >= 0, got ", terms.beta));
  }
  AMPD_RETURN_IF_ERROR(CheckTokenRow(op, "weights", terms.weights, logits,
                                     terms.kind == TokenLossKind::kCrossEntropy));
  AMPD_RETURN_IF_ERROR(CheckTokenRow(op, "advantages", terms.advantages, logits, policy));
  AMPD_RETURN_IF_ERROR(
      CheckTokenRow(op, "sampling_logprobs", terms.sampling_logprobs, logits, policy));
  AMPD_RETURN_IF_ERROR(CheckTokenRow(op, "token_losses", terms.token_losses, logits, true));
  return CheckTokenRow(op, "logprobs", terms.logprobs, logits, true);
}

}  // namespace

absl::Status ValidateCrossEntropyChunk(const Tensor& logits, const Tensor& labels,
                                       const TokenLossTerms& terms, const Tensor& loss,
                                       const Tensor& dlogits) {
  constexpr absl::string_view kOp = "CrossEntropyChunk";
  AMPD_RETURN_IF_ERROR(CheckCrossEntropyOperands(kOp, logits, labels, loss, dlogits));
  AMPD_RETURN_IF_ERROR(CheckTokenLossTerms(kOp, logits, terms));
  // A softmax over no classes has no label. An empty chunk (N = 0) is fine.
  if (logits.dim(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": logits is ", logits.DebugString(), "; need at least one class"));
  }
  // In place is the whole tensor or nothing: a shifted alias would have
  // rows overwritten before they are read.
  if (dlogits.data() != logits.data()) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "dlogits", dlogits, "logits", logits));
  }
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "loss", loss, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "loss", loss, "dlogits", dlogits));
  // Each per-row output apart from every other operand it could clobber.
  const std::pair<const char*, const Tensor*> outputs[] = {
      {"terms.logprobs", terms.logprobs}, {"terms.token_losses", terms.token_losses}};
  for (const auto& [name, out] : outputs) {
    if (out == nullptr) continue;
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, name, *out, "logits", logits));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, name, *out, "dlogits", dlogits));
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, name, *out, "loss", loss));
  }
  if (terms.logprobs != nullptr && terms.token_losses != nullptr) {
    AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "terms.token_losses", *terms.token_losses,
                                        "terms.logprobs", *terms.logprobs));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelLogprobs(const Tensor& logits, const Tensor& labels, float temperature,
                                   const Tensor& logprobs) {
  constexpr absl::string_view kOp = "LabelLogprobs";
  AMPD_RETURN_IF_ERROR(CheckFloat(kOp, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckRank(kOp, "logits", logits, 2));
  if (logits.dim(1) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": logits is ", logits.DebugString(), "; need at least one class"));
  }
  AMPD_RETURN_IF_ERROR(CheckIndex(kOp, "labels", labels));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "labels", labels, {logits.dim(0)}, "(N)"));
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "logprobs", logprobs, DType::kF32));
  AMPD_RETURN_IF_ERROR(CheckShapeIs(kOp, "logprobs", logprobs, {logits.dim(0)}, "(N)"));
  AMPD_RETURN_IF_ERROR(CheckHasMemory(kOp, "logprobs", logprobs));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "logprobs", logprobs, "logits", logits));
  AMPD_RETURN_IF_ERROR(CheckNoOverlap(kOp, "logprobs", logprobs, "labels", labels));
  if (!(std::isfinite(temperature) && temperature > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": temperature is ", temperature, "; expected finite and > 0"));
  }
  return absl::OkStatus();
}

// ---- loss scaling and the optimizer ----------------------------------------------

absl::Status ValidateUnscaleAndCheck(absl::Span<Tensor* const> grads, const Tensor& found_inf,
                                     const Tensor* norm_sq, const Tensor* max_abs) {
  constexpr absl::string_view kOp = "UnscaleAndCheck";
  AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "found_inf", found_inf));
  if (norm_sq != nullptr) AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "norm_sq", *norm_sq));
  if (max_abs != nullptr) AMPD_RETURN_IF_ERROR(CheckScalarF32(kOp, "max_abs", *max_abs));
  return CheckGradList(kOp, grads);
}

absl::Status ValidateOptimizerParams(absl::string_view op, absl::Span<const ParamRef> params,
                                     bool needs_state0, bool needs_state1,
                                     const GradTransform& transform) {
  AMPD_RETURN_IF_ERROR(CheckTransform(op, transform));
  for (size_t i = 0; i < params.size(); ++i) {
    AMPD_RETURN_IF_ERROR(CheckParam(op, i, params[i], needs_state0, needs_state1));
  }
  return absl::OkStatus();
}

absl::Status ValidateAdamUpdate(absl::Span<const ParamRef> params, int64_t step,
                                const GradTransform& transform) {
  constexpr absl::string_view kOp = "AdamUpdate";
  // step is the bias-correction exponent: 1 - beta^0 would divide by zero.
  if (step < 1) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": step is ", step, "; expected >= 1"));
  }
  return ValidateOptimizerParams(kOp, params, /*needs_state0=*/true, /*needs_state1=*/true,
                                 transform);
}

absl::Status ValidateSgdUpdate(absl::Span<const ParamRef> params, const SgdConfig& config,
                               const GradTransform& transform) {
  return ValidateOptimizerParams("SgdUpdate", params,
                                 /*needs_state0=*/config.momentum != 0.0f,
                                 /*needs_state1=*/false, transform);
}

// ---- observability ----------------------------------------------------------------

absl::Status ValidateGradLog2Histogram(absl::Span<const Tensor* const> grads,
                                       const Tensor& counts) {
  constexpr absl::string_view kOp = "GradLog2Histogram";
  AMPD_RETURN_IF_ERROR(CheckDType(kOp, "counts", counts, DType::kI64));
  if (counts.rank() != 1 || counts.dim(0) != kGradHistogramBins) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": counts is ", counts.DebugString(),
                                                   "; expected I64(", kGradHistogramBins, ")"));
  }
  return CheckGradList(kOp, grads);
}

}  // namespace ampd::kernels
