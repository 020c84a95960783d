// MakeNcclAllReduce in a build without CUDA or NCCL.
#include "absl/strings/str_cat.h"
#include "server/engine/dist/nccl_all_reduce.h"

namespace ampd::engine::dist {

absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeNcclAllReduce(ProcessGroup&,
                                                                     kernels::Backend& backend) {
  return absl::UnimplementedError(
      absl::StrCat("distributed: ", backend.name(),
                   " jobs sum gradients with NCCL, and this ampd was built without it"));
}

}  // namespace ampd::engine::dist
