// dropkv-tokenize: the server's tokenizer on the command line, for users and outside checks.
//   encode (default): each stdin line is UTF-8 text -> one JSON array of ids per line
//   --decode:         each stdin line is a JSON array of ids -> one JSON string per line
//   --chat:           each stdin line is a JSON array of {"role","content"} messages -> the ids of
//                     the rendered chat template (with the generation prompt), as HF
//                     apply_chat_template(tokenize=True); --render prints the text instead
// --no-special: encode without the post-processor's special tokens (BOS); decode skips special
// tokens. A bad line prints {"error": "..."} on that line and the exit status becomes 1.
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/tokenizer/tokenizer.h"

namespace {

using nlohmann::json;

std::string ErrorLine(const std::string& msg) {
  return json{{"error", msg}}.dump();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dropkv-tokenize: encode / decode / render chat with a model's tokenizer.json"};
  std::string dir;
  bool decode = false, chat = false, render = false, no_special = false;
  app.add_option("--tokenizer", dir, "model folder with tokenizer.json (+ tokenizer_config.json)")
      ->required();
  app.add_flag("--decode", decode, "stdin lines are JSON id arrays; print JSON strings");
  app.add_flag("--chat", chat, "stdin lines are JSON message arrays; print template ids");
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
      json j = json::parse(line, nullptr, false);
      std::vector<dropkv::ChatMessage> messages;
      bool ok = j.is_array();
      if (ok) {
        for (const auto& m : j) {
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
              !m.contains("content") || !m["content"].is_string()) {
            ok = false;
            break;
          }
          messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
        }
      }
      if (!ok) {
        out = ErrorLine("expected a JSON array of {\"role\": string, \"content\": string}");
      } else if (auto text = tok.ApplyChatTemplate(messages, true); !text.ok()) {
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
