#include "engine/common/named_value.h"

#include <cctype>

#include "absl/strings/str_cat.h"

namespace dropkv {
namespace names_internal {

std::string Normalize(std::string_view text) {
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  std::string out(text.substr(begin, end - begin));
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

absl::Status UnknownName(std::string_view field, std::string_view text,
                         const std::vector<std::string_view>& accepted) {
  std::string list;
  for (std::string_view name : accepted) {
    if (!list.empty()) list += '|';
    list += name;
  }
  std::string prefix = field.empty() ? std::string() : absl::StrCat(std::string(field), ": ");
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, "expected one of ", list, ", got '", std::string(text), "'"));
}

}  // namespace names_internal

}  // namespace dropkv
