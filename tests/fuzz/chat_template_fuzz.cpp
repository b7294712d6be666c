// libFuzzer target for chat templates. The first byte picks what the rest is:
//   even: a template source, parsed and rendered with a fixed conversation (tools included);
//   odd:  a chat request as JSON ({"messages", "tools", "documents", "add_generation_prompt",
//         "continue_final_message", "kwargs"}), rendered with every template in
//         tests/tokenizer/chat_templates/ (family styles and construct templates).
// Invariants: no crash or sanitizer report, no hang (the render budget is small here); a render
// is valid UTF-8 or fails with one of the documented codes.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/jinja/template.h"
#include "engine/tokenizer/unicode.h"

namespace {

using ojson = nlohmann::ordered_json;

void Check(bool ok) {
  if (!ok) std::abort();
}

bool DocumentedCode(absl::StatusCode code) {
  return code == absl::StatusCode::kInvalidArgument ||
         code == absl::StatusCode::kFailedPrecondition ||
         code == absl::StatusCode::kResourceExhausted;
}

// Small limits: an input must finish well inside libFuzzer's per-input timeout under ASan.
const dropkv::jinja::RenderOptions& Options() {
  static const dropkv::jinja::RenderOptions options = [] {
    dropkv::jinja::RenderOptions o;
    o.limits.max_steps = 200'000;
    o.limits.max_output_bytes = 1 << 20;
    o.local_time = [] {
      std::tm tm{};
      tm.tm_year = 124;
      tm.tm_mday = 1;
      return tm;
    };
    return o;
  }();
  return options;
}

const ojson& FixedVariables() {
  static const ojson variables = ojson::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Zürich? 🌦"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"sky\": \"rain\"}"},
      {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}}}],
    "documents": null, "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  return variables;
}

const std::vector<dropkv::ChatTemplate>& AuthoredTemplates() {
  static const std::vector<dropkv::ChatTemplate>* templates = [] {
    auto* out = new std::vector<dropkv::ChatTemplate>();
    for (const auto& entry : std::filesystem::directory_iterator(DROPKV_CHAT_TEMPLATES_DIR)) {
      if (entry.path().extension() != ".jinja") continue;
      std::ifstream in(entry.path());
      std::stringstream ss;
      ss << in.rdbuf();
      out->push_back(dropkv::ChatTemplate::FromConfig(
          nlohmann::json{{"chat_template", ss.str()}, {"bos_token", "<s>"}, {"eos_token", "</s>"}},
          ""));
      Check(out->back().load_status().ok());
    }
    Check(!out->empty());
    return out;
  }();
  return *templates;
}

void CheckResult(const absl::StatusOr<std::string>& text) {
  if (text.ok()) {
    Check(dropkv::unicode::IsValidUtf8(*text));
  } else {
    Check(DocumentedCode(text.status().code()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string input(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0) {
    auto tmpl = dropkv::jinja::Template::Parse(input);
    if (!tmpl.ok()) {
      Check(tmpl.status().code() == absl::StatusCode::kInvalidArgument);
      return 0;
    }
    CheckResult((*tmpl)->Render(FixedVariables(), Options()));
    return 0;
  }
  const ojson j = ojson::parse(input, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("messages")) return 0;
  dropkv::ChatRequest request;
  request.messages = j["messages"];
  if (j.contains("tools") && !j["tools"].is_null()) request.tools = j["tools"];
  if (j.contains("documents") && !j["documents"].is_null()) request.documents = j["documents"];
  if (j.contains("kwargs")) request.template_kwargs = j["kwargs"];
  request.add_generation_prompt = j.value("add_generation_prompt", ojson(true)) == true;
  request.continue_final_message = j.value("continue_final_message", ojson(false)) == true;
  for (const dropkv::ChatTemplate& chat : AuthoredTemplates()) {
    CheckResult(chat.Render(request, Options()));
  }
  return 0;
}
