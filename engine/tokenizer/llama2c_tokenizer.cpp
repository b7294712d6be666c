#include "engine/tokenizer/llama2c_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"

namespace dropkv {
namespace {

constexpr const char* kSpace = "\xE2\x96\x81";  // U+2581 '▁', SentencePiece's word boundary

struct Piece {
  std::string text;
  float score = 0.0f;
};

bool IsUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xE  ? 3
                 : (c >> 3) == 0x1E ? 4
                                    : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

std::string ReplaceSpaces(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == ' ') {
      out += kSpace;
    } else {
      out += c;
    }
  }
  return out;
}

nlohmann::ordered_json AddedToken(int id, const std::string& content) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", true}};
}

}  // namespace

absl::StatusOr<std::string> Tok512ToTokenizerJson(const std::string& tok512_path,
                                                  int32_t vocab_size) {
  if (vocab_size < 259) {
    return absl::InvalidArgumentError(
        absl::StrCat(tok512_path, ": vocab_size ", vocab_size,
                     " is too small (need <unk>, <s>, </s>, 256 bytes)"));
  }
  auto data_or = ReadFileToString(tok512_path);
  if (!data_or.ok()) return data_or.status();
  const std::string& data = *data_or;
  size_t off = 4;  // int32 max_token_length, not needed
  if (data.size() < off)
    return absl::InvalidArgumentError(absl::StrCat(tok512_path, ": truncated header"));
  std::vector<Piece> pieces(vocab_size);
  for (int32_t id = 0; id < vocab_size; ++id) {
    int32_t len = 0;
    if (off + 8 > data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tok512_path, ": truncated at record ", id, " of ", vocab_size));
    }
    std::memcpy(&pieces[id].score, data.data() + off, 4);
    std::memcpy(&len, data.data() + off + 4, 4);
    off += 8;
    if (len < 0 || off + static_cast<size_t>(len) > data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tok512_path, ": record ", id, " has bad length ", len));
    }
    pieces[id].text.assign(data.data() + off, len);
    off += len;
  }
  if (off != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(tok512_path, ": ", data.size() - off,
                                                   " trailing bytes after ", vocab_size,
                                                   " records (wrong vocab_size?)"));
  }
  // Fixed ids of the llama2.c / SentencePiece layout.
  pieces[0].text = "<unk>";
  pieces[1].text = "<s>";
  pieces[2].text = "</s>";
  for (int b = 0; b < 256; ++b) {
    char want[8];
    std::snprintf(want, sizeof(want), "<0x%02X>", b);
    if (pieces[3 + b].text != want) {
      return absl::InvalidArgumentError(absl::StrCat(tok512_path, ": record ", 3 + b, " is '",
                                                     pieces[3 + b].text, "', expected ", want));
    }
  }
  std::unordered_map<std::string, int32_t> vocab;
  nlohmann::ordered_json vocab_json = nlohmann::ordered_json::object();
  for (int32_t id = 0; id < vocab_size; ++id) {
    if (id >= 259) {
      if (!IsUtf8(pieces[id].text) || pieces[id].text.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(tok512_path, ": record ", id, " is empty or not UTF-8"));
      }
      pieces[id].text = ReplaceSpaces(pieces[id].text);
    }
    if (!vocab.emplace(pieces[id].text, id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(tok512_path, ": record ", id, " duplicates piece '", pieces[id].text, "'"));
    }
    vocab_json[pieces[id].text] = id;
  }
  // SentencePiece BPE merges: a multi-piece merge is ranked by its result's score (higher first);
  // each split of the result into two normal pieces is one merge. Ties keep the id order, which is
  // the score order in llama2.c exports.
  std::vector<int32_t> order;
  for (int32_t id = 259; id < vocab_size; ++id) order.push_back(id);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return pieces[a].score > pieces[b].score; });
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (int32_t id : order) {
    const std::string& text = pieces[id].text;
    std::vector<std::pair<std::pair<int32_t, int32_t>, size_t>> splits;
    for (size_t cut = 1; cut < text.size(); ++cut) {
      if ((static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) continue;  // inside a char
      auto l = vocab.find(text.substr(0, cut));
      auto r = vocab.find(text.substr(cut));
      if (l == vocab.end() || r == vocab.end() || l->second < 259 || r->second < 259) continue;
      splits.push_back({{l->second, r->second}, cut});
    }
    std::sort(splits.begin(), splits.end());
    for (const auto& [ids, cut] : splits) {
      merges.push_back(nlohmann::ordered_json::array({text.substr(0, cut), text.substr(cut)}));
    }
  }

  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = {AddedToken(0, "<unk>"), AddedToken(1, "<s>"), AddedToken(2, "</s>")};
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Prepend"}, {"prepend", kSpace}},
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSpace}}}}};
  j["pre_tokenizer"] = nullptr;
  nlohmann::ordered_json bos = {{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}};
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {bos, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair",
       {bos,
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
        {{"SpecialToken", {{"id", "<s>"}, {"type_id", 1}}}},
        {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", kSpace}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", "<unk>"},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", true},
                {"byte_fallback", true},
                {"ignore_merges", false},
                {"vocab", vocab_json},
                {"merges", merges}};
  return j.dump(1);
}

std::string Tok512TokenizerConfigJson() {
  nlohmann::ordered_json j = {{"add_bos_token", true},
                              {"add_eos_token", false},
                              {"bos_token", "<s>"},
                              {"eos_token", "</s>"},
                              {"unk_token", "<unk>"},
                              {"pad_token", nullptr},
                              {"clean_up_tokenization_spaces", false},
                              {"legacy", false},
                              {"model_max_length", 512},
                              {"tokenizer_class", "PreTrainedTokenizerFast"}};
  return j.dump(2);
}

}  // namespace dropkv
