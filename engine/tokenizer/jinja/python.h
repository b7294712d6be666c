// Python's behaviour for the values of value.h, as jinja2 inherits it: str() and repr(), truth,
// ==, ordering, json.dumps (transformers' `tojson`), and the str methods templates call. Each
// function throws RenderError where Python raises.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer/jinja/value.h"

namespace dropkv::jinja::py {

// float.__repr__ (shortest round trip; '1e-05', '1e+16', '0.1', '2.0', 'inf', 'nan').
std::string FloatRepr(double f);
// str(value) appended to `out` (Undefined prints nothing).
void AppendStr(const Value& value, std::string* out);
std::string Str(const Value& value);
// repr(value) appended to `out`.
void AppendRepr(const Value& value, std::string* out);
// repr() of a str: quotes and escapes as Python chooses them.
void AppendStringRepr(std::string_view s, std::string* out);

bool Truthy(const Value& value);
// Python ==.
bool Equal(const Value& a, const Value& b);
// Python <, as -1 / 0 / 1; TypeError for unorderable types (str < int).
int Compare(const Value& a, const Value& b);
// "str", "int", "list", "dict", ... (Python's type names, for error messages).
std::string TypeName(const Value& value);

struct JsonOptions {
  bool ensure_ascii = false;                  // transformers' default (json.dumps' is True)
  std::optional<std::string> indent;          // None: one line
  std::optional<std::string> item_separator;  // default ", " (or "," with an indent)
  std::optional<std::string> key_separator;   // default ": "
  bool sort_keys = false;
};
// json.dumps(value, ...) as transformers' tojson calls it.
std::string ToJson(const Value& value, const JsonOptions& options);

// --- str methods. Positions and lengths count code points, as Python's do. ---
size_t CodePointCount(std::string_view s);
// Byte offset of every code point boundary: offsets[i] is where code point i starts; the last
// entry is s.size().
std::vector<size_t> CodePointOffsets(std::string_view s);
// strip()/lstrip()/rstrip(): the part of `s` that remains; `chars` nullopt strips whitespace.
std::string_view Strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                       bool right);
// split()/rsplit() as pieces of `s`; `sep` nullopt splits on whitespace runs. maxsplit < 0: no
// limit.
std::vector<std::string_view> Split(std::string_view s, const std::optional<std::string>& sep,
                                    int64_t maxsplit, bool from_right);
std::vector<std::string_view> SplitLines(std::string_view s, bool keepends);
std::string Replace(std::string_view s, std::string_view old_text, std::string_view new_text,
                    int64_t count);
// find()/rfind() result in code points (-1 when absent); count() of non-overlapping matches.
int64_t Find(std::string_view s, std::string_view sub, bool from_right);
int64_t Count(std::string_view s, std::string_view sub);

}  // namespace dropkv::jinja::py
