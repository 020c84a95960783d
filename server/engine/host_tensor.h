// The engine's host tensors are the codec's (codec/host_tensor.h): a Step's
// inputs and a checkpoint's tensors reach the engine as the bytes the client
// or the file held, with no conversion in between. This header brings them
// into engine::, where jobs, models and checkpoints use them.
#pragma once

#include "codec/host_tensor.h"

namespace ampd::engine {

using codec::HostTensor;
using codec::ResizeForBulkCopy;

}  // namespace ampd::engine
