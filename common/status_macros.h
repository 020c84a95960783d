// Early-return helpers for absl::Status / absl::StatusOr chains (Debian's
// Abseil has no public equivalents). Header-only; every layer may use them.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the enclosing function when `expr` is a non-OK absl::Status.
#define AMPD_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status ampd_status_ = (expr);        \
    if (!ampd_status_.ok()) return ampd_status_; \
  } while (false)

// `AMPD_ASSIGN_OR_RETURN(lhs, expr)`: evaluates the StatusOr `expr`; returns
// its status when not OK, else moves the value into `lhs`, which may be a
// declaration (`auto x`) or an existing lvalue.
#define AMPD_ASSIGN_OR_RETURN(lhs, expr) \
  AMPD_ASSIGN_OR_RETURN_IMPL_(AMPD_STATUS_CONCAT_(ampd_statusor_, __LINE__), lhs, expr)

#define AMPD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)   \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#define AMPD_STATUS_CONCAT_INNER_(a, b) a##b
#define AMPD_STATUS_CONCAT_(a, b) AMPD_STATUS_CONCAT_INNER_(a, b)
