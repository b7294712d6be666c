// The tokenizer.json pipeline of HF tokenizers, restricted to what Llama-2/3, Qwen2/3 and Gemma
// use:
//   added tokens (raw text) -> normalizer -> pre-tokenizer -> BPE -> post-processor   (encode)
//   ids -> tokens -> decoder chain                                                     (decode)
// Each stage is a small list of steps read from tokenizer.json; an unknown step type is an
// UNIMPLEMENTED error at load naming the field, never a silent difference.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/bpe_model.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {

class Pcre2Regex;  // hf_tokenizer.cpp

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest matcher over a set of literal strings (HF uses Aho-Corasick with the same
// match kind). A byte trie: at most a few thousand tokens, matched at every text position.
class TokenTrie {
 public:
  void Add(std::string_view text, int32_t token_idx);
  bool empty() const { return nodes_.size() <= 1; }
  // Longest match starting at `pos`: (length, token_idx), or length 0.
  std::pair<size_t, int32_t> LongestAt(std::string_view s, size_t pos) const;

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, int32_t> next;
    int32_t token_idx = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  bool first_byte_[256] = {};
};

class HfTokenizer final : public Tokenizer {
 public:
  // `tokenizer_json` and `config_json` are file contents; `dir` names files in errors. The chat
  // template files are chat_template.jinja and additional_chat_templates/tool_use.jinja ("" when
  // absent).
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> Create(
      const std::string& dir, std::string_view tokenizer_json, std::string_view config_json,
      std::string_view generation_config_json, std::string_view chat_template_file,
      std::string_view tool_use_template_file = {});
  ~HfTokenizer() override;

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens = true) const override;
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens = true) const override;
  using Tokenizer::ApplyChatTemplate;
  absl::StatusOr<std::string> ApplyChatTemplate(const ChatRequest& request) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> bos_token_id() const override { return bos_id_; }
  std::vector<int32_t> eos_token_ids() const override { return eos_ids_; }

  const ChatTemplate& chat_template() const { return chat_template_; }

  struct NormStep;
  struct PreStep;
  struct DecodeStep;

 private:
  HfTokenizer();
  absl::Status LoadJson(const std::string& dir, std::string_view tokenizer_json);
  absl::Status LoadConfig(const std::string& dir, std::string_view config_json,
                          std::string_view generation_config_json,
                          std::string_view chat_template_file,
                          std::string_view tool_use_template_file);
  absl::Status LoadConfigUnchecked(const std::string& dir, std::string_view config_json,
                                   std::string_view generation_config_json,
                                   std::string_view chat_template_file,
                                   std::string_view tool_use_template_file);
  std::string Normalize(std::string_view text) const;
  // `at_text_start`: the segment begins at offset 0 of the input (Metaspace prepend "first").
  absl::Status EncodeSegment(std::string_view text, bool at_text_start,
                             std::vector<int32_t>* ids) const;
  absl::Status EncodeNormalized(std::string_view normalized, bool at_text_start,
                                std::vector<int32_t>* ids) const;
  std::optional<int32_t> TokenToId(const std::string& token) const;

  BpeModel model_;
  std::vector<std::string> id_to_token_;  // original token text ("" when the id is unused)
  std::vector<uint8_t> id_is_special_;
  std::vector<AddedToken> added_;
  TokenTrie raw_trie_;         // added tokens with normalized=false: matched on the raw text
  TokenTrie normalized_trie_;  // normalized=true: matched on each normalized segment
  std::vector<NormStep> normalizers_;
  std::vector<PreStep> pre_tokenizers_;
  std::vector<DecodeStep> decoders_;
  bool has_decoder_ = false;
  // TemplateProcessing "single": ids before and after the sequence.
  bool has_template_ = false;
  std::vector<int32_t> template_prefix_ids_;
  std::vector<int32_t> template_suffix_ids_;
  bool add_bos_ = false;  // tokenizer_config add_bos_token, used only without a template
  bool add_eos_ = false;
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_;
  std::vector<int32_t> eos_ids_;
  std::string bos_token_;
  std::string eos_token_;
  ChatTemplate chat_template_;
};

}  // namespace dropkv
