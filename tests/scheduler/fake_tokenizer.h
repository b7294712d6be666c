// A Tokenizer stand-in: one printable character per id ('0' + id), BOS 1 / EOS 2 are special and
// skipped when decoding. Enough to test text deltas and stop strings without a model folder.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv::testing {

class FakeTokenizer : public Tokenizer {
 public:
  explicit FakeTokenizer(int32_t vocab = 64) : vocab_(vocab) {}
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    if (add_special_tokens) ids.push_back(1);
    for (char ch : text) {
      const int id = static_cast<unsigned char>(ch) - '0';
      if (id < 3 || id >= vocab_)
        return absl::InvalidArgumentError(
            absl::StrCat("character '", std::string(1, ch), "' not in vocabulary"));
      ids.push_back(id);
    }
    return ids;
  }
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens) const override {
    std::string text;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_) return absl::InvalidArgumentError("unknown id");
      if (skip_special_tokens && id < 3) continue;
      text.push_back(static_cast<char>('0' + id));
    }
    return text;
  }
  using Tokenizer::ApplyChatTemplate;
  // Each message's content followed by '<'.
  absl::StatusOr<std::string> ApplyChatTemplate(const ChatRequest& request) const override {
    std::string text;
    for (const auto& m : request.messages) {
      absl::StrAppend(&text, m.value("content", std::string()), "<");
    }
    return text;
  }
  int32_t vocab_size() const override { return vocab_; }
  std::optional<int32_t> bos_token_id() const override { return 1; }
  std::vector<int32_t> eos_token_ids() const override { return {2}; }

 private:
  int32_t vocab_;
};

}  // namespace dropkv::testing
