// Chat templates: the model's own Jinja template, rendered by our interpreter (jinja/) exactly as
// transformers' apply_chat_template renders it. The templates come from files beside the
// tokenizer (how transformers 5 saves them: chat_template.jinja, and named ones such as
// additional_chat_templates/tool_use.jinja) or else tokenizer_config.json's `chat_template` (a
// string, or a list of named templates). "default" renders, or "tool_use" when tools are passed.
//
// A missing template, or one that does not parse, is reported once at load (load_status()) and
// every render is FAILED_PRECONDITION; nothing is guessed.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/tokenizer/jinja/template.h"

namespace dropkv {

// One chat render: the arguments of HF apply_chat_template(conversation, tools, documents,
// add_generation_prompt, continue_final_message, **kwargs). Messages are passed to the template
// as they are (OpenAI's shape: role, content as a string or a list of {"type": "text", "text"}
// parts, tool_calls, tool_call_id, name); key order is kept, as Python dicts keep it.
struct ChatRequest {
  // Not an aggregate, so `ApplyChatTemplate({{"user", "hi"}})` means plain ChatMessages.
  ChatRequest() = default;

  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::optional<nlohmann::ordered_json> tools;      // a list of JSON schemas; nullopt: None
  std::optional<nlohmann::ordered_json> documents;  // a list of objects; nullopt: None
  bool add_generation_prompt = true;
  // Render the final message open-ended so the model continues it (HF's semantics; excludes
  // add_generation_prompt).
  bool continue_final_message = false;
  // Extra template variables (enable_thinking, date_string, ...); they override the special
  // tokens, as HF's kwargs do.
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
};

// Variables every render defines; template_kwargs may not set them.
inline constexpr std::string_view kChatReservedVariables[] = {"messages", "tools", "documents",
                                                              "add_generation_prompt"};

class ChatTemplate {
 public:
  ChatTemplate() = default;  // no template: renders are FAILED_PRECONDITION
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // `config`: tokenizer_config.json (null or an object); `jinja_file` / `tool_use_jinja_file`:
  // the template files' texts ("" when absent; when either exists, the files replace the
  // config's templates, as in transformers). Never fails: problems land in load_status().
  static ChatTemplate FromConfig(const nlohmann::json& config, std::string_view jinja_file,
                                 std::string_view tool_use_jinja_file = {});

  // OK when chat works; otherwise FAILED_PRECONDITION saying why (no template; "line N: ..." for
  // one that does not parse).
  const absl::Status& load_status() const { return load_status_; }
  // Filters / tests the template uses that the interpreter lacks (renders reaching them fail).
  std::vector<std::string> unsupported() const;

  // Errors: INVALID_ARGUMENT for a request the template or HF refuses (empty conversation,
  // raise_exception, a message shape the template cannot use); FAILED_PRECONDITION when the
  // template is unusable or reaches an unsupported construct; RESOURCE_EXHAUSTED when the render
  // budget runs out.
  absl::StatusOr<std::string> Render(const ChatRequest& request,
                                     const jinja::RenderOptions& options = {}) const;

 private:
  std::unique_ptr<jinja::Template> default_template_;
  std::unique_ptr<jinja::Template> tool_use_template_;  // named "tool_use"; used when tools != None
  std::string default_source_, tool_use_source_;
  // bos_token, eos_token, ... as HF's special_tokens_map passes them (only those that are set).
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  absl::Status load_status_ = absl::FailedPreconditionError("the model has no chat template");
};

// Deepest nesting a chat's JSON may have: templates never need more, and deeper input would
// make the recursive copies and walks below unsafe for the stack.
inline constexpr int kMaxChatJsonDepth = 64;
// True when `json` nests deeper than `max_depth` arrays / objects (checked without recursion).
bool JsonNestedDeeperThan(const nlohmann::ordered_json& json, int max_depth);

// OpenAI clients send tool_calls[].function.arguments as JSON text; templates expect a mapping
// (Llama 3.1 applies tojson to it, which would quote the text again), so parse it the way vLLM
// does. Arguments that are not valid JSON text are INVALID_ARGUMENT naming
// `<field_prefix>[i].tool_calls[j].function.arguments`.
absl::Status ParseToolCallArguments(nlohmann::ordered_json* messages,
                                    std::string_view field_prefix);

}  // namespace dropkv
