// Input checks shared by the kernels' entry points: each failure is an InvalidArgument that names
// the argument and the offending value. Internal to kernels/.
#pragma once

#include <exception>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dropkv::kernels::internal {

inline std::string ShapeStr(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) absl::StrAppend(&s, i ? ", " : "", t.size(i));
  return s + "]";
}

inline absl::Status CheckDim(const at::Tensor& t, const char* name, int64_t dim,
                             const char* layout) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(name, ": undefined tensor"));
  if (t.dim() != dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected ", dim, " dims ", layout, ", got shape ", ShapeStr(t)));
  }
  return absl::OkStatus();
}

inline absl::Status CheckSize(const at::Tensor& t, const char* name, int64_t dim, int64_t want,
                              const char* what) {
  if (t.size(dim) != want) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dim ", dim, " (", what, ") is ",
                                                   t.size(dim), ", expected ", want, " (shape ",
                                                   ShapeStr(t), ")"));
  }
  return absl::OkStatus();
}

// Runs f (which may throw c10::Error) and turns exceptions into Internal errors.
template <typename F>
auto CatchTorch(const char* op, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(op, ": ", e.what()));
  }
}

}  // namespace dropkv::kernels::internal
