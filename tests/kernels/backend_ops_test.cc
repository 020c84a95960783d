// Every op of the Backend interface on every backend this build can create
// (cpu, and cuda:0 where a device is visible), on seeded random inputs in
// each float dtype the op accepts, in the manner of ggml's test-backend-ops:
// one list of op cases, one test parametrised over (backend, case).
//
// What a backend's outputs are compared with:
// - cpu (the oracle) with float64 references computed here from the same
//   inputs, so the oracle itself is checked rather than compared with
//   itself. Where the contract fixes the operation order (one fp32
//   operation and one rounding, copies, integer counts) the reference
//   emulates each fp32 operation in double and rounds it with the test's
//   own model of fp32/fp16/bf16 rounding (kernel_test_util.h), and the
//   comparison is bitwise: in double, +, - and * of two floats are exact
//   and a quotient is correctly rounded, so rounding that to fp32 gives
//   the fp32 result (53 >= 2 * 24 + 2: double rounding is innocuous).
//   Elsewhere the reference is the exact formula in double, and the
//   tolerance is the fp32 error the op's algorithm can make (stated per
//   case) plus one unit in the last place of the output dtype.
// - any other backend with the cpu backend run on the same inputs: bitwise
//   where the contract fixes the order, else within the tolerance stated
//   per case (transcendentals and summation order differ between CUDA and
//   the CPU's libm and serial loops).
// A backend that cannot be created here is skipped with the reason
// ("cuda:0: no device ..."), and an op a backend answers with Unimplemented
// is skipped as "not supported"; neither passes silently.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/float16.h"
#include "kernels/tensor.h"
#include "tests/kernels/gpt_reference.h"
#include "tests/kernels/kernel_test_util.h"

namespace ampd::kernels {
namespace {

namespace kt = ::ampd::kernels::testing;
using kt::DenormMin;
using kt::kU32;
using kt::RefGeluTanh;
using kt::RefGeluTanhGrad;

// ---- tolerances ---------------------------------------------------------------
// |got - want| <= atol + rtol |want|; {0, 0} means bitwise (NaN matches NaN,
// and the sign of zero must match).
struct Tol {
  double rtol = 0.0;
  double atol = 0.0;
};
constexpr Tol kBitwise{};
Tol operator+(Tol a, Tol b) { return {a.rtol + b.rtol, a.atol + b.atol}; }

// fp32's unit roundoff: the relative error of one rounded fp32 operation.

// n units in the last place of dtype, relative, with the subnormal quantum
// as the floor near zero.
Tol Ulps(DType dtype, double n) { return {n * kt::Eps(dtype), n * DenormMin(dtype)}; }

// CUDA against the CPU: elementwise ops, a few ulps of the dtype, since
// CUDA's erfcf/expf/tanhf may differ from glibc's by an ulp before the final
// rounding (the same units the CUDA op tests have always used).
Tol DeviceElementwise(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return {2e-3, 1e-5};  // two fp16 ulps (2^-10 each, relative)
    case DType::kBF16:
      return {1.6e-2, 1e-4};  // two bf16 ulps (2^-7 each, relative)
    default:
      return {1e-5, 1e-7};
  }
}

// Relative bound on the CPU's ChunkedSum of n non-negative fp32 terms: runs of
// 1024 summed in order, then the runs' totals (cpu_internal.h), each partial
// sum rounded once: (1024 + n / 1024 + 2) u.
double ChunkedSumBound(int64_t n) {
  return (1024.0 + static_cast<double>(n) / 1024.0 + 2.0) * kU32;
}

// ---- host tensors and transfers -------------------------------------------------
// A tensor's values on the host; each is exactly representable in dtype.
struct HostTensor {
  DType dtype;
  Shape shape;
  std::vector<double> values;
};

HostTensor Random(DType dtype, const Shape& shape, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  return {dtype, shape,
          kt::RandomValues(rng, dtype, static_cast<size_t>(NumElements(shape)), lo, hi)};
}

HostTensor Ids(DType dtype, int64_t n, uint64_t seed, int64_t limit) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, limit - 1);
  HostTensor t{dtype, {n}, std::vector<double>(static_cast<size_t>(n))};
  for (double& v : t.values) v = static_cast<double>(dist(rng));
  return t;
}

std::vector<uint8_t> Encode(DType dtype, const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * SizeOf(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kF32: {
        const float f = static_cast<float>(v);
        std::memcpy(&bytes[i * 4], &f, 4);
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        const float f = static_cast<float>(v);
        const uint16_t bits = dtype == DType::kF16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
        std::memcpy(&bytes[i * 2], &bits, 2);
        break;
      }
      case DType::kI32: {
        const int32_t x = static_cast<int32_t>(v);
        std::memcpy(&bytes[i * 4], &x, 4);
        break;
      }
      case DType::kI64: {
        const int64_t x = static_cast<int64_t>(v);
        std::memcpy(&bytes[i * 8], &x, 8);
        break;
      }
      case DType::kU8:
      case DType::kBool:
        bytes[i] = static_cast<uint8_t>(v);
        break;
    }
  }
  return bytes;
}

// Decodes with the test's own fp16/bf16 definitions, not kernels/float16.h.
std::vector<double> Decode(DType dtype, const uint8_t* bytes, size_t n) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, bytes + i * 4, 4);
        out[i] = f;
        break;
      }
      case DType::kF16:
      case DType::kBF16: {
        uint16_t b;
        std::memcpy(&b, bytes + i * 2, 2);
        out[i] = dtype == DType::kF16 ? kt::RefDecodeHalf(b) : kt::RefDecodeBf16(b);
        break;
      }
      case DType::kI32: {
        int32_t x;
        std::memcpy(&x, bytes + i * 4, 4);
        out[i] = x;
        break;
      }
      case DType::kI64: {
        int64_t x;
        std::memcpy(&x, bytes + i * 8, 8);
        out[i] = static_cast<double>(x);
        break;
      }
      case DType::kU8:
      case DType::kBool:
        out[i] = static_cast<double>(bytes[i]);
        break;
    }
  }
  return out;
}

// One output of an op: read back from a backend (tol: how far another
// backend may be from the oracle's) or computed by a reference (tol: how
// far the oracle may be from it).
struct Output {
  std::string name;
  std::vector<double> values;
  Tol tol;
};
using Outputs = std::vector<Output>;

// Moves tensors between the host and one backend for one run of a case.
class Io {
 public:
  explicit Io(Backend& backend) : backend_(backend) {}

  absl::StatusOr<Tensor> Upload(const HostTensor& h) {
    AMPD_ASSIGN_OR_RETURN(Tensor t, backend_.Allocate(h.dtype, h.shape));
    const std::vector<uint8_t> bytes = Encode(h.dtype, h.values);
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(bytes.data(), bytes.size(), t));
    return t;
  }
  absl::StatusOr<Tensor> Scalar(float v) { return Upload({DType::kF32, {1}, {v}}); }
  // An output tensor whose every byte is 0xFF (NaN in every float dtype), so
  // an element the op fails to write cannot match a reference.
  absl::StatusOr<Tensor> Unwritten(DType dtype, const Shape& shape) {
    AMPD_ASSIGN_OR_RETURN(Tensor t, backend_.Allocate(dtype, shape));
    const std::vector<uint8_t> bytes(t.nbytes(), 0xFF);
    AMPD_RETURN_IF_ERROR(backend_.CopyFromHost(bytes.data(), bytes.size(), t));
    return t;
  }
  absl::StatusOr<std::vector<double>> Values(const Tensor& t) {
    std::vector<uint8_t> bytes(t.nbytes());
    AMPD_RETURN_IF_ERROR(backend_.CopyToHost(t, bytes.data(), bytes.size()));
    return Decode(t.dtype(), bytes.data(), static_cast<size_t>(t.numel()));
  }
  absl::Status Read(std::string name, const Tensor& t, Tol tol) {
    AMPD_ASSIGN_OR_RETURN(std::vector<double> values, Values(t));
    outputs_.push_back({std::move(name), std::move(values), tol});
    return absl::OkStatus();
  }
  void Add(std::string name, std::vector<double> values, Tol tol) {
    outputs_.push_back({std::move(name), std::move(values), tol});
  }
  Outputs Take() { return std::move(outputs_); }

 private:
  Backend& backend_;
  Outputs outputs_;
};

// ---- the cases ------------------------------------------------------------------
// What a case does, with its inputs captured.
struct CaseFns {
  // Runs the op on a backend with the case's inputs and reads its outputs.
  std::function<absl::StatusOr<Outputs>(Backend&)> run;
  // The same outputs from a float64 reference, in the same order; null
  // where the case has a check instead.
  std::function<Outputs()> reference;
  // For outputs with no cheap reference (random draws): properties the CPU's
  // outputs must have.
  std::function<::testing::AssertionResult(const Outputs&)> check;
};

struct OpCase {
  std::string op;       // the Backend method
  std::string variant;  // dtypes and options
  // Generates the inputs and returns the case's functions. Called when the
  // case runs, so that registering the cases (once per test process under
  // CTest) generates no data.
  std::function<CaseFns()> build;
};

std::string Lower(DType dtype) { return absl::AsciiStrToLower(DTypeName(dtype)); }

const DType kFloatDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
const DType kIdDTypes[] = {DType::kI32, DType::kI64};

double F32(double x) { return kt::RefF32(x); }

// Fill: one value rounded once to the dtype.
void AddFillCases(std::vector<OpCase>& cases) {
  // 65519 rounds down in fp16, 65520 overflows to inf, 1e-8 is below half of
  // fp16's smallest subnormal, 0.1 is inexact everywhere, 3e-38 is near
  // fp32's smallest normal.
  static const float kValues[] = {0.1f, -3.7f, 65519.0f, 65520.0f, 1e-8f, 3e-38f};
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      CaseFns c;
      c.run = [dt](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        for (float v : kValues) {
          AMPD_ASSIGN_OR_RETURN(Tensor t, io.Unwritten(dt, {3, 5}));
          AMPD_RETURN_IF_ERROR(be.Fill(t, v));
          AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("value ", v), t, kBitwise));
        }
        return io.Take();
      };
      c.reference = [dt] {
        Outputs out;
        for (float v : kValues) {
          out.push_back(
              {absl::StrCat("value ", v), std::vector<double>(15, kt::RefStore(dt, v)), kBitwise});
        }
        return out;
      };
      return c;
    };
    cases.push_back({"Fill", Lower(dt), build});
  }
}

// FillTensors: Fill over a list in one pass. Views at every alignment
// inside a larger tensor (whose other elements must keep their values), a
// view that spans several CUDA blocks, mixed dtypes, an empty tensor, and
// more tensors than one CUDA launch takes (128), so the chunking is
// exercised too.
void AddFillTensorsCases(std::vector<OpCase>& cases) {
  // 65520 overflows to inf in fp16; 0 is what a step's zeroing writes.
  static const float kValues[] = {0.0f, -3.7f, 65520.0f};
  // (offset, length) of the views inside each dtype's 10,000-element
  // parent: starts at every 2-byte phase of a 16-byte slot, lengths from one
  // element to 9,000 (over two 16 KiB blocks even in bf16).
  static const std::pair<int64_t, int64_t> kViews[] = {
      {0, 1}, {2, 1}, {5, 3}, {9, 8}, {18, 7}, {27, 16}, {44, 33}, {80, 9000}, {9090, 900}};
  constexpr int64_t kParent = 10000;
  constexpr int kSmall = 140;  // (3) tensors, dtypes in turn
  auto build = [] {
    std::vector<HostTensor> parents;
    uint64_t seed = 4100;
    for (DType dt : kFloatDTypes) parents.push_back(Random(dt, {kParent}, seed++, -2, 2));
    CaseFns c;
    c.run = [parents](Backend& be) -> absl::StatusOr<Outputs> {
      Io io(be);
      for (float v : kValues) {
        std::vector<Tensor> owned;
        std::vector<Tensor> views;
        for (const HostTensor& h : parents) {
          AMPD_ASSIGN_OR_RETURN(Tensor parent, io.Upload(h));
          for (const auto& [offset, length] : kViews) {
            AMPD_ASSIGN_OR_RETURN(Tensor view, parent.View(offset, {length}));
            views.push_back(std::move(view));
          }
          owned.push_back(std::move(parent));
        }
        AMPD_ASSIGN_OR_RETURN(Tensor empty, be.Allocate(DType::kF16, {0, 4}));
        views.push_back(std::move(empty));
        for (int i = 0; i < kSmall; ++i) {
          AMPD_ASSIGN_OR_RETURN(Tensor small, io.Unwritten(kFloatDTypes[i % 3], {3}));
          views.push_back(std::move(small));
        }
        std::vector<Tensor*> dsts;
        for (Tensor& t : views) dsts.push_back(&t);
        AMPD_RETURN_IF_ERROR(be.FillTensors(dsts, v));
        for (size_t p = 0; p < owned.size(); ++p) {
          AMPD_RETURN_IF_ERROR(
              io.Read(absl::StrCat("value ", v, " parent ", p), owned[p], kBitwise));
        }
        std::vector<double> small_values;
        for (size_t i = views.size() - kSmall; i < views.size(); ++i) {
          AMPD_ASSIGN_OR_RETURN(std::vector<double> got, io.Values(views[i]));
          small_values.insert(small_values.end(), got.begin(), got.end());
        }
        io.Add(absl::StrCat("value ", v, " small tensors"), std::move(small_values), kBitwise);
      }
      return io.Take();
    };
    c.reference = [parents] {
      Outputs out;
      for (float v : kValues) {
        for (size_t p = 0; p < parents.size(); ++p) {
          std::vector<double> want = parents[p].values;
          for (const auto& [offset, length] : kViews) {
            for (int64_t i = offset; i < offset + length; ++i) {
              want[static_cast<size_t>(i)] = kt::RefStore(parents[p].dtype, v);
            }
          }
          out.push_back({absl::StrCat("value ", v, " parent ", p), std::move(want), kBitwise});
        }
        std::vector<double> small;
        for (int i = 0; i < kSmall; ++i) {
          small.insert(small.end(), 3, kt::RefStore(kFloatDTypes[i % 3], v));
        }
        out.push_back({absl::StrCat("value ", v, " small tensors"), std::move(small), kBitwise});
      }
      return out;
    };
    return c;
  };
  cases.push_back({"FillTensors", "mixed_views", build});
}

// FillTensors refuses a null or non-float tensor anywhere in the list,
// naming it, before it writes anything.
void AddFillTensorsErrorCases(std::vector<OpCase>& cases) {
  auto build = [] {
    CaseFns c;
    c.run = [](Backend& be) -> absl::StatusOr<Outputs> {
      Io io(be);
      AMPD_ASSIGN_OR_RETURN(Tensor first, io.Upload({DType::kF32, {4}, {1, 2, 3, 4}}));
      AMPD_ASSIGN_OR_RETURN(Tensor ids, be.Allocate(DType::kI32, {4}));
      Tensor* with_null[] = {&first, nullptr};
      Tensor* with_ids[] = {&first, &ids};
      const std::pair<const char*, absl::Span<Tensor* const>> calls[] = {
          {"a null tensor", with_null}, {"an I32 tensor", with_ids}};
      for (const auto& [what, dsts] : calls) {
        const absl::Status s = be.FillTensors(dsts, 0.0f);
        const bool named = s.code() == absl::StatusCode::kInvalidArgument &&
                           absl::StrContains(s.message(), "dsts[1]");
        io.Add(absl::StrCat(what, " is refused by name"), {named ? 1.0 : 0.0}, kBitwise);
      }
      AMPD_RETURN_IF_ERROR(io.Read("first untouched", first, kBitwise));
      return io.Take();
    };
    c.check = [](const Outputs& got) -> ::testing::AssertionResult {
      if (got.size() != 3) return ::testing::AssertionFailure() << got.size() << " outputs";
      for (size_t i = 0; i < 2; ++i) {
        if (got[i].values[0] != 1.0) return ::testing::AssertionFailure() << got[i].name;
      }
      if (got[2].values != std::vector<double>{1, 2, 3, 4}) {
        return ::testing::AssertionFailure() << "the first tensor was written";
      }
      return ::testing::AssertionSuccess();
    };
    return c;
  };
  cases.push_back({"FillTensors", "refusals", build});
}

// Cast: exact widening, one rounding when narrowing.
void AddCastCases(std::vector<OpCase>& cases) {
  for (DType src : kFloatDTypes) {
    for (DType dst : kFloatDTypes) {
      auto build = [=] {
        // Edges of fp16/bf16 rounding, then random values over 60 octaves.
        std::vector<double> raw = {65504.0,       65519.99,      65520.0,   -65536.0,
                                   5.9604645e-08, 2.98e-08,      3.0e-08,   8.940697e-08,
                                   6.1035156e-05, 6.0975552e-05, 1.0009766, 1.0048828,
                                   3.3895314e38,  -INFINITY,     -0.0,      1e-40};
        std::mt19937_64 rng(2);
        std::uniform_real_distribution<double> dist(-1.0, 1.0);
        for (int i = 0; i < 4096; ++i) raw.push_back(dist(rng) * std::ldexp(1.0, i % 60 - 30));
        HostTensor in{src, {static_cast<int64_t>(raw.size())}, {}};
        for (double v : raw) in.values.push_back(kt::RefStore(src, F32(v)));
        CaseFns c;
        c.run = [in, dst](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor s, io.Upload(in));
          AMPD_ASSIGN_OR_RETURN(Tensor d, io.Unwritten(dst, in.shape));
          AMPD_RETURN_IF_ERROR(be.Cast(s, d));
          AMPD_RETURN_IF_ERROR(io.Read("dst", d, kBitwise));
          return io.Take();
        };
        c.reference = [in, dst] {
          std::vector<double> want;
          for (double v : in.values) want.push_back(kt::RefStore(dst, v));
          return Outputs{{"dst", want, kBitwise}};
        };
        return c;
      };
      cases.push_back({"Cast", absl::StrCat(Lower(src), "_to_", Lower(dst)), build});
    }
  }
}

// Copy: the bytes, unchanged.
void AddCopyCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      const HostTensor src = Random(dt, {10, 100}, 3, -5, 5);
      CaseFns c;
      c.run = [src](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor s, io.Upload(src));
        AMPD_ASSIGN_OR_RETURN(Tensor d, io.Unwritten(src.dtype, {1000}));
        AMPD_RETURN_IF_ERROR(be.Copy(s, d));
        AMPD_RETURN_IF_ERROR(io.Read("dst", d, kBitwise));
        return io.Take();
      };
      c.reference = [src] { return Outputs{{"dst", src.values, kBitwise}}; };
      return c;
    };
    cases.push_back({"Copy", Lower(dt), build});
  }
}

// CopyColumns: a column block into another matrix's, bitwise, the rest of
// dst kept. Shapes that take each CUDA path: "odd" offsets and widths (one
// element per access; tall enough that the grid-stride loop goes round
// more than once), "aligned" blocks whose offsets, strides and width are
// multiples of 16 bytes (16-byte accesses), and integer dtypes of 8 and 1
// bytes for the other element sizes.
void AddCopyColumnsCases(std::vector<OpCase>& cases) {
  struct Block {
    const char* name;
    int64_t rows, src_width, src_col, cols, dst_width, dst_col;
  };
  static const Block kBlocks[] = {
      {"odd", 4099, 301, 7, 293, 307, 11},
      {"aligned", 64, 1024, 256, 512, 768, 128},
      {"edges", 3, 40, 32, 8, 8, 0},
  };
  const DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kI64, DType::kU8};
  for (DType dt : kDTypes) {
    for (const Block& k : kBlocks) {
      if (!IsFloating(dt) && std::string(k.name) == "edges") continue;
      auto random = [dt](const Shape& shape, uint64_t seed) {
        if (IsFloating(dt)) return Random(dt, shape, seed, -5, 5);
        HostTensor h = Ids(dt, NumElements(shape), seed, 256);
        h.shape = shape;
        return h;
      };
      auto build = [=] {
        const HostTensor src = random({k.rows, k.src_width}, 28);
        const HostTensor dst = random({k.rows, k.dst_width}, 29);
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor s, io.Upload(src));
          AMPD_ASSIGN_OR_RETURN(Tensor d, io.Upload(dst));
          AMPD_RETURN_IF_ERROR(be.CopyColumns(s, k.src_col, k.cols, d, k.dst_col));
          AMPD_RETURN_IF_ERROR(io.Read("dst", d, kBitwise));
          AMPD_RETURN_IF_ERROR(io.Read("src", s, kBitwise));
          return io.Take();
        };
        c.reference = [=] {
          std::vector<double> want = dst.values;
          for (int64_t r = 0; r < k.rows; ++r) {
            for (int64_t j = 0; j < k.cols; ++j) {
              want[static_cast<size_t>(r * k.dst_width + k.dst_col + j)] =
                  src.values[static_cast<size_t>(r * k.src_width + k.src_col + j)];
            }
          }
          return Outputs{{"dst", want, kBitwise}, {"src", src.values, kBitwise}};
        };
        return c;
      };
      cases.push_back({"CopyColumns", absl::StrCat(Lower(dt), "_", k.name), build});
    }
  }
}

// ReadBack: scalars written by queued ops (the read must wait for them) and
// a raw copy of a tensor in the case's dtype, in one call.
void AddReadBackCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      const HostTensor scalars = Random(DType::kF32, {40}, 26, -100, 100);
      const HostTensor copied = Random(dt, {7, 9}, 27, -3, 3);
      const float bump = 0.375f;
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor b, io.Scalar(bump));
        std::vector<Tensor> s;
        for (double v : scalars.values) {
          AMPD_ASSIGN_OR_RETURN(Tensor t, io.Scalar(static_cast<float>(v)));
          AMPD_RETURN_IF_ERROR(be.Add(b, t));
          s.push_back(std::move(t));
        }
        AMPD_ASSIGN_OR_RETURN(Tensor t, io.Upload(copied));
        std::vector<const Tensor*> ptrs;
        for (const Tensor& x : s) ptrs.push_back(&x);
        std::vector<float> out(ptrs.size(), -1.0f);
        std::vector<uint8_t> host(t.nbytes());
        const HostCopy copies[] = {{&t, host.data(), host.size()}};
        AMPD_RETURN_IF_ERROR(be.ReadBack(ptrs, absl::MakeSpan(out), copies));
        AMPD_RETURN_IF_ERROR(be.Synchronize());
        io.Add("scalars", std::vector<double>(out.begin(), out.end()), kBitwise);
        io.Add("copy", Decode(dt, host.data(), static_cast<size_t>(t.numel())), kBitwise);
        return io.Take();
      };
      c.reference = [=] {
        std::vector<double> want;
        for (double v : scalars.values) want.push_back(F32(v + bump));
        return Outputs{{"scalars", want, kBitwise}, {"copy", copied.values, kBitwise}};
      };
      return c;
    };
    cases.push_back({"ReadBack", Lower(dt), build});
  }
}

// Add: y += x in fp32, one rounding to y's dtype, any mix of dtypes; then
// the aliased y += y.
void AddAddCases(std::vector<OpCase>& cases) {
  for (DType ydt : kFloatDTypes) {
    for (DType xdt : kFloatDTypes) {
      auto build = [=] {
        HostTensor x = Random(xdt, {33, 70}, 24, -3, 3);
        HostTensor y = Random(ydt, {33, 70}, 25, -3, 3);
        // Exact cancellation, fp16 overflow, a tie in fp16/bf16 (2049), fp16
        // subnormals: the edges where a second rounding would show.
        const double xe[] = {1.5, 40000.0, 1.0, std::ldexp(1.0, -24)};
        const double ye[] = {-1.5, 30000.0, 2048.0, std::ldexp(3.0, -24)};
        for (int i = 0; i < 4; ++i) {
          x.values[static_cast<size_t>(i)] = kt::RefStore(xdt, xe[i]);
          y.values[static_cast<size_t>(i)] = kt::RefStore(ydt, ye[i]);
        }
        CaseFns c;
        c.run = [x, y](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(y));
          AMPD_RETURN_IF_ERROR(be.Add(tx, ty));
          AMPD_RETURN_IF_ERROR(io.Read("y", ty, kBitwise));
          AMPD_RETURN_IF_ERROR(be.Add(ty, ty));
          AMPD_RETURN_IF_ERROR(io.Read("y += y", ty, kBitwise));
          return io.Take();
        };
        c.reference = [x, y] {
          std::vector<double> sum, twice;
          for (size_t i = 0; i < y.values.size(); ++i) {
            sum.push_back(kt::RefStore(y.dtype, F32(x.values[i] + y.values[i])));
            twice.push_back(kt::RefStore(y.dtype, F32(sum.back() + sum.back())));
          }
          return Outputs{{"y", sum, kBitwise}, {"y += y", twice, kBitwise}};
        };
        return c;
      };
      cases.push_back({"Add", absl::StrCat("x_", Lower(xdt), "_y_", Lower(ydt)), build});
    }
  }
}

// AddScaled: y = scale * (y + x) in fp32, one rounding to y's dtype. Scales
// 2^12 and 2^-12 carry 16-bit sums out of and into the subnormal range
// (what a GPT's per-block loss scales do to the residual gradient), where
// rounding the sum first and scaling it after would lose bits; 0.75 is not
// a power of two, so the product's own fp32 rounding shows too.
void AddAddScaledCases(std::vector<OpCase>& cases) {
  for (DType ydt : kFloatDTypes) {
    for (const double scale : {std::ldexp(1.0, 12), std::ldexp(1.0, -12), 0.75}) {
      auto build = [=] {
        HostTensor x = Random(DType::kF16, {17, 40}, 26, -3, 3);
        HostTensor y = Random(ydt, {17, 40}, 27, -3, 3);
        // Sums at fp16's smallest subnormals and near its largest finite.
        const double xe[] = {std::ldexp(1.0, -24), std::ldexp(3.0, -24), 30000.0, 1.0};
        const double ye[] = {std::ldexp(1.0, -24), std::ldexp(-1.0, -24), 30000.0, 2048.0};
        for (int i = 0; i < 4; ++i) {
          x.values[static_cast<size_t>(i)] = kt::RefStore(DType::kF16, xe[i]);
          y.values[static_cast<size_t>(i)] = kt::RefStore(ydt, ye[i]);
        }
        CaseFns c;
        c.run = [x, y, scale](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(y));
          AMPD_RETURN_IF_ERROR(be.AddScaled(tx, static_cast<float>(scale), ty));
          AMPD_RETURN_IF_ERROR(io.Read("y", ty, kBitwise));
          return io.Take();
        };
        c.reference = [x, y, scale] {
          std::vector<double> want;
          for (size_t i = 0; i < y.values.size(); ++i) {
            want.push_back(kt::RefStore(y.dtype, F32(F32(x.values[i] + y.values[i]) * F32(scale))));
          }
          return Outputs{{"y", want, kBitwise}};
        };
        return c;
      };
      cases.push_back({"AddScaled", absl::StrCat(Lower(ydt), "_scale_", scale), build});
    }
  }
}

// AddBias: y (N, C) += bias (C) in fp32, one rounding.
void AddAddBiasCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      const HostTensor y = Random(dt, {33, 70}, 20, -3, 3);
      const HostTensor b = Random(dt, {70}, 21, -3, 3);
      CaseFns c;
      c.run = [y, b](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(y));
        AMPD_ASSIGN_OR_RETURN(Tensor tb, io.Upload(b));
        AMPD_RETURN_IF_ERROR(be.AddBias(tb, ty));
        AMPD_RETURN_IF_ERROR(io.Read("y", ty, kBitwise));
        return io.Take();
      };
      c.reference = [y, b] {
        std::vector<double> want;
        for (size_t i = 0; i < y.values.size(); ++i) {
          want.push_back(kt::RefStore(y.dtype, F32(y.values[i] + b.values[i % 70])));
        }
        return Outputs{{"y", want, kBitwise}};
      };
      return c;
    };
    cases.push_back({"AddBias", Lower(dt), build});
  }
}

// BiasGrad: dbias = column sums of dy + beta * dbias.
void AddBiasGradCases(std::vector<OpCase>& cases) {
  const int64_t rows = 300, cols = 70;
  for (DType dt : kFloatDTypes) {
    for (float beta : {0.0f, 1.0f}) {
      auto build = [=] {
        const HostTensor dy = Random(dt, {rows, cols}, 30, -1, 1);
        const HostTensor db = Random(dt, {cols}, 31, -1, 1);
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
          AMPD_ASSIGN_OR_RETURN(Tensor tdb, io.Upload(db));
          AMPD_RETURN_IF_ERROR(be.BiasGrad(tdy, beta, tdb));
          // CUDA sums the rows in another order: ~2^-24 per row of |dy| < 1.
          AMPD_RETURN_IF_ERROR(io.Read("dbias", tdb, DeviceElementwise(dt) + Tol{0, rows * 6e-8}));
          return io.Take();
        };
        c.reference = [=] {
          std::vector<double> want(cols);
          for (int64_t col = 0; col < cols; ++col) {
            double s = 0;
            for (int64_t r = 0; r < rows; ++r) s += dy.values[static_cast<size_t>(r * cols + col)];
            want[static_cast<size_t>(col)] = s + beta * db.values[static_cast<size_t>(col)];
          }
          // A sequential fp32 sum of 300 terms below 1 in magnitude: each of
          // the 300 additions rounds a partial sum (below 300) by at most
          // half its ulp; in practice the errors cancel like a random walk,
          // and 4 u per row bounds them with a wide margin.
          return Outputs{{"dbias", want, Ulps(dt, 1) + Tol{0, 4 * rows * kU32}}};
        };
        return c;
      };
      cases.push_back({"BiasGrad", absl::StrCat(Lower(dt), "_beta", beta), build});
    }
  }
}

// Gemm: every transpose, output in fp32 and in the input dtype.
void AddGemmCases(std::vector<OpCase>& cases) {
  const int64_t m = 37, n = 45, k = 70;
  const float alpha = 0.75f, beta = 0.5f;
  for (DType dt : kFloatDTypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        auto build = [=] {
          const HostTensor a = Random(dt, ta ? Shape{k, m} : Shape{m, k}, 10, -1, 1);
          const HostTensor b = Random(dt, tb ? Shape{n, k} : Shape{k, n}, 11, -1, 1);
          const HostTensor c32 = Random(DType::kF32, {m, n}, 12, -1, 1);
          const HostTensor cdt = Random(dt, {m, n}, 12, -1, 1);
          CaseFns c;
          c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
            Io io(be);
            AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(a));
            AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(b));
            for (const HostTensor* out : {&c32, &cdt}) {
              AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Upload(*out));
              AMPD_RETURN_IF_ERROR(be.Gemm(ta, tb, alpha, tx, tw, beta, tc));
              // fp32 sums of k products in another order: ~k 2^-24 absolute.
              AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("c ", Lower(out->dtype)), tc,
                                           DeviceElementwise(out->dtype) + Tol{0, k * 6e-8}));
            }
            return io.Take();
          };
          c.reference = [=] {
            auto at = [&](int64_t i, int64_t p) {
              return a.values[static_cast<size_t>(ta ? p * m + i : i * k + p)];
            };
            auto bt = [&](int64_t p, int64_t j) {
              return b.values[static_cast<size_t>(tb ? j * k + p : p * n + j)];
            };
            Outputs out;
            for (const HostTensor* c0 : {&c32, &cdt}) {
              std::vector<double> want(static_cast<size_t>(m * n));
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  double s = 0;
                  for (int64_t p = 0; p < k; ++p) s += at(i, p) * bt(p, j);
                  want[static_cast<size_t>(i * n + j)] =
                      alpha * s + beta * c0->values[static_cast<size_t>(i * n + j)];
                }
              }
              // BLAS accumulates the k products (|a b| < 1) in fp32 in a
              // blocked order of its choosing: 4 u per product bounds it.
              out.push_back({absl::StrCat("c ", Lower(c0->dtype)), want,
                             Ulps(c0->dtype, 1) + Tol{0, 4 * k * kU32}});
            }
            return out;
          };
          return c;
        };
        cases.push_back({"Gemm", absl::StrCat(Lower(dt), ta ? "_t" : "_n", tb ? "t" : "n"), build});
      }
    }
  }
  // A power-of-two alpha scales the fp32 sum before its one rounding, so a
  // 16-bit c is exactly 2^e times alpha = 1's wherever both are normal:
  // per-layer loss scales move the upstream gradient between layer groups
  // this way. Outputs: c(2^e) - 2^e c(1) over the elements where 2^e c(1)
  // is a normal value of the dtype (0 elsewhere), which must be 0 exactly.
  for (DType dt : {DType::kF16, DType::kBF16}) {
    auto build = [=] {
      const HostTensor a = Random(dt, {m, k}, 13, -1, 1);
      const HostTensor b = Random(dt, {n, k}, 14, -1, 1);
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(a));
        AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(b));
        AMPD_ASSIGN_OR_RETURN(Tensor one, io.Unwritten(dt, {m, n}));
        AMPD_RETURN_IF_ERROR(be.Gemm(false, true, 1.0f, tx, tw, 0.0f, one));
        AMPD_ASSIGN_OR_RETURN(const std::vector<double> base, io.Values(one));
        const double min_normal = dt == DType::kF16 ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126);
        const double max_finite = dt == DType::kF16 ? 65504.0 : 3.0e38;
        for (const int e : {-7, 5}) {
          AMPD_ASSIGN_OR_RETURN(Tensor scaled, io.Unwritten(dt, {m, n}));
          AMPD_RETURN_IF_ERROR(be.Gemm(false, true, std::ldexp(1.0f, e), tx, tw, 0.0f, scaled));
          AMPD_ASSIGN_OR_RETURN(const std::vector<double> got, io.Values(scaled));
          std::vector<double> diff(got.size(), 0.0);
          for (size_t i = 0; i < got.size(); ++i) {
            const double want = std::ldexp(base[i], e);
            const double mag = std::fabs(want);
            if (mag >= min_normal && mag <= max_finite) diff[i] = got[i] - want;
          }
          io.Add(absl::StrCat("c(2^", e, ") - 2^", e, " c(1)"), std::move(diff), kBitwise);
        }
        return io.Take();
      };
      c.reference = [=] {
        Outputs out;
        for (const int e : {-7, 5}) {
          out.push_back({absl::StrCat("c(2^", e, ") - 2^", e, " c(1)"),
                         std::vector<double>(static_cast<size_t>(m * n), 0.0), kBitwise});
        }
        return out;
      };
      return c;
    };
    cases.push_back({"Gemm", absl::StrCat(Lower(dt), "_pow2_alpha"), build});
  }
}

// ---- the Linear ops: GEMMs with their epilogues ----
// op(x)[i, p] of a row-major host matrix stored transposed or not.
struct HostGemm {
  HostTensor a, b;
  bool ta, tb;
  int64_t m, n, k;
  double A(int64_t i, int64_t p) const {
    return a.values[static_cast<size_t>(ta ? p * m + i : i * k + p)];
  }
  double B(int64_t p, int64_t j) const {
    return b.values[static_cast<size_t>(tb ? j * k + p : p * n + j)];
  }
  // The exact sum over K in double, and the sum of |terms| (the scale of
  // an fp32 summation's error).
  double Sum(int64_t i, int64_t j, double* abs_sum = nullptr) const {
    double s = 0, as = 0;
    for (int64_t p = 0; p < k; ++p) {
      s += A(i, p) * B(p, j);
      as += std::fabs(A(i, p) * B(p, j));
    }
    if (abs_sum != nullptr) *abs_sum = as;
    return s;
  }
};

HostGemm RandomGemm(DType dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, uint64_t seed,
                    double b_range) {
  return {Random(dt, ta ? Shape{k, m} : Shape{m, k}, seed, -1, 1),
          Random(dt, tb ? Shape{n, k} : Shape{k, n}, seed + 1, -b_range, b_range),
          ta,
          tb,
          m,
          n,
          k};
}

std::string Trans(bool ta, bool tb) { return absl::StrCat(ta ? "t" : "n", tb ? "t" : "n"); }

// GELU computed by cuBLASLt's epilogue on F16/BF16 may use its own fp32
// tanh. A tanh within 2^-10 relative moves gelu_tanh(p) = 0.5 p (1 + t) by
// at most 0.5 |p| 2^-10 < 1e-3 for the |p| < 2 of these cases (a bias in
// [-1, 1] plus sums of k = 64 products below 1/16 in magnitude, of
// standard deviation 0.17), and the derivative (GemmActivationBackward) by
// 2^-10 (0.5 + 0.8 |x| (1 + 0.134 x^2)) < 6e-3 for |x| <= 3, times |g|
// below 0.35 there (products below 1/32): 2e-3 covers both, far below
// what a wrong bias, GELU or layout moves the outputs by (O(0.1)).
constexpr double kEpilogueGeluAtol = 2e-3;

// GemmBiasActivation: c = act(op(a) op(b) + bias) with pre the rounded
// pre-activation; the bias is added to the fp32 sums before the one
// rounding of each output, the GELU evaluated on the unrounded sum. n = 48
// keeps cuBLASLt's GELU epilogue eligible (aux leading dim % 8 == 0); n =
// 45 takes the separate path on every backend.
void AddGemmBiasActivationCases(std::vector<OpCase>& cases) {
  const int64_t m = 37, k = 64;
  for (DType dt : kFloatDTypes) {
    for (GemmActivation act : {GemmActivation::kNone, GemmActivation::kGELUTanh}) {
      const bool gelu = act == GemmActivation::kGELUTanh;
      for (const auto& [ta, tb] : {std::pair{false, false}, {false, true}, {true, false}}) {
        for (const int64_t n : {int64_t{48}, int64_t{45}}) {
          for (const bool with_bias : {true, false}) {
            if (!with_bias && !gelu) continue;  // that is Gemm
            auto build = [=] {
              // |sums| <= k / 16 = 4: within the GELU's interesting range.
              const HostGemm g = RandomGemm(dt, ta, tb, m, n, k, 50, 1.0 / 16);
              const HostTensor bias = Random(dt, {n}, 52, -1, 1);
              CaseFns c;
              c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                Io io(be);
                AMPD_ASSIGN_OR_RETURN(Tensor ta_, io.Upload(g.a));
                AMPD_ASSIGN_OR_RETURN(Tensor tb_, io.Upload(g.b));
                AMPD_ASSIGN_OR_RETURN(Tensor tbias, io.Upload(bias));
                AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Unwritten(dt, {m, n}));
                AMPD_ASSIGN_OR_RETURN(Tensor tpre, io.Unwritten(dt, {m, n}));
                AMPD_RETURN_IF_ERROR(be.GemmBiasActivation(ta, tb, ta_, tb_,
                                                           with_bias ? &tbias : nullptr, act, tc,
                                                           gelu ? &tpre : nullptr));
                // Another backend's fp32 sums run in another order: ~k 2^-24.
                // And cuBLASLt's epilogue may round a 16-bit output's sum to
                // the dtype before it adds the bias (seen on an H100 for
                // some shapes; backend.h): half an ulp of the largest |sum|.
                double max_sum = 0;
                for (int64_t i = 0; i < m; ++i) {
                  for (int64_t j = 0; j < n; ++j)
                    max_sum = std::max(max_sum, std::fabs(g.Sum(i, j)));
                }
                const double bias_rounding = dt == DType::kF32 ? 0.0 : kt::Eps(dt) / 2 * max_sum;
                const Tol sums = DeviceElementwise(dt) + Tol{0, k * 6e-8 + bias_rounding};
                AMPD_RETURN_IF_ERROR(io.Read(
                    "c", tc, gelu && dt != DType::kF32 ? sums + Tol{0, kEpilogueGeluAtol} : sums));
                if (gelu) AMPD_RETURN_IF_ERROR(io.Read("pre", tpre, sums));
                return io.Take();
              };
              c.reference = [=] {
                std::vector<double> want_c, want_pre;
                double worst_abs = 0;
                for (int64_t i = 0; i < m; ++i) {
                  for (int64_t j = 0; j < n; ++j) {
                    double abs_sum = 0;
                    const double p = g.Sum(i, j, &abs_sum) +
                                     (with_bias ? bias.values[static_cast<size_t>(j)] : 0);
                    worst_abs = std::max(worst_abs, abs_sum);
                    want_pre.push_back(p);
                    want_c.push_back(gelu ? RefGeluTanh(p) : p);
                  }
                }
                // BLAS's blocked fp32 sum: 4 u per term of the sum of |terms|,
                // then the bias's addition (one u of p), then one rounding to
                // the dtype. The GELU (slope below 1.2) carries that error
                // and adds its own fp32 evaluation's (ActivationForward's
                // 16 u relative, 64 u absolute).
                const Tol sum_tol = Ulps(dt, 1) + Tol{kU32, 4 * k * kU32 * worst_abs};
                const Tol c_tol =
                    gelu ? Ulps(dt, 1) + Tol{16 * kU32, 64 * kU32 + 1.2 * sum_tol.atol} : sum_tol;
                Outputs out{{"c", want_c, c_tol}};
                if (gelu) out.push_back({"pre", want_pre, sum_tol});
                return out;
              };
              return c;
            };
            cases.push_back({"GemmBiasActivation",
                             absl::StrCat(Lower(dt), gelu ? "_gelu_tanh_" : "_none_", Trans(ta, tb),
                                          "_n", n, with_bias ? "" : "_nobias"),
                             build});
          }
        }
      }
    }
  }
}

// GemmBiasGrad: dW = op(a) op(b) + beta dW and db = column sums of the dy
// operand (a transposed, or b) + beta db, each rounded once; dW in a's
// dtype and in F32, db in a's dtype and in F32.
void AddGemmBiasGradCases(std::vector<OpCase>& cases) {
  const int64_t m = 40, n = 48, k = 300;  // k: the rows (tokens) summed over
  for (DType dt : kFloatDTypes) {
    for (const BiasGradOf of : {BiasGradOf::kA, BiasGradOf::kB}) {
      const bool of_a = of == BiasGradOf::kA;
      for (float beta : {0.0f, 1.0f}) {
        const std::vector<DType> out_dtypes =
            dt == DType::kF32 ? std::vector<DType>{dt} : std::vector<DType>{dt, DType::kF32};
        for (const DType out_dt : out_dtypes) {
          auto build = [=] {
            // The engine's layouts: dW = dy^T x (of a) or x^T dy (of b).
            const HostGemm g = RandomGemm(dt, /*ta=*/true, /*tb=*/false, m, n, k, 60, 1.0);
            const int64_t width = of_a ? m : n;
            const HostTensor c0 = Random(out_dt, {m, n}, 62, -1, 1);
            const HostTensor db0 = Random(out_dt, {width}, 63, -1, 1);
            CaseFns c;
            c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
              Io io(be);
              AMPD_ASSIGN_OR_RETURN(Tensor ta_, io.Upload(g.a));
              AMPD_ASSIGN_OR_RETURN(Tensor tb_, io.Upload(g.b));
              AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Upload(c0));
              AMPD_ASSIGN_OR_RETURN(Tensor tdb, io.Upload(db0));
              AMPD_RETURN_IF_ERROR(be.GemmBiasGrad(true, false, ta_, tb_, beta, tc, of, tdb));
              // Other summation orders: ~2^-24 per term of |terms| < 1.
              const Tol tol = DeviceElementwise(out_dt) + Tol{0, k * 6e-8};
              AMPD_RETURN_IF_ERROR(io.Read("c", tc, tol));
              AMPD_RETURN_IF_ERROR(io.Read("dbias", tdb, tol));
              return io.Take();
            };
            c.reference = [=] {
              std::vector<double> want_c, want_db(static_cast<size_t>(width), 0.0);
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  want_c.push_back(g.Sum(i, j) + beta * c0.values[static_cast<size_t>(i * n + j)]);
                }
              }
              for (int64_t p = 0; p < k; ++p) {
                for (int64_t w = 0; w < width; ++w) {
                  want_db[static_cast<size_t>(w)] += of_a ? g.A(w, p) : g.B(p, w);
                }
              }
              for (int64_t w = 0; w < width; ++w) {
                want_db[static_cast<size_t>(w)] += beta * db0.values[static_cast<size_t>(w)];
              }
              // As Gemm's and BiasGrad's cases: 4 u per product or row.
              return Outputs{{"c", want_c, Ulps(out_dt, 1) + Tol{0, 4 * k * kU32}},
                             {"dbias", want_db, Ulps(out_dt, 1) + Tol{0, 4 * k * kU32}}};
            };
            return c;
          };
          cases.push_back({"GemmBiasGrad",
                           absl::StrCat(Lower(dt), of_a ? "_of_a" : "_of_b", "_beta", beta, "_out_",
                                        Lower(out_dt)),
                           build});
        }
      }
    }
  }
}

// The one rounding, bitwise: sums exact in fp32 that lie half an ulp of the
// dtype above 1 (a tie), plus a bias or an old value of a quarter ulp. One
// rounding of the fp32 total goes up; rounding the sum first (to 1, the
// even neighbour) and then adding would stay at 1. So these catch an
// epilogue that adds the bias, or a bias gradient that accumulates, after
// a rounding to the 16-bit dtype. Every backend must give these bits.
void AddOneRoundingCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    const double half_ulp = kt::Eps(dt) / 2;  // at 1
    const int64_t m = 4, n = 16;
    // GemmBiasActivation: a (m, 2) of ones, b (2, n) = [1; half_ulp], so
    // every sum is 1 + half_ulp; the bias alternates +-half_ulp / 2.
    auto forward = [=] {
      const HostTensor a{dt, {m, 2}, std::vector<double>(static_cast<size_t>(m * 2), 1.0)};
      HostTensor b{dt, {2, n}, {}};
      for (int64_t j = 0; j < n; ++j) b.values.push_back(1.0);
      for (int64_t j = 0; j < n; ++j) b.values.push_back(half_ulp);
      HostTensor bias{dt, {n}, {}};
      for (int64_t j = 0; j < n; ++j)
        bias.values.push_back(j % 2 == 0 ? half_ulp / 2 : -half_ulp / 2);
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor ta, io.Upload(a));
        AMPD_ASSIGN_OR_RETURN(Tensor tb, io.Upload(b));
        AMPD_ASSIGN_OR_RETURN(Tensor tbias, io.Upload(bias));
        AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Unwritten(dt, {m, n}));
        AMPD_RETURN_IF_ERROR(be.GemmBiasActivation(false, false, ta, tb, &tbias,
                                                   GemmActivation::kNone, tc, nullptr));
        AMPD_RETURN_IF_ERROR(io.Read("c", tc, kBitwise));
        return io.Take();
      };
      c.reference = [=] {
        std::vector<double> want;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            want.push_back(
                kt::RefStore(dt, F32(F32(1.0 + half_ulp) + bias.values[static_cast<size_t>(j)])));
          }
        }
        return Outputs{{"c", want, kBitwise}};
      };
      return c;
    };
    cases.push_back({"GemmBiasActivation", absl::StrCat(Lower(dt), "_one_rounding"), forward});

    // GemmBiasGrad with beta 1: dy (2, n) = [1; half_ulp] and x (2, m) of
    // ones, so dW and db both add 1 + half_ulp to an old half_ulp / 2.
    auto grad = [=] {
      const HostTensor x{dt, {2, m}, std::vector<double>(static_cast<size_t>(2 * m), 1.0)};
      HostTensor dy{dt, {2, n}, {}};
      for (int64_t j = 0; j < n; ++j) dy.values.push_back(1.0);
      for (int64_t j = 0; j < n; ++j) dy.values.push_back(half_ulp);
      const HostTensor c0{
          dt, {m, n}, std::vector<double>(static_cast<size_t>(m * n), half_ulp / 2)};
      const HostTensor db0{dt, {n}, std::vector<double>(static_cast<size_t>(n), half_ulp / 2)};
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
        AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
        AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Upload(c0));
        AMPD_ASSIGN_OR_RETURN(Tensor tdb, io.Upload(db0));
        AMPD_RETURN_IF_ERROR(be.GemmBiasGrad(true, false, tx, tdy, 1.0f, tc, BiasGradOf::kB, tdb));
        AMPD_RETURN_IF_ERROR(io.Read("c", tc, kBitwise));
        AMPD_RETURN_IF_ERROR(io.Read("dbias", tdb, kBitwise));
        return io.Take();
      };
      c.reference = [=] {
        const double one = kt::RefStore(dt, F32(F32(1.0 + half_ulp) + half_ulp / 2));
        return Outputs{{"c", std::vector<double>(static_cast<size_t>(m * n), one), kBitwise},
                       {"dbias", std::vector<double>(static_cast<size_t>(n), one), kBitwise}};
      };
      return c;
    };
    cases.push_back({"GemmBiasGrad", absl::StrCat(Lower(dt), "_one_rounding"), grad});
  }
}

// GemmActivationBackward: c = (alpha op(a) op(b)) * gelu_tanh'(pre), the
// fp32 sums never rounded before the product; kNone is a plain GEMM.
void AddGemmActivationBackwardCases(std::vector<OpCase>& cases) {
  const int64_t m = 37, n = 48, k = 64;
  for (DType dt : kFloatDTypes) {
    for (GemmActivation act : {GemmActivation::kNone, GemmActivation::kGELUTanh}) {
      const bool gelu = act == GemmActivation::kGELUTanh;
      for (const auto& [ta, tb] : {std::pair{false, true}, {false, false}, {true, false}}) {
        for (const float alpha : {1.0f, 0.5f}) {
          auto build = [=] {
            // |g| <= k / 32 * alpha (in practice below 0.35); pre in [-3, 3].
            const HostGemm g = RandomGemm(dt, ta, tb, m, n, k, 70, 1.0 / 32);
            const HostTensor pre = Random(dt, {m, n}, 72, -3, 3);
            CaseFns c;
            c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
              Io io(be);
              AMPD_ASSIGN_OR_RETURN(Tensor ta_, io.Upload(g.a));
              AMPD_ASSIGN_OR_RETURN(Tensor tb_, io.Upload(g.b));
              AMPD_ASSIGN_OR_RETURN(Tensor tpre, io.Upload(pre));
              AMPD_ASSIGN_OR_RETURN(Tensor tc, io.Unwritten(dt, {m, n}));
              AMPD_RETURN_IF_ERROR(be.GemmActivationBackward(ta, tb, alpha, ta_, tb_, act,
                                                             gelu ? &tpre : nullptr, tc));
              // A cuBLASLt DGELU may use its own tanh (kEpilogueGeluAtol).
              const Tol sums = DeviceElementwise(dt) + Tol{0, k * 6e-8};
              AMPD_RETURN_IF_ERROR(io.Read(
                  "c", tc, gelu && dt != DType::kF32 ? sums + Tol{0, kEpilogueGeluAtol} : sums));
              return io.Take();
            };
            c.reference = [=] {
              std::vector<double> want;
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  const double s = alpha * g.Sum(i, j);
                  want.push_back(
                      gelu ? s * RefGeluTanhGrad(pre.values[static_cast<size_t>(i * n + j)]) : s);
                }
              }
              // The fp32 sum's 4 u per term (each below 1/32), times the
              // derivative (below 1.2), plus the derivative's fp32
              // evaluation (as ActivationBackward's case: 16 u relative,
              // 64 u absolute per unit of |g| <= k / 32 = 2).
              const Tol tol = Ulps(dt, 1) + Tol{16 * kU32, (1.2 * 4 * k / 32 + 64 * 2) * kU32};
              return Outputs{{"c", want, tol}};
            };
            return c;
          };
          cases.push_back({"GemmActivationBackward",
                           absl::StrCat(Lower(dt), gelu ? "_gelu_tanh_" : "_none_", Trans(ta, tb),
                                        "_alpha", alpha),
                           build});
        }
      }
    }
  }
}

// ---- activations ----
double RefNormalCdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double RefNormalPdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi); }

std::string ActName(Activation act) {
  switch (act) {
    case Activation::kReLU:
      return "relu";
    case Activation::kGELU:
      return "gelu";
    case Activation::kTanh:
      return "tanh";
    case Activation::kGELUTanh:
      return "gelu_tanh";
  }
  return "?";
}

void AddActivationCases(std::vector<OpCase>& cases) {
  const int64_t n = 5000;
  for (Activation act :
       {Activation::kReLU, Activation::kGELU, Activation::kTanh, Activation::kGELUTanh}) {
    for (DType dt : kFloatDTypes) {
      const bool relu = act == Activation::kReLU;
      // ReLU is a selection: bitwise everywhere. GELU and tanh go through
      // fp32 erfcf/expf/tanhf (within an ulp or two of exact in glibc) and a
      // few fp32 operations on values below 6, and tanh's derivative
      // 1 - t^2 cancels near saturation to an absolute error of a few u
      // times |dy| < 2: 16 u relative plus 16 u absolute covers both, then
      // one rounding to the dtype.
      // GELUTanh's argument sqrt(2/pi) (x + 0.044715 x^3) reaches 12 at |x| = 6,
      // so its few roundings move tanh by up to ~40 u before tanh' damps
      // them; 64 u absolute covers that and its derivative's terms.
      const Tol ref_tol =
          relu ? kBitwise
               : Ulps(dt, 1) + Tol{16 * kU32, (act == Activation::kGELUTanh ? 64 : 16) * kU32};
      const Tol dev_tol = relu ? kBitwise : DeviceElementwise(dt);
      // The derivative's cancellation (1 - t^2 near saturation) turns the
      // ulp or two by which CUDA's tanhf and glibc's each miss the exact tanh
      // into an absolute difference of several u times |dy| (seen on an
      // H100: 4 u for tanh, 6 u for GELU-tanh); each backend is within the
      // reference's absolute term of exact, so two of them are within twice it.
      const Tol dev_grad_tol =
          relu ? kBitwise
               : DeviceElementwise(dt) + Tol{0, (act == Activation::kGELUTanh ? 128 : 32) * kU32};

      auto forward = [=] {
        const HostTensor x = Random(dt, {50, 100}, 40, -6, 6);
        CaseFns f;
        f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Unwritten(dt, x.shape));
          AMPD_RETURN_IF_ERROR(be.ActivationForward(act, tx, ty));
          AMPD_RETURN_IF_ERROR(io.Read("y", ty, dev_tol));
          return io.Take();
        };
        f.reference = [=] {
          std::vector<double> want;
          for (double v : x.values) {
            double r = 0.0;
            switch (act) {
              case Activation::kReLU:
                r = v > 0 ? v : 0.0;
                break;
              case Activation::kGELU:
                r = v * RefNormalCdf(v);
                break;
              case Activation::kGELUTanh:
                r = RefGeluTanh(v);
                break;
              default:
                r = std::tanh(v);
            }
            want.push_back(relu ? kt::RefStore(dt, r) : r);
          }
          return Outputs{{"y", want, ref_tol}};
        };
        return f;
      };
      cases.push_back({"ActivationForward", absl::StrCat(ActName(act), "_", Lower(dt)), forward});

      auto backward = [=] {
        const HostTensor x = Random(dt, {50, 100}, 40, -6, 6);
        const HostTensor dy = Random(dt, {50, 100}, 41, -2, 2);
        CaseFns b;
        b.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
          AMPD_ASSIGN_OR_RETURN(Tensor tdx, io.Unwritten(dt, x.shape));
          AMPD_RETURN_IF_ERROR(be.ActivationBackward(act, tx, tdy, tdx));
          AMPD_RETURN_IF_ERROR(io.Read("dx", tdx, dev_grad_tol));
          return io.Take();
        };
        b.reference = [=] {
          std::vector<double> want;
          for (int64_t i = 0; i < n; ++i) {
            const double v = x.values[static_cast<size_t>(i)];
            const double g = dy.values[static_cast<size_t>(i)];
            double r = 0.0;
            switch (act) {
              case Activation::kReLU:
                r = v > 0 ? g : 0.0;
                break;
              case Activation::kGELU:
                r = g * (RefNormalCdf(v) + v * RefNormalPdf(v));
                break;
              case Activation::kGELUTanh:
                r = g * RefGeluTanhGrad(v);
                break;
              default: {
                const double t = std::tanh(v);
                r = g * (1.0 - t * t);
              }
            }
            want.push_back(relu ? kt::RefStore(dt, r) : r);
          }
          return Outputs{{"dx", want, ref_tol}};
        };
        return b;
      };
      cases.push_back({"ActivationBackward", absl::StrCat(ActName(act), "_", Lower(dt)), backward});
    }
  }
}

// ---- LayerNorm ----
struct RowStats {
  std::vector<double> mean, rstd;
};
RowStats RefStats(const HostTensor& x, int64_t rows, int64_t cols, double eps) {
  RowStats s;
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += x.values[static_cast<size_t>(r * cols + c)];
    const double mu = sum / static_cast<double>(cols);
    double sq = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double d = x.values[static_cast<size_t>(r * cols + c)] - mu;
      sq += d * d;
    }
    s.mean.push_back(mu);
    s.rstd.push_back(1.0 / std::sqrt(sq / static_cast<double>(cols) + eps));
  }
  return s;
}

void AddLayerNormCases(std::vector<OpCase>& cases) {
  const int64_t rows = 67, cols = 300;
  const float eps = 1e-5f;
  for (DType dt : kFloatDTypes) {
    for (bool affine : {true, false}) {
      const std::string variant = absl::StrCat(Lower(dt), affine ? "_affine" : "_plain");
      // The statistics: fp32 sums of 300 values in [-2, 4] (mean ~1,
      // rstd ~0.6) whose rounding errors a random walk keeps near
      // sqrt(300) u relative; 2e-5 allows 80 times that.
      const Tol stat_tol{2e-5, 2e-5};

      auto forward = [=] {
        const HostTensor x = Random(dt, {rows, cols}, 50, -2, 4);
        const HostTensor gamma = Random(dt, {cols}, 51, 0.5, 1.5);
        const HostTensor beta = Random(dt, {cols}, 52, -0.5, 0.5);
        CaseFns f;
        f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor tg, io.Upload(gamma));
          AMPD_ASSIGN_OR_RETURN(Tensor tb, io.Upload(beta));
          AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Unwritten(dt, x.shape));
          AMPD_ASSIGN_OR_RETURN(Tensor tm, io.Unwritten(DType::kF32, {rows}));
          AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Unwritten(DType::kF32, {rows}));
          AMPD_RETURN_IF_ERROR(be.LayerNormForward(tx, affine ? &tg : nullptr,
                                                   affine ? &tb : nullptr, eps, ty, tm, tr));
          AMPD_RETURN_IF_ERROR(io.Read("mean", tm, {1e-5, 1e-6}));
          AMPD_RETURN_IF_ERROR(io.Read("rstd", tr, {1e-5, 1e-6}));
          AMPD_RETURN_IF_ERROR(io.Read("y", ty, DeviceElementwise(dt) + Tol{0, 1e-5}));
          return io.Take();
        };
        f.reference = [=] {
          const RowStats s = RefStats(x, rows, cols, eps);
          std::vector<double> y;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) {
              double v =
                  (x.values[static_cast<size_t>(r * cols + c)] - s.mean[static_cast<size_t>(r)]) *
                  s.rstd[static_cast<size_t>(r)];
              if (affine) {
                v = v * gamma.values[static_cast<size_t>(c)] + beta.values[static_cast<size_t>(c)];
              }
              y.push_back(v);
            }
          }
          // y = xhat gamma + beta with |xhat| < 4: the statistics' error
          // times 4, plus the dtype's rounding.
          return Outputs{{"mean", s.mean, stat_tol},
                         {"rstd", s.rstd, stat_tol},
                         {"y", y, Ulps(dt, 1) + Tol{2e-5, 8e-5}}};
        };
        return f;
      };
      cases.push_back({"LayerNormForward", variant, forward});

      auto backward = [=] {
        const HostTensor x = Random(dt, {rows, cols}, 50, -2, 4);
        const HostTensor gamma = Random(dt, {cols}, 51, 0.5, 1.5);
        const HostTensor dy = Random(dt, {rows, cols}, 53, -1, 1);
        const HostTensor pg = Random(dt, {cols}, 54, -1, 1);
        // Backward takes the statistics as inputs: the float64 ones rounded to
        // fp32, the same on every backend.
        const RowStats s = RefStats(x, rows, cols, eps);
        HostTensor mean{DType::kF32, {rows}, {}}, rstd{DType::kF32, {rows}, {}};
        for (int64_t r = 0; r < rows; ++r) {
          mean.values.push_back(F32(s.mean[static_cast<size_t>(r)]));
          rstd.values.push_back(F32(s.rstd[static_cast<size_t>(r)]));
        }
        CaseFns b;
        b.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
          AMPD_ASSIGN_OR_RETURN(Tensor tg, io.Upload(gamma));
          AMPD_ASSIGN_OR_RETURN(Tensor tm, io.Upload(mean));
          AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Upload(rstd));
          AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
          AMPD_ASSIGN_OR_RETURN(Tensor tdx, io.Unwritten(dt, x.shape));
          AMPD_ASSIGN_OR_RETURN(Tensor tdg, io.Upload(pg));
          AMPD_ASSIGN_OR_RETURN(Tensor tdb, io.Upload(pg));
          AMPD_RETURN_IF_ERROR(be.LayerNormBackward(tx, affine ? &tg : nullptr, tm, tr, tdy, tdx,
                                                    affine ? &tdg : nullptr,
                                                    affine ? &tdb : nullptr));
          // Row sums in another order on the device: 1e-6 per row summed.
          const Tol tol = DeviceElementwise(dt) + Tol{0, 1e-5 + rows * 1e-6};
          AMPD_RETURN_IF_ERROR(io.Read("dx", tdx, tol));
          if (affine) {
            AMPD_RETURN_IF_ERROR(io.Read("dgamma", tdg, tol));
            AMPD_RETURN_IF_ERROR(io.Read("dbeta", tdb, tol));
          }
          return io.Take();
        };
        b.reference = [=] {
          std::vector<double> dx, dg(pg.values), dbt(pg.values);
          for (int64_t r = 0; r < rows; ++r) {
            std::vector<double> xhat(cols), dxhat(cols);
            double sum_dxhat = 0, sum_dxhat_xhat = 0;
            for (int64_t c = 0; c < cols; ++c) {
              const size_t i = static_cast<size_t>(r * cols + c);
              const size_t ci = static_cast<size_t>(c);
              xhat[ci] = (x.values[i] - mean.values[static_cast<size_t>(r)]) *
                         rstd.values[static_cast<size_t>(r)];
              dxhat[ci] = affine ? dy.values[i] * gamma.values[ci] : dy.values[i];
              sum_dxhat += dxhat[ci];
              sum_dxhat_xhat += dxhat[ci] * xhat[ci];
              dg[ci] += dy.values[i] * xhat[ci];
              dbt[ci] += dy.values[i];
            }
            for (int64_t c = 0; c < cols; ++c) {
              const size_t ci = static_cast<size_t>(c);
              dx.push_back(rstd.values[static_cast<size_t>(r)] *
                           (dxhat[ci] - sum_dxhat / cols - xhat[ci] * sum_dxhat_xhat / cols));
            }
          }
          // dx: two fp32 row sums of 300 terms (|dxhat| < 1.5, |xhat| < 4)
          // scaled by 1/C, whose rounding a random walk keeps near sqrt(300) u
          // of the sums' magnitudes: 1e-5 absolute allows a hundredfold that.
          // dgamma, dbeta: fp32 column sums of 67 terms below 4 (dgamma) or 1
          // (dbeta): 8 u per summed term.
          Outputs out{{"dx", dx, Ulps(dt, 1) + Tol{16 * kU32, 1e-5}}};
          if (affine) {
            out.push_back({"dgamma", dg, Ulps(dt, 1) + Tol{0, 8 * 4 * rows * kU32}});
            out.push_back({"dbeta", dbt, Ulps(dt, 1) + Tol{0, 8 * rows * kU32}});
          }
          return out;
        };
        return b;
      };
      cases.push_back({"LayerNormBackward", variant, backward});
    }
  }
}

// ---- RMSNorm ----
void AddRmsNormCases(std::vector<OpCase>& cases) {
  const int64_t rows = 67, cols = 320;
  const float eps = 1e-6f;
  // offset 0: Llama's RMSNorm (scale w); 1: Gemma's (scale 1 + w, the
  // checkpoint's w near 0).
  for (const float offset : {0.0f, 1.0f}) {
    for (DType dt : kFloatDTypes) {
      const std::string variant = absl::StrCat(Lower(dt), offset != 0.0f ? "_offset1" : "");
      const double w_lo = offset != 0.0f ? -0.5 : 0.5, w_hi = offset != 0.0f ? 0.5 : 1.5;
      auto ref_rstd = [=](const HostTensor& x) {
        std::vector<double> rstd;
        for (int64_t r = 0; r < rows; ++r) {
          double sq = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const double v = x.values[static_cast<size_t>(r * cols + c)];
            sq += v * v;
          }
          rstd.push_back(1.0 / std::sqrt(sq / static_cast<double>(cols) + eps));
        }
        return rstd;
      };
      cases.push_back(
          {"RmsNormForward", variant, [=] {
             const HostTensor x = Random(dt, {rows, cols}, 60, -2, 2);
             const HostTensor w = Random(dt, {cols}, 61, w_lo, w_hi);
             CaseFns f;
             f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
               Io io(be);
               AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
               AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(w));
               AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Unwritten(dt, x.shape));
               AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Unwritten(DType::kF32, {rows}));
               AMPD_RETURN_IF_ERROR(be.RmsNormForward(tx, tw, eps, offset, ty, tr));
               AMPD_RETURN_IF_ERROR(io.Read("rstd", tr, {1e-5, 1e-6}));
               AMPD_RETURN_IF_ERROR(io.Read("y", ty, DeviceElementwise(dt) + Tol{0, 1e-5}));
               return io.Take();
             };
             f.reference = [=] {
               const std::vector<double> rstd = ref_rstd(x);
               std::vector<double> y;
               for (int64_t r = 0; r < rows; ++r) {
                 for (int64_t c = 0; c < cols; ++c) {
                   y.push_back(x.values[static_cast<size_t>(r * cols + c)] *
                               rstd[static_cast<size_t>(r)] *
                               (offset + w.values[static_cast<size_t>(c)]));
                 }
               }
               // The fp32 sum of 320 squares (relative error near
               // sqrt(320) u by a random walk; 2e-5 allows 60 times
               // that) and y's rounding to the dtype.
               return Outputs{{"rstd", rstd, Tol{2e-5, 0}},
                              {"y", y, Ulps(dt, 1) + Tol{2e-5, 4e-5}}};
             };
             return f;
           }});
      // frozen: dweight nullptr (a LoRA fine-tune's base weight), dx alone.
      for (bool frozen : {false, true}) {
        cases.push_back(
            {"RmsNormBackward", frozen ? variant + "_frozen" : variant, [=] {
               const HostTensor x = Random(dt, {rows, cols}, 60, -2, 2);
               const HostTensor w = Random(dt, {cols}, 61, w_lo, w_hi);
               const HostTensor dy = Random(dt, {rows, cols}, 62, -1, 1);
               const HostTensor pw = Random(dt, {cols}, 63, -1, 1);
               HostTensor rstd{DType::kF32, {rows}, {}};
               for (double v : ref_rstd(x)) rstd.values.push_back(F32(v));
               CaseFns b;
               b.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                 Io io(be);
                 AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
                 AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(w));
                 AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Upload(rstd));
                 AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
                 AMPD_ASSIGN_OR_RETURN(Tensor tdx, io.Unwritten(dt, x.shape));
                 AMPD_ASSIGN_OR_RETURN(Tensor tdw, io.Upload(pw));
                 AMPD_RETURN_IF_ERROR(
                     be.RmsNormBackward(tx, tw, offset, tr, tdy, tdx, frozen ? nullptr : &tdw));
                 const Tol tol = DeviceElementwise(dt) + Tol{0, 1e-5 + rows * 1e-6};
                 AMPD_RETURN_IF_ERROR(io.Read("dx", tdx, tol));
                 if (!frozen) {
                   AMPD_RETURN_IF_ERROR(io.Read("dweight", tdw, tol));
                 } else {
                   // On every backend dx must not depend on whether dweight
                   // is formed: the same bits with it as without.
                   AMPD_ASSIGN_OR_RETURN(Tensor tdx2, io.Unwritten(dt, x.shape));
                   AMPD_RETURN_IF_ERROR(be.RmsNormBackward(tx, tw, offset, tr, tdy, tdx2, &tdw));
                   AMPD_ASSIGN_OR_RETURN(std::vector<double> without, io.Values(tdx));
                   AMPD_ASSIGN_OR_RETURN(std::vector<double> with, io.Values(tdx2));
                   io.Add("dx the same with dweight", {without == with ? 1.0 : 0.0}, kBitwise);
                 }
                 return io.Take();
               };
               b.reference = [=] {
                 std::vector<double> dx, dw(pw.values);
                 for (int64_t r = 0; r < rows; ++r) {
                   const double rs = rstd.values[static_cast<size_t>(r)];
                   double sum_gx = 0;
                   for (int64_t c = 0; c < cols; ++c) {
                     const size_t i = static_cast<size_t>(r * cols + c);
                     const double xhat = x.values[i] * rs;
                     sum_gx += dy.values[i] * (offset + w.values[static_cast<size_t>(c)]) * xhat;
                     dw[static_cast<size_t>(c)] += dy.values[i] * xhat;
                   }
                   for (int64_t c = 0; c < cols; ++c) {
                     const size_t i = static_cast<size_t>(r * cols + c);
                     const double g = dy.values[i] * (offset + w.values[static_cast<size_t>(c)]);
                     dx.push_back(rs * (g - x.values[i] * rs * sum_gx / cols));
                   }
                 }
                 // As LayerNorm's: a row sum of 320 terms below 3 and
                 // column sums of 67 terms below 2 in fp32.
                 Outputs out{{"dx", dx, Ulps(dt, 1) + Tol{16 * kU32, 1e-5}}};
                 if (!frozen) {
                   out.push_back({"dweight", dw, Ulps(dt, 1) + Tol{0, 8 * 2 * rows * kU32}});
                 } else {
                   out.push_back({"dx the same with dweight", {1.0}, kBitwise});
                 }
                 return out;
               };
               return b;
             }});
      }
    }
  }
}

// ---- RMSNorm per head (Qwen3's q_norm / k_norm) ----
// Fused rows (R, W) whose heads [col, col + heads D) are normalised each on
// its own: the q heads of a q|k|v row from column 0 (D 24, whose 16-byte
// vectors CUDA loads), and k heads from an odd column (D 20 from column
// 100 of rows of 150: no vector fits). in_place: y is x (the decoder's
// use); otherwise y starts as NaN and every column outside the heads must
// stay so. The backward writes dx over dy, whose other columns must keep
// their values.
void AddHeadRmsNormCases(std::vector<OpCase>& cases) {
  struct Layout {
    const char* name;
    int64_t rows, width, col, heads, d;
    float offset;  // Gemma 3's q_norm and k_norm scale by 1 + w
  };
  const Layout layouts[] = {{"q_heads", 37, 192, 0, 4, 24, 0.0f},
                            {"k_heads_odd", 29, 150, 100, 2, 20, 0.0f},
                            {"k_heads_offset1", 29, 150, 100, 2, 20, 1.0f}};
  const float eps = 1e-6f;
  for (const Layout& at : layouts) {
    for (DType dt : kFloatDTypes) {
      const std::string variant = absl::StrCat(at.name, "_", Lower(dt));
      const int64_t rows = at.rows, width = at.width, col = at.col, heads = at.heads, d = at.d;
      const float offset = at.offset;
      const double w_lo = offset != 0.0f ? -0.5 : 0.5, w_hi = offset != 0.0f ? 0.5 : 1.5;
      // (R, heads) in double from x.
      auto ref_rstd = [=](const HostTensor& x) {
        std::vector<double> rstd;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t h = 0; h < heads; ++h) {
            double sq = 0;
            for (int64_t c = 0; c < d; ++c) {
              const double v = x.values[static_cast<size_t>(r * width + col + h * d + c)];
              sq += v * v;
            }
            rstd.push_back(1.0 / std::sqrt(sq / static_cast<double>(d) + eps));
          }
        }
        return rstd;
      };
      for (bool in_place : {true, false}) {
        cases.push_back(
            {"HeadRmsNormForward", in_place ? variant + "_in_place" : variant, [=] {
               const HostTensor x = Random(dt, {rows, width}, 64, -2, 2);
               const HostTensor w = Random(dt, {d}, 65, w_lo, w_hi);
               CaseFns f;
               f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                 Io io(be);
                 AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
                 AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(w));
                 AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Unwritten(dt, x.shape));
                 AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Unwritten(DType::kF32, {rows, heads}));
                 AMPD_RETURN_IF_ERROR(be.HeadRmsNormForward(tx, col, heads, tw, eps, offset,
                                                            in_place ? tx : ty, tr));
                 AMPD_RETURN_IF_ERROR(io.Read("rstd", tr, {1e-5, 1e-6}));
                 AMPD_RETURN_IF_ERROR(
                     io.Read("y", in_place ? tx : ty, DeviceElementwise(dt) + Tol{0, 1e-5}));
                 return io.Take();
               };
               f.reference = [=] {
                 const std::vector<double> rstd = ref_rstd(x);
                 std::vector<double> y(in_place ? x.values
                                                : std::vector<double>(x.values.size(), NAN));
                 for (int64_t r = 0; r < rows; ++r) {
                   for (int64_t h = 0; h < heads; ++h) {
                     for (int64_t c = 0; c < d; ++c) {
                       const auto i = static_cast<size_t>(r * width + col + h * d + c);
                       y[i] = x.values[i] * rstd[static_cast<size_t>(r * heads + h)] *
                              (offset + w.values[static_cast<size_t>(c)]);
                     }
                   }
                 }
                 // As RmsNormForward's, over sums of D squares.
                 return Outputs{{"rstd", rstd, Tol{2e-5, 0}},
                                {"y", y, Ulps(dt, 1) + Tol{2e-5, 4e-5}}};
               };
               return f;
             }});
      }
      // frozen: dweight nullptr (a LoRA job's frozen q_norm), dx alone.
      for (bool frozen : {false, true}) {
        cases.push_back(
            {"HeadRmsNormBackward", frozen ? variant + "_frozen" : variant, [=] {
               const HostTensor x = Random(dt, {rows, width}, 64, -2, 2);
               const HostTensor w = Random(dt, {d}, 65, w_lo, w_hi);
               const HostTensor dy = Random(dt, {rows, width}, 66, -1, 1);
               const HostTensor pw = Random(dt, {d}, 67, -1, 1);
               HostTensor rstd{DType::kF32, {rows, heads}, {}};
               for (double v : ref_rstd(x)) rstd.values.push_back(F32(v));
               CaseFns b;
               b.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                 Io io(be);
                 AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
                 AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(w));
                 AMPD_ASSIGN_OR_RETURN(Tensor tr, io.Upload(rstd));
                 AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));  // dx in place
                 AMPD_ASSIGN_OR_RETURN(Tensor tdw, io.Upload(pw));
                 AMPD_RETURN_IF_ERROR(be.HeadRmsNormBackward(tx, col, heads, tw, offset, tr, tdy,
                                                             tdy, frozen ? nullptr : &tdw));
                 const Tol tol = DeviceElementwise(dt) + Tol{0, 1e-5 + rows * heads * 1e-6};
                 AMPD_RETURN_IF_ERROR(io.Read("dx", tdy, tol));
                 if (!frozen) {
                   AMPD_RETURN_IF_ERROR(io.Read("dweight", tdw, tol));
                 } else {
                   // dx does not depend on whether dweight is formed.
                   AMPD_ASSIGN_OR_RETURN(Tensor again, io.Upload(dy));
                   AMPD_RETURN_IF_ERROR(
                       be.HeadRmsNormBackward(tx, col, heads, tw, offset, tr, again, again, &tdw));
                   AMPD_ASSIGN_OR_RETURN(std::vector<double> without, io.Values(tdy));
                   AMPD_ASSIGN_OR_RETURN(std::vector<double> with, io.Values(again));
                   io.Add("dx the same with dweight", {without == with ? 1.0 : 0.0}, kBitwise);
                 }
                 return io.Take();
               };
               b.reference = [=] {
                 std::vector<double> dx(dy.values), dw(pw.values);
                 for (int64_t r = 0; r < rows; ++r) {
                   for (int64_t h = 0; h < heads; ++h) {
                     const double rs = rstd.values[static_cast<size_t>(r * heads + h)];
                     const int64_t start = r * width + col + h * d;
                     double sum_gx = 0;
                     for (int64_t c = 0; c < d; ++c) {
                       const auto i = static_cast<size_t>(start + c);
                       const double xhat = x.values[i] * rs;
                       sum_gx += dy.values[i] * (offset + w.values[static_cast<size_t>(c)]) * xhat;
                       dw[static_cast<size_t>(c)] += dy.values[i] * xhat;
                     }
                     for (int64_t c = 0; c < d; ++c) {
                       const auto i = static_cast<size_t>(start + c);
                       const double g = dy.values[i] * (offset + w.values[static_cast<size_t>(c)]);
                       dx[i] = rs * (g - x.values[i] * rs * sum_gx / static_cast<double>(d));
                     }
                   }
                 }
                 // As RmsNormBackward's: dweight sums R x heads terms below 2.
                 Outputs out{{"dx", dx, Ulps(dt, 1) + Tol{16 * kU32, 1e-5}}};
                 if (!frozen) {
                   out.push_back(
                       {"dweight", dw, Ulps(dt, 1) + Tol{0, 8 * 2 * rows * heads * kU32}});
                 } else {
                   out.push_back({"dx the same with dweight", {1.0}, kBitwise});
                 }
                 return out;
               };
               return b;
             }});
      }
    }
  }
}

// ---- grouped-query K/V heads ----
void AddKvHeadsCases(std::vector<OpCase>& cases) {
  // 6 query heads sharing 2 K/V heads (groups of 3) of 5 channels.
  const int64_t batch = 2, seq = 7, heads = 6, kv_heads = 2, d = 5;
  const int64_t width = (heads + 2 * kv_heads) * d, group = heads / kv_heads;
  // Column of expanded (B T, 3 H D) element (part, h, c) in the compact row.
  auto source_col = [=](int64_t part, int64_t h, int64_t c) {
    return part == 0 ? h * d + c : (heads + (part - 1) * kv_heads + h / group) * d + c;
  };
  for (DType dt : kFloatDTypes) {
    cases.push_back(
        {"ExpandKvHeads", Lower(dt), [=] {
           const HostTensor src = Random(dt, {batch, seq, width}, 90, -3, 3);
           CaseFns f;
           f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
             Io io(be);
             AMPD_ASSIGN_OR_RETURN(Tensor ts, io.Upload(src));
             AMPD_ASSIGN_OR_RETURN(Tensor td, io.Unwritten(dt, {batch, seq, 3 * heads * d}));
             AMPD_RETURN_IF_ERROR(be.ExpandKvHeads(ts, heads, kv_heads, td));
             AMPD_RETURN_IF_ERROR(io.Read("dst", td, kBitwise));
             return io.Take();
           };
           f.reference = [=] {
             std::vector<double> out;
             for (int64_t r = 0; r < batch * seq; ++r) {
               for (int64_t part = 0; part < 3; ++part) {
                 for (int64_t h = 0; h < heads; ++h) {
                   for (int64_t c = 0; c < d; ++c) {
                     out.push_back(
                         src.values[static_cast<size_t>(r * width + source_col(part, h, c))]);
                   }
                 }
               }
             }
             return Outputs{{"dst", out, kBitwise}};
           };
           return f;
         }});
    cases.push_back(
        {"ReduceKvHeads", Lower(dt), [=] {
           const HostTensor dexp = Random(dt, {batch, seq, 3 * heads * d}, 91, -1, 1);
           CaseFns f;
           f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
             Io io(be);
             AMPD_ASSIGN_OR_RETURN(Tensor te, io.Upload(dexp));
             AMPD_ASSIGN_OR_RETURN(Tensor ts, io.Unwritten(dt, {batch, seq, width}));
             AMPD_RETURN_IF_ERROR(be.ReduceKvHeads(te, heads, kv_heads, ts));
             // The same fp32 order on every backend: the same bits.
             AMPD_RETURN_IF_ERROR(io.Read("dsrc", ts, kBitwise));
             return io.Take();
           };
           f.reference = [=] {
             std::vector<double> out(static_cast<size_t>(batch * seq * width), 0.0);
             for (int64_t r = 0; r < batch * seq; ++r) {
               for (int64_t part = 0; part < 3; ++part) {
                 for (int64_t h = 0; h < heads; ++h) {
                   for (int64_t c = 0; c < d; ++c) {
                     out[static_cast<size_t>(r * width + source_col(part, h, c))] +=
                         dexp.values[static_cast<size_t>((r * 3 + part) * heads * d + h * d + c)];
                   }
                 }
               }
             }
             // Three terms below 1 summed in fp32, then one rounding.
             return Outputs{{"dsrc", out, Ulps(dt, 1) + Tol{0, 4 * kU32}}};
           };
           return f;
         }});
  }
}

// ---- rotary position embeddings ----
// inv_freq as a Llama config with rope_theta 10000 gives it, for head_dim D.
HostTensor InvFreq(int64_t head_dim, double theta) {
  HostTensor f{DType::kF32, {head_dim / 2}, {}};
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    f.values.push_back(F32(1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim)));
  }
  return f;
}

void AddRopeCases(std::vector<OpCase>& cases) {
  // Two q heads and one k head of 16 rotated; a v head of 16 and 5 more
  // columns untouched. Positions up to 900 (given) or T - 1 (implicit).
  const int64_t batch = 2, seq = 37, head_dim = 16, heads = 3, width = 4 * head_dim + 5;
  for (DType dt : kFloatDTypes) {
    for (bool given : {false, true}) {
      for (bool inverse : {false, true}) {
        const std::string variant =
            absl::StrCat(Lower(dt), given ? "_positions" : "_implicit", inverse ? "_inverse" : "");
        cases.push_back(
            {"Rope", variant, [=] {
               const HostTensor x = Random(dt, {batch, seq, width}, 70, -2, 2);
               const HostTensor freq = InvFreq(head_dim, 10000.0);
               const HostTensor pos = Ids(DType::kI64, batch * seq, 71, 900);
               CaseFns f;
               f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                 Io io(be);
                 AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(x));
                 AMPD_ASSIGN_OR_RETURN(Tensor tf, io.Upload(freq));
                 HostTensor p2 = pos;
                 p2.shape = {batch, seq};
                 AMPD_ASSIGN_OR_RETURN(Tensor tp, io.Upload(p2));
                 AMPD_RETURN_IF_ERROR(
                     be.Rope(tx, heads, head_dim, tf, given ? &tp : nullptr, inverse));
                 // cosf/sinf of angles up to 900 rad: CUDA's and
                 // glibc's each within a couple of fp32 ulps.
                 AMPD_RETURN_IF_ERROR(io.Read("x", tx, DeviceElementwise(dt) + Tol{0, 4e-6}));
                 return io.Take();
               };
               f.reference = [=] {
                 std::vector<double> y = x.values;
                 const int64_t half = head_dim / 2;
                 for (int64_t r = 0; r < batch * seq; ++r) {
                   const double p = given ? pos.values[static_cast<size_t>(r)] : r % seq;
                   for (int64_t i = 0; i < half; ++i) {
                     // The fp32 angle, as the contract forms it.
                     const double angle = F32(p * freq.values[static_cast<size_t>(i)]);
                     const double c = std::cos(angle);
                     const double sn = inverse ? -std::sin(angle) : std::sin(angle);
                     for (int64_t h = 0; h < heads; ++h) {
                       const size_t a = static_cast<size_t>(r * width + h * head_dim + i);
                       const size_t b2 = a + static_cast<size_t>(half);
                       const double x1 = x.values[a], x2 = x.values[b2];
                       y[a] = x1 * c - x2 * sn;
                       y[b2] = x2 * c + x1 * sn;
                     }
                   }
                 }
                 // fp32 cos/sin and two products and a sum (|x| <= 2).
                 return Outputs{{"x", y, Ulps(dt, 1) + Tol{0, 16 * 2 * kU32}}};
               };
               return f;
             }});
      }
    }
  }
}

// ---- the gated MLP: SwiGLU and GeGLU ----
void AddGatedMulCases(std::vector<OpCase>& cases) {
  const Shape shape{29, 67};  // odd: the vector tails too
  for (GluActivation act : {GluActivation::kSiLU, GluActivation::kGELUTanh}) {
    const bool silu = act == GluActivation::kSiLU;
    const std::string name = silu ? "silu" : "gelu_tanh";
    // act(g) and act'(g) in double.
    auto ref_act = [=](double g) { return silu ? g / (1.0 + std::exp(-g)) : RefGeluTanh(g); };
    auto ref_grad = [=](double g) {
      if (!silu) return RefGeluTanhGrad(g);
      const double sg = 1.0 / (1.0 + std::exp(-g));
      return sg * (1.0 + g * (1.0 - sg));
    };
    // SiLU: exp, the sum, the quotient and two products in fp32 (12 u);
    // act' = s (1 + g (1 - s)) cancels in 1 - s near u32 where s is near 1,
    // times |g| <= 8 and |dy u| <= 3. GELU-tanh: the activation tests'
    // bounds (64 u absolute on act and act', the argument's few roundings
    // moving tanh before tanh' damps them), times |u| <= 3 and |dy u| <= 3.
    const Tol act_tol = silu ? Tol{12 * kU32, 0} : Tol{16 * kU32, 3 * 64 * kU32};
    const Tol grad_tol = silu ? Tol{16 * kU32, 3 * 8 * 4 * kU32} : Tol{16 * kU32, 3 * 64 * kU32};
    // CUDA against the CPU on dgate: as the pointwise activations' (an H100
    // showed 6 u between tanhf and glibc's tanh through GELU-tanh's
    // derivative), times |dy u| <= 3.
    const Tol dev_grad_floor = silu ? Tol{0, 3e-6} : Tol{0, 3 * 128 * kU32};
    for (DType dt : kFloatDTypes) {
      const std::string variant = absl::StrCat(name, "_", Lower(dt));
      cases.push_back({"GatedMulForward", variant, [=] {
                         const HostTensor g = Random(dt, shape, 80, -8, 8);
                         const HostTensor u = Random(dt, shape, 81, -3, 3);
                         CaseFns f;
                         f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
                           Io io(be);
                           AMPD_ASSIGN_OR_RETURN(Tensor tg, io.Upload(g));
                           AMPD_ASSIGN_OR_RETURN(Tensor tu, io.Upload(u));
                           AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Unwritten(dt, shape));
                           AMPD_RETURN_IF_ERROR(be.GatedMulForward(act, tg, tu, ty));
                           AMPD_RETURN_IF_ERROR(io.Read("y", ty, DeviceElementwise(dt)));
                           return io.Take();
                         };
                         f.reference = [=] {
                           std::vector<double> y;
                           for (size_t i = 0; i < g.values.size(); ++i) {
                             y.push_back(ref_act(g.values[i]) * u.values[i]);
                           }
                           return Outputs{{"y", y, Ulps(dt, 1) + act_tol + Tol{0, DenormMin(dt)}}};
                         };
                         return f;
                       }});
      cases.push_back(
          {"GatedMulBackward", variant, [=] {
             const HostTensor g = Random(dt, shape, 80, -8, 8);
             const HostTensor u = Random(dt, shape, 81, -3, 3);
             const HostTensor dy = Random(dt, shape, 82, -1, 1);
             CaseFns f;
             f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
               Io io(be);
               AMPD_ASSIGN_OR_RETURN(Tensor tg, io.Upload(g));
               AMPD_ASSIGN_OR_RETURN(Tensor tu, io.Upload(u));
               AMPD_ASSIGN_OR_RETURN(Tensor tdy, io.Upload(dy));
               AMPD_ASSIGN_OR_RETURN(Tensor tdg, io.Unwritten(dt, shape));
               AMPD_ASSIGN_OR_RETURN(Tensor tdu, io.Unwritten(dt, shape));
               AMPD_RETURN_IF_ERROR(be.GatedMulBackward(act, tg, tu, tdy, tdg, tdu));
               AMPD_RETURN_IF_ERROR(io.Read("dgate", tdg, DeviceElementwise(dt) + dev_grad_floor));
               AMPD_RETURN_IF_ERROR(io.Read("dup", tdu, DeviceElementwise(dt)));
               return io.Take();
             };
             f.reference = [=] {
               std::vector<double> dg, du;
               for (size_t i = 0; i < g.values.size(); ++i) {
                 const double gv = g.values[i];
                 dg.push_back(dy.values[i] * u.values[i] * ref_grad(gv));
                 du.push_back(dy.values[i] * ref_act(gv));
               }
               return Outputs{{"dgate", dg, Ulps(dt, 1) + grad_tol},
                              {"dup", du, Ulps(dt, 1) + act_tol + Tol{0, DenormMin(dt)}}};
             };
             return f;
           }});
    }
  }
}

// ---- embedding ----
void AddEmbeddingCases(std::vector<OpCase>& cases) {
  const int64_t vocab = 50, cols = 40, n = 500;  // n >> vocab: ids repeat
  // scale 1: a lookup; 6.3125 (sqrt(40) to bf16's 8 bits, exact in every
  // dtype): Gemma's sqrt(hidden_size), one rounding of the product.
  for (const float scale : {1.0f, 6.3125f}) {
    for (DType dt : kFloatDTypes) {
      for (DType idt : kIdDTypes) {
        const std::string variant =
            absl::StrCat(Lower(dt), "_ids_", Lower(idt), scale != 1.0f ? "_scaled" : "");

        auto forward = [=] {
          const HostTensor table = Random(dt, {vocab, cols}, 60, -1, 1);
          const HostTensor ids = Ids(idt, n, 62, vocab);
          CaseFns f;
          f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
            Io io(be);
            AMPD_ASSIGN_OR_RETURN(Tensor tid, io.Upload(ids));
            AMPD_ASSIGN_OR_RETURN(Tensor tt, io.Upload(table));
            AMPD_ASSIGN_OR_RETURN(Tensor to, io.Unwritten(dt, {n, cols}));
            AMPD_RETURN_IF_ERROR(be.EmbeddingForward(tid, tt, scale, to));
            AMPD_RETURN_IF_ERROR(io.Read("out", to, kBitwise));
            return io.Take();
          };
          f.reference = [=] {
            std::vector<double> want;
            for (double id : ids.values) {
              for (int64_t c = 0; c < cols; ++c) {
                want.push_back(kt::RefStore(
                    dt, table.values[static_cast<size_t>(static_cast<int64_t>(id) * cols + c)] *
                            scale));
              }
            }
            return Outputs{{"out", want, kBitwise}};
          };
          return f;
        };
        cases.push_back({"EmbeddingForward", variant, forward});

        auto backward = [=] {
          const HostTensor table = Random(dt, {vocab, cols}, 60, -1, 1);
          const HostTensor dout = Random(dt, {n, cols}, 61, -1, 1);
          const HostTensor ids = Ids(idt, n, 62, vocab);
          CaseFns b;
          b.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
            Io io(be);
            AMPD_ASSIGN_OR_RETURN(Tensor tid, io.Upload(ids));
            AMPD_ASSIGN_OR_RETURN(Tensor tt, io.Upload(table));
            AMPD_ASSIGN_OR_RETURN(Tensor tdo, io.Upload(dout));
            AMPD_RETURN_IF_ERROR(be.EmbeddingBackward(tid, tdo, scale, tt));
            // The same fp32 adds in the same (batch) order per row.
            AMPD_RETURN_IF_ERROR(io.Read("dtable", tt, kBitwise));
            return io.Take();
          };
          b.reference = [=] {
            std::vector<double> want(table.values);
            std::vector<int> hits(static_cast<size_t>(vocab), 0);
            for (int64_t i = 0; i < n; ++i) {
              const int64_t id = static_cast<int64_t>(ids.values[static_cast<size_t>(i)]);
              ++hits[static_cast<size_t>(id)];
              for (int64_t c = 0; c < cols; ++c) {
                want[static_cast<size_t>(id * cols + c)] +=
                    kt::RefStore(dt, dout.values[static_cast<size_t>(i * cols + c)] * scale);
              }
            }
            // Each row: an fp32 sum of its hits (terms below scale), added to
            // a value below 1: one rounding of a partial sum below `hits`
            // scale per hit.
            const int most = *std::max_element(hits.begin(), hits.end());
            return Outputs{
                {"dtable", want, Ulps(dt, 1) + Tol{0, (most + 1) * most * scale * kU32}}};
          };
          return b;
        };
        cases.push_back({"EmbeddingBackward", variant, backward});
      }
    }
  }
}

// ---- losses ----
void AddLossCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      const int64_t rows = 256, cols = 100, count = rows * cols;
      const HostTensor pred = Random(dt, {rows, cols}, 80, -2, 2);
      const HostTensor target = Random(DType::kF32, {rows, cols}, 81, -2, 2);
      const float multiplier = 0.5f, scale = 1024.0f;
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor tp, io.Upload(pred));
        AMPD_ASSIGN_OR_RETURN(Tensor tt, io.Upload(target));
        AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Unwritten(DType::kF32, {1}));
        AMPD_ASSIGN_OR_RETURN(Tensor td, io.Unwritten(dt, pred.shape));
        AMPD_RETURN_IF_ERROR(be.MseLoss(tp, tt, multiplier, scale, tl, td));
        AMPD_RETURN_IF_ERROR(io.Read("loss", tl, {1e-5, 0}));
        // One subtraction and one multiply by the same coefficient.
        AMPD_RETURN_IF_ERROR(io.Read("dpred", td, kBitwise));
        return io.Take();
      };
      c.reference = [=] {
        double sum = 0;
        std::vector<double> grad;
        // The gradient's operation order is the contract: coef = (m * 2) *
        // fp32(1 / count), then (coef * (p - t)) * grad_scale, each in fp32.
        const double coef = F32(F32(multiplier * 2.0) * F32(1.0 / count));
        for (size_t i = 0; i < pred.values.size(); ++i) {
          const double d = pred.values[i] - target.values[i];
          sum += d * d;
          grad.push_back(kt::RefStore(dt, F32(F32(coef * F32(d)) * scale)));
        }
        return Outputs{{"loss", {multiplier * sum / count}, {ChunkedSumBound(count) + 4 * kU32, 0}},
                       {"dpred", grad, kBitwise}};
      };
      return c;
    };
    cases.push_back({"MseLoss", Lower(dt), build});
  }
  for (DType dt : kFloatDTypes) {
    for (DType idt : kIdDTypes) {
      auto build = [=] {
        const int64_t rows = 100, vocab = 1000;
        const HostTensor logits = Random(dt, {rows, vocab}, 90, -8, 8);
        const HostTensor labels = Ids(idt, rows, 91, vocab);
        const float multiplier = 1.0f, scale = 65536.0f;
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(logits));
          AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(labels));
          AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Unwritten(DType::kF32, {1}));
          AMPD_ASSIGN_OR_RETURN(Tensor td, io.Unwritten(dt, logits.shape));
          AMPD_RETURN_IF_ERROR(be.CrossEntropyLoss(tx, ty, multiplier, scale, tl, td));
          AMPD_RETURN_IF_ERROR(io.Read("loss", tl, {1e-5, 0}));
          // softmax's expf and sum differ by ulps; softmax - 1 at the label
          // turns them into an absolute error of the scaled gradient.
          AMPD_RETURN_IF_ERROR(
              io.Read("dlogits", td, DeviceElementwise(dt) + Tol{0, scale / rows * 1e-7}));
          return io.Take();
        };
        c.reference = [=] {
          double total = 0;
          std::vector<double> grad;
          for (int64_t r = 0; r < rows; ++r) {
            const double* z = &logits.values[static_cast<size_t>(r * vocab)];
            const int64_t label = static_cast<int64_t>(labels.values[static_cast<size_t>(r)]);
            const double mx = *std::max_element(z, z + vocab);
            double sum = 0;
            for (int64_t v = 0; v < vocab; ++v) sum += std::exp(z[v] - mx);
            total += std::log(sum) - (z[label] - mx);
            for (int64_t v = 0; v < vocab; ++v) {
              const double softmax = std::exp(z[v] - mx) / sum;
              grad.push_back(multiplier / rows * (softmax - (v == label ? 1.0 : 0.0)) * scale);
            }
          }
          // fp32: expf within an ulp or two; the sum of 1000 exponentials is a
          // ChunkedSum (one run); softmax divides by it. Each row's loss
          // (above 2 here: 1000 comparable terms) inherits the sum's relative
          // error as an absolute one, and rows are added in order.
          const double sum_err = ChunkedSumBound(vocab) + 4 * kU32;
          return Outputs{{"loss", {multiplier * total / rows}, {sum_err + rows * kU32, 0}},
                         {"dlogits", grad, Ulps(dt, 1) + Tol{sum_err, 0}}};
        };
        return c;
      };
      cases.push_back({"CrossEntropyLoss", absl::StrCat(Lower(dt), "_labels_", Lower(idt)), build});
    }
  }
}

// ---- causal self-attention ----
// (B, T, C, n_head): T = 1; T below, at and across the key block (64) with
// odd tails; D = 4, 6, 16, 64 and 128 (the CUDA tensor-core sizes) and 160
// (beyond any one tile of channels); one and several heads.
using kt::AttnBackwardRef;
using kt::AttnDims;
using kt::AttnForwardRef;
using kt::RefAttnBackward;
using kt::RefAttnForward;
constexpr AttnDims kAttnDims[] = {{2, 1, 12, 3},
                                  {2, 7, 16, 4},
                                  {3, 13, 24, 4},
                                  {1, 37, 64, 1},
                                  {2, 64, 128, 2},
                                  {2, 130, 128, 2},
                                  {2, 100, 256, 2},
                                  {2, 70, 32, 2},
                                  {1, 67, 320, 2},
                                  // Sliding windows (Gemma 3's local layers) and
                                  // set scales (its query_pre_attn_scalar^-1/2):
                                  // windows inside, at and across key blocks, of
                                  // one key (the query alone), and one longer
                                  // than T (every key, as without).
                                  {2, 130, 128, 2, 50},
                                  {1, 150, 64, 1, 64, 0.3f},
                                  {2, 70, 32, 2, 1},
                                  {2, 100, 256, 2, 37, 0.125f},
                                  {1, 67, 320, 2, 0, 0.2f},
                                  {2, 40, 24, 3, 100}};

// What AttentionOptions a case's dims ask for.
AttentionOptions AttnOptionsOf(const AttnDims& s) {
  AttentionOptions o;
  o.window = s.window;
  if (s.scale > 0.0f) o.scale = s.scale;
  return o;
}

// The largest bound of a reference (absolute); another backend may be twice
// that from the oracle (each within the bound of the same reference).
Tol ToleranceOf(const kt::Bounded& r) {
  return {0.0, *std::max_element(r.bound.begin(), r.bound.end())};
}

Tol Twice(Tol t) { return t + t; }

void AddAttentionCases(std::vector<OpCase>& cases) {
  uint64_t seed = 300;
  for (DType dt : kFloatDTypes) {
    for (const AttnDims& s : kAttnDims) {
      std::string variant = absl::StrCat(Lower(dt), "_b", s.b, "_t", s.t, "_c", s.c, "_h", s.heads);
      if (s.window > 0) absl::StrAppend(&variant, "_w", s.window);
      if (s.scale > 0.0f) absl::StrAppend(&variant, "_scaled");
      const AttentionOptions options = AttnOptionsOf(s);
      const Shape qkv_shape = {s.b, s.t, 3 * s.c};
      const Shape lse_shape = {s.b, s.heads, s.t};
      const Shape out_shape = {s.b, s.t, s.c};
      const uint64_t case_seed = seed++;

      auto forward = [=] {
        const HostTensor qkv = Random(dt, qkv_shape, case_seed, -1.5, 1.5);
        CaseFns f;
        f.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          const AttnForwardRef ref = RefAttnForward(dt, s, qkv.values);
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tq, io.Upload(qkv));
          AMPD_ASSIGN_OR_RETURN(Tensor to, io.Unwritten(dt, out_shape));
          AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Unwritten(DType::kF32, lse_shape));
          AMPD_RETURN_IF_ERROR(be.AttentionForward(tq, s.heads, options, to, tl));
          AMPD_RETURN_IF_ERROR(io.Read("out", to, Twice(ToleranceOf(ref.out))));
          AMPD_RETURN_IF_ERROR(io.Read("lse", tl, Twice(ToleranceOf(ref.lse))));
          return io.Take();
        };
        f.reference = [=] {
          const AttnForwardRef ref = RefAttnForward(dt, s, qkv.values);
          return Outputs{{"out", ref.out.want, ToleranceOf(ref.out)},
                         {"lse", ref.lse.want, ToleranceOf(ref.lse)}};
        };
        return f;
      };
      cases.push_back({"AttentionForward", variant, forward});

      auto backward = [=] {
        const HostTensor qkv = Random(dt, qkv_shape, case_seed, -1.5, 1.5);
        const HostTensor dout = Random(dt, out_shape, case_seed + 1000, -1.0, 1.0);
        // Every backend differentiates the same forward: the reference's
        // out (in the dtype) and lse (in fp32).
        const AttnForwardRef fwd = RefAttnForward(dt, s, qkv.values);
        const HostTensor out{dt, out_shape, fwd.out.want};
        HostTensor lse{DType::kF32, lse_shape, fwd.lse.want};
        for (double& v : lse.values) v = F32(v);
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          const AttnBackwardRef ref =
              RefAttnBackward(dt, s, qkv.values, out.values, lse.values, dout.values);
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tq, io.Upload(qkv));
          AMPD_ASSIGN_OR_RETURN(Tensor to, io.Upload(out));
          AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Upload(lse));
          AMPD_ASSIGN_OR_RETURN(Tensor tg, io.Upload(dout));
          AMPD_ASSIGN_OR_RETURN(Tensor tdq, io.Unwritten(dt, qkv_shape));
          AMPD_RETURN_IF_ERROR(be.AttentionBackward(tq, to, tg, tl, s.heads, options, tdq));
          AMPD_RETURN_IF_ERROR(io.Read("dqkv", tdq, Twice(ToleranceOf(ref.dqkv))));
          return io.Take();
        };
        c.reference = [=] {
          const AttnBackwardRef ref =
              RefAttnBackward(dt, s, qkv.values, out.values, lse.values, dout.values);
          return Outputs{{"dqkv", ref.dqkv.want, ToleranceOf(ref.dqkv)}};
        };
        return c;
      };
      cases.push_back({"AttentionBackward", variant, backward});
    }
  }
}

// ---- attention decode against a KV cache ----
// (S, T_max, H, Hkv, D) and each sequence's position: D = 64 and 128 (the
// CUDA register-tile twin in fp16/bf16), 16 and 160 (the generic twin, 160
// beyond one channel slice); MHA, GQA and a group of 32 query heads (two
// 16-row strips per kv head); positions at 0, inside, at and across key
// blocks and at T_max - 1. Cache positions after a sequence's are NaN (never
// read). The reference: the forward's row t in double, from a q|k|v whose
// keys and values are the cache's, expanded to H heads.
struct DecodeDimsCase {
  int64_t s, t_max, heads, kv_heads, d;
  std::vector<int64_t> positions;
  int64_t window = 0;  // > 0: a sliding window
  float scale = 0.0f;  // > 0: a set score scale
};

void AddAttentionDecodeCases(std::vector<OpCase>& cases) {
  const std::vector<DecodeDimsCase> dims = {
      {3, 150, 4, 2, 64, {0, 63, 149}},    {2, 70, 4, 4, 128, {64, 69}},
      {3, 40, 6, 2, 16, {1, 17, 39}},      {2, 130, 4, 1, 160, {128, 100}},
      {2, 90, 32, 1, 64, {70, 89}},        {3, 150, 4, 2, 64, {0, 70, 149}, 50, 0.2f},
      {2, 130, 4, 1, 160, {128, 100}, 64}, {2, 40, 6, 2, 16, {1, 39}, 1}};
  uint64_t seed = 350;
  for (DType dt : kFloatDTypes) {
    for (size_t i = 0; i < dims.size(); ++i) {
      const DecodeDimsCase g = dims[i];
      const DType idt = kIdDTypes[i % 2];
      std::string variant = absl::StrCat(Lower(dt), "_s", g.s, "_t", g.t_max, "_h", g.heads, "_kv",
                                         g.kv_heads, "_d", g.d, "_", Lower(idt));
      if (g.window > 0) absl::StrAppend(&variant, "_w", g.window);
      if (g.scale > 0.0f) absl::StrAppend(&variant, "_scaled");
      AttentionOptions options;
      options.window = g.window;
      if (g.scale > 0.0f) options.scale = g.scale;
      const uint64_t case_seed = seed++;
      auto build = [=] {
        const int64_t q_width = g.heads * g.d, kv_width = g.kv_heads * g.d;
        const HostTensor q = Random(dt, {g.s, q_width}, case_seed, -1.5, 1.5);
        HostTensor k = Random(dt, {g.s, g.t_max, kv_width}, case_seed + 1000, -1.5, 1.5);
        HostTensor v = Random(dt, {g.s, g.t_max, kv_width}, case_seed + 2000, -1.5, 1.5);
        for (int64_t s = 0; s < g.s; ++s) {
          for (int64_t p = g.positions[static_cast<size_t>(s)] + 1; p < g.t_max; ++p) {
            for (int64_t c = 0; c < kv_width; ++c) {
              const size_t at = static_cast<size_t>((s * g.t_max + p) * kv_width + c);
              k.values[at] = std::numeric_limits<double>::quiet_NaN();
              v.values[at] = std::numeric_limits<double>::quiet_NaN();
            }
          }
        }
        HostTensor pos{idt, {g.s}, {}};
        for (int64_t p : g.positions) pos.values.push_back(static_cast<double>(p));
        // Row t of each sequence's forward in double, and its bound.
        auto reference = [=](std::vector<double>* want, double* bound) {
          const int64_t group = g.heads / g.kv_heads;
          for (int64_t s = 0; s < g.s; ++s) {
            const int64_t t = g.positions[static_cast<size_t>(s)];
            std::vector<double> qkv(static_cast<size_t>((t + 1) * 3 * q_width), 0.0);
            for (int64_t p = 0; p <= t; ++p) {
              double* tok = &qkv[static_cast<size_t>(p * 3 * q_width)];
              for (int64_t h = 0; h < g.heads; ++h) {
                for (int64_t d = 0; d < g.d; ++d) {
                  const size_t cache =
                      static_cast<size_t>((s * g.t_max + p) * kv_width + (h / group) * g.d + d);
                  if (p == t)
                    tok[h * g.d + d] = q.values[static_cast<size_t>(s * q_width + h * g.d + d)];
                  tok[q_width + h * g.d + d] = k.values[cache];
                  tok[2 * q_width + h * g.d + d] = v.values[cache];
                }
              }
            }
            const AttnForwardRef ref =
                RefAttnForward(dt, {1, t + 1, q_width, g.heads, g.window, g.scale}, qkv);
            for (int64_t c = 0; c < q_width; ++c) {
              const size_t at = static_cast<size_t>(t * q_width + c);
              want->push_back(ref.out.want[at]);
              *bound = std::max(*bound, ref.out.bound[at]);
            }
          }
        };
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          std::vector<double> want;
          double bound = 0.0;
          reference(&want, &bound);
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(Tensor tq, io.Upload(q));
          AMPD_ASSIGN_OR_RETURN(Tensor tk, io.Upload(k));
          AMPD_ASSIGN_OR_RETURN(Tensor tv, io.Upload(v));
          AMPD_ASSIGN_OR_RETURN(Tensor tp, io.Upload(pos));
          AMPD_ASSIGN_OR_RETURN(Tensor to, io.Unwritten(dt, {g.s, q_width}));
          AMPD_RETURN_IF_ERROR(
              be.AttentionDecode(tq, tk, tv, tp, g.heads, g.kv_heads, options, to));
          AMPD_RETURN_IF_ERROR(io.Read("out", to, Twice(Tol{0.0, bound})));
          return io.Take();
        };
        c.reference = [=] {
          std::vector<double> want;
          double bound = 0.0;
          reference(&want, &bound);
          return Outputs{{"out", want, Tol{0.0, bound}}};
        };
        return c;
      };
      cases.push_back({"AttentionDecode", variant, build});
    }
  }
}

// ---- chunked token cross-entropy ----
// Rows labelled -100 are ignored; the loss starts at 0.5 to show it is
// accumulated into; in place writes the gradient over the logits.
void AddCrossEntropyChunkCases(std::vector<OpCase>& cases) {
  constexpr int64_t kIgnore = -100;
  const struct { int64_t rows, vocab; } kSizes[] = {{37, 50}, {24, 1000}, {3, 5000}};
  uint64_t seed = 500;
  for (DType dt : kFloatDTypes) {
    for (DType idt : kIdDTypes) {
      for (const auto& size : kSizes) {
        for (bool in_place : {false, true}) {
          const int64_t rows = size.rows, vocab = size.vocab;
          const uint64_t case_seed = seed++;
          auto build = [=] {
            const HostTensor logits = Random(dt, {rows, vocab}, case_seed, -8, 8);
            HostTensor labels = Ids(idt, rows, case_seed + 1, vocab);
            for (int64_t r = 1; r < rows; r += 3) labels.values[static_cast<size_t>(r)] = kIgnore;
            int64_t kept = 0;
            for (double l : labels.values) kept += l != kIgnore ? 1 : 0;
            const float loss_scale = 1.0f / static_cast<float>(kept);
            const float grad_scale = 256.0f / static_cast<float>(kept);
            const double sum_err = ChunkedSumBound(vocab) + 4 * kU32;
            CaseFns c;
            c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
              Io io(be);
              AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(logits));
              AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(labels));
              AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Scalar(0.5f));
              Tensor td;
              if (!in_place) {
                AMPD_ASSIGN_OR_RETURN(td, io.Unwritten(dt, logits.shape));
              }
              Tensor& grad = in_place ? tx : td;
              AMPD_RETURN_IF_ERROR(
                  be.CrossEntropyChunk(tx, ty, kIgnore, loss_scale, grad_scale, tl, grad));
              // Rows are added in another order on a GPU (atomics), and
              // expf and the row sums differ by ulps.
              AMPD_RETURN_IF_ERROR(io.Read("loss", tl, {1e-5, 0}));
              AMPD_RETURN_IF_ERROR(
                  io.Read("dlogits", grad, DeviceElementwise(dt) + Tol{0, grad_scale * 1e-6}));
              return io.Take();
            };
            c.reference = [=] {
              double total = 0;
              std::vector<double> grad;
              for (int64_t r = 0; r < rows; ++r) {
                const int64_t label = static_cast<int64_t>(labels.values[static_cast<size_t>(r)]);
                if (label == kIgnore) {
                  grad.insert(grad.end(), static_cast<size_t>(vocab), 0.0);
                  continue;
                }
                const double* z = &logits.values[static_cast<size_t>(r * vocab)];
                const double mx = *std::max_element(z, z + vocab);
                double sum = 0;
                for (int64_t v = 0; v < vocab; ++v) sum += std::exp(z[v] - mx);
                total += std::log(sum) - (z[label] - mx);
                for (int64_t v = 0; v < vocab; ++v) {
                  const double softmax = std::exp(z[v] - mx) / sum;
                  grad.push_back(grad_scale * (softmax - (v == label ? 1.0 : 0.0)));
                }
              }
              // Each row loss (~log V + 8) inherits the sum's relative error
              // as an absolute one; rows are added to 0.5 one by one.
              const double want = 0.5 + loss_scale * total;
              return Outputs{
                  {"loss", {want}, {(rows + 4) * kU32, sum_err * 20 * loss_scale * rows}},
                  {"dlogits", grad, Ulps(dt, 1) + Tol{sum_err, sum_err * grad_scale}}};
            };
            return c;
          };
          cases.push_back({"CrossEntropyChunk",
                           absl::StrCat(Lower(dt), "_labels_", Lower(idt), "_n", rows, "_v", vocab,
                                        in_place ? "_in_place" : ""),
                           build});
        }
      }
    }
  }
}

// ---- token losses in the chunked cross-entropy ----
// cross_entropy with weights, importance_sampling, ppo, cispo and dro
// (kernels/token_loss.h) with the logprobs and token_losses outputs, in
// place. The sampler's log-probs sit within 0.3 of the model's, so ratios
// straddle the clip range. Also at temperature 0.7 (logits / 0.7, the
// gradient with its 1 / T), with LabelLogprobs' log-probs beside the
// chunk's.
void AddTokenLossCases(std::vector<OpCase>& cases) {
  constexpr int64_t kIgnore = -100;
  const struct { int64_t rows, vocab; } kSizes[] = {{37, 50}, {24, 1000}, {3, 5000}};
  const TokenLossKind kKinds[] = {TokenLossKind::kCrossEntropy, TokenLossKind::kImportanceSampling,
                                  TokenLossKind::kPpo, TokenLossKind::kCispo, TokenLossKind::kDro};
  uint64_t seed = 900;
  for (DType dt : kFloatDTypes) {
    for (const TokenLossKind kind : kKinds) {
      for (const auto& size : kSizes) {
        for (const double temperature : {1.0, 0.7}) {
          if (temperature != 1.0 && size.vocab == 1000) continue;
          const int64_t rows = size.rows, vocab = size.vocab;
          const uint64_t case_seed = seed++;
          auto build = [=] {
            const HostTensor logits = Random(dt, {rows, vocab}, case_seed, -6, 6);
            HostTensor labels = Ids(DType::kI64, rows, case_seed + 1, vocab);
            for (int64_t r = 2; r < rows; r += 5) labels.values[static_cast<size_t>(r)] = kIgnore;
            // Each kept row's log-prob in double, for q and the reference.
            std::vector<double> logp(static_cast<size_t>(rows), 0.0);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t label = static_cast<int64_t>(labels.values[static_cast<size_t>(r)]);
              if (label == kIgnore) continue;
              std::vector<double> z(logits.values.begin() + r * vocab,
                                    logits.values.begin() + (r + 1) * vocab);
              for (double& x : z) x /= temperature;
              const double mx = *std::max_element(z.begin(), z.end());
              double sum = 0;
              for (int64_t v = 0; v < vocab; ++v) sum += std::exp(z[v] - mx);
              logp[static_cast<size_t>(r)] = z[label] - mx - std::log(sum);
            }
            const HostTensor weights = Random(DType::kF32, {rows}, case_seed + 2, 0, 2);
            const HostTensor advantages = Random(DType::kF32, {rows}, case_seed + 3, -2, 2);
            HostTensor sampled = Random(DType::kF32, {rows}, case_seed + 4, -0.3, 0.3);
            for (int64_t r = 0; r < rows; ++r) {
              double& q = sampled.values[static_cast<size_t>(r)];
              q = static_cast<float>(logp[static_cast<size_t>(r)] + q);
            }
            const float lo = 0.9f, hi = 1.1f, beta = 0.5f, grad_scale = 32.0f;
            const double sum_err = ChunkedSumBound(vocab) + 4 * kU32;
            // At a temperature each z / T is one more fp32 rounding (half an
            // ulp of logits up to 6 / 0.7), in the label's logit and the max.
            const double t_err = temperature == 1.0 ? 0.0 : 2e-6;
            CaseFns c;
            c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
              Io io(be);
              AMPD_ASSIGN_OR_RETURN(Tensor tx, io.Upload(logits));
              AMPD_ASSIGN_OR_RETURN(Tensor ty, io.Upload(labels));
              AMPD_ASSIGN_OR_RETURN(Tensor tw, io.Upload(weights));
              AMPD_ASSIGN_OR_RETURN(Tensor ta, io.Upload(advantages));
              AMPD_ASSIGN_OR_RETURN(Tensor tq, io.Upload(sampled));
              AMPD_ASSIGN_OR_RETURN(Tensor tl, io.Scalar(0.5f));
              AMPD_ASSIGN_OR_RETURN(Tensor tp, io.Unwritten(DType::kF32, {rows}));
              AMPD_ASSIGN_OR_RETURN(Tensor tt, io.Unwritten(DType::kF32, {rows}));
              AMPD_ASSIGN_OR_RETURN(Tensor tlp, io.Unwritten(DType::kF32, {rows}));
              AMPD_RETURN_IF_ERROR(
                  be.LabelLogprobs(tx, ty, kIgnore, static_cast<float>(temperature), tlp));
              TokenLossTerms terms;
              terms.kind = kind;
              terms.temperature = static_cast<float>(temperature);
              terms.clip_low = lo;
              terms.clip_high = hi;
              terms.beta = beta;
              if (kind == TokenLossKind::kCrossEntropy) {
                terms.weights = &tw;
              } else {
                terms.advantages = &ta;
                terms.sampling_logprobs = &tq;
              }
              terms.logprobs = &tp;
              terms.token_losses = &tt;
              AMPD_RETURN_IF_ERROR(
                  be.CrossEntropyChunk(tx, ty, kIgnore, terms, 1.0f, grad_scale, tl, tx));
              AMPD_RETURN_IF_ERROR(io.Read("loss", tl, {1e-5, 1e-5}));
              AMPD_RETURN_IF_ERROR(io.Read("logprobs", tp, {1e-6, 1e-5}));
              AMPD_RETURN_IF_ERROR(io.Read("label_logprobs", tlp, {1e-6, 1e-5}));
              AMPD_RETURN_IF_ERROR(io.Read("token_losses", tt, {1e-6, 1e-5}));
              AMPD_RETURN_IF_ERROR(
                  io.Read("dlogits", tx, DeviceElementwise(dt) + Tol{0, grad_scale * 4e-6}));
              return io.Take();
            };
            c.reference = [=] {
              double total = 0;
              std::vector<double> grad;
              std::vector<double> token_terms(static_cast<size_t>(rows), 0.0);
              for (int64_t r = 0; r < rows; ++r) {
                const auto i = static_cast<size_t>(r);
                const int64_t label = static_cast<int64_t>(labels.values[i]);
                if (label == kIgnore) {
                  grad.insert(grad.end(), static_cast<size_t>(vocab), 0.0);
                  continue;
                }
                // The term and -d term / d logp by the definitions; PPO's
                // tie splits the gradient (torch.minimum), clamp passes it
                // inside [lo, hi].
                const double ratio = std::exp(logp[i] - sampled.values[i]);
                const double a = advantages.values[i];
                double term = 0, coef = 0;
                if (kind == TokenLossKind::kCrossEntropy) {
                  term = -weights.values[i] * logp[i];
                  coef = weights.values[i];
                } else if (kind == TokenLossKind::kImportanceSampling) {
                  term = -ratio * a;
                  coef = ratio * a;
                } else if (kind == TokenLossKind::kCispo) {
                  // The clipped ratio is a constant (stop-gradient).
                  const double clipped = std::clamp(ratio, double{lo}, double{hi});
                  term = -(clipped * logp[i] * a);
                  coef = clipped * a;
                } else if (kind == TokenLossKind::kDro) {
                  const double delta = logp[i] - sampled.values[i];
                  term = -(logp[i] * a - 0.5 * beta * delta * delta);
                  coef = a - beta * delta;
                } else {
                  const double unclipped = ratio * a;
                  const double clipped = std::clamp(ratio, double{lo}, double{hi}) * a;
                  const double inside = ratio >= lo && ratio <= hi ? 1.0 : 0.0;
                  term = -std::min(unclipped, clipped);
                  coef = unclipped * (unclipped < clipped   ? 1.0
                                      : unclipped > clipped ? inside
                                                            : 0.5 * (1.0 + inside));
                }
                total += term;
                token_terms[i] = term;
                std::vector<double> z(logits.values.begin() + r * vocab,
                                      logits.values.begin() + (r + 1) * vocab);
                for (double& x : z) x /= temperature;
                const double mx = *std::max_element(z.begin(), z.end());
                double sum = 0;
                for (int64_t v = 0; v < vocab; ++v) sum += std::exp(z[v] - mx);
                for (int64_t v = 0; v < vocab; ++v) {
                  const double softmax = std::exp(z[v] - mx) / sum;
                  grad.push_back(grad_scale * coef / temperature *
                                 (softmax - (v == label ? 1.0 : 0.0)));
                }
              }
              return Outputs{{"loss", {0.5 + total}, {1e-5, 1e-5 * static_cast<double>(rows)}},
                             {"logprobs", logp, {1e-6, sum_err * 4 + 1e-6 + t_err}},
                             {"label_logprobs", logp, {1e-6, sum_err * 4 + 1e-6 + t_err}},
                             {"token_losses", token_terms, {1e-5, sum_err * 8 + 1e-6 + 8 * t_err}},
                             {"dlogits", grad, Ulps(dt, 1) + Tol{1e-5, sum_err * grad_scale * 8}}};
            };
            return c;
          };
          const char* name = kind == TokenLossKind::kCrossEntropy         ? "cross_entropy"
                             : kind == TokenLossKind::kImportanceSampling ? "importance_sampling"
                             : kind == TokenLossKind::kPpo                ? "ppo"
                             : kind == TokenLossKind::kCispo              ? "cispo"
                                                                          : "dro";
          cases.push_back({"CrossEntropyChunkTokenLoss",
                           absl::StrCat(Lower(dt), "_", name, "_n", rows, "_v", vocab,
                                        temperature == 1.0 ? "" : "_t07"),
                           build});
        }
      }
    }
  }
}

// ---- loss scaling and the optimizers ----
// Sizes straddle the CUDA kernels' tile edges (1024 and 2048 elements) and span
// several blocks.
constexpr int64_t kParamSizes[] = {1, 1023, 1024, 2049, 5000, 70000};

void AddUnscaleCases(std::vector<OpCase>& cases) {
  const float inv_scale = 1.0f / 1024;  // a power of two: the product is exact
  struct Mode {
    const char* name;
    bool in_place, norm, nonfinite;
  };
  for (DType dt : kFloatDTypes) {
    for (const Mode& mode :
         {Mode{"in_place_norm", true, true, false}, Mode{"check_only", false, false, false},
          Mode{"nonfinite", false, false, true}}) {
      auto build = [=] {
        std::vector<HostTensor> grads;
        for (size_t i = 0; i < std::size(kParamSizes); ++i) {
          grads.push_back(Random(dt, {kParamSizes[i]}, 300 + i, -1024, 1024));
        }
        if (mode.nonfinite) grads[3].values[700] = INFINITY;
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          std::vector<Tensor> t;
          for (const HostTensor& g : grads) {
            AMPD_ASSIGN_OR_RETURN(Tensor x, io.Upload(g));
            t.push_back(std::move(x));
          }
          std::vector<Tensor*> ptrs;
          for (Tensor& x : t) ptrs.push_back(&x);
          AMPD_ASSIGN_OR_RETURN(Tensor found, io.Scalar(0));
          AMPD_ASSIGN_OR_RETURN(Tensor norm, io.Scalar(0.5f));
          AMPD_RETURN_IF_ERROR(be.UnscaleAndCheck(ptrs, inv_scale, mode.in_place, found,
                                                  mode.norm ? &norm : nullptr));
          AMPD_RETURN_IF_ERROR(io.Read("found_inf", found, kBitwise));
          if (mode.norm) AMPD_RETURN_IF_ERROR(io.Read("norm_sq", norm, {1e-5, 0}));
          for (size_t i = 0; i < t.size(); ++i) {
            AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("grad[", i, "]"), t[i], kBitwise));
          }
          return io.Take();
        };
        c.reference = [=] {
          double norm = 0.5;
          bool nonfinite = false;
          int64_t total = 0;
          Outputs grads_out;
          for (size_t i = 0; i < grads.size(); ++i) {
            std::vector<double> g;
            for (double v : grads[i].values) {
              const double u = F32(v * inv_scale);
              nonfinite |= !std::isfinite(u);
              norm += u * u;
              g.push_back(mode.in_place ? kt::RefStore(dt, u) : v);
            }
            total += static_cast<int64_t>(grads[i].values.size());
            grads_out.push_back({absl::StrCat("grad[", i, "]"), g, kBitwise});
          }
          Outputs out{{"found_inf", {nonfinite ? 1.0 : 0.0}, kBitwise}};
          if (mode.norm) {
            // A ChunkedSum of squares (non-negative) over every gradient.
            out.push_back({"norm_sq", {norm}, {ChunkedSumBound(total) + 2 * kU32, 0}});
          }
          out.insert(out.end(), grads_out.begin(), grads_out.end());
          return out;
        };
        return c;
      };
      cases.push_back({"UnscaleAndCheck", absl::StrCat(Lower(dt), "_", mode.name), build});
    }
  }
}

// One parameter of an optimizer case, on the host.
struct HostParam {
  HostTensor master, working, grad, m, v;
};

std::vector<HostParam> MakeHostParams(DType dt, uint64_t seed) {
  std::vector<HostParam> ps;
  for (size_t i = 0; i < std::size(kParamSizes); ++i) {
    const int64_t n = kParamSizes[i];
    const uint64_t s = seed + 10 * i;
    HostParam p;
    p.master = Random(DType::kF32, {n}, s, -1, 1);
    p.working = {dt, {n}, {}};
    for (double w : p.master.values) p.working.values.push_back(kt::RefStore(dt, w));
    // Scaled gradients as a loss scale of 1024 would leave them.
    p.grad = Random(dt, {n}, s + 1, -1024, 1024);
    p.m = Random(DType::kF32, {n}, s + 2, -0.1, 0.1);
    p.v = Random(DType::kF32, {n}, s + 3, 1e-4, 1e-2);
    ps.push_back(std::move(p));
  }
  return ps;
}

// The state the optimizer cases read back, in a fixed order.
struct DeviceParams {
  std::vector<Tensor> master, working, grad, m, v;
  std::vector<ParamRef> refs;
};

absl::StatusOr<DeviceParams> UploadParams(Io& io, const std::vector<HostParam>& ps, bool working,
                                          bool state0, bool state1) {
  DeviceParams d;
  for (const HostParam& p : ps) {
    AMPD_ASSIGN_OR_RETURN(Tensor master, io.Upload(p.master));
    AMPD_ASSIGN_OR_RETURN(Tensor w, io.Upload(p.working));
    AMPD_ASSIGN_OR_RETURN(Tensor g, io.Upload(p.grad));
    AMPD_ASSIGN_OR_RETURN(Tensor m, io.Upload(p.m));
    AMPD_ASSIGN_OR_RETURN(Tensor v, io.Upload(p.v));
    d.master.push_back(std::move(master));
    d.working.push_back(std::move(w));
    d.grad.push_back(std::move(g));
    d.m.push_back(std::move(m));
    d.v.push_back(std::move(v));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    d.refs.push_back(ParamRef{&d.master[i], working ? &d.working[i] : nullptr, &d.grad[i],
                              state0 ? &d.m[i] : nullptr, state1 ? &d.v[i] : nullptr});
  }
  return d;
}

// fp32 masters and moments: a handful of fp32 operations per element per
// step on values below 1: a few u. The working copy is the master rounded
// once, possibly to the other side of a rounding boundary when the two
// masters differ by an ulp.
absl::Status ReadParams(Io& io, const DeviceParams& d, bool working, bool state0, bool state1,
                        DType dt, bool bitwise) {
  const Tol f32 = bitwise ? kBitwise : Tol{4e-6, 1e-7};
  const Tol wt = bitwise ? kBitwise : DeviceElementwise(dt);
  for (size_t i = 0; i < d.master.size(); ++i) {
    AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("master[", i, "]"), d.master[i], f32));
    if (working) AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("working[", i, "]"), d.working[i], wt));
    if (state0) AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("state0[", i, "]"), d.m[i], f32));
    if (state1) AMPD_RETURN_IF_ERROR(io.Read(absl::StrCat("state1[", i, "]"), d.v[i], f32));
  }
  return absl::OkStatus();
}

// The reference's outputs in ReadParams' order. Masters and moments: after
// three steps of a few fp32 operations each on values below 1, 32 u
// relative and absolute; the working copy one more ulp of its dtype.
Outputs ParamOutputs(const std::vector<std::vector<double>>& w,
                     const std::vector<std::vector<double>>& m,
                     const std::vector<std::vector<double>>& v, bool working, bool state0,
                     bool state1, DType dt, bool bitwise) {
  const Tol f32 = bitwise ? kBitwise : Tol{32 * kU32, 32 * kU32};
  Outputs out;
  for (size_t i = 0; i < w.size(); ++i) {
    out.push_back({absl::StrCat("master[", i, "]"), w[i], f32});
    if (working) {
      std::vector<double> wt;
      for (double x : w[i]) wt.push_back(bitwise ? kt::RefStore(dt, x) : x);
      out.push_back({absl::StrCat("working[", i, "]"), wt, bitwise ? kBitwise : Ulps(dt, 1) + f32});
    }
    if (state0) out.push_back({absl::StrCat("state0[", i, "]"), m[i], f32});
    if (state1) out.push_back({absl::StrCat("state1[", i, "]"), v[i], f32});
  }
  return out;
}

// clip_grad_norm_'s coefficient from an fp32 squared norm, in double.
double RefClip(float norm_sq, float max_norm) {
  if (!(max_norm > 0)) return 1.0;
  return std::min(1.0, max_norm / (std::sqrt(static_cast<double>(norm_sq)) + 1e-6));
}

void AddAdamCases(std::vector<OpCase>& cases) {
  struct Mode {
    const char* name;
    bool decoupled, skipped;
  };
  const float inv_scale = 1.0f / 1024, norm_sq = 250000.0f, max_norm = 100.0f;  // clipping bites
  for (DType dt : kFloatDTypes) {
    for (const Mode& mode :
         {Mode{"adamw", true, false}, Mode{"adam", false, false}, Mode{"skipped", true, true}}) {
      auto build = [=] {
        const bool working = dt != DType::kF32;  // fp32 jobs have no working copy
        const std::vector<HostParam> ps = MakeHostParams(dt, 400);
        AdamConfig config;
        config.lr = 1e-3f;
        config.weight_decay = 0.01f;
        config.decoupled_weight_decay = mode.decoupled;
        const int steps = 3;
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(DeviceParams d, UploadParams(io, ps, working, true, true));
          for (int64_t step = 1; step <= steps; ++step) {
            AMPD_ASSIGN_OR_RETURN(Tensor found, io.Scalar(mode.skipped ? 1.0f : 0.0f));
            AMPD_ASSIGN_OR_RETURN(Tensor norm, io.Scalar(norm_sq));
            const GradTransform tr{inv_scale, &found, &norm, max_norm};
            AMPD_RETURN_IF_ERROR(be.AdamUpdate(d.refs, config, step, tr));
          }
          AMPD_RETURN_IF_ERROR(ReadParams(io, d, working, true, true, dt, mode.skipped));
          return io.Take();
        };
        c.reference = [=] {
          std::vector<std::vector<double>> w, m, v;
          const double clip = RefClip(norm_sq, max_norm);
          for (const HostParam& p : ps) {
            w.push_back(p.master.values);
            m.push_back(p.m.values);
            v.push_back(p.v.values);
            if (mode.skipped) continue;
            for (int step = 1; step <= steps; ++step) {
              const double b1 = config.beta1, b2 = config.beta2, lr = config.lr;
              const double wd = config.weight_decay, eps = config.eps;
              const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
              for (size_t i = 0; i < p.grad.values.size(); ++i) {
                double g = p.grad.values[i] * inv_scale * clip;
                double& wi = w.back()[i];
                if (mode.decoupled) {
                  wi *= 1 - lr * wd;
                } else {
                  g += wd * wi;
                }
                double& mi = m.back()[i];
                double& vi = v.back()[i];
                mi = b1 * mi + (1 - b1) * g;
                vi = b2 * vi + (1 - b2) * g * g;
                wi -= lr / bc1 * (mi / (std::sqrt(vi) / std::sqrt(bc2) + eps));
              }
            }
          }
          return ParamOutputs(w, m, v, working, true, true, dt, mode.skipped);
        };
        return c;
      };
      cases.push_back({"AdamUpdate", absl::StrCat(Lower(dt), "_", mode.name), build});
    }
  }
}

void AddSgdCases(std::vector<OpCase>& cases) {
  struct Mode {
    const char* name;
    float momentum, dampening;
    bool nesterov, skipped;
  };
  const float inv_scale = 1.0f / 1024;
  for (DType dt : kFloatDTypes) {
    for (const Mode& mode :
         {Mode{"plain", 0.0f, 0.0f, false, false}, Mode{"momentum", 0.9f, 0.1f, false, false},
          Mode{"nesterov", 0.9f, 0.0f, true, false}, Mode{"skipped", 0.9f, 0.0f, false, true}}) {
      auto build = [=] {
        const bool working = dt != DType::kF32;
        const bool state = mode.momentum != 0.0f;
        const std::vector<HostParam> ps = MakeHostParams(dt, 500);
        SgdConfig config;
        config.lr = 0.01f;
        config.momentum = mode.momentum;
        config.dampening = mode.dampening;
        config.nesterov = mode.nesterov;
        config.weight_decay = 1e-4f;
        const int steps = 3;
        CaseFns c;
        c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
          Io io(be);
          AMPD_ASSIGN_OR_RETURN(DeviceParams d, UploadParams(io, ps, working, state, false));
          for (int step = 0; step < steps; ++step) {
            AMPD_ASSIGN_OR_RETURN(Tensor found, io.Scalar(mode.skipped ? 1.0f : 0.0f));
            const GradTransform tr{inv_scale, &found, nullptr, 0.0f};
            AMPD_RETURN_IF_ERROR(be.SgdUpdate(d.refs, config, step == 0, tr));
          }
          AMPD_RETURN_IF_ERROR(ReadParams(io, d, working, state, false, dt, mode.skipped));
          return io.Take();
        };
        c.reference = [=] {
          std::vector<std::vector<double>> w, m, v;
          for (const HostParam& p : ps) {
            w.push_back(p.master.values);
            m.push_back(p.m.values);
            if (mode.skipped) continue;
            for (int step = 0; step < steps; ++step) {
              for (size_t i = 0; i < p.grad.values.size(); ++i) {
                double g = p.grad.values[i] * inv_scale;
                double& wi = w.back()[i];
                g += static_cast<double>(config.weight_decay) * wi;
                if (state) {
                  double& b = m.back()[i];
                  b = step == 0 ? g : config.momentum * b + (1.0 - config.dampening) * g;
                  g = mode.nesterov ? g + config.momentum * b : b;
                }
                wi -= static_cast<double>(config.lr) * g;
              }
            }
          }
          return ParamOutputs(w, m, v, working, state, false, dt, mode.skipped);
        };
        return c;
      };
      cases.push_back({"SgdUpdate", absl::StrCat(Lower(dt), "_", mode.name), build});
    }
  }
}

// ---- observability ----
int RefBin(double v) {
  if (std::isnan(v) || std::isinf(v)) return kGradHistogramBins - 1;
  const double a = std::fabs(v);
  if (a == 0) return 0;
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int octave = e - 1;
  if (octave < kGradHistogramMinLog2) return 1;
  if (octave >= kGradHistogramMaxLog2) return kGradHistogramBins - 1;
  return 2 + octave - kGradHistogramMinLog2;
}

void AddHistogramCases(std::vector<OpCase>& cases) {
  for (DType dt : kFloatDTypes) {
    auto build = [=] {
      HostTensor a = Random(dt, {10000}, 100, -1, 1);
      for (size_t i = 0; i < a.values.size(); ++i) {
        a.values[i] =
            kt::RefStore(dt, a.values[i] * std::ldexp(1.0, static_cast<int>(i % 70) - 40));
      }
      // Exact zeros, bin edges and non-finite values.
      for (double v : {0.0, -0.0, std::ldexp(1.0, -30), std::ldexp(1.0, 19), std::ldexp(1.0, 20),
                       static_cast<double>(INFINITY), -static_cast<double>(INFINITY),
                       std::numeric_limits<double>::quiet_NaN()}) {
        a.values.push_back(kt::RefStore(dt, v));
      }
      a.shape = {static_cast<int64_t>(a.values.size())};
      const HostTensor b = Random(dt, {3000}, 101, -100, 100);
      HostTensor start{DType::kI64, {kGradHistogramBins}, {}};
      for (int bin = 0; bin < kGradHistogramBins; ++bin) start.values.push_back(7 * bin + 1);
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor ta, io.Upload(a));
        AMPD_ASSIGN_OR_RETURN(Tensor tb, io.Upload(b));
        AMPD_ASSIGN_OR_RETURN(Tensor counts, io.Upload(start));
        const Tensor* const grads[] = {&ta, &tb};
        AMPD_RETURN_IF_ERROR(be.GradLog2Histogram(grads, counts));
        AMPD_RETURN_IF_ERROR(io.Read("counts", counts, kBitwise));
        return io.Take();
      };
      c.reference = [=] {
        std::vector<double> want(start.values);
        for (const HostTensor* t : {&a, &b}) {
          for (double v : t->values) want[static_cast<size_t>(RefBin(v))] += 1;
        }
        return Outputs{{"counts", want, kBitwise}};
      };
      return c;
    };
    cases.push_back({"GradLog2Histogram", Lower(dt), build});
  }
}

// ---- random fill ----
// FillRandom writes F32 only. Its draws are Philox's, so there is no
// cheaper float64 reference than Philox itself (whose known answers
// cpu_random_test holds); the CPU's draws are checked for their
// distribution's moments, and for being a pure function of the draw index
// (a fill at offset + 5 is the first fill shifted by five).
void AddFillRandomCases(std::vector<OpCase>& cases) {
  const int64_t n = 100000;
  for (RandomDistribution dist : {RandomDistribution::kUniform, RandomDistribution::kNormal}) {
    auto build = [=] {
      const bool uniform = dist == RandomDistribution::kUniform;
      RandomFill fill;
      fill.distribution = dist;
      fill.lo = -2.0f;
      fill.hi = 3.0f;
      fill.mean = 1.0f;
      fill.stddev = 2.0f;
      fill.seed = 7;
      fill.stream = 3;
      fill.offset = 5;
      CaseFns c;
      c.run = [=](Backend& be) -> absl::StatusOr<Outputs> {
        Io io(be);
        AMPD_ASSIGN_OR_RETURN(Tensor t, io.Unwritten(DType::kF32, {n}));
        AMPD_RETURN_IF_ERROR(be.FillRandom(t, fill));
        AMPD_RETURN_IF_ERROR(io.Read("dst", t, kBitwise));
        RandomFill later = fill;
        later.offset += 5;
        AMPD_ASSIGN_OR_RETURN(Tensor tail, io.Unwritten(DType::kF32, {n - 5}));
        AMPD_RETURN_IF_ERROR(be.FillRandom(tail, later));
        AMPD_RETURN_IF_ERROR(io.Read("dst at offset + 5", tail, kBitwise));
        return io.Take();
      };
      c.check = [=](const Outputs& got) -> ::testing::AssertionResult {
        const std::vector<double>& x = got[0].values;
        const std::vector<double>& tail = got[1].values;
        for (size_t i = 0; i < tail.size(); ++i) {
          if (tail[i] != x[i + 5]) {
            return ::testing::AssertionFailure() << "draw " << i + 5 << " is " << x[i + 5]
                                                 << " but the fill at offset + 5 wrote " << tail[i];
          }
        }
        double sum = 0, sq = 0;
        for (double v : x) {
          if (uniform && !(v >= fill.lo && v < fill.hi)) {
            return ::testing::AssertionFailure() << v << " is outside [lo, hi)";
          }
          sum += v;
        }
        const double mean = sum / n;
        for (double v : x) sq += (v - mean) * (v - mean);
        const double var = sq / (n - 1);
        const double want_mean = uniform ? (fill.lo + fill.hi) / 2.0 : fill.mean;
        const double want_var = uniform ? std::pow(fill.hi - fill.lo, 2) / 12.0
                                        : static_cast<double>(fill.stddev) * fill.stddev;
        // Six standard errors: the mean's is sqrt(var / n); the variance's is
        // at most sqrt(2 / n) var (normal; the uniform's is smaller).
        if (std::fabs(mean - want_mean) > 6 * std::sqrt(want_var / n) ||
            std::fabs(var - want_var) > 6 * std::sqrt(2.0 / n) * want_var) {
          return ::testing::AssertionFailure() << "mean " << mean << " variance " << var
                                               << "; want " << want_mean << " and " << want_var;
        }
        return ::testing::AssertionSuccess();
      };
      return c;
    };
    cases.push_back(
        {"FillRandom", dist == RandomDistribution::kUniform ? "f32_uniform" : "f32_normal", build});
  }
}

const std::vector<OpCase>& AllCases() {
  static const std::vector<OpCase>* const cases = [] {
    auto* all = new std::vector<OpCase>;
    AddFillCases(*all);
    AddFillTensorsCases(*all);
    AddFillTensorsErrorCases(*all);
    AddFillRandomCases(*all);
    AddCastCases(*all);
    AddCopyCases(*all);
    AddCopyColumnsCases(*all);
    AddReadBackCases(*all);
    AddAddCases(*all);
    AddAddScaledCases(*all);
    AddGemmCases(*all);
    AddGemmBiasActivationCases(*all);
    AddGemmBiasGradCases(*all);
    AddOneRoundingCases(*all);
    AddGemmActivationBackwardCases(*all);
    AddAddBiasCases(*all);
    AddBiasGradCases(*all);
    AddActivationCases(*all);
    AddLayerNormCases(*all);
    AddRmsNormCases(*all);
    AddHeadRmsNormCases(*all);
    AddKvHeadsCases(*all);
    AddRopeCases(*all);
    AddGatedMulCases(*all);
    AddEmbeddingCases(*all);
    AddLossCases(*all);
    AddAttentionCases(*all);
    AddAttentionDecodeCases(*all);
    AddCrossEntropyChunkCases(*all);
    AddTokenLossCases(*all);
    AddUnscaleCases(*all);
    AddAdamCases(*all);
    AddSgdCases(*all);
    AddHistogramCases(*all);
    return all;
  }();
  return *cases;
}

// ---- comparison ------------------------------------------------------------------
::testing::AssertionResult Close(const std::vector<double>& want, const std::vector<double>& got,
                                 Tol tol) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: want " << want.size() << ", got " << got.size();
  }
  const bool bitwise = tol.rtol == 0 && tol.atol == 0;
  int bad = 0;
  double worst = 0;
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], g = got[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
    } else if (bitwise) {
      ok = w == g && std::signbit(w) == std::signbit(g);
    } else if (std::isinf(w) || std::isinf(g)) {
      ok = w == g;
    } else {
      const double err = std::fabs(g - w);
      ok = err <= tol.atol + tol.rtol * std::fabs(w);
      worst = std::max(worst, err / (tol.atol + tol.rtol * std::fabs(w)));
    }
    if (!ok && bad++ < 5) {
      failure << "[" << i << "] want " << w << " got " << g << " (diff " << g - w << "); ";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  failure << bad << " of " << want.size() << " elements differ";
  if (!bitwise) {
    failure << " beyond rtol " << tol.rtol << " atol " << tol.atol << " (the largest error is "
            << worst << " times its tolerance)";
  }
  return failure;
}

void ExpectMatch(const Outputs& want, const Outputs& got, const std::string& against) {
  ASSERT_EQ(want.size(), got.size()) << "outputs of " << against;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(want[i].name, got[i].name);
    EXPECT_TRUE(Close(want[i].values, got[i].values, want[i].tol))
        << want[i].name << " against the " << against;
  }
}

// ---- the test ----------------------------------------------------------------------
// Every backend ampd can be asked for; those this build or machine lacks skip.
using Param = std::tuple<std::string, size_t>;

class BackendOpsTest : public ::testing::TestWithParam<Param> {};

TEST_P(BackendOpsTest, MatchesReference) {
  const std::string& device = std::get<0>(GetParam());
  const OpCase& op = AllCases()[std::get<1>(GetParam())];
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(device);
  if (!backend.ok() && backend.status().code() == absl::StatusCode::kFailedPrecondition) {
    GTEST_SKIP() << device << ": no device (" << backend.status().message() << ")";
  }
  ASSERT_TRUE(backend.ok()) << device << ": " << backend.status();
  const CaseFns fns = op.build();
  absl::StatusOr<Outputs> got = fns.run(**backend);
  // The CPU backend is the oracle and implements every op; only another
  // backend may lack one.
  if (device != "cpu" && got.status().code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << device << ": " << op.op << " (" << op.variant
                 << ") not supported: " << got.status().message();
  }
  ASSERT_TRUE(got.ok()) << device << ": " << op.op << ": " << got.status();
  if (device == "cpu") {
    ASSERT_TRUE(fns.reference || fns.check) << op.op << " has neither a reference nor a check";
    if (fns.reference) ExpectMatch(fns.reference(), *got, "float64 reference");
    if (fns.check) {
      EXPECT_TRUE(fns.check(*got));
    }
  } else {
    const std::unique_ptr<Backend> oracle = CreateCpuBackend();
    absl::StatusOr<Outputs> want = fns.run(*oracle);
    ASSERT_TRUE(want.ok()) << "cpu: " << op.op << ": " << want.status();
    ExpectMatch(*want, *got, "cpu oracle");
  }
}

std::string CaseName(const ::testing::TestParamInfo<Param>& info) {
  const OpCase& op = AllCases()[std::get<1>(info.param)];
  std::string name = absl::StrCat(std::get<0>(info.param), "_", op.op, "_", op.variant);
  for (char& ch : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendOpsTest,
                         ::testing::Combine(::testing::Values(std::string("cpu"),
                                                              std::string("cuda:0")),
                                            ::testing::Range<size_t>(0, AllCases().size())),
                         CaseName);

}  // namespace
}  // namespace ampd::kernels
