// A Jinja2 interpreter of our own for chat templates: parse once at model load, render per
// request. It renders what transformers' apply_chat_template renders (jinja2's
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls, transformers'
// `tojson`, `raise_exception` and `strftime_now`), byte for byte, for the subset of Jinja that
// model templates use; docs/tokenizer.md lists it.
//
// Rendering is bounded: a step budget, an output size limit and a recursion limit stop any
// template (`{% for i in range(10**9) %}`, a macro calling itself) with RESOURCE_EXHAUSTED.
// Thread-safe: a parsed Template is immutable and may render on many threads at once.
#pragma once

#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"

namespace dropkv::jinja {

struct ParsedTemplate;

struct RenderLimits {
  // Evaluation steps (one per expression node, statement and loop iteration, plus one per 64
  // bytes of strings built). A 50-turn chat with a tool-heavy template takes ~30,000.
  int64_t max_steps = 20'000'000;
  // Largest output, and largest string any expression may build.
  int64_t max_output_bytes = 64 << 20;
  // Nested evaluation frames (expression depth, statement nesting and macro calls together).
  int max_depth = 1000;
};

struct RenderOptions {
  RenderLimits limits;
  // The local time `strftime_now` formats; null: the system clock in the local time zone.
  std::function<std::tm()> local_time;
};

// Named template variables; the JSON stays the caller's and must outlive the render. A later
// entry with the same name wins.
using TemplateVariables = std::vector<std::pair<std::string_view, const nlohmann::ordered_json*>>;

class Template {
 public:
  // Errors (INVALID_ARGUMENT) read "line N: what", naming the construct.
  static absl::StatusOr<std::unique_ptr<Template>> Parse(std::string_view source);
  ~Template();

  // Renders with `variables`. Errors: INVALID_ARGUMENT when the template raises
  // (raise_exception) or the variables do not fit it (a type error, an undefined value used);
  // FAILED_PRECONDITION when it reaches something this interpreter does not implement;
  // RESOURCE_EXHAUSTED when a limit is hit. Messages start with "line N: ".
  absl::StatusOr<std::string> Render(const TemplateVariables& variables,
                                     const RenderOptions& options = {}) const;
  // Each key of a JSON object is a variable.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& variables,
                                     const RenderOptions& options = {}) const;

  // Filters and tests the template names that this interpreter lacks ("line 3: filter 'x'");
  // rendering fails only when a render reaches one.
  const std::vector<std::string>& unsupported() const;

 private:
  explicit Template(std::unique_ptr<ParsedTemplate> parsed);
  std::unique_ptr<ParsedTemplate> parsed_;
};

}  // namespace dropkv::jinja
