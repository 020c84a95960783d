// AMPD_RETURN_IF_ERROR: early return of a non-OK absl::Status, for the
// engine's long chains of Backend calls (Debian's Abseil has no public
// equivalent).
#pragma once

#include "absl/status/status.h"

#define AMPD_RETURN_IF_ERROR(expr)               \
  do {                                           \
    absl::Status ampd_status_ = (expr);          \
    if (!ampd_status_.ok()) return ampd_status_; \
  } while (0)
