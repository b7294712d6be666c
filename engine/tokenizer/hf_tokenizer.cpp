#include "engine/tokenizer/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/status_macros.h"
#include "engine/tokenizer/json_scan.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// PCRE2 (UTF + UCP + JIT): the Split pre-tokenizer regexes use lookahead, which RE2 lacks.
class Pcre2Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Pcre2Regex>> Compile(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return absl::InvalidArgumentError(absl::StrCat("regex '", pattern, "' does not compile at ",
                                                     err_offset, ": ",
                                                     reinterpret_cast<const char*>(msg)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when it fails
    return std::unique_ptr<Pcre2Regex>(new Pcre2Regex(code));
  }
  ~Pcre2Regex() { pcre2_code_free(code_); }

  // Non-overlapping matches, left to right. `s` must be valid UTF-8.
  absl::Status FindAll(std::string_view s, std::vector<std::pair<size_t, size_t>>* spans) const {
    struct ThreadState {
      pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
      pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);
      ThreadState() { pcre2_jit_stack_assign(ctx, nullptr, stack); }
      ~ThreadState() {
        pcre2_jit_stack_free(stack);
        pcre2_match_context_free(ctx);
      }
    };
    thread_local ThreadState state;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    size_t pos = 0;
    while (pos < s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md.get(), state.ctx);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        return absl::InternalError(
            absl::StrCat("pre-tokenizer regex failed: ", reinterpret_cast<const char*>(msg)));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      if (ov[1] == ov[0]) {  // empty match: step one character
        pos = ov[0] + std::max<size_t>(1, unicode::ValidSequenceLength(s, ov[0]));
        continue;
      }
      spans->emplace_back(ov[0], ov[1]);
      pos = ov[1];
    }
    return absl::OkStatus();
  }

 private:
  explicit Pcre2Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// ---------------------------------------------------------------------------------------------
// Pipeline steps.
struct HfTokenizer::NormStep {
  enum class Kind { kNfc, kNfd, kNfkc, kNfkd, kReplace, kPrepend } kind;
  std::string from;  // kReplace pattern, kPrepend text
  std::string to;    // kReplace content
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct HfTokenizer::PreStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  enum class Prepend { kAlways, kFirst, kNever };
  explicit PreStep(Kind k) : kind(k) {}
  Kind kind;
  std::shared_ptr<Pcre2Regex> regex;  // kSplit with a Regex pattern (and ByteLevel use_regex)
  std::string literal;                // kSplit with a String pattern
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;
  std::string replacement;  // kMetaspace
  Prepend prepend = Prepend::kAlways;
  bool split = true;
};

struct HfTokenizer::DecodeStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  explicit DecodeStep(Kind k) : kind(k) {}
  Kind kind;
  std::string from;
  std::string to;
  std::string strip_char;
  int start = 0;
  int stop = 0;
};

namespace {

// The GPT-2 pattern ByteLevel uses when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void ReplaceAll(std::string* s, std::string_view from, std::string_view to) {
  if (from.empty() || s->find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s->size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s->find(from, pos);
    if (hit == std::string::npos) break;
    out.append(*s, pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(*s, pos, std::string::npos);
  *s = std::move(out);
}

// Rust char::is_whitespace (White_Space), used by added tokens' lstrip/rstrip.
bool IsRustWhitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool IsWordChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// A string member of tokenizer_config (either "text" or {"content": "text"}), or "".
std::string ConfigTokenString(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

// Splits [0, s.size()) by the matches as HF's SplitDelimiterBehavior does.
void ApplySplit(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches,
                bool invert, SplitBehavior behavior, std::vector<std::string_view>* out) {
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Span> spans;
  size_t pos = 0;
  for (const auto& [b, e] : matches) {
    if (b > pos) spans.push_back({pos, b, invert});
    spans.push_back({b, e, !invert});
    pos = e;
  }
  if (pos < s.size()) spans.push_back({pos, s.size(), invert});
  std::vector<std::pair<size_t, size_t>> pieces;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& sp : spans) {
        if (!sp.is_match) pieces.emplace_back(sp.begin, sp.end);
      }
      break;
    case SplitBehavior::kIsolated:
      for (const auto& sp : spans) pieces.emplace_back(sp.begin, sp.end);
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const auto& sp : spans) {
        if (sp.is_match && !prev_match && !pieces.empty()) {
          pieces.back().second = sp.end;
        } else {
          pieces.emplace_back(sp.begin, sp.end);
        }
        prev_match = sp.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !prev_match && !pieces.empty()) {
          pieces.back().first = it->begin;
        } else {
          pieces.emplace_back(it->begin, it->end);
        }
        prev_match = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool prev_match = false;
      for (const auto& sp : spans) {
        if (sp.is_match == prev_match && !pieces.empty()) {
          pieces.back().second = sp.end;
        } else {
          pieces.emplace_back(sp.begin, sp.end);
        }
        prev_match = sp.is_match;
      }
      break;
    }
  }
  for (const auto& [b, e] : pieces) {
    if (e > b) out->push_back(s.substr(b, e - b));
  }
}

// A byte-level token (GPT-2 alphabet) back to raw bytes; false when a character is outside it.
bool ByteLevelToBytes(std::string_view tok, std::string* out) {
  out->clear();
  for (size_t i = 0; i < tok.size();) {
    char32_t cp = 0;
    if (unicode::ValidSequenceLength(tok, i) == 0) return false;
    i += unicode::DecodeCodePoint(tok, i, &cp);
    const int b = unicode::CodePointToByte(cp);
    if (b < 0) return false;
    out->push_back(static_cast<char>(b));
  }
  return true;
}

bool HasByteLevel(const json& j) {
  if (j.is_object()) {
    auto t = j.find("type");
    if (t != j.end() && t->is_string() && t->get<std::string>() == "ByteLevel") return true;
    for (const auto& [k, v] : j.items()) {
      if (HasByteLevel(v)) return true;
    }
  } else if (j.is_array()) {
    for (const auto& v : j) {
      if (HasByteLevel(v)) return true;
    }
  }
  return false;
}

absl::StatusOr<SplitBehavior> ParseBehavior(const std::string& b) {
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return absl::UnimplementedError(absl::StrCat("Split behavior '", b, "'"));
}

// "pattern": {"String": s} or {"Regex": r}.
absl::Status ReadPattern(const json& p, std::string* literal, std::string* regex) {
  if (p.contains("String")) {
    *literal = p["String"].get<std::string>();
  } else if (p.contains("Regex")) {
    *regex = p["Regex"].get<std::string>();
  } else {
    return absl::InvalidArgumentError("pattern has neither String nor Regex");
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TokenTrie
void TokenTrie::Add(std::string_view text, int32_t token_idx) {
  if (text.empty()) return;
  int32_t node = 0;
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    auto it = nodes_[node].next.find(c);
    if (it == nodes_[node].next.end()) {
      nodes_.emplace_back();
      const auto child = static_cast<int32_t>(nodes_.size() - 1);
      nodes_[node].next.emplace(c, child);
      node = child;
    } else {
      node = it->second;
    }
  }
  nodes_[node].token_idx = token_idx;
  first_byte_[static_cast<unsigned char>(text[0])] = true;
}

std::pair<size_t, int32_t> TokenTrie::LongestAt(std::string_view s, size_t pos) const {
  if (!first_byte_[static_cast<unsigned char>(s[pos])]) return {0, -1};
  std::pair<size_t, int32_t> best{0, -1};
  int32_t node = 0;
  for (size_t i = pos; i < s.size(); ++i) {
    auto it = nodes_[node].next.find(static_cast<unsigned char>(s[i]));
    if (it == nodes_[node].next.end()) break;
    node = it->second;
    if (nodes_[node].token_idx >= 0) best = {i + 1 - pos, nodes_[node].token_idx};
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
HfTokenizer::HfTokenizer() = default;
HfTokenizer::~HfTokenizer() = default;

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Create(
    const std::string& dir, std::string_view tokenizer_json, std::string_view config_json,
    std::string_view generation_config_json, std::string_view chat_template_file,
    std::string_view tool_use_template_file) {
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  RETURN_IF_ERROR(tok->LoadJson(dir, tokenizer_json));
  RETURN_IF_ERROR(tok->LoadConfig(dir, config_json, generation_config_json, chat_template_file,
                                  tool_use_template_file));
  return tok;
}

absl::Status HfTokenizer::LoadJson(const std::string& dir, std::string_view text) {
  const std::string file = dir + "/tokenizer.json";
  JsonScanner scan(text, file);
  std::map<std::string, json> top;  // every member but model.vocab / model.merges
  std::map<std::string, json> model;
  std::vector<std::pair<std::string, int32_t>> vocab;
  // Merges are resolved while scanning when the vocab and pre-tokenizer came first (the usual
  // order); 515k pairs of strings held in memory would cost a third of Gemma's load time.
  std::vector<std::pair<std::string, std::string>> pending_merges;
  bool vocab_built = false;
  int32_t num_merges = 0;
  std::string ka, kb, km;
  auto build_vocab = [&](bool byte_level) {
    model_.vocab.reserve(vocab.size());
    model_.merges.reserve(2 * vocab.size());
    std::string raw;
    for (auto& [tok, id] : vocab) {
      if (byte_level) {
        if (ByteLevelToBytes(tok, &raw)) model_.vocab.emplace(raw, id);
      } else {
        model_.vocab.emplace(tok, id);
      }
      if (id >= static_cast<int32_t>(id_to_token_.size())) id_to_token_.resize(id + 1);
      id_to_token_[id] = std::move(tok);
    }
    vocab.clear();
    vocab.shrink_to_fit();
    vocab_built = true;
  };
  // Rank = position; a later duplicate overrides (as HF's map collect does).
  auto add_merge = [&](std::string_view a, std::string_view b, bool byte_level) -> absl::Status {
    const int32_t rank = num_merges++;
    if (byte_level) {
      km.assign(a);
      km.append(b);
      if (!ByteLevelToBytes(a, &ka) || !ByteLevelToBytes(b, &kb)) return absl::OkStatus();
      std::string merged_raw;
      if (!ByteLevelToBytes(km, &merged_raw)) return absl::OkStatus();
      km = std::move(merged_raw);
    } else {
      ka.assign(a);
      kb.assign(b);
      km.assign(a);
      km.append(b);
    }
    auto ia = model_.vocab.find(ka), ib = model_.vocab.find(kb), im = model_.vocab.find(km);
    if (ia == model_.vocab.end() || ib == model_.vocab.end() || im == model_.vocab.end()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": merge ", rank, " ('", std::string(a),
                                                     "' '", std::string(b),
                                                     "') uses a token not in the vocab"));
    }
    model_.merges.insert_or_assign(
        (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second),
        std::make_pair(rank, im->second));
    return absl::OkStatus();
  };
  bool early_byte_level = false;
  auto merge_or_defer = [&](std::string a, std::string b) -> absl::Status {
    if (vocab_built) return add_merge(a, b, early_byte_level);
    pending_merges.emplace_back(std::move(a), std::move(b));
    return absl::OkStatus();
  };
  auto parse_raw = [&](std::string_view raw, const std::string& key) -> absl::StatusOr<json> {
    json j = json::parse(raw, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded())
      return absl::InvalidArgumentError(absl::StrCat(file, ": bad JSON in '", key, "'"));
    return j;
  };
  RETURN_IF_ERROR(scan.Expect('{'));
  if (!scan.Consume('}')) {
    do {
      ASSIGN_OR_RETURN(std::string key, scan.String());
      RETURN_IF_ERROR(scan.Expect(':'));
      if (key != "model") {
        ASSIGN_OR_RETURN(std::string_view raw, scan.RawValue());
        ASSIGN_OR_RETURN(top[key], parse_raw(raw, key));
        continue;
      }
      RETURN_IF_ERROR(scan.Expect('{'));
      if (scan.Consume('}')) break;
      do {
        ASSIGN_OR_RETURN(std::string mkey, scan.String());
        RETURN_IF_ERROR(scan.Expect(':'));
        if (mkey == "vocab") {
          RETURN_IF_ERROR(scan.Expect('{'));
          if (!scan.Consume('}')) {
            do {
              ASSIGN_OR_RETURN(std::string tok, scan.String());
              RETURN_IF_ERROR(scan.Expect(':'));
              ASSIGN_OR_RETURN(int64_t id, scan.Int());
              if (id < 0 || id > (1 << 30)) return scan.Error("vocab id out of range");
              vocab.emplace_back(std::move(tok), static_cast<int32_t>(id));
            } while (scan.Consume(','));
            RETURN_IF_ERROR(scan.Expect('}'));
          }
          if (top.count("pre_tokenizer")) {
            early_byte_level = HasByteLevel(top["pre_tokenizer"]);
            build_vocab(early_byte_level);
          }
        } else if (mkey == "merges") {
          RETURN_IF_ERROR(scan.Expect('['));
          if (!scan.Consume(']')) {
            do {
              if (scan.Consume('[')) {  // ["a", "b"]
                ASSIGN_OR_RETURN(std::string a, scan.String());
                RETURN_IF_ERROR(scan.Expect(','));
                ASSIGN_OR_RETURN(std::string b, scan.String());
                RETURN_IF_ERROR(scan.Expect(']'));
                RETURN_IF_ERROR(merge_or_defer(std::move(a), std::move(b)));
              } else {  // "a b"
                ASSIGN_OR_RETURN(std::string m, scan.String());
                const size_t sp = m.find(' ');
                if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos) {
                  return scan.Error(absl::StrCat("merge '", m, "' is not two tokens"));
                }
                RETURN_IF_ERROR(merge_or_defer(m.substr(0, sp), m.substr(sp + 1)));
              }
            } while (scan.Consume(','));
            RETURN_IF_ERROR(scan.Expect(']'));
          }
        } else {
          ASSIGN_OR_RETURN(std::string_view raw, scan.RawValue());
          ASSIGN_OR_RETURN(model[mkey], parse_raw(raw, "model." + mkey));
        }
      } while (scan.Consume(','));
      RETURN_IF_ERROR(scan.Expect('}'));
    } while (scan.Consume(','));
    RETURN_IF_ERROR(scan.Expect('}'));
  }
  if (!scan.AtEnd()) return scan.Error("trailing data");

  try {
    const auto mtype = model.count("type") ? model["type"].get<std::string>() : "BPE";
    if (mtype != "BPE") {
      return absl::UnimplementedError(
          absl::StrCat(file, ": model.type '", mtype, "' is not supported (only BPE)"));
    }
    auto str_or_empty = [&](const char* k) {
      return model.count(k) && model[k].is_string() ? model[k].get<std::string>() : "";
    };
    if (!str_or_empty("continuing_subword_prefix").empty() ||
        !str_or_empty("end_of_word_suffix").empty()) {
      return absl::UnimplementedError(
          absl::StrCat(file, ": model.continuing_subword_prefix / end_of_word_suffix unsupported"));
    }
    if (model.count("dropout") && !model["dropout"].is_null()) {
      return absl::UnimplementedError(absl::StrCat(file, ": model.dropout is not supported"));
    }
    auto flag = [&](const char* k) {
      return model.count(k) && model[k].is_boolean() && model[k].get<bool>();
    };
    model_.byte_fallback = flag("byte_fallback");
    model_.fuse_unk = flag("fuse_unk");
    model_.ignore_merges = flag("ignore_merges");

    // Normalizer.
    std::function<absl::Status(const json&)> add_norm = [&](const json& n) -> absl::Status {
      if (n.is_null()) return absl::OkStatus();
      const std::string type = n.at("type").get<std::string>();
      if (type == "Sequence") {
        for (const auto& sub : n.at("normalizers")) RETURN_IF_ERROR(add_norm(sub));
      } else if (type == "NFC") {
        normalizers_.push_back({NormStep::Kind::kNfc, "", ""});
      } else if (type == "NFD") {
        normalizers_.push_back({NormStep::Kind::kNfd, "", ""});
      } else if (type == "NFKC") {
        normalizers_.push_back({NormStep::Kind::kNfkc, "", ""});
      } else if (type == "NFKD") {
        normalizers_.push_back({NormStep::Kind::kNfkd, "", ""});
      } else if (type == "Prepend") {
        normalizers_.push_back({NormStep::Kind::kPrepend, n.at("prepend").get<std::string>(), ""});
      } else if (type == "Replace") {
        std::string literal, regex;
        RETURN_IF_ERROR(ReadPattern(n.at("pattern"), &literal, &regex));
        if (!regex.empty()) {
          return absl::UnimplementedError(absl::StrCat(file, ": Replace normalizer with a Regex"));
        }
        normalizers_.push_back(
            {NormStep::Kind::kReplace, literal, n.at("content").get<std::string>()});
      } else {
        return absl::UnimplementedError(
            absl::StrCat(file, ": normalizer '", type, "' is not supported"));
      }
      return absl::OkStatus();
    };
    if (top.count("normalizer")) RETURN_IF_ERROR(add_norm(top["normalizer"]));

    // Pre-tokenizer.
    bool byte_level = false;
    std::function<absl::Status(const json&)> add_pre = [&](const json& p) -> absl::Status {
      if (p.is_null()) return absl::OkStatus();
      const std::string type = p.at("type").get<std::string>();
      if (type == "Sequence") {
        for (const auto& sub : p.at("pretokenizers")) RETURN_IF_ERROR(add_pre(sub));
      } else if (type == "Split") {
        PreStep step(PreStep::Kind::kSplit);
        std::string regex;
        RETURN_IF_ERROR(ReadPattern(p.at("pattern"), &step.literal, &regex));
        if (!regex.empty()) {
          auto re = Pcre2Regex::Compile(regex);
          if (!re.ok())
            return absl::InvalidArgumentError(
                absl::StrCat(file, ": pre_tokenizer: ", re.status().message()));
          step.regex = std::move(*re);
        } else if (step.literal.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(file, ": Split with an empty pattern"));
        }
        ASSIGN_OR_RETURN(step.behavior, ParseBehavior(p.at("behavior").get<std::string>()));
        step.invert = p.value("invert", false);
        pre_tokenizers_.push_back(std::move(step));
      } else if (type == "Digits") {
        // HF's Digits splits on each numeric char (Rust char::is_numeric: Unicode N*), every digit
        // its own piece or runs of them together.
        PreStep step(PreStep::Kind::kSplit);
        ASSIGN_OR_RETURN(step.regex, Pcre2Regex::Compile("\\p{N}"));
        step.behavior = p.value("individual_digits", false) ? SplitBehavior::kIsolated
                                                            : SplitBehavior::kContiguous;
        pre_tokenizers_.push_back(std::move(step));
      } else if (type == "ByteLevel") {
        PreStep step(PreStep::Kind::kByteLevel);
        step.add_prefix_space = p.value("add_prefix_space", false);
        if (p.value("use_regex", true)) {
          ASSIGN_OR_RETURN(auto re, Pcre2Regex::Compile(kGpt2Pattern));
          step.regex = std::move(re);
        }
        byte_level = true;
        pre_tokenizers_.push_back(std::move(step));
      } else if (type == "Metaspace") {
        PreStep step(PreStep::Kind::kMetaspace);
        step.replacement = p.value("replacement", std::string("\xE2\x96\x81"));
        const std::string scheme = p.value("prepend_scheme", std::string());
        if (scheme.empty()) {  // older files: add_prefix_space
          step.prepend = p.value("add_prefix_space", true) ? PreStep::Prepend::kAlways
                                                           : PreStep::Prepend::kNever;
        } else if (scheme == "always") {
          step.prepend = PreStep::Prepend::kAlways;
        } else if (scheme == "first") {
          step.prepend = PreStep::Prepend::kFirst;
        } else if (scheme == "never") {
          step.prepend = PreStep::Prepend::kNever;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat(file, ": Metaspace prepend_scheme '", scheme, "'"));
        }
        step.split = p.value("split", true);
        if (step.replacement.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(file, ": empty Metaspace replacement"));
        }
        pre_tokenizers_.push_back(std::move(step));
      } else {
        return absl::UnimplementedError(
            absl::StrCat(file, ": pre_tokenizer '", type, "' is not supported"));
      }
      return absl::OkStatus();
    };
    if (top.count("pre_tokenizer")) RETURN_IF_ERROR(add_pre(top["pre_tokenizer"]));
    model_.byte_level = byte_level;

    // Vocab: byte-level tokens are translated back to raw bytes for the model's lookup table.
    if (vocab_built && early_byte_level != byte_level) {
      return absl::InternalError(absl::StrCat(file, ": inconsistent ByteLevel detection"));
    }
    if (!vocab_built) build_vocab(byte_level);
    for (auto& [a, b] : pending_merges) RETURN_IF_ERROR(add_merge(a, b, byte_level));
    pending_merges.clear();
    int32_t max_id = static_cast<int32_t>(id_to_token_.size()) - 1;
    std::vector<AddedToken> added;
    if (top.count("added_tokens")) {
      for (const auto& a : top["added_tokens"]) {
        AddedToken t;
        t.id = a.at("id").get<int32_t>();
        t.content = a.at("content").get<std::string>();
        t.special = a.value("special", false);
        t.lstrip = a.value("lstrip", false);
        t.rstrip = a.value("rstrip", false);
        t.single_word = a.value("single_word", false);
        t.normalized = a.value("normalized", !t.special);
        if (t.id < 0 || t.id > (1 << 30))
          return absl::InvalidArgumentError(absl::StrCat(file, ": added token id out of range"));
        max_id = std::max(max_id, t.id);
        added.push_back(std::move(t));
      }
    }
    vocab_size_ = max_id + 1;
    id_to_token_.resize(vocab_size_);
    id_is_special_.assign(vocab_size_, 0);
    if (model_.vocab.empty())
      return absl::InvalidArgumentError(absl::StrCat(file, ": empty model.vocab"));

    // Added tokens.
    added_ = std::move(added);
    for (size_t k = 0; k < added_.size(); ++k) {
      const AddedToken& t = added_[k];
      id_to_token_[t.id] = t.content;
      id_is_special_[t.id] = t.special ? 1 : 0;
      (t.normalized ? normalized_trie_ : raw_trie_).Add(t.content, static_cast<int32_t>(k));
    }
    const std::string unk = str_or_empty("unk_token");
    if (!unk.empty()) {
      auto id = TokenToId(unk);
      if (!id)
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": model.unk_token '", unk, "' is not in the vocab"));
      model_.unk_id = id;
    }
    model_.Finalize();

    // Post-processor.
    std::function<absl::Status(const json&)> add_post = [&](const json& p) -> absl::Status {
      if (p.is_null()) return absl::OkStatus();
      const std::string type = p.at("type").get<std::string>();
      if (type == "Sequence") {
        for (const auto& sub : p.at("processors")) RETURN_IF_ERROR(add_post(sub));
      } else if (type == "ByteLevel") {
        // Only trims offsets; ids are unchanged.
      } else if (type == "TemplateProcessing") {
        has_template_ = true;
        template_prefix_ids_.clear();
        template_suffix_ids_.clear();
        bool seen_sequence = false;
        for (const auto& item : p.at("single")) {
          if (item.contains("Sequence")) {
            seen_sequence = true;
            continue;
          }
          const std::string name = item.at("SpecialToken").at("id").get<std::string>();
          const auto& spec = p.at("special_tokens").at(name);
          auto& dst = seen_sequence ? template_suffix_ids_ : template_prefix_ids_;
          for (const auto& id : spec.at("ids")) dst.push_back(id.get<int32_t>());
        }
      } else if (type == "RobertaProcessing" || type == "BertProcessing") {
        has_template_ = true;
        template_prefix_ids_ = {p.at("cls").at(1).get<int32_t>()};
        template_suffix_ids_ = {p.at("sep").at(1).get<int32_t>()};
      } else {
        return absl::UnimplementedError(
            absl::StrCat(file, ": post_processor '", type, "' is not supported"));
      }
      return absl::OkStatus();
    };
    if (top.count("post_processor")) RETURN_IF_ERROR(add_post(top["post_processor"]));
    for (int32_t id : template_prefix_ids_) {
      if (id < 0 || id >= vocab_size_)
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": post_processor id ", id, " out of range"));
    }
    for (int32_t id : template_suffix_ids_) {
      if (id < 0 || id >= vocab_size_)
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": post_processor id ", id, " out of range"));
    }

    // Decoder.
    std::function<absl::Status(const json&)> add_dec = [&](const json& d) -> absl::Status {
      if (d.is_null()) return absl::OkStatus();
      has_decoder_ = true;
      const std::string type = d.at("type").get<std::string>();
      if (type == "Sequence") {
        for (const auto& sub : d.at("decoders")) RETURN_IF_ERROR(add_dec(sub));
      } else if (type == "ByteLevel") {
        decoders_.emplace_back(DecodeStep::Kind::kByteLevel);
      } else if (type == "ByteFallback") {
        decoders_.emplace_back(DecodeStep::Kind::kByteFallback);
      } else if (type == "Fuse") {
        decoders_.emplace_back(DecodeStep::Kind::kFuse);
      } else if (type == "Replace") {
        DecodeStep step(DecodeStep::Kind::kReplace);
        std::string regex;
        RETURN_IF_ERROR(ReadPattern(d.at("pattern"), &step.from, &regex));
        if (!regex.empty())
          return absl::UnimplementedError(absl::StrCat(file, ": Replace decoder with a Regex"));
        step.to = d.at("content").get<std::string>();
        decoders_.push_back(std::move(step));
      } else if (type == "Strip") {
        DecodeStep step(DecodeStep::Kind::kStrip);
        step.strip_char = d.at("content").get<std::string>();
        step.start = d.value("start", 0);
        step.stop = d.value("stop", 0);
        decoders_.push_back(std::move(step));
      } else if (type == "Metaspace") {
        DecodeStep step(DecodeStep::Kind::kMetaspace);
        step.from = d.value("replacement", std::string("\xE2\x96\x81"));
        const std::string scheme = d.value("prepend_scheme", std::string());
        const bool never = scheme.empty() ? !d.value("add_prefix_space", true) : scheme == "never";
        step.start = never ? 0 : 1;  // 1: the first token loses its replacement characters
        decoders_.push_back(std::move(step));
      } else {
        return absl::UnimplementedError(
            absl::StrCat(file, ": decoder '", type, "' is not supported"));
      }
      return absl::OkStatus();
    };
    if (top.count("decoder")) RETURN_IF_ERROR(add_dec(top["decoder"]));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": unexpected structure: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::LoadConfig(const std::string& dir, std::string_view config_json,
                                     std::string_view generation_config_json,
                                     std::string_view chat_template_file,
                                     std::string_view tool_use_template_file) {
  // nlohmann's value()/get() throw on type mismatches: a bad config is an error, not a crash.
  try {
    return LoadConfigUnchecked(dir, config_json, generation_config_json, chat_template_file,
                               tool_use_template_file);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/tokenizer_config.json: unexpected structure: ", e.what()));
  }
}

absl::Status HfTokenizer::LoadConfigUnchecked(const std::string& dir, std::string_view config_json,
                                              std::string_view generation_config_json,
                                              std::string_view chat_template_file,
                                              std::string_view tool_use_template_file) {
  json cfg = json::object();
  if (!config_json.empty()) {
    cfg = json::parse(config_json, nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/tokenizer_config.json: not a JSON object"));
    }
  }
  bos_token_ = ConfigTokenString(cfg, "bos_token");
  eos_token_ = ConfigTokenString(cfg, "eos_token");
  if (!bos_token_.empty()) bos_id_ = TokenToId(bos_token_);
  if (!eos_token_.empty()) {
    if (auto id = TokenToId(eos_token_)) eos_ids_.push_back(*id);
  }
  if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean())
    add_bos_ = cfg["add_bos_token"].get<bool>();
  if (cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean())
    add_eos_ = cfg["add_eos_token"].get<bool>();
  if (!generation_config_json.empty()) {
    json gen = json::parse(generation_config_json, nullptr, false);
    if (gen.is_object() && gen.contains("eos_token_id")) {
      const json& e = gen["eos_token_id"];
      std::vector<int32_t> ids;
      if (e.is_number_integer()) ids.push_back(e.get<int32_t>());
      if (e.is_array()) {
        for (const auto& x : e) {
          if (x.is_number_integer()) ids.push_back(x.get<int32_t>());
        }
      }
      for (int32_t id : ids) {
        if (id >= 0 && id < vocab_size_ &&
            std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) {
          eos_ids_.push_back(id);
        }
      }
    }
  }
  chat_template_ = ChatTemplate::FromConfig(cfg, chat_template_file, tool_use_template_file);
  const absl::Status& chat_status = chat_template_.load_status();
  if (absl::IsFailedPrecondition(chat_status) && chat_template_file.empty() &&
      tool_use_template_file.empty() && !cfg.contains("chat_template")) {
    spdlog::info("tokenizer {}: no chat template; chat requests will fail", dir);
  } else if (!chat_status.ok()) {
    spdlog::warn("tokenizer {}: {}; chat requests will fail with FAILED_PRECONDITION", dir,
                 std::string(chat_status.message()));
  }
  for (const std::string& name : chat_template_.unsupported()) {
    spdlog::warn(
        "tokenizer {}: the chat template uses {}, which the interpreter lacks; chat "
        "requests that reach it fail with FAILED_PRECONDITION",
        dir, name);
  }
  return absl::OkStatus();
}

std::optional<int32_t> HfTokenizer::TokenToId(const std::string& token) const {
  for (const auto& a : added_) {
    if (a.content == token) return a.id;
  }
  std::string key = token;
  if (model_.byte_level && !ByteLevelToBytes(token, &key)) return std::nullopt;
  auto it = model_.vocab.find(key);
  if (it != model_.vocab.end()) return it->second;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Encode

std::string HfTokenizer::Normalize(std::string_view text) const {
  std::string s(text);
  for (const auto& n : normalizers_) {
    switch (n.kind) {
      case NormStep::Kind::kNfc:
        s = unicode::Nfc(s);
        break;
      case NormStep::Kind::kNfd:
        s = unicode::Nfd(s);
        break;
      case NormStep::Kind::kNfkc:
        s = unicode::Nfkc(s);
        break;
      case NormStep::Kind::kNfkd:
        s = unicode::Nfkd(s);
        break;
      case NormStep::Kind::kReplace:
        ReplaceAll(&s, n.from, n.to);
        break;
      case NormStep::Kind::kPrepend:
        if (!s.empty()) s.insert(0, n.from);
        break;
    }
  }
  return s;
}

namespace {

struct Segment {
  size_t begin;
  size_t end;
  int32_t token_idx;  // -1: plain text
};

// HF AddedVocabulary split: leftmost-longest matches, then single_word / lstrip / rstrip.
void SplitOnAdded(const TokenTrie& trie, const std::vector<AddedToken>& added, std::string_view s,
                  std::vector<Segment>* out) {
  size_t text_start = 0;
  size_t i = 0;
  while (i < s.size()) {
    const auto [len, idx] = trie.LongestAt(s, i);
    if (len == 0) {
      ++i;
      continue;
    }
    const AddedToken& t = added[idx];
    size_t start = i, stop = i + len;
    if (t.single_word) {
      const bool start_ok = start == 0 || !IsWordChar(s[start - 1]);
      const bool stop_ok = stop == s.size() || !IsWordChar(s[stop]);
      if (!start_ok || !stop_ok) {
        i = stop;
        continue;
      }
    }
    if (t.lstrip) {
      // Walk back over whitespace characters, not past the previous match.
      size_t k = start;
      while (k > text_start) {
        size_t b = k - 1;
        while (b > text_start && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
        char32_t cp = 0;
        unicode::DecodeCodePoint(s, b, &cp);
        if (!IsRustWhitespace(cp)) break;
        k = b;
      }
      start = k;
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        char32_t cp = 0;
        const size_t n = unicode::DecodeCodePoint(s, stop, &cp);
        if (!IsRustWhitespace(cp)) break;
        stop += n;
      }
    }
    if (start > text_start) out->push_back({text_start, start, -1});
    out->push_back({start, stop, idx});
    text_start = stop;
    i = stop;
  }
  if (text_start < s.size()) out->push_back({text_start, s.size(), -1});
}

}  // namespace

absl::Status HfTokenizer::EncodeNormalized(std::string_view normalized, bool at_text_start,
                                           std::vector<int32_t>* ids) const {
  // Pieces, and whether each starts at offset 0 of the original text (Metaspace "first").
  std::vector<std::string_view> pieces{normalized};
  std::vector<uint8_t> at_start{static_cast<uint8_t>(at_text_start)};
  std::vector<std::string_view> next;
  std::vector<uint8_t> next_at_start;
  std::vector<std::unique_ptr<std::string>> owned;  // pieces a step rewrote
  std::vector<std::pair<size_t, size_t>> matches;
  for (const auto& step : pre_tokenizers_) {
    next.clear();
    next_at_start.clear();
    for (size_t p = 0; p < pieces.size(); ++p) {
      std::string_view piece = pieces[p];
      const size_t first_out = next.size();
      if (step.kind == PreStep::Kind::kByteLevel && step.add_prefix_space &&
          (piece.empty() || piece[0] != ' ')) {
        owned.push_back(std::make_unique<std::string>(" " + std::string(piece)));
        piece = *owned.back();
      }
      matches.clear();
      SplitBehavior behavior = SplitBehavior::kIsolated;
      bool invert = false;
      if (step.kind == PreStep::Kind::kMetaspace) {
        auto rewritten = std::make_unique<std::string>(piece);
        ReplaceAll(rewritten.get(), " ", step.replacement);
        const bool prepend = step.prepend == PreStep::Prepend::kAlways ||
                             (step.prepend == PreStep::Prepend::kFirst && at_start[p] != 0);
        if (prepend && rewritten->compare(0, step.replacement.size(), step.replacement) != 0) {
          rewritten->insert(0, step.replacement);
        }
        owned.push_back(std::move(rewritten));
        piece = *owned.back();
        if (!step.split) {
          next.push_back(piece);
        } else {
          for (size_t pos = piece.find(step.replacement); pos != std::string_view::npos;
               pos = piece.find(step.replacement, pos + step.replacement.size())) {
            matches.emplace_back(pos, pos + step.replacement.size());
          }
          ApplySplit(piece, matches, false, SplitBehavior::kMergedWithNext, &next);
        }
      } else if (!step.regex && step.kind == PreStep::Kind::kByteLevel) {
        next.push_back(piece);
      } else {
        if (step.regex) {
          RETURN_IF_ERROR(step.regex->FindAll(piece, &matches));
        } else {
          for (size_t pos = piece.find(step.literal); pos != std::string_view::npos;
               pos = piece.find(step.literal, pos + step.literal.size())) {
            matches.emplace_back(pos, pos + step.literal.size());
          }
        }
        if (step.kind == PreStep::Kind::kSplit) {
          invert = step.invert;
          behavior = step.behavior;
        }
        ApplySplit(piece, matches, invert, behavior, &next);
      }
      for (size_t k = first_out; k < next.size(); ++k) {
        next_at_start.push_back(k == first_out && at_start[p] != 0 &&
                                next[k].data() == piece.data());
      }
    }
    pieces.swap(next);
    at_start.swap(next_at_start);
  }
  for (std::string_view word : pieces) model_.Tokenize(word, ids);
  return absl::OkStatus();
}

absl::Status HfTokenizer::EncodeSegment(std::string_view text, bool at_text_start,
                                        std::vector<int32_t>* ids) const {
  const std::string normalized = Normalize(text);
  if (normalized_trie_.empty()) return EncodeNormalized(normalized, at_text_start, ids);
  std::vector<Segment> segs;
  SplitOnAdded(normalized_trie_, added_, normalized, &segs);
  for (const auto& seg : segs) {
    if (seg.token_idx >= 0) {
      ids->push_back(added_[seg.token_idx].id);
    } else {
      RETURN_IF_ERROR(
          EncodeNormalized(std::string_view(normalized).substr(seg.begin, seg.end - seg.begin),
                           at_text_start && seg.begin == 0, ids));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(std::string_view text,
                                                         bool add_special_tokens) const {
  if (const size_t bad = unicode::FindInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("text is not valid UTF-8 (byte ", bad, ")"));
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) {
    if (has_template_) {
      ids = template_prefix_ids_;
    } else if (add_bos_ && bos_id_) {
      ids.push_back(*bos_id_);
    }
  }
  std::vector<Segment> segs;
  if (raw_trie_.empty()) {
    segs.push_back({0, text.size(), -1});
  } else {
    SplitOnAdded(raw_trie_, added_, text, &segs);
  }
  for (const auto& seg : segs) {
    if (seg.token_idx >= 0) {
      ids.push_back(added_[seg.token_idx].id);
    } else {
      RETURN_IF_ERROR(
          EncodeSegment(text.substr(seg.begin, seg.end - seg.begin), seg.begin == 0, &ids));
    }
  }
  if (add_special_tokens) {
    if (has_template_) {
      ids.insert(ids.end(), template_suffix_ids_.begin(), template_suffix_ids_.end());
    } else if (add_eos_ && !eos_ids_.empty()) {
      ids.push_back(eos_ids_.front());
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Decode

absl::StatusOr<std::string> HfTokenizer::Decode(const std::vector<int32_t>& ids,
                                                bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_ || id_to_token_[id].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is not in the vocabulary (size ", vocab_size_, ")"));
    }
    if (skip_special_tokens && id_is_special_[id]) continue;
    tokens.push_back(id_to_token_[id]);
  }
  if (!has_decoder_) {
    std::string out;
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (k > 0) out.push_back(' ');
      out += tokens[k];
    }
    return out;
  }
  for (const auto& d : decoders_) {
    switch (d.kind) {
      case DecodeStep::Kind::kByteLevel: {
        std::string bytes;
        std::string raw;
        for (const auto& t : tokens) {
          raw.clear();
          bool ok = true;
          for (size_t i = 0; i < t.size() && ok;) {
            char32_t cp = 0;
            i += unicode::DecodeCodePoint(t, i, &cp);
            const int b = unicode::CodePointToByte(cp);
            if (b < 0) ok = false;
            raw.push_back(static_cast<char>(b));
          }
          bytes += ok ? raw : t;
        }
        tokens.assign(1, unicode::Utf8Lossy(bytes));
        break;
      }
      case DecodeStep::Kind::kReplace:
        for (auto& t : tokens) ReplaceAll(&t, d.from, d.to);
        break;
      case DecodeStep::Kind::kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t pending_count = 0;
        auto flush = [&]() {
          if (pending_count == 0) return;
          if (unicode::IsValidUtf8(pending)) {
            out.push_back(pending);
          } else {
            for (size_t k = 0; k < pending_count; ++k) out.emplace_back("\xEF\xBF\xBD");
          }
          pending.clear();
          pending_count = 0;
        };
        auto hex = [](char c) {
          return c >= '0' && c <= '9'   ? c - '0'
                 : c >= 'A' && c <= 'F' ? c - 'A' + 10
                 : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                        : -1;
        };
        for (auto& t : tokens) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && hex(t[3]) >= 0 &&
              hex(t[4]) >= 0) {
            pending.push_back(static_cast<char>(hex(t[3]) * 16 + hex(t[4])));
            ++pending_count;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecodeStep::Kind::kMetaspace:
        // As HF: in the first token every replacement character is dropped (not only a leading
        // one) unless prepend_scheme is "never"; elsewhere it becomes a space.
        for (size_t k = 0; k < tokens.size(); ++k) {
          ReplaceAll(&tokens[k], d.from, (k == 0 && d.start == 1) ? "" : " ");
        }
        break;
      case DecodeStep::Kind::kFuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecodeStep::Kind::kStrip:
        for (auto& t : tokens) {
          const std::string& c = d.strip_char;
          if (c.empty()) continue;
          size_t b = 0, e = t.size();
          for (int k = 0; k < d.start && e - b >= c.size() && t.compare(b, c.size(), c) == 0; ++k)
            b += c.size();
          for (int k = 0;
               k < d.stop && e - b >= c.size() && t.compare(e - c.size(), c.size(), c) == 0; ++k)
            e -= c.size();
          t = t.substr(b, e - b);
        }
        break;
    }
  }
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

absl::StatusOr<std::string> HfTokenizer::ApplyChatTemplate(const ChatRequest& request) const {
  return chat_template_.Render(request);
}

}  // namespace dropkv
