// A tensor's row-major shape and the two things every layer asks of it: its
// element count and its printed form "(2, 3)", which error messages on both
// sides of the API use, so a shape reads the same in ampctl and the server.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ampd::codec {

using Shape = std::vector<int64_t>;

// Product of the dims; 1 for a scalar (empty shape). Unchecked: callers
// holding a shape from outside check it first (HostTensor::Validate).
int64_t NumElements(const Shape& shape);
std::string ShapeToString(const Shape& shape);  // "(2, 3)"

}  // namespace ampd::codec
