// Errors inside the interpreter. A render stops at the first error, so the interpreter throws one
// RenderError and Template::Render (the only entry point) turns it into an absl::Status with the
// template line; no exception leaves this library.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dropkv::jinja {

// absl::StrCat that also takes std::string_view (absl::string_view is its own type here).
template <typename T>
decltype(auto) AsAlphaNum(const T& value) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return absl::string_view(value.data(), value.size());
  } else {
    return (value);
  }
}
template <typename... Args>
std::string Cat(const Args&... args) {
  return absl::StrCat(AsAlphaNum(args)...);
}

struct RenderError {
  // kInvalidArgument: the template raised, or the conversation does not fit the template (a type
  //   error, an undefined value used);
  // kFailedPrecondition: the template uses something this interpreter does not implement;
  // kResourceExhausted: the render budget (steps, output size, nesting) ran out.
  absl::StatusCode code;
  std::string message;
};

[[noreturn]] inline void Fail(absl::StatusCode code, std::string message) {
  throw RenderError{code, std::move(message)};
}
[[noreturn]] inline void TypeError(std::string message) {
  Fail(absl::StatusCode::kInvalidArgument, std::move(message));
}
[[noreturn]] inline void Unsupported(std::string message) {
  Fail(absl::StatusCode::kFailedPrecondition, std::move(message));
}

}  // namespace dropkv::jinja
