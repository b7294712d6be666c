#include "engine/tokenizer/jinja/python.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv::jinja::py {
namespace {

using unicode::DecodeCodePoint;

void AppendHex(uint32_t value, int width, std::string* out) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%0*x", width, value);
  out->append(buf);
}

bool IsLineBreak(char32_t cp) {
  switch (cp) {
    case '\n':
    case '\r':
    case 0x0B:
    case 0x0C:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x85:
    case 0x2028:
    case 0x2029:
      return true;
    default:
      return false;
  }
}

// Start of the code point that ends at byte `end` (> 0).
size_t PreviousCodePoint(std::string_view s, size_t end) {
  size_t k = end - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  return k;
}

void AppendJson(const Value& value, const JsonOptions& options, int level, std::string* out);

void AppendJsonString(std::string_view s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      switch (c) {
        case '"':
          out->append("\\\"");
          break;
        case '\\':
          out->append("\\\\");
          break;
        case '\n':
          out->append("\\n");
          break;
        case '\r':
          out->append("\\r");
          break;
        case '\t':
          out->append("\\t");
          break;
        case '\b':
          out->append("\\b");
          break;
        case '\f':
          out->append("\\f");
          break;
        default:
          if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
            out->append("\\u");
            AppendHex(c, 4, out);
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
      continue;
    }
    char32_t cp = 0;
    const size_t n = DecodeCodePoint(s, i, &cp);
    if (!ensure_ascii) {
      out->append(s.substr(i, n));
    } else if (cp < 0x10000) {
      out->append("\\u");
      AppendHex(cp, 4, out);
    } else {  // a UTF-16 surrogate pair, as Python writes it
      const uint32_t v = cp - 0x10000;
      out->append("\\u");
      AppendHex(0xD800 + (v >> 10), 4, out);
      out->append("\\u");
      AppendHex(0xDC00 + (v & 0x3FF), 4, out);
    }
    i += n;
  }
  out->push_back('"');
}

void AppendJsonNewline(const JsonOptions& options, int level, std::string* out) {
  out->push_back('\n');
  for (int k = 0; k < level; ++k) out->append(*options.indent);
}

void AppendJson(const Value& value, const JsonOptions& options, int level, std::string* out) {
  const std::string item_separator =
      options.item_separator ? *options.item_separator : (options.indent ? "," : ", ");
  const std::string key_separator = options.key_separator ? *options.key_separator : ": ";
  switch (value.kind()) {
    case Value::Kind::kNone:
      out->append("null");
      return;
    case Value::Kind::kBool:
      out->append(value.as_bool() ? "true" : "false");
      return;
    case Value::Kind::kInt:
      absl::StrAppend(out, value.as_int());
      return;
    case Value::Kind::kFloat: {
      const double f = value.as_float();
      if (std::isnan(f)) {
        out->append("NaN");
      } else if (std::isinf(f)) {
        out->append(f > 0 ? "Infinity" : "-Infinity");
      } else {
        out->append(FloatRepr(f));
      }
      return;
    }
    case Value::Kind::kString:
      AppendJsonString(value.as_string(), options.ensure_ascii, out);
      return;
    case Value::Kind::kList: {
      const auto& items = value.as_list().items;
      if (items.empty()) {
        out->append("[]");
        return;
      }
      out->push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out->append(item_separator);
        if (options.indent) AppendJsonNewline(options, level + 1, out);
        AppendJson(items[i], options, level + 1, out);
      }
      if (options.indent) AppendJsonNewline(options, level, out);
      out->push_back(']');
      return;
    }
    case Value::Kind::kDict: {
      const auto& entries = value.as_dict().entries;
      if (entries.empty()) {
        out->append("{}");
        return;
      }
      std::vector<const std::pair<std::string, Value>*> order;
      order.reserve(entries.size());
      for (const auto& e : entries) order.push_back(&e);
      if (options.sort_keys) {
        std::stable_sort(order.begin(), order.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out->push_back('{');
      for (size_t i = 0; i < order.size(); ++i) {
        if (i > 0) out->append(item_separator);
        if (options.indent) AppendJsonNewline(options, level + 1, out);
        AppendJsonString(order[i]->first, options.ensure_ascii, out);
        out->append(key_separator);
        AppendJson(order[i]->second, options, level + 1, out);
      }
      if (options.indent) AppendJsonNewline(options, level, out);
      out->push_back('}');
      return;
    }
    case Value::Kind::kUndefined:
    case Value::Kind::kObject:
      TypeError(Cat("Object of type ", TypeName(value), " is not JSON serializable"));
  }
}

}  // namespace

std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0) return std::signbit(f) ? "-0.0" : "0.0";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  const std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));  // "-1.2345e+16"
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    pos = 1;
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (size_t k = pos; k < e; ++k) {
    if (sci[k] != '.') digits.push_back(sci[k]);
  }
  int exponent = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exponent);
  const int decpt = exponent + 1;  // value = 0.DIGITS * 10^decpt
  const int num_digits = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {  // Python's repr switches to exponents outside this range
    if (decpt <= 0) {
      out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= num_digits) {
      out += digits + std::string(static_cast<size_t>(decpt - num_digits), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt)) + "." +
             digits.substr(static_cast<size_t>(decpt));
    }
    return out;
  }
  out.push_back(digits[0]);
  if (num_digits > 1) out += "." + digits.substr(1);
  const int shown = decpt - 1;
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", shown < 0 ? '-' : '+', std::abs(shown));
  out += exp_buf;
  return out;
}

void AppendStr(const Value& value, std::string* out) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return;
    case Value::Kind::kString:
      out->append(value.as_string());
      return;
    default:
      AppendRepr(value, out);
  }
}

std::string Str(const Value& value) {
  if (value.is_string()) return std::string(value.as_string());
  std::string out;
  AppendStr(value, &out);
  return out;
}

void AppendStringRepr(std::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  out->push_back(quote);
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    const size_t n = DecodeCodePoint(s, i, &cp);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(cp));
    } else if (cp == '\t') {
      out->append("\\t");
    } else if (cp == '\n') {
      out->append("\\n");
    } else if (cp == '\r') {
      out->append("\\r");
    } else if (cp < 0x20 || cp == 0x7F) {
      out->append("\\x");
      AppendHex(cp, 2, out);
    } else if (cp < 0x7F || unicode::IsPythonPrintable(cp)) {
      out->append(s.substr(i, n));
    } else if (cp <= 0xFF) {
      out->append("\\x");
      AppendHex(cp, 2, out);
    } else if (cp <= 0xFFFF) {
      out->append("\\u");
      AppendHex(cp, 4, out);
    } else {
      out->append("\\U");
      AppendHex(cp, 8, out);
    }
    i += n;
  }
  out->push_back(quote);
}

void AppendRepr(const Value& value, std::string* out) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      out->append("Undefined");
      return;
    case Value::Kind::kNone:
      out->append("None");
      return;
    case Value::Kind::kBool:
      out->append(value.as_bool() ? "True" : "False");
      return;
    case Value::Kind::kInt:
      absl::StrAppend(out, value.as_int());
      return;
    case Value::Kind::kFloat:
      out->append(FloatRepr(value.as_float()));
      return;
    case Value::Kind::kString:
      AppendStringRepr(value.as_string(), out);
      return;
    case Value::Kind::kList: {
      const ListData& list = value.as_list();
      out->push_back(list.is_tuple ? '(' : '[');
      for (size_t i = 0; i < list.items.size(); ++i) {
        if (i > 0) out->append(", ");
        AppendRepr(list.items[i], out);
      }
      if (list.is_tuple && list.items.size() == 1) out->push_back(',');
      out->push_back(list.is_tuple ? ')' : ']');
      return;
    }
    case Value::Kind::kDict: {
      out->push_back('{');
      bool first = true;
      for (const auto& [key, item] : value.as_dict().entries) {
        if (!first) out->append(", ");
        first = false;
        AppendStringRepr(key, out);
        out->append(": ");
        AppendRepr(item, out);
      }
      out->push_back('}');
      return;
    }
    case Value::Kind::kObject:
      // Python would print an address ("<generator object at 0x...>"): nothing to match.
      Unsupported(Cat("cannot print a ", value.as_object()->type_name()));
  }
}

bool Truthy(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return value.as_bool();
    case Value::Kind::kInt:
      return value.as_int() != 0;
    case Value::Kind::kFloat:
      return value.as_float() != 0.0;
    case Value::Kind::kString:
      return !value.as_string().empty();
    case Value::Kind::kList:
      return !value.as_list().items.empty();
    case Value::Kind::kDict:
      return !value.as_dict().entries.empty();
    case Value::Kind::kObject:
      return true;  // generators too: Python does not know whether one is empty
  }
  return false;
}

bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList: {
      const ListData& x = a.as_list();
      const ListData& y = b.as_list();
      if (x.is_tuple != y.is_tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!Equal(x.items[i], y.items[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const DictData& x = a.as_dict();
      const DictData& y = b.as_dict();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [key, item] : x.entries) {
        const Value* other = y.Find(key);
        if (other == nullptr || !Equal(item, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kObject:
      return a.as_object() == b.as_object();
    default:
      return false;
  }
}

int Compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list() && a.as_list().is_tuple == b.as_list().is_tuple) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equal(x[i], y[i])) return Compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  TypeError(
      Cat("'<' not supported between instances of '", TypeName(a), "' and '", TypeName(b), "'"));
}

std::string TypeName(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return value.as_list().is_tuple ? "tuple" : "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kObject:
      return std::string(value.as_object()->type_name());
  }
  return "object";
}

std::string ToJson(const Value& value, const JsonOptions& options) {
  std::string out;
  AppendJson(value, options, 0, &out);
  return out;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

std::vector<size_t> CodePointOffsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) offsets.push_back(i);
  }
  offsets.push_back(s.size());
  return offsets;
}

std::string_view Strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                       bool right) {
  // Membership in `chars` by scanning it: the sets are a character or two ('\n', ' \t').
  const auto strippable = [&](char32_t cp) {
    if (!chars) return unicode::IsPythonSpace(cp);
    for (size_t i = 0; i < chars->size();) {
      char32_t c = 0;
      i += DecodeCodePoint(*chars, i, &c);
      if (c == cp) return true;
    }
    return false;
  };
  size_t begin = 0, end = s.size();
  while (left && begin < end) {
    char32_t cp = 0;
    const size_t n = DecodeCodePoint(s, begin, &cp);
    if (!strippable(cp)) break;
    begin += n;
  }
  while (right && end > begin) {
    const size_t k = PreviousCodePoint(s, end);
    char32_t cp = 0;
    DecodeCodePoint(s, k, &cp);
    if (!strippable(cp)) break;
    end = k;
  }
  return s.substr(begin, end - begin);
}

std::vector<std::string_view> Split(std::string_view s, const std::optional<std::string>& sep,
                                    int64_t maxsplit, bool from_right) {
  std::vector<std::string_view> parts;
  if (sep) {
    if (sep->empty()) TypeError("empty separator");
    parts.reserve(static_cast<size_t>(Count(s, *sep)) + 1);
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t hit = s.find(*sep, pos);
        if (hit == std::string_view::npos) break;
        parts.emplace_back(s.substr(pos, hit - pos));
        pos = hit + sep->size();
      }
      parts.emplace_back(s.substr(pos));
      return parts;
    }
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      if (end < sep->size()) break;
      const size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      parts.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    parts.emplace_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Whitespace runs separate words; leading and trailing runs give no empty words. Once maxsplit
  // is reached the rest is one part, with its outer whitespace on the far side kept.
  const auto is_space_at = [&](size_t pos, size_t* len) {
    char32_t cp = 0;
    *len = DecodeCodePoint(s, pos, &cp);
    return unicode::IsPythonSpace(cp);
  };
  if (!from_right) {
    size_t pos = 0, len = 0;
    while (true) {
      while (pos < s.size() && is_space_at(pos, &len)) pos += len;
      if (pos >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) {
        parts.emplace_back(s.substr(pos));  // the rest keeps its trailing whitespace
        break;
      }
      const size_t start = pos;
      while (pos < s.size() && !is_space_at(pos, &len)) pos += len;
      parts.emplace_back(s.substr(start, pos - start));
    }
    return parts;
  }
  size_t end = s.size(), len = 0;
  while (true) {
    while (end > 0) {
      const size_t k = PreviousCodePoint(s, end);
      if (!is_space_at(k, &len)) break;
      end = k;
    }
    if (end == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) {
      parts.emplace_back(s.substr(0, end));  // the rest keeps its leading whitespace
      break;
    }
    size_t start = end;
    while (start > 0) {
      const size_t k = PreviousCodePoint(s, start);
      if (is_space_at(k, &len)) break;
      start = k;
    }
    parts.emplace_back(s.substr(start, end - start));
    end = start;
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::vector<std::string_view> SplitLines(std::string_view s, bool keepends) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    const size_t n = DecodeCodePoint(s, i, &cp);
    if (!IsLineBreak(cp)) {
      i += n;
      continue;
    }
    size_t end_of_break = i + n;
    if (cp == '\r' && end_of_break < s.size() && s[end_of_break] == '\n') ++end_of_break;
    lines.emplace_back(s.substr(start, (keepends ? end_of_break : i) - start));
    start = i = end_of_break;
  }
  if (start < s.size()) lines.emplace_back(s.substr(start));
  return lines;
}

std::string Replace(std::string_view s, std::string_view old_text, std::string_view new_text,
                    int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old_text.empty()) {  // Python inserts `new` before every code point and at the end
    const std::vector<size_t> offsets = CodePointOffsets(s);
    for (size_t k = 0; k + 1 < offsets.size(); ++k) {
      if (count < 0 || done < count) {
        out.append(new_text);
        ++done;
      }
      out.append(s.substr(offsets[k], offsets[k + 1] - offsets[k]));
    }
    if (count < 0 || done < count) out.append(new_text);
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old_text, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(new_text);
    pos = hit + old_text.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

int64_t Find(std::string_view s, std::string_view sub, bool from_right) {
  const size_t hit = from_right ? s.rfind(sub) : s.find(sub);
  if (hit == std::string_view::npos) return -1;
  return static_cast<int64_t>(CodePointCount(s.substr(0, hit)));
}

int64_t Count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(CodePointCount(s)) + 1;
  int64_t n = 0;
  for (size_t pos = s.find(sub); pos != std::string_view::npos; pos = s.find(sub, pos + sub.size()))
    ++n;
  return n;
}

}  // namespace dropkv::jinja::py
