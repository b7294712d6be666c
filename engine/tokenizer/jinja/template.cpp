#include "engine/tokenizer/jinja/template.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/builtins.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/jinja/interpreter.h"
#include "engine/tokenizer/jinja/lexer.h"
#include "engine/tokenizer/jinja/parser.h"

namespace dropkv::jinja {

Template::Template(std::unique_ptr<ParsedTemplate> parsed) : parsed_(std::move(parsed)) {}
Template::~Template() = default;

absl::StatusOr<std::unique_ptr<Template>> Template::Parse(std::string_view source) {
  auto tokens = Tokenize(source);
  if (!tokens.ok()) return tokens.status();
  auto parsed = ParseTokens(*tokens);
  if (!parsed.ok()) return parsed.status();
  return std::unique_ptr<Template>(new Template(std::move(*parsed)));
}

const std::vector<std::string>& Template::unsupported() const {
  return parsed_->unsupported;
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& variables,
                                             const RenderOptions& options) const {
  if (!variables.is_object()) {
    return absl::InvalidArgumentError("template variables must be a JSON object");
  }
  TemplateVariables named;
  named.reserve(variables.size());
  for (auto it = variables.begin(); it != variables.end(); ++it) {
    named.emplace_back(it.key(), &it.value());  // keys live in `variables`
  }
  return Render(named, options);
}

absl::StatusOr<std::string> Template::Render(const TemplateVariables& variables,
                                             const RenderOptions& options) const {
  int64_t steps = 0;
  Interpreter interp(*parsed_, options, &steps);
  try {
    auto root = std::make_shared<Scope>();
    AddGlobals(parsed_->symbols, root.get());
    for (const auto& [name, value] : variables) {
      // A variable the template never mentions cannot be read: it is not even converted.
      if (Symbol symbol = parsed_->symbols.Find(name)) root->Set(symbol, FromJson(*value));
    }
    return interp.RenderRoot(std::move(root));
  } catch (const RenderError& e) {
    return absl::Status(e.code, Cat("line ", interp.current_line(), ": ", e.message));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        Cat("line ", interp.current_line(), ": out of memory while rendering"));
  }
}

}  // namespace dropkv::jinja
