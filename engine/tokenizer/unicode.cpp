#include "engine/tokenizer/unicode.h"

#include <cstring>

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

namespace dropkv::unicode {

size_t ValidSequenceLength(std::string_view s, size_t pos) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(pos);
  if (c < 0x80) return 1;
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return 0;
  }
  if (pos + len > s.size()) return 0;
  if (b(pos + 1) < lo || b(pos + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if ((b(pos + k) & 0xC0) != 0x80) return 0;
  }
  return len;
}

size_t FindInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs eight bytes at a time (chat messages are mostly ASCII).
    while (i + 8 <= s.size()) {
      uint64_t word;
      std::memcpy(&word, s.data() + i, 8);
      if ((word & 0x8080808080808080ULL) != 0) break;
      i += 8;
    }
    if (i >= s.size()) break;
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t len = ValidSequenceLength(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string Utf8Lossy(std::string_view s) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  while (i < s.size()) {
    const size_t len = ValidSequenceLength(s, i);
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    // Maximal subpart: the lead byte plus the continuation bytes that were still acceptable.
    const unsigned char c = b(i);
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    size_t consumed = 1;
    if (need > 0 && i + 1 < s.size() && b(i + 1) >= lo && b(i + 1) <= hi) {
      consumed = 2;
      while (consumed < need && i + consumed < s.size() && (b(i + consumed) & 0xC0) == 0x80) {
        ++consumed;
      }
    }
    out.append(kReplacement);
    i += consumed;
  }
  return out;
}

size_t DecodeCodePoint(std::string_view s, size_t pos, char32_t* cp) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(s[i])); };
  const char32_t c = b(pos);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  if (c < 0xE0) {
    *cp = ((c & 0x1F) << 6) | (b(pos + 1) & 0x3F);
    return 2;
  }
  if (c < 0xF0) {
    *cp = ((c & 0x0F) << 12) | ((b(pos + 1) & 0x3F) << 6) | (b(pos + 2) & 0x3F);
    return 3;
  }
  *cp = ((c & 0x07) << 18) | ((b(pos + 1) & 0x3F) << 12) | ((b(pos + 2) & 0x3F) << 6) |
        (b(pos + 3) & 0x3F);
  return 4;
}

void AppendCodePoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

enum class Form { kNfc, kNfd, kNfkc, kNfkd };

std::string Normalize(std::string_view s, Form form) {
  if (IsAscii(s)) return std::string(s);  // ASCII is invariant under all four forms
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case Form::kNfc:
      n = icu::Normalizer2::getNFCInstance(err);
      break;
    case Form::kNfd:
      n = icu::Normalizer2::getNFDInstance(err);
      break;
    case Form::kNfkc:
      n = icu::Normalizer2::getNFKCInstance(err);
      break;
    case Form::kNfkd:
      n = icu::Normalizer2::getNFKDInstance(err);
      break;
  }
  if (U_FAILURE(err) || n == nullptr) return std::string(s);
  const icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (n->isNormalized(in, err) && U_SUCCESS(err)) return std::string(s);
  err = U_ZERO_ERROR;
  const icu::UnicodeString out = n->normalize(in, err);
  if (U_FAILURE(err)) return std::string(s);
  std::string result;
  out.toUTF8String(result);
  return result;
}

}  // namespace

std::string Nfc(std::string_view s) {
  return Normalize(s, Form::kNfc);
}
std::string Nfd(std::string_view s) {
  return Normalize(s, Form::kNfd);
}
std::string Nfkc(std::string_view s) {
  return Normalize(s, Form::kNfkc);
}
std::string Nfkd(std::string_view s) {
  return Normalize(s, Form::kNfkd);
}

bool IsPythonSpace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

namespace {

icu::UnicodeString ToIcu(std::string_view s) {
  return icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
}

std::string FromIcu(const icu::UnicodeString& s) {
  std::string out;
  s.toUTF8String(out);
  return out;
}

// Applies `ascii` to each byte of ASCII text and `icu` to anything else.
template <typename AsciiMap, typename IcuMap>
std::string MapCase(std::string_view s, AsciiMap ascii, IcuMap icu) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) c = ascii(c);
    return out;
  }
  icu::UnicodeString u = ToIcu(s);
  icu(u);
  return FromIcu(u);
}

bool IsCased(char32_t cp) {
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_CASED);
}

// Python's title() / capitalize() map one code point at a time; `title_next` says whether this
// one starts a word.
void AppendTitleOrLower(char32_t cp, bool title, std::string* out) {
  const UChar32 mapped =
      title ? u_totitle(static_cast<UChar32>(cp)) : u_tolower(static_cast<UChar32>(cp));
  AppendCodePoint(static_cast<char32_t>(mapped), out);
}

// True when every code point satisfies `pred` and there is at least one.
template <typename Pred>
bool AllCodePoints(std::string_view s, Pred pred) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    i += DecodeCodePoint(s, i, &cp);
    if (!pred(cp)) return false;
  }
  return true;
}

// Python's isupper()/islower(): at least one cased character, and no cased character of the
// other kind.
bool CaseTest(std::string_view s, bool upper) {
  bool any_cased = false;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    i += DecodeCodePoint(s, i, &cp);
    const UChar32 c = static_cast<UChar32>(cp);
    const bool is_upper = u_hasBinaryProperty(c, UCHAR_UPPERCASE);
    const bool is_lower = u_hasBinaryProperty(c, UCHAR_LOWERCASE);
    if (u_istitle(c) || (upper ? is_lower : is_upper)) return false;
    if (upper ? is_upper : is_lower) any_cased = true;
  }
  return any_cased;
}

}  // namespace

std::string PythonUpper(std::string_view s) {
  return MapCase(
      s, [](char c) { return (c >= 'a' && c <= 'z') ? static_cast<char>(c - 32) : c; },
      [](icu::UnicodeString& u) { u.toUpper(icu::Locale::getRoot()); });
}

std::string PythonLower(std::string_view s) {
  return MapCase(
      s, [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; },
      [](icu::UnicodeString& u) { u.toLower(icu::Locale::getRoot()); });
}

std::string PythonTitle(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool previous_cased = false;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    i += DecodeCodePoint(s, i, &cp);
    AppendTitleOrLower(cp, !previous_cased, &out);
    previous_cased = IsCased(cp);
  }
  return out;
}

std::string PythonCapitalize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool first = true;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    i += DecodeCodePoint(s, i, &cp);
    AppendTitleOrLower(cp, first, &out);
    first = false;
  }
  return out;
}

bool IsPythonPrintable(char32_t cp) {
  if (cp == ' ') return true;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_CONTROL_CHAR:         // Cc
    case U_FORMAT_CHAR:          // Cf
    case U_SURROGATE:            // Cs
    case U_PRIVATE_USE_CHAR:     // Co
    case U_UNASSIGNED:           // Cn
    case U_LINE_SEPARATOR:       // Zl
    case U_PARAGRAPH_SEPARATOR:  // Zp
    case U_SPACE_SEPARATOR:      // Zs
      return false;
    default:
      return true;
  }
}

bool PythonIsAlpha(std::string_view s) {
  return AllCodePoints(s, [](char32_t cp) { return u_isalpha(static_cast<UChar32>(cp)) != 0; });
}

bool PythonIsDigit(std::string_view s) {
  return AllCodePoints(s, [](char32_t cp) {
    return u_getIntPropertyValue(static_cast<UChar32>(cp), UCHAR_NUMERIC_TYPE) == U_NT_DECIMAL ||
           u_getIntPropertyValue(static_cast<UChar32>(cp), UCHAR_NUMERIC_TYPE) == U_NT_DIGIT;
  });
}

bool PythonIsAlnum(std::string_view s) {
  return AllCodePoints(s, [](char32_t cp) {
    const UChar32 c = static_cast<UChar32>(cp);
    const int32_t numeric = u_getIntPropertyValue(c, UCHAR_NUMERIC_TYPE);
    return u_isalpha(c) || numeric != U_NT_NONE;
  });
}

bool PythonIsUpper(std::string_view s) {
  return CaseTest(s, /*upper=*/true);
}

bool PythonIsLower(std::string_view s) {
  return CaseTest(s, /*upper=*/false);
}

const std::array<char32_t, 256>& ByteToCodePoint() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int CodePointToByte(char32_t cp) {
  static const std::array<int, 512> inverse = [] {
    std::array<int, 512> t;
    t.fill(-1);
    const auto& fwd = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) t[fwd[b]] = b;
    return t;
  }();
  return cp < 512 ? inverse[cp] : -1;
}

}  // namespace dropkv::unicode
