// The tokenizer contract the rest of the engine and the server use.
// Reads a Hugging Face model folder's tokenizer.json + tokenizer_config.json.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dropkv {

// A plain-text chat message; ChatRequest (chat_template.h) carries everything else (tool calls,
// content parts, tools, template arguments).
struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool", ...
  std::string content;
};

struct ChatRequest;

class Tokenizer {
 public:
  // Loads DIR/tokenizer.json (+ DIR/tokenizer_config.json when present). Errors name the file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDirectory(const std::string& dir);
  virtual ~Tokenizer() = default;

  // Ids exactly as HF tokenizers' encode(text, add_special_tokens=add_special_tokens).
  // Invalid UTF-8 is INVALID_ARGUMENT.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                      bool add_special_tokens = true) const = 0;
  // Text as HF decode(ids, skip_special_tokens=skip_special_tokens). Unknown ids: INVALID_ARGUMENT.
  virtual absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                             bool skip_special_tokens = true) const = 0;
  // The model's chat template rendered as HF apply_chat_template renders it (chat_template.h
  // documents the errors: FAILED_PRECONDITION when the model's template is missing or unusable).
  virtual absl::StatusOr<std::string> ApplyChatTemplate(const ChatRequest& request) const = 0;
  // Plain-text messages (each {"role", "content"}).
  absl::StatusOr<std::string> ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                                bool add_generation_prompt = true) const;
  virtual int32_t vocab_size() const = 0;
  virtual std::optional<int32_t> bos_token_id() const = 0;
  virtual std::vector<int32_t> eos_token_ids() const = 0;
};

// Streaming detokenization: feed ids one at a time, get the text that became final. Each delta is
// valid UTF-8; a character split across tokens is held back until complete; Flush() returns the
// rest.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true);
  std::string Push(int32_t id);
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // ids before this are fully emitted context
  size_t read_offset_ = 0;
  std::string emitted_;
};

}  // namespace dropkv
