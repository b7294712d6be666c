// Tokens -> statements, following jinja2's parser.py (precedence, tuples, test arguments without
// parentheses, filter and test chains) for the statements chat templates use: if / for (with
// `else`, a filter condition, break / continue) / set (also block set and namespace attributes)
// / macro / call / filter / with / print, and transformers' `generation` block.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/jinja/ast.h"
#include "engine/tokenizer/jinja/lexer.h"

namespace dropkv::jinja {

struct ParsedTemplate {
  Body body;
  SymbolTable symbols;
  // Names the interpreter binds itself; null when the template never mentions them.
  Symbol loop = nullptr;
  Symbol caller = nullptr;
  Symbol varargs = nullptr;
  Symbol kwargs = nullptr;
  // Filters and tests the template names that the interpreter lacks, as "line N: filter 'x'".
  // The template still loads (jinja2 also resolves names lazily inside conditionals); a render
  // that reaches one fails with FAILED_PRECONDITION.
  std::vector<std::string> unsupported;
};

// Errors are INVALID_ARGUMENT "line N: ...".
// Heap-allocated: the AST points into its symbol table.
absl::StatusOr<std::unique_ptr<ParsedTemplate>> ParseTokens(const std::vector<Token>& tokens);

}  // namespace dropkv::jinja
