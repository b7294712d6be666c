// The values a Jinja template computes with, modelled on the Python objects jinja2 passes around
// (chat templates are rendered by Python's jinja2 in transformers, so Python's semantics are the
// reference): Undefined, None, bool, int, float, str, list / tuple, dict (insertion-ordered, as
// Python's) and opaque objects (namespaces, loop state, callables, generators).
//
// Values are immutable and cheap to copy: strings, lists and dicts are shared. Only objects may
// change (a namespace's attributes, a generator's read position).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"

namespace dropkv::jinja {

class Value;
class Object;
class Callable;
class Generator;
class Namespace;

struct ListData;
struct DictData;

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kObject,
  };

  Value() : kind_(Kind::kUndefined), int_(0) {}
  // Undefined with a description for the error raised when it is used ("'x' is undefined").
  static Value Undefined(std::string what);
  // The same for the two common cases, without allocating (`is defined` checks are frequent):
  // "'<name>' is undefined" and "'dict object' has no attribute '<name>'". `name` must outlive
  // the value (it is the template's own text).
  static Value UndefinedName(const std::string* name);
  static Value UndefinedDictAttribute(const std::string* name);
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  static Value String(std::string s);
  // A string that borrows `text`, which must outlive the value (the render's JSON input: a
  // conversation is read, never copied).
  static Value BorrowedString(std::string_view text);
  // `part` (which lies inside `whole`, a string) sharing whole's storage: split, strip and
  // slices allocate nothing.
  static Value Substring(const Value& whole, std::string_view part);
  static Value List(std::vector<Value> items, bool is_tuple = false);
  static Value Dict(DictData dict);
  static Value FromObject(std::shared_ptr<Object> object);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // Python's numbers include bool (True + 1 == 2).
  bool is_number() const {
    return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat;
  }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const { return bool_; }
  // int or bool as an int.
  int64_t as_int() const { return kind_ == Kind::kBool ? (bool_ ? 1 : 0) : int_; }
  // Any number as a double.
  double as_float() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(as_int()); }
  std::string_view as_string() const {
    return std::string_view(static_cast<const char*>(ptr_.get()), string_len_);
  }
  const ListData& as_list() const { return *static_cast<const ListData*>(ptr_.get()); }
  const DictData& as_dict() const { return *static_cast<const DictData*>(ptr_.get()); }
  // Objects are the one mutable kind (a namespace's attributes, a generator's position).
  Object* as_object() const { return const_cast<Object*>(static_cast<const Object*>(ptr_.get())); }
  // The description given to Undefined*().
  std::string undefined_what() const;

  // Nesting depth of lists / dicts (0 for scalars) and whether objects hide inside.
  int depth() const;
  bool holds_objects() const;

 private:
  Kind kind_;
  union {
    bool bool_;
    int64_t int_;  // also an Undefined's description kind
    double float_;
    size_t string_len_;
  };
  // A string's first byte (owned through the control block, or borrowed with none), ListData,
  // DictData, Object, or Undefined's description (a std::string): one pointer keeps copies cheap.
  std::shared_ptr<const void> ptr_;
};

// A list or a tuple (tuples print with parentheses; otherwise they behave alike here).
struct ListData {
  std::vector<Value> items;
  bool is_tuple = false;
  int depth = 1;               // nesting depth, bounded so destruction cannot overflow the stack
  bool holds_objects = false;  // contains (at any depth) a namespace, callable, ...
};

// Python dict with string keys, in insertion order. Lookups are linear below a few entries and
// through an index above.
struct DictData {
  // Inline for the usual message dict ({role, content} and a few more).
  absl::InlinedVector<std::pair<std::string, Value>, 4> entries;
  int depth = 1;
  bool holds_objects = false;

  const Value* Find(std::string_view key) const;
  // Inserts or replaces (Python d[key] = value keeps the first position).
  void Set(std::string key, Value value);

 private:
  mutable std::vector<uint32_t> index_;  // open-addressing table of entry positions (lazy)
  mutable size_t indexed_ = 0;           // entries covered by index_
};

// Objects: everything Python has that is not plain data. The As* casts are virtual calls
// instead of dynamic_cast, which showed in profiles of attribute-heavy templates.
class Object {
 public:
  virtual ~Object() = default;
  // Python's type name, used in error messages ("namespace", "function", "generator").
  virtual std::string_view type_name() const = 0;
  // `object.name`: true, with *out set, when the object has that attribute.
  virtual bool GetAttribute(std::string_view name, Value* out) { return false; }
  virtual Callable* AsCallable() { return nullptr; }
  virtual Generator* AsGenerator() { return nullptr; }
  virtual Namespace* AsNamespace() { return nullptr; }
};

// Limits every render enforces; a list or dict nested deeper than this is refused (and so are
// templates that build one), which keeps recursion in printing, comparison and destruction
// bounded.
inline constexpr int kMaxValueDepth = 256;

}  // namespace dropkv::jinja
