#include "engine/tokenizer/chat_template.h"

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv {
namespace {

// Fingerprints of the exact template texts in ../shared/tokenizers/*/tokenizer_config.json.
constexpr uint64_t kLlama3Fingerprint = 0x0e60067a5537498eULL;
constexpr uint64_t kQwen3Fingerprint = 0x2bfdb7aa9754484eULL;
constexpr uint64_t kGemma3Fingerprint = 0xc90dea00b85c935dULL;

// Python str.strip() / lstrip() / rstrip() with no argument (Jinja's `trim` filter).
std::string PyStrip(std::string_view s, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      char32_t cp = 0;
      const size_t n = unicode::DecodeCodePoint(s, b, &cp);
      if (!unicode::IsPythonSpace(cp)) break;
      b += n;
    }
  }
  if (right) {
    while (e > b) {
      size_t k = e - 1;
      while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
      char32_t cp = 0;
      unicode::DecodeCodePoint(s, k, &cp);
      if (!unicode::IsPythonSpace(cp)) break;
      e = k;
    }
  }
  return std::string(s.substr(b, e - b));
}

// Python str.strip(chars) for a set of ASCII chars.
std::string StripChars(std::string_view s, std::string_view chars, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && chars.find(s[b]) != std::string_view::npos) ++b;
  }
  if (right) {
    while (e > b && chars.find(s[e - 1]) != std::string_view::npos) --e;
  }
  return std::string(s.substr(b, e - b));
}

std::string RenderLlama3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                         std::string_view bos_token) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == 0) out += bos_token;
    absl::StrAppend(&out, "<|start_header_id|>", messages[i].role, "<|end_header_id|>\n\n",
                    PyStrip(messages[i].content, true, true), "<|eot_id|>");
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

bool StartsWith(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}
bool EndsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

std::string RenderQwen3(const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string out;
  const size_t n = messages.size();
  if (n > 0 && messages[0].role == "system") {
    absl::StrAppend(&out, "<|im_start|>system\n", messages[0].content, "<|im_end|>\n");
  }
  // Index of the last user message that is not a tool response (default: the last message).
  bool multi_step_tool = true;
  size_t last_query_index = n - 1;  // wraps for n == 0; then no loop runs
  for (size_t r = 0; r < n; ++r) {
    const size_t index = n - 1 - r;
    const ChatMessage& m = messages[index];
    if (multi_step_tool && m.role == "user" &&
        !(StartsWith(m.content, "<tool_response>") && EndsWith(m.content, "</tool_response>"))) {
      multi_step_tool = false;
      last_query_index = index;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
    } else if (m.role == "assistant") {
      std::string content = m.content;
      std::string reasoning;
      const size_t close = m.content.find("</think>");
      if (close != std::string::npos) {
        // content.split('</think>')[-1].lstrip('\n')
        const size_t last_close = m.content.rfind("</think>");
        content = StripChars(std::string_view(m.content).substr(last_close + 8), "\n", true, false);
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
        std::string before =
            StripChars(std::string_view(m.content).substr(0, close), "\n", false, true);
        const size_t open = before.rfind("<think>");
        if (open != std::string::npos) before = before.substr(open + 7);
        reasoning = StripChars(before, "\n", true, false);
      }
      const bool last = i + 1 == n;
      if (i > last_query_index && (last || !reasoning.empty())) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n<think>\n",
                        StripChars(reasoning, "\n", true, true), "\n</think>\n\n",
                        StripChars(content, "\n", true, false));
      } else {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n", content);
      }
      out += "<|im_end|>\n";
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      absl::StrAppend(&out, "\n<tool_response>\n", m.content, "\n</tool_response>");
      if (i + 1 == n || messages[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

absl::StatusOr<std::string> RenderGemma3(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt, std::string_view bos_token) {
  std::string out(bos_token);
  std::string first_user_prefix;
  size_t begin = 0;
  if (messages[0].role == "system") {
    first_user_prefix = messages[0].content + "\n\n";
    begin = 1;
  }
  for (size_t i = begin; i < messages.size(); ++i) {
    const size_t index0 = i - begin;
    const ChatMessage& m = messages[i];
    if ((m.role == "user") != (index0 % 2 == 0)) {
      return absl::InvalidArgumentError(
          "Conversation roles must alternate user/assistant/user/assistant/...");
    }
    const std::string role = m.role == "assistant" ? "model" : m.role;
    absl::StrAppend(&out, "<start_of_turn>", role, "\n", index0 == 0 ? first_user_prefix : "",
                    PyStrip(m.content, true, true), "<end_of_turn>\n");
  }
  if (add_generation_prompt) out += "<start_of_turn>model\n";
  return out;
}

}  // namespace

uint64_t ChatTemplateFingerprint(std::string_view t) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a 64
  for (char c : t) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

ChatTemplateKind IdentifyChatTemplate(std::string_view t) {
  if (t.empty()) return ChatTemplateKind::kNone;
  const uint64_t h = ChatTemplateFingerprint(t);
  if (h == kLlama3Fingerprint) return ChatTemplateKind::kLlama3;
  if (h == kQwen3Fingerprint) return ChatTemplateKind::kQwen3;
  if (h == kGemma3Fingerprint) return ChatTemplateKind::kGemma3;
  return ChatTemplateKind::kNone;
}

const char* ChatTemplateKindName(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::kLlama3:
      return "llama3";
    case ChatTemplateKind::kQwen3:
      return "qwen3";
    case ChatTemplateKind::kGemma3:
      return "gemma3";
    case ChatTemplateKind::kNone:
      break;
  }
  return "none";
}

absl::StatusOr<std::string> RenderChatTemplate(ChatTemplateKind kind,
                                               const std::vector<ChatMessage>& messages,
                                               bool add_generation_prompt,
                                               std::string_view bos_token) {
  if (kind != ChatTemplateKind::kNone && messages.empty()) {
    return absl::InvalidArgumentError("chat request has no messages");
  }
  for (const auto& m : messages) {
    if (!unicode::IsValidUtf8(m.content) || !unicode::IsValidUtf8(m.role)) {
      return absl::InvalidArgumentError("chat message is not valid UTF-8");
    }
  }
  switch (kind) {
    case ChatTemplateKind::kLlama3:
      return RenderLlama3(messages, add_generation_prompt, bos_token);
    case ChatTemplateKind::kQwen3:
      return RenderQwen3(messages, add_generation_prompt);
    case ChatTemplateKind::kGemma3:
      return RenderGemma3(messages, add_generation_prompt, bos_token);
    case ChatTemplateKind::kNone:
      break;
  }
  return absl::FailedPreconditionError(
      "the model's chat template is missing or not supported (supported: llama3, qwen3, gemma3)");
}

}  // namespace dropkv
