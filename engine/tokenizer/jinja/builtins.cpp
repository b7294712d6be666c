#include "engine/tokenizer/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/jinja/interpreter.h"
#include "engine/tokenizer/jinja/python.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv::jinja {
namespace {

// The sandbox's range limit (jinja2.sandbox.MAX_RANGE).
constexpr int64_t kMaxRange = 100000;

// A callable that only fails: mutating methods (the immutable sandbox refuses them) and Python
// methods this interpreter does not implement.
class FailingCallable final : public Callable {
 public:
  FailingCallable(absl::StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}
  Value Call(Interpreter&, CallArgs&) override { Fail(code_, message_); }

 private:
  absl::StatusCode code_;
  std::string message_;
};

// jinja2's joiner(): "" the first time, `separator` after that.
class JoinerCallable final : public Callable {
 public:
  explicit JoinerCallable(std::string separator) : separator_(std::move(separator)) {}
  Value Call(Interpreter&, CallArgs& args) override {
    if (!args.positional.empty() || !args.keywords.empty()) TypeError("joiner takes no arguments");
    if (!used_) {
      used_ = true;
      return Value::String("");
    }
    return Value::String(separator_);
  }

 private:
  std::string separator_;
  bool used_ = false;
};

Value MakeCallable(std::string name, BuiltinFn fn, Value self = Value::None()) {
  return Value::FromObject(std::make_shared<BuiltinCallable>(std::move(name), fn, std::move(self)));
}

Value MakeGenerator(std::vector<Value> items) {
  return Value::FromObject(std::make_shared<Generator>(std::move(items)));
}

[[noreturn]] void UndefinedError(const Value& v) {
  TypeError(v.undefined_what());
}

void NoArgs(const CallArgs& args, std::string_view function) {
  ArgReader(args, function, {});
}

std::string StrOf(const Value& v) {
  return py::Str(v);
}

// Python returns the same string when nothing is stripped; so does this (no copy).
Value StripValue(Interpreter& interp, const Value& s, const std::optional<std::string>& chars,
                 bool left, bool right) {
  const std::string_view kept = py::Strip(s.as_string(), chars, left, right);
  if (kept.size() == s.as_string().size()) return s;
  return Value::Substring(s, kept);
}

// Python's len().
int64_t Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(py::CodePointCount(v.as_string()));
    case Value::Kind::kList:
      return static_cast<int64_t>(v.as_list().items.size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.as_dict().entries.size());
    default:
      TypeError(Cat("object of type '", py::TypeName(v), "' has no len()"));
  }
}

// jinja2's make_attrgetter: "a.b.0" looks up each part with getitem (item first), integer parts
// as indexes.
Value AttrPath(Interpreter& interp, const Value& item, const Value& path) {
  if (path.is_int()) return interp.GetItem(item, path);
  if (!path.is_string()) TypeError("attribute must be a string or an integer");
  Value current = item;
  const std::string_view text = path.as_string();
  size_t start = 0;
  while (true) {
    const size_t dot = text.find('.', start);
    const std::string part(text.substr(start, dot == std::string::npos ? dot : dot - start));
    const bool is_index = !part.empty() && std::all_of(part.begin(), part.end(),
                                                       [](char c) { return c >= '0' && c <= '9'; });
    current = interp.GetItem(current, is_index && part.size() < 18
                                          ? Value::Int(std::strtoll(part.c_str(), nullptr, 10))
                                          : Value::String(part));
    if (dot == std::string::npos) return current;
    start = dot + 1;
  }
}

// The key jinja2's sort / unique / min / max compare by: lower-cased strings unless
// case_sensitive.
Value SortKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::String(unicode::PythonLower(v.as_string()));
  return v;
}

CallArgs RestArgs(const CallArgs& args, size_t skip) {
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(skip),
                         args.positional.end());
  rest.keywords = args.keywords;
  return rest;
}

// ---- filters -------------------------------------------------------------------------------

Value FilterAbs(Interpreter&, const Value& v, CallArgs& args) {
  NoArgs(args, "abs");
  if (v.is_float()) return Value::Float(std::fabs(v.as_float()));
  if (v.is_int() || v.is_bool()) {
    if (v.as_int() == INT64_MIN) Unsupported("integer overflow");
    return Value::Int(std::llabs(v.as_int()));
  }
  if (v.is_undefined()) UndefinedError(v);
  TypeError(Cat("bad operand type for abs(): '", py::TypeName(v), "'"));
}

Value FilterAttr(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "attr", {"name"});
  const std::string name = a.String(0, "");
  if (v.is_dict()) {  // attributes only, never items
    Value method;
    if (FindMethod(v, name, &method) == MethodLookup::kFound) return method;
    return Value::Undefined(Cat("'dict object' has no attribute '", name, "'"));
  }
  return interp.GetAttr(v, name);
}

Value FilterCapitalize(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "capitalize");
  return interp.MakeString(unicode::PythonCapitalize(StrOf(v)));
}

Value FilterLength(Interpreter&, const Value& v, CallArgs& args) {
  NoArgs(args, "length");
  return Value::Int(Length(v));
}

Value FilterDefault(Interpreter&, const Value& v, CallArgs& args) {
  ArgReader a(args, "default", {"default_value", "boolean"});
  static const Value kEmpty = Value::String("");
  if (v.is_undefined() || (a.Bool(1, false) && !py::Truthy(v))) return a.GetOr(0, kEmpty);
  return v;
}

Value FilterDictsort(Interpreter&, const Value& v, CallArgs& args) {
  ArgReader a(args, "dictsort", {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) TypeError("dictsort expects a mapping");
  const bool case_sensitive = a.Bool(0, false);
  const std::string by = a.String(1, "key");
  if (by != "key" && by != "value") TypeError("You can only sort by either \"key\" or \"value\"");
  std::vector<Value> pairs;
  for (const auto& [key, item] : v.as_dict().entries) {
    pairs.push_back(Value::List({Value::String(key), item}, /*is_tuple=*/true));
  }
  const size_t pos = by == "key" ? 0 : 1;
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
    return py::Compare(SortKey(x.as_list().items[pos], case_sensitive),
                       SortKey(y.as_list().items[pos], case_sensitive)) < 0;
  });
  if (a.Bool(2, false)) std::reverse(pairs.begin(), pairs.end());
  return Value::List(std::move(pairs));
}

Value FilterEscape(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "escape");
  std::string out;
  for (char c : StrOf(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return interp.MakeString(std::move(out));
}

Value FilterFirst(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "first");
  if (v.is_object()) {
    if (auto* gen = v.as_object()->AsGenerator()) {
      const Value* first = gen->TakeOne();
      if (first != nullptr) return *first;
      return Value::Undefined("No first item, sequence was empty.");
    }
  }
  if (v.is_list() && !v.as_list().items.empty()) return v.as_list().items.front();
  if (v.is_dict() && !v.as_dict().entries.empty()) {
    return Value::String(v.as_dict().entries.front().first);
  }
  if (v.is_string() && !v.as_string().empty()) return interp.GetItem(v, Value::Int(0));
  if (!v.is_undefined() && !v.is_list() && !v.is_dict() && !v.is_string()) {
    TypeError(Cat("'", py::TypeName(v), "' object is not iterable"));
  }
  return Value::Undefined("No first item, sequence was empty.");
}

Value FilterLast(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "last");
  if (v.is_list() && !v.as_list().items.empty()) return v.as_list().items.back();
  if (v.is_dict() && !v.as_dict().entries.empty()) {
    return Value::String(v.as_dict().entries.back().first);
  }
  if (v.is_string() && !v.as_string().empty()) return interp.GetItem(v, Value::Int(-1));
  if (!v.is_undefined() && !v.is_list() && !v.is_dict() && !v.is_string()) {
    TypeError(Cat("'", py::TypeName(v), "' object is not reversible"));
  }
  return Value::Undefined("No last item, sequence was empty.");
}

// Python float(str): surrounding whitespace allowed, the whole rest must be a number.
bool ParseFloat(const std::string& text, double* out) {
  const std::string s(py::Strip(text, std::nullopt, true, true));
  if (s.empty()) return false;
  std::string plain;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {  // only between digits
      if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
        return false;
      }
      continue;
    }
    plain.push_back(s[i]);
  }
  const std::string lower = unicode::PythonLower(plain);
  const std::string unsigned_part = (lower[0] == '+' || lower[0] == '-') ? lower.substr(1) : lower;
  if (unsigned_part == "inf" || unsigned_part == "infinity" || unsigned_part == "nan") {
    const double magnitude = unsigned_part == "nan" ? std::nan("") : INFINITY;
    *out = lower[0] == '-' ? -magnitude : magnitude;
    return true;
  }
  for (char c : unsigned_part) {  // strtod would also take hex floats
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.' && c != 'e' && c != '+' &&
        c != '-') {
      return false;
    }
  }
  char* end = nullptr;
  *out = std::strtod(plain.c_str(), &end);
  return end == plain.c_str() + plain.size();
}

// Python int(str, base).
bool ParseInt(const std::string& text, int64_t base, int64_t* out) {
  std::string s(py::Strip(text, std::nullopt, true, true));
  bool negative = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    negative = s[0] == '-';
    s = s.substr(1);
  }
  if (base == 16 && s.size() > 2 && (s.substr(0, 2) == "0x" || s.substr(0, 2) == "0X")) {
    s = s.substr(2);
  }
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  int64_t value = 0;
  bool last_underscore = false;
  for (char c : s) {
    if (c == '_') {
      if (last_underscore) return false;
      last_underscore = true;
      continue;
    }
    last_underscore = false;
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'a' && c <= 'z') digit = c - 'a' + 10;
    if (c >= 'A' && c <= 'Z') digit = c - 'A' + 10;
    if (digit < 0 || digit >= base) return false;
    if (__builtin_mul_overflow(value, base, &value) ||
        __builtin_add_overflow(value, digit, &value)) {
      Unsupported("integer overflow (this interpreter has 64-bit integers)");
    }
  }
  *out = negative ? -value : value;
  return true;
}

Value FilterFloat(Interpreter&, const Value& v, CallArgs& args) {
  ArgReader a(args, "float", {"default"});
  static const Value kZero = Value::Float(0.0);
  if (v.is_number()) return Value::Float(v.as_float());
  double f = 0;
  if (v.is_string() && ParseFloat(std::string(v.as_string()), &f)) return Value::Float(f);
  return a.GetOr(0, kZero);
}

Value FilterInt(Interpreter&, const Value& v, CallArgs& args) {
  ArgReader a(args, "int", {"default", "base"});
  static const Value kZero = Value::Int(0);
  const int64_t base = a.Int(1, 10);
  if (v.is_int() || v.is_bool()) return Value::Int(v.as_int());
  if (v.is_float()) {
    const double f = v.as_float();
    if (!std::isfinite(f)) return a.GetOr(0, kZero);
    if (std::fabs(f) >= 9.2e18) Unsupported("integer overflow (64-bit integers)");
    return Value::Int(static_cast<int64_t>(f));
  }
  if (v.is_string()) {
    int64_t i = 0;
    if (base >= 2 && base <= 36 && ParseInt(std::string(v.as_string()), base, &i)) {
      return Value::Int(i);
    }
    double f = 0;  // jinja2 then tries int(float(value))
    if (ParseFloat(std::string(v.as_string()), &f) && std::isfinite(f) && std::fabs(f) < 9.2e18) {
      return Value::Int(static_cast<int64_t>(f));
    }
  }
  return a.GetOr(0, kZero);
}

Value FilterIndent(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "indent", {"width", "first", "blank"});
  std::string indention;
  if (a.Get(0) != nullptr && a.Get(0)->is_string()) {
    indention = a.Get(0)->as_string();
  } else {
    indention = std::string(static_cast<size_t>(std::max<int64_t>(0, a.Int(0, 4))), ' ');
  }
  std::string s = StrOf(v) + "\n";  // jinja2 appends one so splitlines keeps a trailing blank
  const std::vector<std::string_view> lines = py::SplitLines(s, false);
  std::string out;
  if (a.Bool(2, false)) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) out += "\n" + indention;
      out += lines[i];
    }
  } else if (!lines.empty()) {
    out = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      out += "\n";
      if (!lines[i].empty()) out += indention;
      out += lines[i];
    }
  }
  if (a.Bool(1, false)) out = indention + out;
  return interp.MakeString(std::move(out));
}

Value FilterItems(Interpreter&, const Value& v, CallArgs& args) {
  NoArgs(args, "items");
  if (v.is_undefined()) return MakeGenerator({});
  if (!v.is_dict()) TypeError("Can only get item pairs from a mapping.");
  std::vector<Value> pairs;
  for (const auto& [key, item] : v.as_dict().entries) {
    pairs.push_back(Value::List({Value::String(key), item}, /*is_tuple=*/true));
  }
  return MakeGenerator(std::move(pairs));
}

Value FilterJoin(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "join", {"d", "attribute"});
  const std::string separator = a.Get(0) != nullptr ? StrOf(*a.Get(0)) : "";
  std::string out;
  bool first = true;
  for (const Value& item : interp.Iterate(v)) {
    if (!first) out += separator;
    first = false;
    py::AppendStr(a.Get(1) != nullptr ? AttrPath(interp, item, *a.Get(1)) : item, &out);
  }
  return interp.MakeString(std::move(out));
}

Value FilterList(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "list");
  return Value::List(interp.Iterate(v));
}

Value FilterLower(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "lower");
  return interp.MakeString(unicode::PythonLower(StrOf(v)));
}

Value FilterUpper(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "upper");
  return interp.MakeString(unicode::PythonUpper(StrOf(v)));
}

Value FilterMap(Interpreter& interp, const Value& v, CallArgs& args) {
  std::vector<Value> out;
  if (args.positional.empty()) {
    const Value* attribute = nullptr;
    Value fallback = Value::None();
    bool has_default = false;
    for (const auto& [key, value] : args.keywords) {
      if (key == "attribute") {
        attribute = &value;
      } else if (key == "default") {
        fallback = value;
        has_default = true;
      } else {
        TypeError(Cat("Unexpected keyword argument '", key, "'"));
      }
    }
    if (attribute == nullptr) TypeError("map requires a filter argument");
    for (const Value& item : interp.Iterate(v)) {
      Value mapped = AttrPath(interp, item, *attribute);
      out.push_back(has_default && mapped.is_undefined() ? fallback : std::move(mapped));
    }
    return MakeGenerator(std::move(out));
  }
  if (!args.positional[0].is_string()) TypeError("map: the filter name must be a string");
  const std::string name(args.positional[0].as_string());
  CallArgs rest = RestArgs(args, 1);
  for (const Value& item : interp.Iterate(v)) {
    interp.Tick();
    CallArgs call = rest;
    out.push_back(interp.ApplyFilter(name, item, call));
  }
  return MakeGenerator(std::move(out));
}

// select / reject (by_attribute false) and selectattr / rejectattr.
Value SelectOrReject(Interpreter& interp, const Value& v, CallArgs& args, bool by_attribute,
                     bool keep_when) {
  size_t next = 0;
  const Value* attribute = nullptr;
  if (by_attribute) {
    if (args.positional.empty()) TypeError("selectattr / rejectattr need an attribute");
    attribute = &args.positional[next++];
  }
  std::optional<std::string> test;
  if (next < args.positional.size()) {
    if (!args.positional[next].is_string()) TypeError("the test name must be a string");
    test = args.positional[next++].as_string();
  }
  CallArgs rest = RestArgs(args, next);
  std::vector<Value> out;
  for (const Value& item : interp.Iterate(v)) {
    interp.Tick();
    const Value subject = attribute != nullptr ? AttrPath(interp, item, *attribute) : item;
    bool passes = false;
    if (test) {
      CallArgs call = rest;
      passes = interp.ApplyTest(*test, subject, call);
    } else {
      passes = py::Truthy(subject);
    }
    if (passes == keep_when) out.push_back(item);
  }
  return MakeGenerator(std::move(out));
}

Value FilterSelect(Interpreter& interp, const Value& v, CallArgs& args) {
  return SelectOrReject(interp, v, args, false, true);
}
Value FilterReject(Interpreter& interp, const Value& v, CallArgs& args) {
  return SelectOrReject(interp, v, args, false, false);
}
Value FilterSelectattr(Interpreter& interp, const Value& v, CallArgs& args) {
  return SelectOrReject(interp, v, args, true, true);
}
Value FilterRejectattr(Interpreter& interp, const Value& v, CallArgs& args) {
  return SelectOrReject(interp, v, args, true, false);
}

Value MinOrMax(Interpreter& interp, const Value& v, CallArgs& args, bool want_max) {
  ArgReader a(args, want_max ? "max" : "min", {"case_sensitive", "attribute"});
  const bool case_sensitive = a.Bool(0, false);
  const std::vector<Value> items = interp.Iterate(v);
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  const auto key = [&](const Value& item) {
    return SortKey(a.Get(1) != nullptr ? AttrPath(interp, item, *a.Get(1)) : item, case_sensitive);
  };
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    const int c = py::Compare(k, best_key);
    if (want_max ? c > 0 : c < 0) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

Value FilterMax(Interpreter& interp, const Value& v, CallArgs& args) {
  return MinOrMax(interp, v, args, true);
}
Value FilterMin(Interpreter& interp, const Value& v, CallArgs& args) {
  return MinOrMax(interp, v, args, false);
}

Value FilterReplace(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "replace", {"old", "new", "count"});
  if (a.Get(0) == nullptr || a.Get(1) == nullptr) TypeError("replace() needs old and new");
  const int64_t count = a.Get(2) == nullptr || a.Get(2)->is_none() ? -1 : a.Int(2, -1);
  return interp.MakeString(py::Replace(StrOf(v), StrOf(*a.Get(0)), StrOf(*a.Get(1)), count));
}

Value FilterReverse(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "reverse");
  if (v.is_string()) {
    const std::string_view s = v.as_string();
    const std::vector<size_t> offsets = py::CodePointOffsets(s);
    std::string out;
    for (size_t i = offsets.size() - 1; i > 0; --i) {
      out.append(s, offsets[i - 1], offsets[i] - offsets[i - 1]);
    }
    return interp.MakeString(std::move(out));
  }
  if (v.is_object() && v.as_object()->AsGenerator() != nullptr) {
    std::vector<Value> items = interp.Iterate(v);  // list(value).reverse(): a list
    std::reverse(items.begin(), items.end());
    return Value::List(std::move(items));
  }
  std::vector<Value> items = interp.Iterate(v);  // reversed(value): an iterator
  std::reverse(items.begin(), items.end());
  return MakeGenerator(std::move(items));
}

Value FilterRound(Interpreter&, const Value& v, CallArgs& args) {
  ArgReader a(args, "round", {"precision", "method"});
  const int64_t precision = a.Int(0, 0);
  const std::string method = a.String(1, "common");
  if (method != "common" && method != "ceil" && method != "floor") {
    TypeError("method must be common, ceil or floor");
  }
  if (!v.is_number()) TypeError(Cat("type ", py::TypeName(v), " doesn't define __round__"));
  if (method == "common" && !v.is_float()) return Value::Int(v.as_int());  // round(int, n) is int
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_float() * scale;
  double r = 0;
  if (method == "ceil") {
    r = std::ceil(x);
  } else if (method == "floor") {
    r = std::floor(x);
  } else {
    r = std::nearbyint(x);  // round half to even, as Python's round()
  }
  return Value::Float(r / scale);
}

Value FilterSafe(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "safe");
  return v.is_string() ? v : interp.MakeString(StrOf(v));
}

Value FilterSort(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "sort", {"reverse", "case_sensitive", "attribute"});
  const bool reverse = a.Bool(0, false);
  const bool case_sensitive = a.Bool(1, false);
  std::vector<Value> items = interp.Iterate(v);
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const Value& item : items) {
    keys.push_back(
        SortKey(a.Get(2) != nullptr ? AttrPath(interp, item, *a.Get(2)) : item, case_sensitive));
  }
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  interp.Tick(static_cast<int64_t>(items.size()));
  // Python's sort is stable also when reversed (equal items keep their order).
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    const int c = py::Compare(keys[x], keys[y]);
    return reverse ? c > 0 : c < 0;
  });
  std::vector<Value> sorted;
  for (size_t i : order) sorted.push_back(items[i]);
  return Value::List(std::move(sorted));
}

Value FilterString(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "string");
  return v.is_string() ? v : interp.MakeString(StrOf(v));
}

Value FilterSum(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "sum", {"attribute", "start"});
  static const Value kZero = Value::Int(0);
  Value total = a.GetOr(1, kZero);
  for (const Value& item : interp.Iterate(v)) {
    const Value x = a.Get(0) != nullptr ? AttrPath(interp, item, *a.Get(0)) : item;
    if (!x.is_number() || !total.is_number()) {
      TypeError(Cat("unsupported operand type(s) for +: '", py::TypeName(total), "' and '",
                    py::TypeName(x), "'"));
    }
    if (x.is_float() || total.is_float()) {
      total = Value::Float(total.as_float() + x.as_float());
    } else {
      int64_t r = 0;
      if (__builtin_add_overflow(total.as_int(), x.as_int(), &r)) Unsupported("integer overflow");
      total = Value::Int(r);
    }
  }
  return total;
}

Value FilterTitle(Interpreter& interp, const Value& v, CallArgs& args) {
  NoArgs(args, "title");
  return interp.MakeString(unicode::PythonTitle(StrOf(v)));
}

Value FilterTrim(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "trim", {"chars"});
  std::optional<std::string> chars;
  if (a.Get(0) != nullptr && !a.Get(0)->is_none()) chars = a.String(0, "");
  if (v.is_string()) return StripValue(interp, v, chars, true, true);
  return interp.MakeString(std::string(py::Strip(StrOf(v), chars, true, true)));
}

Value FilterUnique(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "unique", {"case_sensitive", "attribute"});
  const bool case_sensitive = a.Bool(0, false);
  std::vector<Value> seen, out;
  for (const Value& item : interp.Iterate(v)) {
    interp.Tick(static_cast<int64_t>(seen.size() / 16));
    Value key =
        SortKey(a.Get(1) != nullptr ? AttrPath(interp, item, *a.Get(1)) : item, case_sensitive);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return py::Equal(s, key); })) {
      continue;
    }
    seen.push_back(std::move(key));
    out.push_back(item);
  }
  return MakeGenerator(std::move(out));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False), returned as a plain string (jinja2's own would HTML-escape).
Value FilterToJson(Interpreter& interp, const Value& v, CallArgs& args) {
  ArgReader a(args, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  py::JsonOptions options;
  options.ensure_ascii = a.Bool(0, false);
  if (const Value* indent = a.Get(1); indent != nullptr && !indent->is_none()) {
    if (indent->is_string()) {
      options.indent = indent->as_string();
    } else if (indent->is_int() || indent->is_bool()) {
      options.indent =
          std::string(static_cast<size_t>(std::clamp<int64_t>(indent->as_int(), 0, 64)), ' ');
    } else {
      TypeError("tojson: indent must be an int or a string");
    }
  }
  if (const Value* separators = a.Get(2); separators != nullptr && !separators->is_none()) {
    if (!separators->is_list() || separators->as_list().items.size() != 2 ||
        !separators->as_list().items[0].is_string() ||
        !separators->as_list().items[1].is_string()) {
      TypeError("tojson: separators must be a pair of strings");
    }
    options.item_separator = separators->as_list().items[0].as_string();
    options.key_separator = separators->as_list().items[1].as_string();
  }
  options.sort_keys = a.Bool(3, false);
  return interp.MakeString(py::ToJson(v, options));
}

// ---- tests ---------------------------------------------------------------------------------

Value TestDefined(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(!v.is_undefined());
}
Value TestUndefined(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_undefined());
}
Value TestNone(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_none());
}
Value TestBoolean(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_bool());
}
Value TestTrue(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_bool() && v.as_bool());
}
Value TestFalse(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_bool() && !v.as_bool());
}
Value TestInteger(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_int());
}
Value TestFloat(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_float());
}
Value TestNumber(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_number());
}
Value TestString(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_string());
}
Value TestMapping(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_dict());
}
Value TestIterable(Interpreter&, const Value& v, CallArgs&) {
  if (v.is_object()) return Value::Bool(v.as_object()->AsGenerator() != nullptr);
  return Value::Bool(v.is_undefined() || v.is_string() || v.is_list() || v.is_dict());
}
Value TestSequence(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_undefined() || v.is_string() || v.is_list() || v.is_dict());
}
Value TestCallable(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_object() && v.as_object()->AsCallable() != nullptr);
}
Value TestEscaped(Interpreter&, const Value&, CallArgs&) {
  return Value::Bool(false);
}
Value TestLower(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(unicode::PythonIsLower(StrOf(v)));
}
Value TestUpper(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(unicode::PythonIsUpper(StrOf(v)));
}

const Value& OneArg(const CallArgs& args, std::string_view test) {
  if (args.positional.size() != 1 || !args.keywords.empty()) {
    TypeError(Cat("test '", test, "' takes one argument"));
  }
  return args.positional[0];
}

int64_t IntModulo(const Value& v, int64_t divisor) {
  if (!v.is_int() && !v.is_bool()) {
    TypeError(Cat("unsupported operand type(s) for %: '", py::TypeName(v), "' and 'int'"));
  }
  if (divisor == 0) TypeError("integer division or modulo by zero");
  const int64_t m = v.as_int() % divisor;
  return (m != 0 && ((m < 0) != (divisor < 0))) ? m + divisor : m;
}

Value TestOdd(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(IntModulo(v, 2) == 1);
}
Value TestEven(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(IntModulo(v, 2) == 0);
}
Value TestDivisibleBy(Interpreter&, const Value& v, CallArgs& args) {
  const Value& n = OneArg(args, "divisibleby");
  if (!n.is_int() && !n.is_bool()) TypeError("divisibleby needs an integer");
  return Value::Bool(IntModulo(v, n.as_int()) == 0);
}
Value TestEq(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(py::Equal(v, OneArg(args, "eq")));
}
Value TestNe(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(!py::Equal(v, OneArg(args, "ne")));
}
int CompareDefined(const Value& a, const Value& b) {
  if (a.is_undefined()) UndefinedError(a);
  if (b.is_undefined()) UndefinedError(b);
  return py::Compare(a, b);
}
Value TestLt(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(CompareDefined(v, OneArg(args, "lt")) < 0);
}
Value TestLe(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(CompareDefined(v, OneArg(args, "le")) <= 0);
}
Value TestGt(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(CompareDefined(v, OneArg(args, "gt")) > 0);
}
Value TestGe(Interpreter&, const Value& v, CallArgs& args) {
  return Value::Bool(CompareDefined(v, OneArg(args, "ge")) >= 0);
}
Value TestIn(Interpreter& interp, const Value& v, CallArgs& args) {
  const Value& seq = OneArg(args, "in");
  if (seq.is_string()) {
    if (!v.is_string()) TypeError("'in <string>' requires string as left operand");
    return Value::Bool(seq.as_string().find(v.as_string()) != std::string::npos);
  }
  if (seq.is_dict()) return Value::Bool(v.is_string() && seq.as_dict().Find(v.as_string()));
  for (const Value& item : interp.Iterate(seq)) {
    if (py::Equal(item, v)) return Value::Bool(true);
  }
  return Value::Bool(false);
}
Value TestSameAs(Interpreter&, const Value& v, CallArgs& args) {
  const Value& other = OneArg(args, "sameas");
  if (v.kind() != other.kind()) return Value::Bool(false);
  switch (v.kind()) {
    case Value::Kind::kNone:
    case Value::Kind::kUndefined:
      return Value::Bool(v.is_none());  // None is a singleton; each Undefined is its own object
    case Value::Kind::kBool:
      return Value::Bool(v.as_bool() == other.as_bool());
    case Value::Kind::kObject:
      return Value::Bool(v.as_object() == other.as_object());
    case Value::Kind::kList:
      return Value::Bool(&v.as_list() == &other.as_list());
    case Value::Kind::kDict:
      return Value::Bool(&v.as_dict() == &other.as_dict());
    default:
      Unsupported("'sameas' on numbers and strings depends on Python's object caching");
  }
}
Value TestFilter(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_string() && FindFilter(v.as_string()) != nullptr);
}
Value TestTest(Interpreter&, const Value& v, CallArgs&) {
  return Value::Bool(v.is_string() && FindTest(v.as_string()) != nullptr);
}

// ---- str / list / dict methods ---------------------------------------------------------------

std::string_view Self(const Value& self) {
  return self.as_string();
}

// Python's optional [start, end] of find / count / startswith, as a substring and the code
// points before it.
std::string_view SubRange(std::string_view s, const ArgReader& a, size_t start_index,
                          int64_t* offset_cp) {
  const std::vector<size_t> offsets = py::CodePointOffsets(s);
  const auto n = static_cast<int64_t>(offsets.size()) - 1;
  const auto clamp = [&](const Value* arg, int64_t fallback) {
    if (arg == nullptr || arg->is_none()) return fallback;
    if (!arg->is_int() && !arg->is_bool()) TypeError("slice indices must be integers or None");
    int64_t v = arg->as_int();
    if (v < 0) v = std::max<int64_t>(0, v + n);
    return std::min(v, n);
  };
  const int64_t start = clamp(a.Get(start_index), 0);
  const int64_t end = clamp(a.Get(start_index + 1), n);
  *offset_cp = start;
  if (start > end) return std::string_view();
  return std::string_view(s).substr(
      offsets[static_cast<size_t>(start)],
      offsets[static_cast<size_t>(end)] - offsets[static_cast<size_t>(start)]);
}

Value AffixTest(const Value& self, CallArgs& args, bool prefix) {
  ArgReader a(args, prefix ? "startswith" : "endswith", {"prefix", "start", "end"});
  if (a.Get(0) == nullptr) TypeError("startswith / endswith need an argument");
  int64_t unused = 0;
  std::string_view range = SubRange(Self(self), a, 1, &unused);
  if (a.Get(1) != nullptr && !a.Get(1)->is_none() &&
      static_cast<int64_t>(py::CodePointCount(Self(self))) < a.Get(1)->as_int()) {
    return Value::Bool(false);
  }
  std::vector<Value> candidates;
  if (a.Get(0)->is_string()) {
    candidates.push_back(*a.Get(0));
  } else if (a.Get(0)->is_list() && a.Get(0)->as_list().is_tuple) {
    candidates = a.Get(0)->as_list().items;
  } else {
    TypeError(Cat(prefix ? "startswith" : "endswith",
                  " first arg must be str or a tuple of str, not ", py::TypeName(*a.Get(0))));
  }
  for (const Value& c : candidates) {
    if (!c.is_string()) TypeError("a tuple for startswith must only contain str");
    const std::string_view affix = c.as_string();
    if (affix.size() > range.size()) continue;
    if (prefix ? range.substr(0, affix.size()) == affix
               : range.substr(range.size() - affix.size()) == affix) {
      return Value::Bool(true);
    }
  }
  return Value::Bool(false);
}

Value StrStartswith(Interpreter&, const Value& self, CallArgs& args) {
  return AffixTest(self, args, true);
}
Value StrEndswith(Interpreter&, const Value& self, CallArgs& args) {
  return AffixTest(self, args, false);
}

std::optional<std::string> OptionalChars(const ArgReader& a, size_t index) {
  if (a.Get(index) == nullptr || a.Get(index)->is_none()) return std::nullopt;
  return a.String(index, "");
}

Value StrStrip(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "strip", {"chars"});
  return StripValue(interp, self, OptionalChars(a, 0), true, true);
}
Value StrLstrip(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "lstrip", {"chars"});
  return StripValue(interp, self, OptionalChars(a, 0), true, false);
}
Value StrRstrip(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "rstrip", {"chars"});
  return StripValue(interp, self, OptionalChars(a, 0), false, true);
}

Value SplitImpl(Interpreter& interp, const Value& self, CallArgs& args, bool from_right) {
  ArgReader a(args, from_right ? "rsplit" : "split", {"sep", "maxsplit"});
  const std::vector<std::string_view> pieces =
      py::Split(Self(self), OptionalChars(a, 0), a.Int(1, -1), from_right);
  std::vector<Value> parts;
  parts.reserve(pieces.size());
  for (std::string_view piece : pieces) parts.push_back(Value::Substring(self, piece));
  interp.Tick(static_cast<int64_t>(parts.size()));
  return Value::List(std::move(parts));
}
Value StrSplit(Interpreter& interp, const Value& self, CallArgs& args) {
  return SplitImpl(interp, self, args, false);
}
Value StrRsplit(Interpreter& interp, const Value& self, CallArgs& args) {
  return SplitImpl(interp, self, args, true);
}

Value StrSplitlines(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "splitlines", {"keepends"});
  std::vector<Value> lines;
  for (std::string_view line : py::SplitLines(Self(self), a.Bool(0, false))) {
    lines.push_back(Value::Substring(self, line));
  }
  interp.Tick(static_cast<int64_t>(lines.size()));
  return Value::List(std::move(lines));
}

Value StrUpper(Interpreter& interp, const Value& self, CallArgs& args) {
  NoArgs(args, "upper");
  return interp.MakeString(unicode::PythonUpper(Self(self)));
}
Value StrLower(Interpreter& interp, const Value& self, CallArgs& args) {
  NoArgs(args, "lower");
  return interp.MakeString(unicode::PythonLower(Self(self)));
}
Value StrTitle(Interpreter& interp, const Value& self, CallArgs& args) {
  NoArgs(args, "title");
  return interp.MakeString(unicode::PythonTitle(Self(self)));
}
Value StrCapitalize(Interpreter& interp, const Value& self, CallArgs& args) {
  NoArgs(args, "capitalize");
  return interp.MakeString(unicode::PythonCapitalize(Self(self)));
}

Value StrReplace(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "replace", {"old", "new", "count"});
  if (a.Get(0) == nullptr || a.Get(1) == nullptr) TypeError("replace() needs old and new");
  return interp.MakeString(py::Replace(Self(self), a.String(0, ""), a.String(1, ""), a.Int(2, -1)));
}

Value FindImpl(const Value& self, CallArgs& args, bool from_right, bool raise) {
  ArgReader a(args, from_right ? (raise ? "rindex" : "rfind") : (raise ? "index" : "find"),
              {"sub", "start", "end"});
  int64_t offset = 0;
  const std::string_view range = SubRange(Self(self), a, 1, &offset);
  const int64_t found = py::Find(range, a.String(0, ""), from_right);
  if (found < 0 && raise) TypeError("substring not found");
  return Value::Int(found < 0 ? -1 : found + offset);
}
Value StrFind(Interpreter&, const Value& self, CallArgs& args) {
  return FindImpl(self, args, false, false);
}
Value StrRfind(Interpreter&, const Value& self, CallArgs& args) {
  return FindImpl(self, args, true, false);
}
Value StrIndex(Interpreter&, const Value& self, CallArgs& args) {
  return FindImpl(self, args, false, true);
}
Value StrRindex(Interpreter&, const Value& self, CallArgs& args) {
  return FindImpl(self, args, true, true);
}

Value StrCount(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "count", {"sub", "start", "end"});
  int64_t offset = 0;
  return Value::Int(py::Count(SubRange(Self(self), a, 1, &offset), a.String(0, "")));
}

Value StrJoin(Interpreter& interp, const Value& self, CallArgs& args) {
  ArgReader a(args, "join", {"iterable"});
  if (a.Get(0) == nullptr) TypeError("join() takes exactly one argument");
  std::string out;
  bool first = true;
  for (const Value& item : interp.Iterate(*a.Get(0))) {
    if (!item.is_string()) {
      TypeError(Cat("sequence item: expected str instance, ", py::TypeName(item), " found"));
    }
    if (!first) out += Self(self);
    first = false;
    out += item.as_string();
  }
  return interp.MakeString(std::move(out));
}

Value Partition(Interpreter&, const Value& self, CallArgs& args, bool from_right) {
  ArgReader a(args, from_right ? "rpartition" : "partition", {"sep"});
  const std::string sep = a.String(0, "");
  if (sep.empty()) TypeError("empty separator");
  const std::string_view s = Self(self);
  const size_t hit = from_right ? s.rfind(sep) : s.find(sep);
  if (hit == std::string::npos) {
    return from_right ? Value::List({Value::String(""), Value::String(""), self}, true)
                      : Value::List({self, Value::String(""), Value::String("")}, true);
  }
  return Value::List({Value::Substring(self, s.substr(0, hit)), Value::String(sep),
                      Value::Substring(self, s.substr(hit + sep.size()))},
                     true);
}
Value StrPartition(Interpreter& interp, const Value& self, CallArgs& args) {
  return Partition(interp, self, args, false);
}
Value StrRpartition(Interpreter& interp, const Value& self, CallArgs& args) {
  return Partition(interp, self, args, true);
}

Value StrRemoveprefix(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "removeprefix", {"prefix"});
  const std::string prefix = a.String(0, "");
  const std::string_view s = Self(self);
  return s.substr(0, prefix.size()) == prefix ? Value::Substring(self, s.substr(prefix.size()))
                                              : self;
}
Value StrRemovesuffix(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "removesuffix", {"suffix"});
  const std::string suffix = a.String(0, "");
  const std::string_view s = Self(self);
  if (suffix.empty() || suffix.size() > s.size() || s.substr(s.size() - suffix.size()) != suffix) {
    return self;
  }
  return Value::Substring(self, s.substr(0, s.size() - suffix.size()));
}

Value Justify(Interpreter& interp, const Value& self, CallArgs& args, int where) {
  ArgReader a(args, where < 0 ? "ljust" : (where > 0 ? "rjust" : "center"), {"width", "fillchar"});
  const int64_t width = a.Int(0, 0);
  const std::string fill = a.String(1, " ");
  if (py::CodePointCount(fill) != 1)
    TypeError("The fill character must be exactly one character long");
  const std::string_view s = Self(self);
  const int64_t margin = width - static_cast<int64_t>(py::CodePointCount(s));
  if (margin <= 0) return self;
  if (margin > (1 << 20)) Fail(absl::StatusCode::kResourceExhausted, "justify width too large");
  int64_t left = 0;
  if (where > 0) left = margin;
  if (where == 0) left = margin / 2 + (margin & width & 1);  // CPython's centering
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = left; i < margin; ++i) out += fill;
  return interp.MakeString(std::move(out));
}

Value StrLjust(Interpreter& interp, const Value& self, CallArgs& args) {
  return Justify(interp, self, args, -1);
}
Value StrRjust(Interpreter& interp, const Value& self, CallArgs& args) {
  return Justify(interp, self, args, 1);
}
Value StrCenter(Interpreter& interp, const Value& self, CallArgs& args) {
  return Justify(interp, self, args, 0);
}

template <bool (*Predicate)(std::string_view)>
Value StrIs(Interpreter&, const Value& self, CallArgs& args) {
  NoArgs(args, "is...");
  return Value::Bool(Predicate(Self(self)));
}

bool IsSpaceString(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    i += unicode::DecodeCodePoint(s, i, &cp);
    if (!unicode::IsPythonSpace(cp)) return false;
  }
  return true;
}

Value ListCount(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "count", {"value"});
  if (a.Get(0) == nullptr) TypeError("count() takes exactly one argument");
  int64_t n = 0;
  for (const Value& item : self.as_list().items) n += py::Equal(item, *a.Get(0));
  return Value::Int(n);
}

Value ListIndex(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "index", {"value"});
  if (a.Get(0) == nullptr) TypeError("index() takes exactly one argument");
  const auto& items = self.as_list().items;
  for (size_t i = 0; i < items.size(); ++i) {
    if (py::Equal(items[i], *a.Get(0))) return Value::Int(static_cast<int64_t>(i));
  }
  TypeError("list.index(x): x not in list");
}

Value Copy(Interpreter&, const Value& self, CallArgs& args) {
  NoArgs(args, "copy");
  return self;  // values are immutable: a copy is the same value
}

Value DictGet(Interpreter&, const Value& self, CallArgs& args) {
  ArgReader a(args, "get", {"key", "default"});
  if (a.Get(0) == nullptr) TypeError("get expected at least 1 argument, got 0");
  static const Value kNone = Value::None();
  if (a.Get(0)->is_string()) {
    if (const Value* v = self.as_dict().Find(a.Get(0)->as_string())) return *v;
  }
  return a.GetOr(1, kNone);
}

// dict.items() / keys() / values(): views in Python; lists here (iterable, reusable, len()).
Value DictItems(Interpreter&, const Value& self, CallArgs& args) {
  NoArgs(args, "items");
  std::vector<Value> pairs;
  for (const auto& [key, item] : self.as_dict().entries) {
    pairs.push_back(Value::List({Value::String(key), item}, /*is_tuple=*/true));
  }
  return Value::List(std::move(pairs));
}
Value DictKeys(Interpreter&, const Value& self, CallArgs& args) {
  NoArgs(args, "keys");
  std::vector<Value> keys;
  for (const auto& entry : self.as_dict().entries) keys.push_back(Value::String(entry.first));
  return Value::List(std::move(keys));
}
Value DictValues(Interpreter&, const Value& self, CallArgs& args) {
  NoArgs(args, "values");
  std::vector<Value> values;
  for (const auto& entry : self.as_dict().entries) values.push_back(entry.second);
  return Value::List(std::move(values));
}

// ---- globals -------------------------------------------------------------------------------

Value GlobalRange(Interpreter&, const Value&, CallArgs& args) {
  if (!args.keywords.empty()) TypeError("range() takes no keyword arguments");
  if (args.positional.empty() || args.positional.size() > 3) {
    TypeError("range expected 1 to 3 arguments");
  }
  int64_t bounds[3] = {0, 0, 1};
  for (size_t i = 0; i < args.positional.size(); ++i) {
    const Value& v = args.positional[i];
    if (!v.is_int() && !v.is_bool()) {
      TypeError(Cat("'", py::TypeName(v), "' object cannot be interpreted as an integer"));
    }
  }
  if (args.positional.size() == 1) {
    bounds[1] = args.positional[0].as_int();
  } else {
    bounds[0] = args.positional[0].as_int();
    bounds[1] = args.positional[1].as_int();
    if (args.positional.size() == 3) bounds[2] = args.positional[2].as_int();
  }
  const int64_t start = bounds[0], stop = bounds[1], step = bounds[2];
  if (step == 0) TypeError("range() arg 3 must not be zero");
  // Length without overflow: count in floating point first, then exactly.
  const long double span =
      step > 0 ? static_cast<long double>(stop) - start : static_cast<long double>(start) - stop;
  const long double count =
      span <= 0 ? 0 : std::ceil(span / std::fabs(static_cast<long double>(step)));
  if (count > kMaxRange) {
    Fail(absl::StatusCode::kInvalidArgument,
         "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  }
  std::vector<Value> items;
  for (int64_t i = 0; i < static_cast<int64_t>(count); ++i)
    items.push_back(Value::Int(start + i * step));
  return Value::List(std::move(items));
}

Value GlobalDict(Interpreter&, const Value&, CallArgs& args) {
  DictData dict;
  if (args.positional.size() > 1) TypeError("dict expected at most 1 argument");
  if (!args.positional.empty()) {
    const Value& init = args.positional[0];
    if (!init.is_dict()) Unsupported("dict() from a non-mapping is not supported");
    dict = init.as_dict();
  }
  for (const auto& [key, value] : args.keywords) dict.Set(key, value);
  return Value::Dict(std::move(dict));
}

Value GlobalNamespace(Interpreter&, const Value&, CallArgs& args) {
  auto ns = std::make_shared<Namespace>();
  if (args.positional.size() > 1) TypeError("namespace expected at most 1 positional argument");
  if (!args.positional.empty()) {
    if (!args.positional[0].is_dict()) TypeError("namespace(): the argument must be a mapping");
    for (const auto& [key, value] : args.positional[0].as_dict().entries) ns->attrs.Set(key, value);
  }
  for (const auto& [key, value] : args.keywords) ns->attrs.Set(key, value);
  return Value::FromObject(std::move(ns));
}

Value GlobalJoiner(Interpreter&, const Value&, CallArgs& args) {
  ArgReader a(args, "joiner", {"sep"});
  return Value::FromObject(std::make_shared<JoinerCallable>(a.String(0, ", ")));
}

// transformers: raise jinja2.exceptions.TemplateError(message).
Value GlobalRaiseException(Interpreter&, const Value&, CallArgs& args) {
  ArgReader a(args, "raise_exception", {"message"});
  Fail(absl::StatusCode::kInvalidArgument, a.Get(0) != nullptr ? StrOf(*a.Get(0)) : "");
}

// transformers: datetime.now().strftime(format).
Value GlobalStrftimeNow(Interpreter& interp, const Value&, CallArgs& args) {
  ArgReader a(args, "strftime_now", {"format"});
  const std::string format = a.String(0, "");
  const std::tm now = interp.LocalTime();
  if (format.empty()) return Value::String("");
  std::string buffer(format.size() * 4 + 64, '\0');
  for (int attempt = 0; attempt < 4; ++attempt) {
    const size_t n = std::strftime(buffer.data(), buffer.size(), format.c_str(), &now);
    if (n > 0) return interp.MakeString(buffer.substr(0, n));
    buffer.resize(buffer.size() * 4);
  }
  return Value::String("");  // strftime wrote nothing (a format like "%p" in some locales)
}

// ---- tables --------------------------------------------------------------------------------

struct NamedFn {
  std::string_view name;
  BuiltinFn fn;
};

constexpr NamedFn kFilters[] = {
    {"abs", &FilterAbs},
    {"attr", &FilterAttr},
    {"capitalize", &FilterCapitalize},
    {"count", &FilterLength},
    {"d", &FilterDefault},
    {"default", &FilterDefault},
    {"dictsort", &FilterDictsort},
    {"e", &FilterEscape},
    {"escape", &FilterEscape},
    {"first", &FilterFirst},
    {"float", &FilterFloat},
    {"forceescape", &FilterEscape},
    {"indent", &FilterIndent},
    {"int", &FilterInt},
    {"items", &FilterItems},
    {"join", &FilterJoin},
    {"last", &FilterLast},
    {"length", &FilterLength},
    {"list", &FilterList},
    {"lower", &FilterLower},
    {"map", &FilterMap},
    {"max", &FilterMax},
    {"min", &FilterMin},
    {"reject", &FilterReject},
    {"rejectattr", &FilterRejectattr},
    {"replace", &FilterReplace},
    {"reverse", &FilterReverse},
    {"round", &FilterRound},
    {"safe", &FilterSafe},
    {"select", &FilterSelect},
    {"selectattr", &FilterSelectattr},
    {"sort", &FilterSort},
    {"string", &FilterString},
    {"sum", &FilterSum},
    {"title", &FilterTitle},
    {"tojson", &FilterToJson},
    {"trim", &FilterTrim},
    {"unique", &FilterUnique},
    {"upper", &FilterUpper},
};

constexpr NamedFn kTests[] = {
    {"!=", &TestNe},
    {"<", &TestLt},
    {"<=", &TestLe},
    {"==", &TestEq},
    {">", &TestGt},
    {">=", &TestGe},
    {"boolean", &TestBoolean},
    {"callable", &TestCallable},
    {"defined", &TestDefined},
    {"divisibleby", &TestDivisibleBy},
    {"eq", &TestEq},
    {"equalto", &TestEq},
    {"escaped", &TestEscaped},
    {"even", &TestEven},
    {"false", &TestFalse},
    {"filter", &TestFilter},
    {"float", &TestFloat},
    {"ge", &TestGe},
    {"greaterthan", &TestGt},
    {"gt", &TestGt},
    {"in", &TestIn},
    {"integer", &TestInteger},
    {"iterable", &TestIterable},
    {"le", &TestLe},
    {"lessthan", &TestLt},
    {"lower", &TestLower},
    {"lt", &TestLt},
    {"mapping", &TestMapping},
    {"ne", &TestNe},
    {"none", &TestNone},
    {"number", &TestNumber},
    {"odd", &TestOdd},
    {"sameas", &TestSameAs},
    {"sequence", &TestSequence},
    {"string", &TestString},
    {"test", &TestTest},
    {"true", &TestTrue},
    {"undefined", &TestUndefined},
    {"upper", &TestUpper},
};

constexpr NamedFn kStrMethods[] = {
    {"capitalize", &StrCapitalize},
    {"casefold", &StrLower},
    {"center", &StrCenter},
    {"count", &StrCount},
    {"endswith", &StrEndswith},
    {"find", &StrFind},
    {"index", &StrIndex},
    {"isalnum", &StrIs<unicode::PythonIsAlnum>},
    {"isalpha", &StrIs<unicode::PythonIsAlpha>},
    {"isdecimal", &StrIs<unicode::PythonIsDigit>},
    {"isdigit", &StrIs<unicode::PythonIsDigit>},
    {"islower", &StrIs<unicode::PythonIsLower>},
    {"isnumeric", &StrIs<unicode::PythonIsDigit>},
    {"isspace", &StrIs<IsSpaceString>},
    {"isupper", &StrIs<unicode::PythonIsUpper>},
    {"join", &StrJoin},
    {"ljust", &StrLjust},
    {"lower", &StrLower},
    {"lstrip", &StrLstrip},
    {"partition", &StrPartition},
    {"removeprefix", &StrRemoveprefix},
    {"removesuffix", &StrRemovesuffix},
    {"replace", &StrReplace},
    {"rfind", &StrRfind},
    {"rindex", &StrRindex},
    {"rjust", &StrRjust},
    {"rpartition", &StrRpartition},
    {"rsplit", &StrRsplit},
    {"rstrip", &StrRstrip},
    {"split", &StrSplit},
    {"splitlines", &StrSplitlines},
    {"startswith", &StrStartswith},
    {"strip", &StrStrip},
    {"title", &StrTitle},
    {"upper", &StrUpper},
};
// Python str methods this interpreter does not implement: calling one is FAILED_PRECONDITION,
// and `s.format is defined` stays true as in Python.
constexpr std::string_view kStrUnimplemented[] = {
    "encode",      "expandtabs", "format",    "format_map", "isascii",   "isidentifier",
    "isprintable", "istitle",    "maketrans", "swapcase",   "translate", "zfill"};

constexpr NamedFn kListMethods[] = {
    {"copy", &Copy},
    {"count", &ListCount},
    {"index", &ListIndex},
};
constexpr std::string_view kListUnsafe[] = {"append", "clear",  "extend",  "insert",
                                            "pop",    "remove", "reverse", "sort"};

constexpr NamedFn kDictMethods[] = {
    {"copy", &Copy},     {"get", &DictGet},       {"items", &DictItems},
    {"keys", &DictKeys}, {"values", &DictValues},
};
constexpr std::string_view kDictUnsafe[] = {"clear", "pop", "popitem", "setdefault", "update"};
constexpr std::string_view kDictUnimplemented[] = {"fromkeys"};

template <size_t N>
BuiltinFn Lookup(const NamedFn (&table)[N], std::string_view name) {
  for (const NamedFn& entry : table) {
    if (entry.name == name) return entry.fn;
  }
  return nullptr;
}

template <size_t N>
bool Contains(const std::string_view (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

}  // namespace

BuiltinFn FindFilter(std::string_view name) {
  return Lookup(kFilters, name);
}

BuiltinFn FindTest(std::string_view name) {
  return Lookup(kTests, name);
}

uint8_t MethodOwners(std::string_view name) {
  uint8_t owners = 0;
  if (Lookup(kStrMethods, name) != nullptr || Contains(kStrUnimplemented, name)) {
    owners |= kStrMethodOwner;
  }
  if (Lookup(kListMethods, name) != nullptr || Contains(kListUnsafe, name)) {
    owners |= kListMethodOwner;
  }
  if (Lookup(kDictMethods, name) != nullptr || Contains(kDictUnsafe, name) ||
      Contains(kDictUnimplemented, name)) {
    owners |= kDictMethodOwner;
  }
  return owners;
}

BuiltinFn FindMethodFn(const Value& self, std::string_view name) {
  if (self.is_string()) return Lookup(kStrMethods, name);
  if (self.is_list()) {
    if (self.as_list().is_tuple && name == "copy") return nullptr;  // tuples have no copy()
    return Lookup(kListMethods, name);
  }
  if (self.is_dict()) return Lookup(kDictMethods, name);
  return nullptr;
}

MethodFns FindMethodFns(std::string_view name) {
  return MethodFns{Lookup(kStrMethods, name), Lookup(kListMethods, name),
                   Lookup(kDictMethods, name)};
}

MethodLookup FindMethod(const Value& self, std::string_view name, Value* method) {
  const BuiltinFn fn = FindMethodFn(self, name);
  std::string_view type;
  bool unsafe = false, unimplemented = false;
  if (self.is_string()) {
    type = "str";
    unimplemented = Contains(kStrUnimplemented, name);
  } else if (self.is_list()) {
    type = self.as_list().is_tuple ? "tuple" : "list";
    unsafe = !self.as_list().is_tuple && Contains(kListUnsafe, name);
  } else if (self.is_dict()) {
    type = "dict";
    unsafe = Contains(kDictUnsafe, name);
    unimplemented = Contains(kDictUnimplemented, name);
  }
  if (fn != nullptr) {
    *method = MakeCallable(std::string(name), fn, self);
    return MethodLookup::kFound;
  }
  if (unsafe) {
    *method = Value::FromObject(std::make_shared<FailingCallable>(
        absl::StatusCode::kInvalidArgument,
        Cat("access to attribute '", name, "' of '", type, "' object is unsafe")));
    return MethodLookup::kFound;
  }
  if (unimplemented) {
    *method = Value::FromObject(std::make_shared<FailingCallable>(
        absl::StatusCode::kFailedPrecondition,
        Cat(type, ".", name, "() is not supported by this interpreter")));
    return MethodLookup::kFound;
  }
  return MethodLookup::kNone;
}

void AddGlobals(const SymbolTable& symbols, Scope* root) {
  static constexpr NamedFn kGlobals[] = {
      {"range", &GlobalRange},
      {"dict", &GlobalDict},
      {"namespace", &GlobalNamespace},
      {"joiner", &GlobalJoiner},
      {"raise_exception", &GlobalRaiseException},
      {"strftime_now", &GlobalStrftimeNow},
  };
  for (const NamedFn& global : kGlobals) {
    if (Symbol symbol = symbols.Find(global.name)) {
      root->Set(symbol, MakeCallable(std::string(global.name), global.fn));
    }
  }
}

}  // namespace dropkv::jinja
