// Tokens -> statements, following jinja2's parser.py (precedence, tuples, test arguments without
// parentheses, filter and test chains) for the statements chat templates use: if / for (with
// `else`, a filter condition, break / continue) / set (also block set and namespace attributes)
// / macro / call / filter / with / print, and transformers' `generation` block.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/jinja/ast.h"
#include "engine/tokenizer/jinja/lexer.h"

namespace dropkv::jinja {

struct ParsedTemplate {
  Body body;
  // Filters and tests the template names that the interpreter lacks, as "line N: filter 'x'".
  // The template still loads (jinja2 also resolves names lazily inside conditionals); a render
  // that reaches one fails with FAILED_PRECONDITION.
  std::vector<std::string> unsupported;
};

// Errors are INVALID_ARGUMENT "line N: ...".
absl::StatusOr<ParsedTemplate> ParseTokens(const std::vector<Token>& tokens);

}  // namespace dropkv::jinja
