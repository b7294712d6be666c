#include "engine/tokenizer/json_scan.h"

#include <charconv>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv {

void JsonScanner::SkipWs() {
  while (pos_ < s_.size() &&
         (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) {
    ++pos_;
  }
}

absl::Status JsonScanner::Error(std::string_view msg) const {
  return absl::InvalidArgumentError(
      absl::StrCat(what_, ": JSON error at byte ", pos_, ": ", std::string(msg)));
}

absl::Status JsonScanner::Expect(char c) {
  SkipWs();
  if (pos_ >= s_.size() || s_[pos_] != c)
    return Error(absl::StrCat("expected '", std::string(1, c), "'"));
  ++pos_;
  return absl::OkStatus();
}

bool JsonScanner::Consume(char c) {
  SkipWs();
  if (pos_ < s_.size() && s_[pos_] == c) {
    ++pos_;
    return true;
  }
  return false;
}

bool JsonScanner::AtEnd() {
  SkipWs();
  return pos_ >= s_.size();
}

namespace {
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

absl::StatusOr<std::string> JsonScanner::String() {
  SkipWs();
  if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string");
  ++pos_;
  std::string out;
  size_t start = pos_;
  while (true) {
    if (pos_ >= s_.size()) return Error("unterminated string");
    const char c = s_[pos_];
    if (c == '"') {
      out.append(s_.substr(start, pos_ - start));
      ++pos_;
      return out;
    }
    if (c != '\\') {
      ++pos_;
      continue;
    }
    out.append(s_.substr(start, pos_ - start));
    if (pos_ + 1 >= s_.size()) return Error("unterminated escape");
    const char e = s_[pos_ + 1];
    pos_ += 2;
    switch (e) {
      case '"':
        out.push_back('"');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '/':
        out.push_back('/');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'u': {
        auto read4 = [&](char32_t* v) {
          if (pos_ + 4 > s_.size()) return false;
          *v = 0;
          for (int k = 0; k < 4; ++k) {
            const int h = HexValue(s_[pos_ + k]);
            if (h < 0) return false;
            *v = (*v << 4) | static_cast<char32_t>(h);
          }
          pos_ += 4;
          return true;
        };
        char32_t cp = 0;
        if (!read4(&cp)) return Error("bad \\u escape");
        if (cp >= 0xD800 && cp <= 0xDBFF && pos_ + 1 < s_.size() && s_[pos_] == '\\' &&
            s_[pos_ + 1] == 'u') {
          const size_t save = pos_;
          pos_ += 2;
          char32_t lo = 0;
          if (read4(&lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else {
            pos_ = save;
          }
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;  // lone surrogate
        unicode::AppendCodePoint(cp, &out);
        break;
      }
      default:
        return Error("bad escape");
    }
    start = pos_;
  }
}

absl::StatusOr<int64_t> JsonScanner::Int() {
  SkipWs();
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s_.data() + pos_, s_.data() + s_.size(), v);
  if (ec != std::errc()) return Error("expected an integer");
  pos_ = ptr - s_.data();
  return v;
}

absl::Status JsonScanner::SkipString() {
  ++pos_;  // opening quote
  while (pos_ < s_.size()) {
    const char c = s_[pos_];
    if (c == '\\') {
      pos_ += 2;
    } else if (c == '"') {
      ++pos_;
      return absl::OkStatus();
    } else {
      ++pos_;
    }
  }
  return Error("unterminated string");
}

absl::StatusOr<std::string_view> JsonScanner::RawValue() {
  SkipWs();
  const size_t start = pos_;
  if (pos_ >= s_.size()) return Error("expected a value");
  int depth = 0;
  do {
    if (pos_ >= s_.size()) return Error("unterminated value");
    const char c = s_[pos_];
    if (c == '"') {
      if (absl::Status st = SkipString(); !st.ok()) return st;
    } else if (c == '{' || c == '[') {
      ++depth;
      ++pos_;
    } else if (c == '}' || c == ']') {
      if (depth == 0) return Error("unexpected bracket");
      --depth;
      ++pos_;
    } else if (depth == 0) {
      // A scalar at top level: up to the next delimiter.
      while (pos_ < s_.size() && s_[pos_] != ',' && s_[pos_] != '}' && s_[pos_] != ']' &&
             s_[pos_] != ' ' && s_[pos_] != '\n' && s_[pos_] != '\r' && s_[pos_] != '\t') {
        ++pos_;
      }
    } else {
      ++pos_;
    }
  } while (depth > 0);
  return s_.substr(start, pos_ - start);
}

}  // namespace dropkv
