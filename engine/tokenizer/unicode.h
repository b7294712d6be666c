// UTF-8 helpers the tokenizer needs: strict validation (as Rust's str), lossy decoding (as Rust's
// String::from_utf8_lossy, which HF tokenizers' decoders use), NFC (ICU), GPT-2 byte-level map.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace dropkv::unicode {

// Length of the valid UTF-8 sequence starting at s[pos], or 0 when it is invalid/truncated.
// Rejects overlongs, surrogates and code points above U+10FFFF.
size_t ValidSequenceLength(std::string_view s, size_t pos);
// Byte offset of the first invalid sequence, or npos when `s` is valid UTF-8.
size_t FindInvalidUtf8(std::string_view s);
inline bool IsValidUtf8(std::string_view s) {
  return FindInvalidUtf8(s) == std::string_view::npos;
}

// Each maximal invalid subpart becomes one U+FFFD (Rust from_utf8_lossy / WHATWG).
std::string Utf8Lossy(std::string_view bytes);

// Decodes the valid code point at s[pos] (caller ensures validity); returns its length in bytes.
size_t DecodeCodePoint(std::string_view s, size_t pos, char32_t* cp);
void AppendCodePoint(char32_t cp, std::string* out);

// Unicode NFC through ICU. ASCII-only input is returned unchanged without calling ICU.
std::string Nfc(std::string_view s);
std::string Nfd(std::string_view s);
std::string Nfkc(std::string_view s);
std::string Nfkd(std::string_view s);

// Python str.isspace() for one code point (what Jinja's `trim` and str.strip() remove).
bool IsPythonSpace(char32_t cp);

// Python's str.upper() / str.lower(): full case mapping (ß -> SS), through ICU's root locale.
// ASCII-only input is mapped without calling ICU. `s` must be valid UTF-8.
std::string PythonUpper(std::string_view s);
std::string PythonLower(std::string_view s);
// Python's str.title() / str.capitalize() (simple title-case mapping per code point).
std::string PythonTitle(std::string_view s);
std::string PythonCapitalize(std::string_view s);
// Python str.isprintable() for one code point (what repr() leaves unescaped).
bool IsPythonPrintable(char32_t cp);
// Python str.isalpha() / isdigit() / isalnum() / isupper() / islower() for a whole string.
bool PythonIsAlpha(std::string_view s);
bool PythonIsDigit(std::string_view s);
bool PythonIsAlnum(std::string_view s);
bool PythonIsUpper(std::string_view s);
bool PythonIsLower(std::string_view s);

// GPT-2 byte-level alphabet: byte b <-> code point kByteToCodePoint[b].
const std::array<char32_t, 256>& ByteToCodePoint();
// Inverse: code point -> byte, or -1 when the code point is not in the alphabet.
int CodePointToByte(char32_t cp);

}  // namespace dropkv::unicode
