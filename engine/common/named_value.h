// Enums named by a constant table of (value, name) pairs: one spelling per value for config keys,
// request fields, flags and help texts, with case-insensitive parsing whose errors list every
// accepted name.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv {

template <typename E>
struct NamedValue {
  E value;
  std::string_view name;
};

namespace names_internal {
// Lower case, surrounding ASCII whitespace removed.
std::string Normalize(std::string_view text);
// INVALID_ARGUMENT "<field>: expected one of a|b|c, got 'text'" ("expected ..." when field is "").
absl::Status UnknownName(std::string_view field, std::string_view text,
                         const std::vector<std::string_view>& accepted);
}  // namespace names_internal

// The name of `value` in `table`, "unknown" when it has none.
template <typename E, size_t N>
std::string_view NameOf(const std::array<NamedValue<E>, N>& table, E value) {
  for (const NamedValue<E>& nv : table) {
    if (nv.value == value) return nv.name;
  }
  return "unknown";
}

// "a|b|c": the accepted names, in table order (help texts, errors).
template <typename E, size_t N>
std::string JoinNames(const std::array<NamedValue<E>, N>& table) {
  std::string out;
  for (const NamedValue<E>& nv : table) {
    if (!out.empty()) out += '|';
    out += nv.name;
  }
  return out;
}

// Case-insensitive; surrounding whitespace is ignored. The error starts with `field` (when not
// empty) and lists every accepted name.
template <typename E, size_t N>
absl::StatusOr<E> ParseName(const std::array<NamedValue<E>, N>& table, std::string_view text,
                            std::string_view field) {
  std::string t = names_internal::Normalize(text);
  std::vector<std::string_view> accepted;
  for (const NamedValue<E>& nv : table) {
    if (t == nv.name) return nv.value;
    accepted.push_back(nv.name);
  }
  return names_internal::UnknownName(field, text, accepted);
}

}  // namespace dropkv
