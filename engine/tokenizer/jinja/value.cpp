#include "engine/tokenizer/jinja/value.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/errors.h"

namespace dropkv::jinja {
namespace {

constexpr size_t kLinearLookupMax = 12;  // below this a scan beats hashing

void CheckDepth(int depth) {
  if (depth > kMaxValueDepth) {
    Fail(absl::StatusCode::kResourceExhausted,
         Cat("value nested deeper than ", kMaxValueDepth, " levels"));
  }
}

}  // namespace

const Value* DictData::Find(std::string_view key) const {
  if (entries.size() <= kLinearLookupMax) {
    for (const auto& [k, v] : entries) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  if (indexed_ != entries.size()) {
    // Rebuild: capacity a power of two at least twice the entries, linear probing.
    size_t capacity = 32;
    while (capacity < entries.size() * 2) capacity *= 2;
    index_.assign(capacity, UINT32_MAX);
    for (size_t i = 0; i < entries.size(); ++i) {
      size_t slot = std::hash<std::string_view>{}(entries[i].first) & (capacity - 1);
      while (index_[slot] != UINT32_MAX) slot = (slot + 1) & (capacity - 1);
      index_[slot] = static_cast<uint32_t>(i);
    }
    indexed_ = entries.size();
  }
  const size_t mask = index_.size() - 1;
  for (size_t slot = std::hash<std::string_view>{}(key)&mask; index_[slot] != UINT32_MAX;
       slot = (slot + 1) & mask) {
    if (entries[index_[slot]].first == key) return &entries[index_[slot]].second;
  }
  return nullptr;
}

void DictData::Set(std::string key, Value value) {
  depth = std::max(depth, value.depth() + 1);
  CheckDepth(depth);
  holds_objects = holds_objects || value.holds_objects();
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

// An Undefined's int_ says how its ptr_ (a std::string) reads.
enum UndefinedText : int64_t { kUndefinedText, kUndefinedName, kUndefinedDictAttribute };

Value Value::Undefined(std::string what) {
  Value v;
  v.ptr_ = std::make_shared<const std::string>(std::move(what));
  v.int_ = kUndefinedText;
  return v;
}

Value Value::UndefinedName(const std::string* name) {
  Value v;
  v.ptr_ = std::shared_ptr<const void>(std::shared_ptr<const void>(), name);  // not owned
  v.int_ = kUndefinedName;
  return v;
}

Value Value::UndefinedDictAttribute(const std::string* name) {
  Value v = UndefinedName(name);
  v.int_ = kUndefinedDictAttribute;
  return v;
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}

Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.int_ = i;
  return v;
}

Value Value::Float(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.float_ = f;
  return v;
}

Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  auto owner = std::make_shared<const std::string>(std::move(s));
  v.string_len_ = owner->size();
  const char* data = owner->data();
  v.ptr_ = std::shared_ptr<const void>(std::move(owner), data);
  return v;
}

Value Value::BorrowedString(std::string_view text) {
  Value v;
  v.kind_ = Kind::kString;
  v.string_len_ = text.size();
  v.ptr_ = std::shared_ptr<const void>(std::shared_ptr<const void>(), text.data());
  return v;
}

Value Value::Substring(const Value& whole, std::string_view part) {
  Value v;
  v.kind_ = Kind::kString;
  v.string_len_ = part.size();
  v.ptr_ = std::shared_ptr<const void>(whole.ptr_, part.data());
  return v;
}

Value Value::List(std::vector<Value> items, bool is_tuple) {
  auto data = std::make_shared<ListData>();
  for (const Value& item : items) {
    data->depth = std::max(data->depth, item.depth() + 1);
    data->holds_objects = data->holds_objects || item.holds_objects();
  }
  CheckDepth(data->depth);
  data->items = std::move(items);
  data->is_tuple = is_tuple;
  Value v;
  v.kind_ = Kind::kList;
  v.ptr_ = std::move(data);
  return v;
}

Value Value::Dict(DictData dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.ptr_ = std::make_shared<const DictData>(std::move(dict));
  return v;
}

Value Value::FromObject(std::shared_ptr<Object> object) {
  Value v;
  v.kind_ = Kind::kObject;
  v.ptr_ = std::shared_ptr<const Object>(std::move(object));
  return v;
}

std::string Value::undefined_what() const {
  if (kind_ != Kind::kUndefined || ptr_ == nullptr) return "value is undefined";
  const std::string& text = *static_cast<const std::string*>(ptr_.get());
  switch (int_) {
    case kUndefinedName:
      return Cat("'", text, "' is undefined");
    case kUndefinedDictAttribute:
      return Cat("'dict object' has no attribute '", text, "'");
    default:
      return text;
  }
}

int Value::depth() const {
  switch (kind_) {
    case Kind::kList:
      return as_list().depth;
    case Kind::kDict:
      return as_dict().depth;
    default:
      return 0;
  }
}

bool Value::holds_objects() const {
  switch (kind_) {
    case Kind::kList:
      return as_list().holds_objects;
    case Kind::kDict:
      return as_dict().holds_objects;
    case Kind::kObject:
      return true;
    default:
      return false;
  }
}

}  // namespace dropkv::jinja
