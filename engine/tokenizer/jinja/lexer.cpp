#include "engine/tokenizer/jinja/lexer.h"

#include <array>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv::jinja {
namespace {

// Longest first: the lexer takes the first operator that matches.
constexpr std::array<std::string_view, 28> kOperators = {
    "//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]",
    "(",  ")",  "{",  "}",  ">",  "<",  "=", ".", ":", "|", ",", ";", "!", "@"};

bool IsDigit(char c) {
  return c >= '0' && c <= '9';
}
bool IsNameStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool IsNameChar(char c) {
  return IsNameStart(c) || IsDigit(c);
}
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : source_(Normalize(source)) {}

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < source_.size()) {
      const size_t tag = FindTagStart(pos_);
      if (tag == std::string_view::npos) {
        Emit(TokenType::kData, std::string(Rest(pos_)));
        break;
      }
      if (auto st = LexTag(tag); !st.ok()) return st;
    }
    tokens_.push_back(Token{TokenType::kEof, line_, {}});
    return std::move(tokens_);
  }

 private:
  // \r\n and \r become \n; one trailing newline goes (keep_trailing_newline=False).
  static std::string Normalize(std::string_view in) {
    std::string out;
    out.reserve(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i] == '\r') {
        out.push_back('\n');
        if (i + 1 < in.size() && in[i + 1] == '\n') ++i;
      } else {
        out.push_back(in[i]);
      }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  }

  std::string_view Rest(size_t pos) const { return std::string_view(source_).substr(pos); }
  bool At(size_t pos, std::string_view s) const { return Rest(pos).substr(0, s.size()) == s; }

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(Cat("line ", line_, ": ", what));
  }

  void Emit(TokenType type, std::string value) {
    if (type == TokenType::kData && value.empty()) return;
    tokens_.push_back(Token{type, line_, std::move(value)});
  }

  void CountLines(std::string_view text) {
    for (char c : text) line_ += c == '\n';
  }

  size_t FindTagStart(size_t from) const {
    for (size_t p = source_.find('{', from); p != std::string::npos; p = source_.find('{', p + 1)) {
      if (p + 1 < source_.size() &&
          (source_[p + 1] == '{' || source_[p + 1] == '%' || source_[p + 1] == '#')) {
        return p;
      }
    }
    return std::string_view::npos;
  }

  // Python's `\s*` / `\s+` (Unicode whitespace) from `pos`; returns the end.
  size_t SkipSpace(size_t pos) const {
    while (pos < source_.size()) {
      char32_t cp = 0;
      const size_t n = unicode::DecodeCodePoint(source_, pos, &cp);
      if (!unicode::IsPythonSpace(cp)) break;
      pos += n;
    }
    return pos;
  }

  static bool AllSpace(std::string_view text) {
    for (size_t i = 0; i < text.size();) {
      char32_t cp = 0;
      i += unicode::DecodeCodePoint(text, i, &cp);
      if (!unicode::IsPythonSpace(cp)) return false;
    }
    return true;
  }

  static std::string RStrip(std::string_view text) {
    size_t end = text.size();
    while (end > 0) {
      size_t k = end - 1;
      while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
      char32_t cp = 0;
      unicode::DecodeCodePoint(text, k, &cp);
      if (!unicode::IsPythonSpace(cp)) break;
      end = k;
    }
    return std::string(text.substr(0, end));
  }

  // The text before a tag, after `{%-` (strip everything) or lstrip_blocks (strip the spaces
  // between the line start and a block or comment tag).
  std::string TextBeforeTag(std::string_view text, char sign, bool is_variable) const {
    if (sign == '-') return RStrip(text);
    if (sign != '+' && !is_variable) {
      const size_t newline = text.rfind('\n');
      const size_t line_begin = newline == std::string_view::npos ? 0 : newline + 1;
      if ((line_begin > 0 || line_starting_) && line_begin < text.size() &&
          AllSpace(text.substr(line_begin))) {
        return std::string(text.substr(0, line_begin));
      }
    }
    return std::string(text);
  }

  // The end of the closer `closer` at `pos` with its whitespace control, or npos. "%}" and "#}"
  // (block_style) honour trim_blocks and know `+`; "}}" knows only `-`.
  size_t MatchCloser(size_t pos, std::string_view closer, bool block_style) const {
    if (block_style && At(pos, "+") && At(pos + 1, closer)) return pos + 1 + closer.size();
    if (At(pos, "-") && At(pos + 1, closer)) return SkipSpace(pos + 1 + closer.size());
    if (At(pos, closer)) {
      size_t end = pos + closer.size();
      if (block_style && At(end, "\n")) ++end;
      return end;
    }
    return std::string_view::npos;
  }

  void Consume(size_t from, size_t to) {
    const std::string_view chunk = std::string_view(source_).substr(from, to - from);
    CountLines(chunk);
    if (!chunk.empty()) line_starting_ = chunk.back() == '\n';
    pos_ = to;
  }

  absl::Status LexTag(size_t tag) {
    const char kind = source_[tag + 1];
    const char sign =
        (tag + 2 < source_.size() && (source_[tag + 2] == '-' || source_[tag + 2] == '+'))
            ? source_[tag + 2]
            : '\0';
    const size_t body = tag + 2 + (sign != '\0');
    const std::string_view text = std::string_view(source_).substr(pos_, tag - pos_);
    const size_t raw_end = kind == '%' ? MatchRawBegin(body) : std::string_view::npos;
    Emit(TokenType::kData, TextBeforeTag(text, sign, kind == '{'));
    CountLines(text);
    line_starting_ = false;
    pos_ = body;
    if (raw_end != std::string_view::npos) {
      Consume(body, raw_end);
      return LexRaw();
    }
    if (kind == '#') {
      for (size_t p = body; p < source_.size(); ++p) {
        const size_t end = MatchCloser(p, "#}", /*block_style=*/true);
        if (end != std::string_view::npos) {
          Consume(body, end);
          return absl::OkStatus();
        }
      }
      return Error("Missing end of comment tag");
    }
    const bool is_block = kind == '%';
    Emit(is_block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "");
    return LexInsideTag(is_block);
  }

  // `{%(-|+|)\s*raw\s*(-%}\s*|%})` from the position after the sign; returns the end or npos.
  size_t MatchRawBegin(size_t pos) const {
    pos = SkipSpace(pos);
    if (!At(pos, "raw")) return std::string_view::npos;
    pos = SkipSpace(pos + 3);
    if (At(pos, "-%}")) return SkipSpace(pos + 3);
    if (At(pos, "%}")) return pos + 2;
    return std::string_view::npos;
  }

  absl::Status LexRaw() {
    for (size_t p = source_.find("{%", pos_); p != std::string::npos;
         p = source_.find("{%", p + 1)) {
      const char sign = (p + 2 < source_.size() && (source_[p + 2] == '-' || source_[p + 2] == '+'))
                            ? source_[p + 2]
                            : '\0';
      size_t q = SkipSpace(p + 2 + (sign != '\0'));
      if (!At(q, "endraw")) continue;
      q = SkipSpace(q + 6);
      const size_t end = MatchCloser(q, "%}", /*block_style=*/true);
      if (end == std::string_view::npos) continue;
      const std::string_view text = std::string_view(source_).substr(pos_, p - pos_);
      Emit(TokenType::kData, TextBeforeTag(text, sign, /*is_variable=*/false));
      CountLines(text);
      line_starting_ = false;
      Consume(p, end);
      return absl::OkStatus();
    }
    return Error("Missing end of raw directive");
  }

  absl::Status LexInsideTag(bool is_block) {
    std::vector<char> balancing;  // closers of the open brackets
    while (true) {
      if (pos_ >= source_.size()) return absl::OkStatus();  // the parser reports the open tag
      if (balancing.empty()) {
        const size_t end = is_block ? MatchCloser(pos_, "%}", /*block_style=*/true)
                                    : MatchCloser(pos_, "}}", /*block_style=*/false);
        if (end != std::string_view::npos) {
          const int line = line_;
          Consume(pos_, end);
          tokens_.push_back(
              Token{is_block ? TokenType::kBlockEnd : TokenType::kVariableEnd, line, {}});
          return absl::OkStatus();
        }
      }
      const size_t space_end = SkipSpace(pos_);
      if (space_end > pos_) {
        Consume(pos_, space_end);
        continue;
      }
      const char c = source_[pos_];
      if (IsDigit(c)) {
        if (auto st = LexNumber(); !st.ok()) return st;
        continue;
      }
      if (IsNameStart(c)) {
        size_t end = pos_;
        while (end < source_.size() && IsNameChar(source_[end])) ++end;
        Emit(TokenType::kName, source_.substr(pos_, end - pos_));
        Consume(pos_, end);
        continue;
      }
      if (c == '\'' || c == '"') {
        if (auto st = LexString(); !st.ok()) return st;
        continue;
      }
      std::string_view op;
      for (std::string_view candidate : kOperators) {
        if (At(pos_, candidate)) {
          op = candidate;
          break;
        }
      }
      if (op.empty() || op == "!" || op == "@") {
        return Error(Cat("unexpected char '", std::string(1, c), "'"));
      }
      if (op == "(" || op == "[" || op == "{") {
        balancing.push_back(op == "(" ? ')' : (op == "[" ? ']' : '}'));
      } else if (op == ")" || op == "]" || op == "}") {
        if (balancing.empty()) return Error(Cat("unexpected '", op, "'"));
        if (balancing.back() != op[0]) {
          return Error(
              Cat("unexpected '", op, "', expected '", std::string(1, balancing.back()), "'"));
        }
        balancing.pop_back();
      }
      Emit(TokenType::kOperator, std::string(op));
      Consume(pos_, pos_ + op.size());
    }
  }

  // Digits with optional single underscores between them, from `pos`; returns the end.
  size_t SkipDigits(size_t pos, int base) const {
    const auto is_digit = [&](char ch) {
      const int v = HexValue(ch);
      return v >= 0 && v < base && (base == 16 || IsDigit(ch));
    };
    if (pos >= source_.size() || !is_digit(source_[pos])) return pos;
    ++pos;
    while (pos < source_.size()) {
      if (is_digit(source_[pos])) {
        ++pos;
      } else if (source_[pos] == '_' && pos + 1 < source_.size() && is_digit(source_[pos + 1])) {
        pos += 2;
      } else {
        break;
      }
    }
    return pos;
  }

  absl::Status LexNumber() {
    const size_t start = pos_;
    // float: digits ((. digits)? e[+-]? digits | . digits), not right after a '.'.
    if (start == 0 || source_[start - 1] != '.') {
      const size_t int_end = SkipDigits(start, 10);
      size_t end = int_end;
      bool is_float = false;
      if (At(end, ".") && end + 1 < source_.size() && IsDigit(source_[end + 1])) {
        end = SkipDigits(end + 1, 10);
        is_float = true;
      }
      if (end < source_.size() && (source_[end] == 'e' || source_[end] == 'E')) {
        size_t e = end + 1;
        if (e < source_.size() && (source_[e] == '+' || source_[e] == '-')) ++e;
        const size_t exp_end = SkipDigits(e, 10);
        if (exp_end > e) {
          end = exp_end;
          is_float = true;
        }
      }
      if (is_float) {
        std::string text;
        for (size_t k = start; k < end; ++k) {
          if (source_[k] != '_') text.push_back(source_[k]);
        }
        Token token{TokenType::kFloat, line_, text};
        token.float_value = std::strtod(text.c_str(), nullptr);
        tokens_.push_back(std::move(token));
        Consume(start, end);
        return absl::OkStatus();
      }
    }
    int base = 10;
    size_t digits = start;
    if (source_[start] == '0' && start + 1 < source_.size()) {
      const char p =
          static_cast<char>(std::tolower(static_cast<unsigned char>(source_[start + 1])));
      base = p == 'b' ? 2 : (p == 'o' ? 8 : (p == 'x' ? 16 : 10));
      if (base != 10) digits = start + 2;
    }
    size_t end = 0;
    if (base != 10) {
      // 0x(_?[0-9a-f])+ : an underscore may also follow the prefix.
      size_t p = digits;
      if (At(p, "_")) ++p;
      end = SkipDigits(p, base);
      if (end == p) base = 10;  // "0x" without digits: the integer is the 0
    }
    if (base == 10) {
      if (source_[start] == '0') {  // 0(_?0)*
        end = start + 1;
        while (end < source_.size()) {
          if (source_[end] == '0') {
            ++end;
          } else if (source_[end] == '_' && end + 1 < source_.size() && source_[end + 1] == '0') {
            end += 2;
          } else {
            break;
          }
        }
      } else {
        end = SkipDigits(start, 10);
      }
      digits = start;
    }
    int64_t value = 0;
    for (size_t k = digits; k < end; ++k) {
      if (source_[k] == '_') continue;
      const int d = HexValue(source_[k]);
      if (__builtin_mul_overflow(value, static_cast<int64_t>(base), &value) ||
          __builtin_add_overflow(value, static_cast<int64_t>(d), &value)) {
        return Error("integer literal too large (the interpreter has 64-bit integers)");
      }
    }
    Token token{TokenType::kInteger, line_, source_.substr(start, end - start)};
    token.int_value = value;
    tokens_.push_back(std::move(token));
    Consume(start, end);
    return absl::OkStatus();
  }

  // A quoted literal, unescaped as Python's unicode-escape codec does (what jinja2 uses).
  absl::Status LexString() {
    const char quote = source_[pos_];
    size_t end = pos_ + 1;
    while (end < source_.size() && source_[end] != quote) {
      end += source_[end] == '\\' ? 2 : 1;
    }
    if (end >= source_.size()) {
      return Error(Cat("unexpected char '", std::string(1, quote), "'"));
    }
    const std::string_view body = std::string_view(source_).substr(pos_ + 1, end - pos_ - 1);
    std::string value;
    if (auto st = Unescape(body, &value); !st.ok()) return st;
    Emit(TokenType::kString, std::move(value));
    Consume(pos_, end + 1);
    return absl::OkStatus();
  }

  absl::Status Unescape(std::string_view s, std::string* out) const {
    for (size_t i = 0; i < s.size();) {
      if (s[i] != '\\' || i + 1 >= s.size()) {
        out->push_back(s[i++]);
        continue;
      }
      const char c = s[i + 1];
      i += 2;
      switch (c) {
        case '\n':
          break;  // line continuation
        case '\\':
        case '\'':
        case '"':
          out->push_back(c);
          break;
        case 'a':
          out->push_back('\a');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'v':
          out->push_back('\v');
          break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t width = c == 'x' ? 2 : (c == 'u' ? 4 : 8);
          uint32_t cp = 0;
          for (size_t k = 0; k < width; ++k) {
            const int v = i + k < s.size() ? HexValue(s[i + k]) : -1;
            if (v < 0) return Error(Cat("truncated \\", std::string(1, c), " escape"));
            cp = cp * 16 + static_cast<uint32_t>(v);
          }
          i += width;
          if (cp > 0x10FFFF) return Error("illegal Unicode character in string literal");
          if (cp >= 0xD800 && cp <= 0xDFFF) {
            return Error("a surrogate escape in a string literal is not valid UTF-8");
          }
          unicode::AppendCodePoint(cp, out);
          break;
        }
        case 'N':
          return Error("\\N{...} escapes in string literals are not supported");
        default:
          if (c >= '0' && c <= '7') {
            uint32_t cp = static_cast<uint32_t>(c - '0');
            for (int k = 0; k < 2 && i < s.size() && s[i] >= '0' && s[i] <= '7'; ++k, ++i) {
              cp = cp * 8 + static_cast<uint32_t>(s[i] - '0');
            }
            unicode::AppendCodePoint(cp, out);
          } else if (static_cast<unsigned char>(c) >= 0x80) {
            // jinja2 first turns non-ASCII into \x / \u / \U escapes, so a backslash before
            // one escapes the escape's backslash: "\é" reads as the four characters \xe9.
            char32_t cp = 0;
            const size_t n = unicode::DecodeCodePoint(s, i - 1, &cp);
            i = i - 1 + n;
            char buf[16];
            if (cp <= 0xFF) {
              std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(cp));
            } else if (cp <= 0xFFFF) {
              std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
            } else {
              std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(cp));
            }
            out->append(buf);
          } else {
            out->push_back('\\');  // unknown escapes stay as written
            out->push_back(c);
          }
      }
    }
    return absl::OkStatus();
  }

  std::string source_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source) {
  if (!unicode::IsValidUtf8(source)) {
    return absl::InvalidArgumentError("the template is not valid UTF-8");
  }
  return Lexer(source).Run();
}

}  // namespace dropkv::jinja
