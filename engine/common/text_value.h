// Scalar values as text, for every place a setting arrives as a string (YAML, flags, environment,
// the schema's own encoding): strict parsers whose errors say what was expected and what came,
// and a double format that reads back to the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dropkv {

// Debian's abseil has its own string_view type (not an alias of std's): convert at the API edge.
inline absl::string_view AbslView(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// "'text'": the given value as errors quote it.
std::string QuoteText(std::string_view text);

// Whole-string parses (surrounding ASCII whitespace ignored). Errors: "expected an integer, got
// 'x'" and the like, with no field name (the caller puts it in front).
absl::StatusOr<int64_t> ParseIntText(std::string_view text);
absl::StatusOr<uint64_t> ParseUintText(std::string_view text);
absl::StatusOr<double> ParseDoubleText(std::string_view text);  // finite only
// true/false, yes/no, on/off, 1/0 (any case).
absl::StatusOr<bool> ParseBoolText(std::string_view text);

// The shortest text that parses back to `value`, always with a fraction or an exponent
// ("1" -> "1.0") so that YAML keeps reading it as a number.
std::string FormatDoubleText(double value);

}  // namespace dropkv
