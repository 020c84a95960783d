// AllocationGuard: a job's strand work run with allocation failures turned
// into ResourceExhausted. Private to server/engine/jobs/.
#pragma once

#include <new>
#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ampd::engine {

// Runs f, turning an allocation failure thrown anywhere inside it (a host
// vector or string the size of a tensor or a state dict) into
// ResourceExhausted: on a strand worker an escaping exception would reach
// std::terminate and take every job down with it.
template <typename F>
auto AllocationGuard(absl::string_view what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": a buffer exceeds the maximum size"));
  }
}

}  // namespace ampd::engine
