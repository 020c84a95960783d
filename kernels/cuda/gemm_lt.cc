// cuBLASLt plans for the Linear ops (see gemm_lt.h). cuBLASLt is
// column-major: as in LaunchGemm (gemm.cc) the row-major
//   c (m, n) = op(a) (m, k) @ op(b) (k, n)
// is the column-major c^T (n, m) = op(b)^T (n, k) @ op(a)^T (k, m), so
// cuBLASLt's A is our b and its B is our a, and a row-major (R, C) matrix
// is described as the column-major (C, R) matrix with leading dimension C.
// In those terms our epilogues map onto cuBLASLt's by name:
//   bias over c's columns (n)       = cuBLASLt's bias over D's rows   (BIAS)
//   aux (m, n), leading dim n       = cuBLASLt's aux with AUX_LD = n  (GELU_AUX_BIAS, DGELU)
//   column sums of b stored (k, n)  = sums over k of its A            (BGRADA)
//   column sums of a stored (k, m)  = sums over k of its B            (BGRADB)
#include "kernels/cuda/gemm_lt.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace ampd::kernels::cuda {
namespace {

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

const char* TypeName(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    default:
      return "f32";
  }
}

cublasLtEpilogue_t CublasEpilogue(LtEpilogue epilogue) {
  switch (epilogue) {
    case LtEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case LtEpilogue::kBGradA:  // our a is cuBLASLt's B
      return CUBLASLT_EPILOGUE_BGRADB;
    case LtEpilogue::kBGradB:  // our b is cuBLASLt's A
      return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool UsesBias(LtEpilogue e) { return e != LtEpilogue::kDGelu; }
bool UsesAux(LtEpilogue e) { return e == LtEpilogue::kGeluAuxBias || e == LtEpilogue::kDGelu; }

// The largest power of two up to 256 dividing the address (256 for null:
// an operand the epilogue does not use constrains nothing).
int Alignment(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && addr % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const {
    if (p != nullptr) (void)Destroy(p);
  }
};
using DescPtr = std::unique_ptr<cublasLtMatmulDescOpaque_t,
                                LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t,
                                  LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using PreferencePtr =
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                    LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

template <typename T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}
template <typename T>
cublasStatus_t SetPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
}

// A row-major (rows, cols) matrix as cuBLASLt's column-major (cols, rows).
absl::StatusOr<LayoutPtr> RowMajorLayout(DType dtype, int rows, int cols) {
  cublasLtMatrixLayout_t layout = nullptr;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      &layout, CudaType(dtype), static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), cols));
  return LayoutPtr(layout);
}

}  // namespace

const char* LtEpilogueName(LtEpilogue epilogue) {
  switch (epilogue) {
    case LtEpilogue::kBias:
      return "BIAS";
    case LtEpilogue::kGeluAuxBias:
      return "GELU_AUX_BIAS";
    case LtEpilogue::kDGelu:
      return "DGELU";
    case LtEpilogue::kBGradA:
      return "BGRADB(a)";
    case LtEpilogue::kBGradB:
      return "BGRADA(b)";
  }
  return "?";
}

struct LtMatmul::Plan {
  bool fused = false;
  std::string what;  // the call, for the log and Describe
  std::string why;   // "fused", or why not
  DescPtr desc;
  LayoutPtr a_layout;  // cuBLASLt's A: our b
  LayoutPtr b_layout;  // cuBLASLt's B: our a
  LayoutPtr c_layout;  // C and D: our c
  cublasLtMatmulAlgo_t algo{};
};

LtMatmul::LtMatmul(std::string name, cublasLtHandle_t handle, void* workspace,
                   size_t workspace_bytes)
    : name_(std::move(name)),
      handle_(handle),
      workspace_(workspace),
      workspace_bytes_(workspace_bytes) {}

LtMatmul::~LtMatmul() {
  plans_.clear();  // the descriptors go before the handle
  if (handle_ != nullptr) (void)cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<LtMatmul>> LtMatmul::Create(std::string name, void* workspace,
                                                           size_t workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle));
  return std::unique_ptr<LtMatmul>(
      new LtMatmul(std::move(name), handle, workspace, workspace_bytes));
}

absl::StatusOr<LtMatmul::Plan*> LtMatmul::PlanFor(const Key& key, const LtMatmulArgs& args) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second.get();
  }
  auto plan = std::make_unique<Plan>();
  plan->what = absl::StrCat(LtEpilogueName(args.epilogue), " ", TypeName(args.ab_dtype), "->",
                            TypeName(args.c_dtype), " m=", args.m, " n=", args.n, " k=", args.k,
                            args.trans_a ? " a^T" : "", args.trans_b ? " b^T" : "");
  if (UsesBias(args.epilogue) && args.bias_dtype != args.c_dtype) {
    absl::StrAppend(&plan->what, " bias ", TypeName(args.bias_dtype));
  }

  cublasLtMatmulDesc_t desc = nullptr;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  plan->desc.reset(desc);
  const cublasOperation_t op_a = args.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A: our b
  const cublasOperation_t op_b = args.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B: our a
  AMPD_CUBLAS_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a));
  AMPD_CUBLAS_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b));
  // The epilogue's settings. A type is set only where it differs from the
  // default (c's dtype): cuBLASLt refuses some explicit settings it would
  // accept by default. A setting it refuses leaves the plan unfused.
  auto configure = [&]() -> cublasStatus_t {
    cublasStatus_t st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CublasEpilogue(args.epilogue));
    // The heuristic reads the pointers' alignment from the descriptor.
    if (st == CUBLAS_STATUS_SUCCESS && UsesBias(args.epilogue)) {
      if (args.bias_dtype != args.c_dtype) {
        const int32_t bias_type = CudaType(args.bias_dtype);
        st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
      }
      if (st == CUBLAS_STATUS_SUCCESS) {
        st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
      }
    }
    if (st == CUBLAS_STATUS_SUCCESS && UsesAux(args.epilogue)) {
      const int64_t aux_ld = args.n;  // aux is stored like c: (m, n) row-major
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, args.aux);
      if (st == CUBLAS_STATUS_SUCCESS) {
        st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld);
      }
    }
    return st;
  };
  const cublasStatus_t configured = configure();
  // Stored shapes, row-major: a (m, k) or (k, m), b (k, n) or (n, k), c (m, n).
  AMPD_ASSIGN_OR_RETURN(plan->a_layout,
                        RowMajorLayout(args.ab_dtype, args.trans_b ? args.n : args.k,
                                       args.trans_b ? args.k : args.n));
  AMPD_ASSIGN_OR_RETURN(plan->b_layout,
                        RowMajorLayout(args.ab_dtype, args.trans_a ? args.k : args.m,
                                       args.trans_a ? args.m : args.k));
  AMPD_ASSIGN_OR_RETURN(plan->c_layout, RowMajorLayout(args.c_dtype, args.m, args.n));

  cublasLtMatmulPreference_t raw_pref = nullptr;
  AMPD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&raw_pref));
  const PreferencePtr pref(raw_pref);
  const uint64_t max_workspace = workspace_bytes_;
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace));
  // Split-K partial sums only in fp32 (never added up in a 16-bit output).
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes));
  const uint32_t align_a = static_cast<uint32_t>(Alignment(args.b));  // cuBLASLt's A
  const uint32_t align_b = static_cast<uint32_t>(Alignment(args.a));
  const uint32_t align_c = static_cast<uint32_t>(Alignment(args.c));
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a));
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b));
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c));
  AMPD_CUBLAS_RETURN_IF_ERROR(
      SetPref(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      configured != CUBLAS_STATUS_SUCCESS
          ? configured
          : cublasLtMatmulAlgoGetHeuristic(handle_, desc, plan->a_layout.get(),
                                           plan->b_layout.get(), plan->c_layout.get(),
                                           plan->c_layout.get(), pref.get(), 1, &result, &found);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
      result.workspaceSize <= workspace_bytes_) {
    plan->fused = true;
    plan->algo = result.algo;
    plan->why = "cuBLASLt epilogue";
  } else if (status == CUBLAS_STATUS_SUCCESS || status == CUBLAS_STATUS_NOT_SUPPORTED ||
             status == CUBLAS_STATUS_INVALID_VALUE) {
    // No algorithm for this combination: the caller's separate kernels run.
    plan->why = absl::StrCat(
        "separate kernels (", configured != CUBLAS_STATUS_SUCCESS ? "descriptor" : "heuristic",
        ": ", status == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasGetStatusName(status), ")");
  } else {
    AMPD_CUBLAS_RETURN_IF_ERROR(status);
  }
  // One line per plan, at its first use: which path this GEMM takes.
  std::fprintf(stderr, "ampd: %s: GEMM %s: %s\n", name_.c_str(), plan->what.c_str(),
               plan->why.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = plans_.emplace(key, std::move(plan));
  return it->second.get();
}

absl::StatusOr<bool> LtMatmul::Run(const LtMatmulArgs& args, cudaStream_t stream) {
  const Key key{args.m,
                args.n,
                args.k,
                args.trans_a,
                args.trans_b,
                static_cast<int>(args.ab_dtype),
                static_cast<int>(args.c_dtype),
                static_cast<int>(args.epilogue),
                UsesBias(args.epilogue) ? static_cast<int>(args.bias_dtype) : -1,
                Alignment(args.a),
                Alignment(args.b),
                Alignment(args.c),
                UsesBias(args.epilogue) ? Alignment(args.bias) : 256,
                UsesAux(args.epilogue) ? Alignment(args.aux) : 256};
  AMPD_ASSIGN_OR_RETURN(Plan * plan, PlanFor(key, args));
  if (!plan->fused) return false;
  cublasLtMatmulDesc_t desc = plan->desc.get();
  // This call's pointers, on the cached descriptor (host-side setters).
  if (UsesBias(args.epilogue)) {
    AMPD_CUBLAS_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias));
  }
  if (UsesAux(args.epilogue)) {
    AMPD_CUBLAS_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, args.aux));
  }
  const cublasStatus_t status =
      cublasLtMatmul(handle_, desc, &args.alpha, args.b, plan->a_layout.get(), args.a,
                     plan->b_layout.get(), &args.beta, args.c, plan->c_layout.get(), args.c,
                     plan->c_layout.get(), &plan->algo, workspace_, workspace_bytes_, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
    // Refused at launch (checked on the host; nothing was enqueued): this
    // call and later ones of its plan take the separate kernels.
    std::lock_guard<std::mutex> lock(mu_);
    plan->fused = false;
    plan->why =
        absl::StrCat("separate kernels (cublasLtMatmul: ", cublasGetStatusName(status), ")");
    std::fprintf(stderr, "ampd: %s: GEMM %s: %s\n", name_.c_str(), plan->what.c_str(),
                 plan->why.c_str());
    return false;
  }
  AMPD_CUBLAS_RETURN_IF_ERROR(status);
  return true;
}

std::vector<std::string> LtMatmul::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> lines;
  lines.reserve(plans_.size());
  for (const auto& [key, plan] : plans_) lines.push_back(absl::StrCat(plan->what, ": ", plan->why));
  return lines;
}

}  // namespace ampd::kernels::cuda
