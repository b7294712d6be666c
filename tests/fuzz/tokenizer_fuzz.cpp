// libFuzzer target for the tokenizer: arbitrary bytes to Encode / Decode / IncrementalDecoder /
// chat rendering, and to the tokenizer.json loader itself. Two tokenizers cover both BPE paths:
// the tok512-derived SentencePiece one (Prepend/Replace normalizers, byte fallback, Strip) and a
// small synthetic byte-level one (Llama-3 regex Split, ByteLevel, NFC, added tokens with
// lstrip/rstrip/single_word/normalized). Invariants: no crash or sanitizer report; invalid UTF-8
// is INVALID_ARGUMENT; decoded text is valid UTF-8; streamed deltas concatenate to the decode.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/llama2c_tokenizer.h"
#include "engine/tokenizer/unicode.h"

namespace {

using dropkv::HfTokenizer;

std::string ByteLevelJson() {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  const auto& alphabet = dropkv::unicode::ByteToCodePoint();
  int id = 0;
  std::vector<std::string> sym(256);
  for (int b = 0; b < 256; ++b) {
    dropkv::unicode::AppendCodePoint(alphabet[b], &sym[b]);
    vocab[sym[b]] = id++;
  }
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  auto add = [&](const std::string& a, const std::string& b) {
    if (!vocab.contains(a + b)) vocab[a + b] = id++;
    merges.push_back(a + " " + b);
  };
  const std::string sp = sym[' '];
  add("t", "h");
  add("th", "e");
  add(sp, "the");
  add("e", "r");
  add(sp, sp);
  add(sp + sp, sp + sp);
  add("i", "n");
  add("in", "g");
  add(sym[0xC3], sym[0xA9]);  // 'é'
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  const char* contents[] = {"<|x|>", "<|lstrip|>", "<|rstrip|>", "word", "<norm>"};
  for (int k = 0; k < 5; ++k) {
    added.push_back({{"id", id + k},
                     {"content", contents[k]},
                     {"single_word", k == 3},
                     {"lstrip", k == 1},
                     {"rstrip", k == 2},
                     {"normalized", k == 4},
                     {"special", k != 3}});
  }
  nlohmann::ordered_json post;
  post["type"] = "TemplateProcessing";
  post["single"] = nlohmann::ordered_json::array();
  post["single"].push_back({{"SpecialToken", {{"id", "<|x|>"}, {"type_id", 0}}}});
  post["single"].push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  post["special_tokens"]["<|x|>"]["id"] = "<|x|>";
  post["special_tokens"]["<|x|>"]["ids"] = nlohmann::ordered_json::array({id});
  nlohmann::ordered_json j = {
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern",
            {{"Regex",
              R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"post_processor", post},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", merges}}}};
  return j.dump();
}

struct Tokenizers {
  std::unique_ptr<HfTokenizer> sentencepiece;
  std::unique_ptr<HfTokenizer> metaspace;  // the same vocab with a Metaspace pre-tokenizer
  std::unique_ptr<HfTokenizer> byte_level;
};

const Tokenizers& Get() {
  static const Tokenizers t = [] {
    Tokenizers out;
    auto sp_json = dropkv::Tok512ToTokenizerJson(DROPKV_TOK512_PATH, 512);
    if (!sp_json.ok()) std::abort();
    auto sp = HfTokenizer::Create("tok512", *sp_json, dropkv::Tok512TokenizerConfigJson(), "", "");
    auto bl =
        HfTokenizer::Create("bytelevel", ByteLevelJson(), R"({"bos_token": "<|x|>"})", "", "");
    auto ms_json = nlohmann::json::parse(*sp_json);
    ms_json["normalizer"] = nullptr;
    ms_json["pre_tokenizer"] = {{"type", "Metaspace"},
                                {"replacement", "\xE2\x96\x81"},
                                {"prepend_scheme", "first"},
                                {"split", true}};
    ms_json["decoder"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}};
    auto ms = HfTokenizer::Create("metaspace", ms_json.dump(), dropkv::Tok512TokenizerConfigJson(),
                                  "", "");
    if (!sp.ok() || !bl.ok() || !ms.ok()) std::abort();
    out.metaspace = std::move(*ms);
    out.sentencepiece = std::move(*sp);
    out.byte_level = std::move(*bl);
    return out;
  }();
  return t;
}

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Tokenizers& toks = Get();
  const uint8_t mode = data[0];
  const std::string input(reinterpret_cast<const char*>(data + 1), size - 1);
  const HfTokenizer& tok = (mode & 1)    ? *toks.byte_level
                           : (mode & 32) ? *toks.metaspace
                                         : *toks.sentencepiece;
  switch ((mode >> 1) % 4) {
    case 0: {  // encode, then decode and stream the ids back
      auto ids = tok.Encode(input, (mode & 8) != 0);
      if (!dropkv::unicode::IsValidUtf8(input)) {
        Check(!ids.ok() && ids.status().code() == absl::StatusCode::kInvalidArgument);
        break;
      }
      Check(ids.ok());
      const bool skip = (mode & 16) != 0;
      auto text = tok.Decode(*ids, skip);
      Check(text.ok() && dropkv::unicode::IsValidUtf8(*text));
      dropkv::IncrementalDecoder dec(tok, skip);
      std::string streamed;
      for (int32_t id : *ids) {
        const std::string delta = dec.Push(id);
        Check(dropkv::unicode::IsValidUtf8(delta));
        streamed += delta;
      }
      streamed += dec.Flush();
      Check(streamed == *text);
      break;
    }
    case 1: {  // arbitrary ids (some invalid) to Decode and the streaming decoder
      std::vector<int32_t> ids;
      for (size_t i = 0; i + 2 <= input.size(); i += 2) {
        int16_t v;
        std::memcpy(&v, input.data() + i, 2);
        ids.push_back(v % (tok.vocab_size() + 8));
      }
      auto text = tok.Decode(ids, (mode & 16) != 0);
      if (text.ok()) Check(dropkv::unicode::IsValidUtf8(*text));
      dropkv::IncrementalDecoder dec(tok, (mode & 16) != 0);
      for (int32_t id : ids) Check(dropkv::unicode::IsValidUtf8(dec.Push(id)));
      Check(dropkv::unicode::IsValidUtf8(dec.Flush()));
      break;
    }
    case 2: {  // chat rendering: NUL-separated role/content pairs through small templates
      // (chat_template_fuzz covers the interpreter itself)
      static const std::vector<dropkv::ChatTemplate>* templates = [] {
        auto* out = new std::vector<dropkv::ChatTemplate>();
        for (const char* source :
             {"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
              "{{ bos_token }}{% for m in messages %}{% if (m.role == 'user') != "
              "(loop.index0 % 2 == 0) %}{{ raise_exception('alternate') }}{% endif %}"
              "<start_of_turn>{{ m.role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}",
              "{% for m in messages %}{% set c = m.content.split('</think>')[-1].lstrip('\n') %}"
              "{{ m.role | upper }}: {{ c[:64] }}{{ c[64:] | length }}\n{% endfor %}"}) {
          out->push_back(dropkv::ChatTemplate::FromConfig(
              nlohmann::json{{"chat_template", source}, {"bos_token", "<bos>"}}, ""));
        }
        return out;
      }();
      std::vector<std::string> parts;
      size_t pos = 0;
      while (pos <= input.size()) {
        size_t nul = input.find('\0', pos);
        if (nul == std::string::npos) nul = input.size();
        parts.push_back(input.substr(pos, nul - pos));
        pos = nul + 1;
      }
      static const char* roles[] = {"system", "user", "assistant", "tool"};
      dropkv::ChatRequest request;
      bool all_valid = true;
      for (const std::string& part : parts) {
        const std::string role = part.empty() ? "user" : roles[static_cast<uint8_t>(part[0]) % 4];
        request.messages.push_back({{"role", role}, {"content", part}});
        all_valid = all_valid && dropkv::unicode::IsValidUtf8(part);
      }
      request.add_generation_prompt = (mode & 16) != 0;
      for (const dropkv::ChatTemplate& chat : *templates) {
        Check(chat.load_status().ok());
        auto text = chat.Render(request);
        if (!all_valid) {
          Check(!text.ok() && text.status().code() == absl::StatusCode::kInvalidArgument);
        } else if (text.ok()) {
          Check(dropkv::unicode::IsValidUtf8(*text));
          Check(tok.Encode(*text, false).ok());
        } else {
          Check(text.status().code() == absl::StatusCode::kInvalidArgument);  // alternation
        }
      }
      break;
    }
    case 3: {  // the loader: the input as tokenizer.json (or as tokenizer_config.json)
      if (mode & 16) {
        auto t = HfTokenizer::Create("fuzz", ByteLevelJson(), input, input, "");
        (void)t;
      } else {
        auto t = HfTokenizer::Create("fuzz", input, "", "", "");
        if (t.ok()) {
          auto ids = (*t)->Encode("Hello wörld <|x|> 123", true);
          if (ids.ok()) (void)(*t)->Decode(*ids, false);
        }
      }
      break;
    }
  }
  return 0;
}
