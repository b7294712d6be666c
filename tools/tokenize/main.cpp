// dropkv-tokenize: the server's tokenizer on the command line, for users and outside checks.
//   encode (default): each stdin line is UTF-8 text -> one JSON array of ids per line
//   --decode:         each stdin line is a JSON array of ids -> one JSON string per line
//   --chat:           each stdin line is a chat -> the ids of the model's rendered chat template,
//                     as HF apply_chat_template(tokenize=True); --render prints the text instead.
//                     A chat is a JSON array of messages (rendered with the generation prompt) or
//                     an object {"messages", "tools", "documents", "add_generation_prompt",
//                     "continue_final_message", "chat_template_kwargs"} with HF's meanings;
//                     messages are passed as they are (OpenAI's shape: tool_calls, content parts)
// --no-special: encode without the post-processor's special tokens (BOS); decode skips special
// tokens. A bad line prints {"error": "..."} on that line and the exit status becomes 1.
#include <iostream>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace {

using nlohmann::json;

std::string ErrorLine(const std::string& msg) {
  return json{{"error", msg}}.dump();
}

// One --chat line -> the render's arguments; an error message when the line is malformed.
std::optional<std::string> ParseChatLine(const std::string& line, dropkv::ChatRequest* request) {
  using ojson = nlohmann::ordered_json;  // keeps key order, which tojson in templates shows
  const ojson j = ojson::parse(line, nullptr, false);
  if (j.is_array()) {
    request->messages = j;
    request->add_generation_prompt = true;
  } else if (j.is_object() && j.contains("messages") && j["messages"].is_array()) {
    request->messages = j["messages"];
    if (j.contains("tools") && !j["tools"].is_null()) request->tools = j["tools"];
    if (j.contains("documents") && !j["documents"].is_null()) request->documents = j["documents"];
    if (j.contains("chat_template_kwargs")) request->template_kwargs = j["chat_template_kwargs"];
    const auto flag = [&](const char* key, bool fallback) -> std::optional<bool> {
      if (!j.contains(key)) return fallback;
      if (!j[key].is_boolean()) return std::nullopt;
      return j[key].get<bool>();
    };
    const auto cont = flag("continue_final_message", false);
    const auto gen = flag("add_generation_prompt", !cont.value_or(false));
    if (!cont || !gen) return "add_generation_prompt / continue_final_message must be booleans";
    request->continue_final_message = *cont;
    request->add_generation_prompt = *gen;
  } else {
    return "expected a JSON array of messages or an object with \"messages\"";
  }
  for (const auto& m : request->messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return "each message must be an object with a string \"role\"";
    }
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dropkv-tokenize: encode / decode / render chat with a model's tokenizer.json"};
  std::string dir;
  bool decode = false, chat = false, render = false, no_special = false;
  app.add_option("--tokenizer", dir, "model folder with tokenizer.json (+ tokenizer_config.json)")
      ->required();
  app.add_flag("--decode", decode, "stdin lines are JSON id arrays; print JSON strings");
  app.add_flag("--chat", chat,
               "stdin lines are chats (message arrays or {messages, tools, ...}); print template "
               "ids");
  app.add_flag("--render", render, "with --chat: print the rendered template text (JSON string)");
  app.add_flag("--no-special", no_special,
               "encode without special tokens (BOS); decode skipping special tokens");
  CLI11_PARSE(app, argc, argv);
  if (decode && chat) {
    std::cerr << "--decode and --chat are exclusive\n";
    return 2;
  }
  auto tok_or = dropkv::Tokenizer::FromDirectory(dir);
  if (!tok_or.ok()) {
    std::cerr << "dropkv-tokenize: " << tok_or.status() << "\n";
    return 2;
  }
  const dropkv::Tokenizer& tok = **tok_or;
  int rc = 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::string out;
    if (decode) {
      json j = json::parse(line, nullptr, false);
      std::vector<int32_t> ids;
      bool ok = j.is_array();
      if (ok) {
        for (const auto& x : j) {
          if (!x.is_number_integer()) {
            ok = false;
            break;
          }
          ids.push_back(x.get<int32_t>());
        }
      }
      if (!ok) {
        out = ErrorLine("expected a JSON array of integer ids");
      } else if (auto text = tok.Decode(ids, no_special); text.ok()) {
        out = json(*text).dump();
      } else {
        out = ErrorLine(std::string(text.status().message()));
      }
    } else if (chat) {
      dropkv::ChatRequest request;
      if (auto error = ParseChatLine(line, &request)) {
        out = ErrorLine(*error);
      } else if (auto text = tok.ApplyChatTemplate(request); !text.ok()) {
        out = ErrorLine(std::string(text.status().message()));
      } else if (render) {
        out = json(*text).dump();
      } else if (auto ids = tok.Encode(*text, false); ids.ok()) {
        out = json(*ids).dump();
      } else {
        out = ErrorLine(std::string(ids.status().message()));
      }
    } else if (auto ids = tok.Encode(line, !no_special); ids.ok()) {
      out = json(*ids).dump();
    } else {
      out = ErrorLine(std::string(ids.status().message()));
    }
    if (out.rfind("{\"error\"", 0) == 0) rc = 1;
    std::cout << out << "\n";
  }
  return rc;
}
