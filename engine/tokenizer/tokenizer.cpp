// Tokenizer::FromDirectory and the streaming IncrementalDecoder.
#include "engine/tokenizer/tokenizer.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv {

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDirectory(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  auto read_optional = [&](const char* name) -> absl::StatusOr<std::string> {
    std::error_code ec;
    if (!fs::exists(root / name, ec)) return std::string();
    return ReadFileToString((root / name).string());
  };
  // Mapped, not read: Gemma's is 33 MB and a copy costs a tenth of its load time.
  auto tokenizer_json = MappedFile::Open((root / "tokenizer.json").string());
  if (!tokenizer_json.ok()) return tokenizer_json.status();
  const std::string_view json_text(reinterpret_cast<const char*>((*tokenizer_json)->data()),
                                   (*tokenizer_json)->size_bytes());
  auto config = read_optional("tokenizer_config.json");
  if (!config.ok()) return config.status();
  auto generation = read_optional("generation_config.json");
  if (!generation.ok()) return generation.status();
  // transformers 5 saves templates as files: the default one and named ones beside it.
  auto chat_template = read_optional("chat_template.jinja");
  if (!chat_template.ok()) return chat_template.status();
  auto tool_use_template = read_optional("additional_chat_templates/tool_use.jinja");
  if (!tool_use_template.ok()) return tool_use_template.status();
  auto tok =
      HfTokenizer::Create(dir, json_text, *config, *generation, *chat_template, *tool_use_template);
  if (!tok.ok()) return tok.status();
  return std::unique_ptr<Tokenizer>(std::move(*tok));
}

absl::StatusOr<std::string> Tokenizer::ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                                         bool add_generation_prompt) const {
  ChatRequest request;
  for (const ChatMessage& m : messages) {
    request.messages.push_back({{"role", m.role}, {"content", m.content}});
  }
  request.add_generation_prompt = add_generation_prompt;
  return ApplyChatTemplate(request);
}

// vLLM-style detokenization: decode a short window of already-emitted ids plus the new ones, and
// emit the difference once it no longer ends in an incomplete character (U+FFFD). The window
// keeps context-dependent decoders right (SentencePiece's leading-space strip).
IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

namespace {
constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

bool EndsWithReplacement(const std::string& s) {
  return s.size() >= 3 && std::string_view(s).substr(s.size() - 3) == kReplacementChar;
}
}  // namespace

std::string IncrementalDecoder::Push(int32_t id) {
  ids_.push_back(id);
  const std::vector<int32_t> prefix(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  const std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.end());
  auto prefix_text = tokenizer_.Decode(prefix, skip_special_tokens_);
  auto new_text = tokenizer_.Decode(window, skip_special_tokens_);
  if (!prefix_text.ok() || !new_text.ok()) {
    ids_.pop_back();  // an unknown id contributes nothing
    return "";
  }
  if (new_text->size() <= prefix_text->size() || EndsWithReplacement(*new_text) ||
      new_text->compare(0, prefix_text->size(), *prefix_text) != 0) {
    return "";  // nothing new yet, or a character is still incomplete
  }
  std::string delta = new_text->substr(prefix_text->size());
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  emitted_ += delta;
  return delta;
}

std::string IncrementalDecoder::Flush() {
  const std::vector<int32_t> prefix(ids_.begin() + prefix_offset_, ids_.begin() + read_offset_);
  const std::vector<int32_t> window(ids_.begin() + prefix_offset_, ids_.end());
  auto prefix_text = tokenizer_.Decode(prefix, skip_special_tokens_);
  auto new_text = tokenizer_.Decode(window, skip_special_tokens_);
  std::string delta;
  if (prefix_text.ok() && new_text.ok() && new_text->size() > prefix_text->size() &&
      new_text->compare(0, prefix_text->size(), *prefix_text) == 0) {
    delta = new_text->substr(prefix_text->size());
  }
  prefix_offset_ = read_offset_ = ids_.size();
  emitted_ += delta;
  return delta;
}

}  // namespace dropkv
