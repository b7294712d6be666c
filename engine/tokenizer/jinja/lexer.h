// Template source -> tokens, as jinja2's lexer produces them with transformers' settings
// (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False):
//  * newlines (\r\n, \r, \n) become \n and one trailing newline of the source is dropped;
//  * `{%-` / `{{-` / `{#-` strip all whitespace before the tag, `-%}` / `-}}` / `-#}` all after;
//  * trim_blocks drops the first newline after `%}` / `#}`; `+%}` keeps it;
//  * lstrip_blocks drops spaces and tabs between a line start and `{%` / `{#`; `{%+` keeps them;
//  * `{% raw %}...{% endraw %}` is data; comments produce nothing.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dropkv::jinja {

enum class TokenType : uint8_t {
  kData,           // template text, `value`
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,           // identifiers and keywords, `value`
  kString,         // a string literal, `value` unescaped
  kInteger,        // `int_value`
  kFloat,          // `float_value`
  kOperator,       // `value`: "+", "//", "(", "==", ...
  kEof,
};

struct Token {
  TokenType type;
  int line;
  std::string value;
  int64_t int_value = 0;
  double float_value = 0;
};

// Errors are INVALID_ARGUMENT "line N: ...".
absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source);

}  // namespace dropkv::jinja
