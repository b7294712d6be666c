// Status propagation helpers for absl::Status / absl::StatusOr (absl has no public macros).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DROPKV_CONCAT_INNER(a, b) a##b
#define DROPKV_CONCAT(a, b) DROPKV_CONCAT_INNER(a, b)

// RETURN_IF_ERROR(expr): returns the status of `expr` from the enclosing function unless ok.
#define RETURN_IF_ERROR(expr)                               \
  do {                                                      \
    ::absl::Status dropkv_status_ = (expr);                 \
    if (!dropkv_status_.ok()) return dropkv_status_;        \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): `lhs = *expr` when ok, else returns the status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  DROPKV_ASSIGN_OR_RETURN_IMPL(DROPKV_CONCAT(dropkv_statusor_, __LINE__), lhs, expr)
#define DROPKV_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(*tmp)
