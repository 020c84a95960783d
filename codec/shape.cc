// Element counts and printable shapes (shape.h).
#include "codec/shape.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ampd::codec {

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

}  // namespace ampd::codec
