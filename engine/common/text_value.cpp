#include "engine/common/text_value.h"

#include <array>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace dropkv {
namespace {

std::string_view Strip(std::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(AbslView(text));
  return std::string_view(s.data(), s.size());
}

template <typename T>
absl::StatusOr<T> ParseInteger(std::string_view text, const char* expected) {
  std::string_view t = Strip(text);
  T v = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || ptr != t.data() + t.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", expected, ", got ", QuoteText(text)));
  }
  return v;
}

}  // namespace

std::string QuoteText(std::string_view text) {
  return absl::StrCat("'", AbslView(text), "'");
}

absl::StatusOr<int64_t> ParseIntText(std::string_view text) {
  return ParseInteger<int64_t>(text, "an integer");
}

absl::StatusOr<uint64_t> ParseUintText(std::string_view text) {
  return ParseInteger<uint64_t>(text, "a non-negative integer");
}

absl::StatusOr<double> ParseDoubleText(std::string_view text) {
  std::string t(Strip(text));
  char* end = nullptr;
  double v = t.empty() ? 0.0 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || !std::isfinite(v)) {
    return absl::InvalidArgumentError(absl::StrCat("expected a number, got ", QuoteText(text)));
  }
  return v;
}

absl::StatusOr<bool> ParseBoolText(std::string_view text) {
  std::string t = absl::AsciiStrToLower(AbslView(Strip(text)));
  if (t == "true" || t == "yes" || t == "on" || t == "1") return true;
  if (t == "false" || t == "no" || t == "off" || t == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("expected a boolean (true/false), got ", QuoteText(text)));
}

std::string FormatDoubleText(double value) {
  std::array<char, 64> buf{};
  auto [ptr, ec] = std::to_chars(buf.data(), buf.data() + buf.size(), value);
  std::string s(buf.data(), ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace dropkv
