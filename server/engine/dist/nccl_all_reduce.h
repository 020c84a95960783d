// NCCL's GradientAllReduce (nccl_all_reduce.cc, built with CUDA and NCCL;
// without them nccl_unavailable.cc answers Unimplemented).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/engine/dist/gradient_all_reduce.h"
#include "server/engine/dist/process_group.h"

namespace ampd::engine::dist {

// A communicator over the group's ranks (NCCL's unique id comes from rank
// 0 through the group's Broadcast), summing on `backend`'s stream.
absl::StatusOr<std::unique_ptr<GradientAllReduce>> MakeNcclAllReduce(ProcessGroup& group,
                                                                     kernels::Backend& backend);

}  // namespace ampd::engine::dist
