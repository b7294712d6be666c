// jinja2's builtin filters and tests, transformers' additions (tojson, raise_exception,
// strftime_now), the globals (range, namespace, dict, joiner) and the Python methods of str,
// list and dict that templates call. Everything takes and returns jinja::Value and behaves as the
// Python original does, errors included.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "engine/tokenizer/jinja/ast.h"
#include "engine/tokenizer/jinja/value.h"

namespace dropkv::jinja {

struct Scope;

// Null when the name is not a filter / test this interpreter has.
BuiltinFn FindFilter(std::string_view name);
BuiltinFn FindTest(std::string_view name);

// What `object.name` finds among the Python methods of str / list / dict:
//  kNone: not a method (the caller falls back to items); otherwise a callable is returned in
//  *method, which for unsafe (mutating) and unimplemented methods fails when called.
enum class MethodLookup { kNone, kFound };
MethodLookup FindMethod(const Value& self, std::string_view name, Value* method);
// The implemented method `name` of a str / list / dict value, or null: calls through it skip
// building a bound-method object.
BuiltinFn FindMethodFn(const Value& self, std::string_view name);
// The same resolved per type once, at parse time, for `x.name(...)`.
struct MethodFns {
  BuiltinFn str = nullptr;
  BuiltinFn list = nullptr;  // tuples have the same except copy()
  BuiltinFn dict = nullptr;
};
MethodFns FindMethodFns(std::string_view name);
// Which of str / list / dict have an attribute `name` at all (bit flags, parse-time hints that
// let `message.role` skip the method tables).
inline constexpr uint8_t kStrMethodOwner = 1;
inline constexpr uint8_t kListMethodOwner = 2;
inline constexpr uint8_t kDictMethodOwner = 4;
uint8_t MethodOwners(std::string_view name);

// Adds the global functions the template mentions to the root scope.
void AddGlobals(const SymbolTable& symbols, Scope* root);

}  // namespace dropkv::jinja
