#include "engine/tokenizer/chat_template.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv {
namespace {

using ojson = nlohmann::ordered_json;

// transformers appends this to the final message's text, renders, and cuts the output where it
// lands (render_jinja_template's continue_final_message).
constexpr std::string_view kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

// HF's SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to every template.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

// A token given as a string or as an AddedToken object {"content": ...}; nullopt when unset.
std::optional<std::string> TokenText(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return std::nullopt;
}

// Python's str.strip() / rstrip().
std::string PyStrip(std::string_view s, bool left) {
  size_t begin = 0, end = s.size();
  while (left && begin < end) {
    char32_t cp = 0;
    const size_t n = unicode::DecodeCodePoint(s, begin, &cp);
    if (!unicode::IsPythonSpace(cp)) break;
    begin += n;
  }
  while (end > begin) {
    size_t k = end - 1;
    while (k > begin && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    char32_t cp = 0;
    unicode::DecodeCodePoint(s, k, &cp);
    if (!unicode::IsPythonSpace(cp)) break;
    end = k;
  }
  return std::string(s.substr(begin, end - begin));
}

absl::Status ParseTemplate(const std::string& source, std::string_view what,
                           std::unique_ptr<jinja::Template>* out) {
  auto parsed = jinja::Template::Parse(source);
  if (!parsed.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the model's ", std::string(what), " could not be parsed: ", parsed.status().message()));
  }
  *out = std::move(*parsed);
  return absl::OkStatus();
}

}  // namespace

ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::FromConfig(const nlohmann::json& config, std::string_view jinja_file,
                                      std::string_view tool_use_jinja_file) {
  ChatTemplate chat;
  const bool has_config = config.is_object();
  if (has_config) {
    for (const char* name : kSpecialTokenNames) {
      if (!config.contains(name)) continue;
      if (auto text = TokenText(config[name])) chat.special_tokens_[name] = *text;
    }
    // Named extra tokens (Gemma 3's boi_token, ...) join the map in transformers 5.
    if (config.contains("extra_special_tokens") && config["extra_special_tokens"].is_object()) {
      for (const auto& [name, value] : config["extra_special_tokens"].items()) {
        if (auto text = TokenText(value)) chat.special_tokens_[name] = *text;
      }
    }
  }
  if (!jinja_file.empty() || !tool_use_jinja_file.empty()) {
    chat.default_source_ = std::string(jinja_file);
    chat.tool_use_source_ = std::string(tool_use_jinja_file);
  } else if (has_config && config.contains("chat_template")) {
    const nlohmann::json& t = config["chat_template"];
    if (t.is_string()) {
      chat.default_source_ = t.get<std::string>();
    } else if (t.is_array()) {
      for (const auto& named : t) {
        if (!named.is_object() || !named.contains("template") || !named["template"].is_string()) {
          continue;
        }
        const std::string name = named.value("name", "");
        if (name == "default") chat.default_source_ = named["template"].get<std::string>();
        if (name == "tool_use") chat.tool_use_source_ = named["template"].get<std::string>();
      }
      if (chat.default_source_.empty() && chat.tool_use_source_.empty()) {
        chat.load_status_ = absl::FailedPreconditionError(
            "the model's chat templates have neither a 'default' nor a 'tool_use' one");
        return chat;
      }
    }
  }
  if (chat.default_source_.empty() && chat.tool_use_source_.empty()) return chat;
  absl::Status status = absl::OkStatus();
  if (!chat.default_source_.empty()) {
    status.Update(ParseTemplate(chat.default_source_, "chat template", &chat.default_template_));
  }
  if (!chat.tool_use_source_.empty()) {
    status.Update(
        ParseTemplate(chat.tool_use_source_, "tool_use chat template", &chat.tool_use_template_));
  }
  chat.load_status_ = status;
  return chat;
}

std::vector<std::string> ChatTemplate::unsupported() const {
  std::vector<std::string> names;
  for (const auto* t : {default_template_.get(), tool_use_template_.get()}) {
    if (t != nullptr) names.insert(names.end(), t->unsupported().begin(), t->unsupported().end());
  }
  return names;
}

absl::StatusOr<std::string> ChatTemplate::Render(const ChatRequest& request,
                                                 const jinja::RenderOptions& options) const {
  if (!load_status_.ok()) return load_status_;
  // HF's get_chat_template: "tool_use" when tools are passed and it exists, else "default".
  const bool use_tool_template = tool_use_template_ != nullptr && request.tools.has_value();
  const jinja::Template* tmpl =
      use_tool_template ? tool_use_template_.get() : default_template_.get();
  const std::string& source = use_tool_template ? tool_use_source_ : default_source_;
  if (tmpl == nullptr) {
    return absl::FailedPreconditionError(
        "the model's chat templates have no 'default' one (only 'tool_use', for requests with "
        "tools)");
  }
  for (const ojson* part : {&request.messages, &request.template_kwargs}) {
    if (JsonNestedDeeperThan(*part, kMaxChatJsonDepth)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the chat nests deeper than ", kMaxChatJsonDepth, " levels"));
    }
  }
  for (const auto* part : {&request.tools, &request.documents}) {
    if (part->has_value() && JsonNestedDeeperThan(**part, kMaxChatJsonDepth)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the chat nests deeper than ", kMaxChatJsonDepth, " levels"));
    }
  }
  if (!request.messages.is_array() || request.messages.empty()) {
    return absl::InvalidArgumentError(
        "Cannot apply chat template to an empty conversation. Provide at least one message.");
  }
  if (request.tools && !request.tools->is_array()) {
    return absl::InvalidArgumentError("tools must be a list of JSON schemas");
  }
  if (request.tools) {
    for (const auto& tool : *request.tools) {
      if (!tool.is_object()) return absl::InvalidArgumentError("each tool must be a JSON object");
    }
  }
  if (request.documents) {
    if (!request.documents->is_array()) {
      return absl::InvalidArgumentError("documents must be a list of objects");
    }
    for (const auto& doc : *request.documents) {
      if (!doc.is_object()) {
        return absl::InvalidArgumentError(
            "Documents should be a list of dicts with 'title' and 'text' keys!");
      }
    }
  }
  if (request.continue_final_message && request.add_generation_prompt) {
    return absl::InvalidArgumentError(
        "continue_final_message and add_generation_prompt are not compatible");
  }
  if (!request.template_kwargs.is_object()) {
    return absl::InvalidArgumentError("chat_template_kwargs must be a JSON object");
  }

  // The variables point into the request (no copy) except the final message's text, which
  // continue_final_message changes in a copy.
  jinja::TemplateVariables variables;
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) {
    variables.emplace_back(it.key(), &it.value());
  }
  for (auto it = request.template_kwargs.begin(); it != request.template_kwargs.end(); ++it) {
    if (std::find(std::begin(kChatReservedVariables), std::end(kChatReservedVariables), it.key()) !=
        std::end(kChatReservedVariables)) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat_template_kwargs may not set '", it.key(), "'"));
    }
    variables.emplace_back(it.key(), &it.value());
  }
  static const ojson kNone = nullptr;
  const ojson add_generation_prompt = request.add_generation_prompt;
  ojson continued_messages;
  const size_t messages_index = variables.size();
  variables.emplace_back("messages", &request.messages);
  variables.emplace_back("tools", request.tools ? &*request.tools : &kNone);
  variables.emplace_back("documents", request.documents ? &*request.documents : &kNone);
  variables.emplace_back("add_generation_prompt", &add_generation_prompt);

  std::string final_text;
  if (request.continue_final_message) {
    continued_messages = request.messages;
    variables[messages_index].second = &continued_messages;
    ojson& last = continued_messages.back();
    if (!last.is_object() || !last.contains("content") || last["content"].is_null()) {
      return absl::InvalidArgumentError(
          "continue_final_message is set but the final message has no \"content\" to continue!");
    }
    if (source.find("content") == std::string::npos) {
      return absl::InvalidArgumentError(
          "continue_final_message is set to \"content\" but this is not an accepted field in the "
          "chat_template");
    }
    ojson& content = last["content"];
    ojson* text = nullptr;
    if (content.is_string()) {
      text = &content;
    } else if (content.is_array()) {
      // The last part that has text (HF walks the parts backwards).
      for (auto it = content.rbegin(); it != content.rend() && text == nullptr; ++it) {
        if (it->is_object() && it->contains("text") && (*it)["text"].is_string()) {
          text = &(*it)["text"];
        }
      }
    }
    if (text == nullptr) {
      return absl::InvalidArgumentError(
          "continue_final_message is set but we could not find any text to continue in the "
          "final message!");
    }
    final_text = text->get<std::string>();
    *text = final_text + std::string(kContinueTag);
  }

  auto rendered = tmpl->Render(variables, options);
  if (!rendered.ok()) return rendered.status();
  if (!request.continue_final_message) return rendered;

  const std::string stripped_tag = PyStrip(kContinueTag, true);
  if (rendered->find(PyStrip(final_text, true)) == std::string::npos ||
      rendered->find(stripped_tag) == std::string::npos) {
    return absl::InvalidArgumentError(
        "continue_final_message is set but the final message does not appear in the chat after "
        "applying the chat template");
  }
  const size_t tag_pos = rendered->rfind(stripped_tag);
  if (rendered->compare(tag_pos, kContinueTag.size(), kContinueTag) == 0) {
    return rendered->substr(0, tag_pos);  // the template kept the message's spacing
  }
  return PyStrip(std::string_view(*rendered).substr(0, tag_pos), /*left=*/false);
}

bool JsonNestedDeeperThan(const nlohmann::ordered_json& json, int max_depth) {
  std::vector<std::pair<const ojson*, int>> stack = {{&json, 0}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    if (!node->is_structured()) continue;
    if (depth + 1 > max_depth) return true;
    for (const auto& child : *node) stack.emplace_back(&child, depth + 1);
  }
  return false;
}

absl::Status ParseToolCallArguments(nlohmann::ordered_json* messages,
                                    std::string_view field_prefix) {
  if (!messages->is_array()) return absl::OkStatus();
  for (size_t i = 0; i < messages->size(); ++i) {
    ojson& message = (*messages)[i];
    if (!message.is_object() || !message.contains("tool_calls") ||
        !message["tool_calls"].is_array()) {
      continue;
    }
    ojson& calls = message["tool_calls"];
    for (size_t j = 0; j < calls.size(); ++j) {
      if (!calls[j].is_object() || !calls[j].contains("function") ||
          !calls[j]["function"].is_object()) {
        continue;
      }
      ojson& function = calls[j]["function"];
      if (!function.contains("arguments") || !function["arguments"].is_string()) continue;
      ojson parsed = ojson::parse(function["arguments"].get<std::string>(), nullptr, false);
      if (parsed.is_discarded() || JsonNestedDeeperThan(parsed, kMaxChatJsonDepth)) {
        return absl::InvalidArgumentError(absl::StrCat(std::string(field_prefix), "[", i,
                                                       "].tool_calls[", j,
                                                       "].function.arguments: not valid JSON"));
      }
      function["arguments"] = std::move(parsed);
    }
  }
  return absl::OkStatus();
}

}  // namespace dropkv
