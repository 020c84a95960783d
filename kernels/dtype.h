// The backends' element types are the codec's (codec/dtype.h): a tensor's
// bytes arrive from a client or a file and reach a backend without a dtype
// conversion. Kernel code spells them kernels::DType, kernels::SizeOf, ...
#pragma once

#include "codec/dtype.h"

namespace ampd::kernels {

using codec::DType;
using codec::DTypeFromName;
using codec::DTypeName;
using codec::IsFloating;
using codec::SizeOf;

}  // namespace ampd::kernels
