// The tree-walking evaluator behind Template::Render, and the runtime objects it creates
// (scopes, namespaces, loops, macros, generators). Internal to the jinja library; builtins.cpp
// uses it for filters that call back (map, selectattr, sort by attribute).
//
// Scoping follows jinja2: `if` shares its enclosing scope; every loop iteration, macro call,
// `with` and block `set` body gets a child scope whose assignments vanish with it (hence
// `namespace`). Lookups walk outwards; macros see the scope they were defined in, live.
#pragma once

#include <array>
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "engine/tokenizer/jinja/ast.h"
#include "engine/tokenizer/jinja/builtins.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/jinja/parser.h"
#include "engine/tokenizer/jinja/template.h"
#include "engine/tokenizer/jinja/value.h"

namespace dropkv::jinja {

// Inline storage: a call rarely has more than a few arguments, and calls are per message.
struct CallArgs {
  absl::InlinedVector<Value, 3> positional;
  absl::InlinedVector<std::pair<std::string, Value>, 1> keywords;
};

// Binds CallArgs to a builtin's Python signature: positional parameters in order, then keywords
// by name; unknown keywords and surplus arguments are TypeErrors naming the function.
class ArgReader {
 public:
  static constexpr size_t kMaxParams = 4;
  // `function` and `params` must be literals (they are kept as views).
  ArgReader(const CallArgs& args, std::string_view function,
            std::initializer_list<std::string_view> params);
  // The argument for parameter `index` (by position or name), or null when not given.
  const Value* Get(size_t index) const { return bound_[index]; }
  const Value& GetOr(size_t index, const Value& fallback) const {
    return bound_[index] != nullptr ? *bound_[index] : fallback;
  }
  // Typed accessors (TypeError on a wrong type); `fallback` when not given.
  std::string String(size_t index, std::string_view fallback) const;
  int64_t Int(size_t index, int64_t fallback) const;
  bool Bool(size_t index, bool fallback) const;

 private:
  // Fixed arrays: builtins are called per message, and vectors here cost two allocations a call.
  std::string_view function_;
  std::array<std::string_view, kMaxParams> params_{};
  std::array<const Value*, kMaxParams> bound_{};
  size_t num_params_ = 0;
};

// Variables by interned name (ast.h's Symbol). Most scopes hold one to three, kept inline.
struct Scope {
  std::shared_ptr<Scope> parent;
  absl::InlinedVector<std::pair<Symbol, Value>, 4> vars;

  const Value* Find(Symbol name) const;
  void Set(Symbol name, Value value);
};

// Python callables: builtin functions and bound methods, macros, loop.cycle.
class Callable : public Object {
 public:
  std::string_view type_name() const override { return "function"; }
  Callable* AsCallable() override { return this; }
  virtual Value Call(Interpreter& interp, CallArgs& args) = 0;
};

// A builtin function or a method bound to `self` (same signature as filters: self first).
class BuiltinCallable final : public Callable {
 public:
  BuiltinCallable(std::string name, BuiltinFn fn, Value self)
      : name_(std::move(name)), fn_(fn), self_(std::move(self)) {}
  Value Call(Interpreter& interp, CallArgs& args) override { return fn_(interp, self_, args); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  BuiltinFn fn_;
  Value self_;
};

// jinja2's Namespace: the one mutable object templates have (`set ns.x = ...`).
class Namespace final : public Object {
 public:
  std::string_view type_name() const override { return "Namespace"; }
  Namespace* AsNamespace() override { return this; }
  bool GetAttribute(std::string_view name, Value* out) override {
    const Value* v = attrs.Find(name);
    if (v != nullptr) *out = *v;
    return v != nullptr;
  }
  DictData attrs;
};

// An iterator in Python terms (selectattr, map, reverse, items): truthy, no len(), and each item
// can be taken once, so a second loop over it sees nothing.
class Generator final : public Object {
 public:
  explicit Generator(std::vector<Value> items) : items_(std::move(items)) {}
  std::string_view type_name() const override { return "generator"; }
  Generator* AsGenerator() override { return this; }
  // The items not taken yet, taking them.
  std::vector<Value> TakeAll();
  // The next item, or null at the end.
  const Value* TakeOne();
  bool HoldsObjects() const;

 private:
  std::vector<Value> items_;
  size_t next_ = 0;
};

class Interpreter {
 public:
  Interpreter(const ParsedTemplate& parsed, const RenderOptions& options, int64_t* steps);

  std::string RenderRoot(std::shared_ptr<Scope> root);

  // ---- for builtins ----
  // One unit of work; RESOURCE_EXHAUSTED past the budget.
  void Tick(int64_t cost = 1) {
    *steps_ += cost;
    if (*steps_ > options_.limits.max_steps) BudgetExceeded();
  }
  // A string result, charged to the budget and checked against the size limit.
  Value MakeString(std::string s);
  // jinja2's sandboxed getattr (attribute, then item) and getitem (item, then attribute).
  Value GetAttr(const Value& object, std::string_view name);
  // The same with MethodOwners(name) known.
  Value GetAttr(const Value& object, std::string_view name, uint8_t method_owners);
  Value GetItem(const Value& object, const Value& key);
  // The items a for loop would see (a generator is consumed); TypeError when not iterable.
  std::vector<Value> Iterate(const Value& value);
  Value CallValue(const Value& callee, CallArgs& args);
  // Filter / test by name, as map('upper') and select('odd') apply them.
  Value ApplyFilter(std::string_view name, const Value& value, CallArgs& args);
  bool ApplyTest(std::string_view name, const Value& value, CallArgs& args);
  std::tm LocalTime() const;
  int current_line() const { return line_; }

  // Macros: rendered through the interpreter's statement walker.
  Value CallMacro(const Stmt& def, const std::shared_ptr<Scope>& closure, std::string_view name,
                  CallArgs& args);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  [[noreturn]] void BudgetExceeded() const;
  [[noreturn]] void DepthExceeded() const;
  [[noreturn]] void StringLimitExceeded() const;
  Flow ExecBody(const Body& body, const std::shared_ptr<Scope>& scope, std::string* out);
  Flow Exec(const Stmt& stmt, const std::shared_ptr<Scope>& scope, std::string* out);
  void ExecFor(const Stmt& stmt, const std::shared_ptr<Scope>& scope, std::string* out);
  void Assign(const Target& target, const Value& value, Scope& scope);
  std::string RenderBlock(const Body& body, const std::shared_ptr<Scope>& scope);
  Value ApplyFilterChain(const Expr& chain, const Value& block_text, Scope& scope);
  void Append(std::string_view text, std::string* out);

  Value Eval(const Expr& expr, Scope& scope);
  // Eval without copying when the result already lives somewhere stable (a constant, a
  // variable, an item of a dict or list); otherwise the result is stored in `tmp`.
  const Value& EvalRef(const Expr& expr, Scope& scope, Value& tmp);
  Value EvalCall(const Expr& expr, Scope& scope);
  Value EvalAddChain(const Expr& expr, Scope& scope);
  // The operands of a left-deep a + b + c chain, evaluated in order.
  struct AddOperands {
    absl::InlinedVector<Value, 8> temps;
    absl::InlinedVector<const Value*, 8> values;
    bool all_strings = true;
    size_t total_bytes = 0;
  };
  void CollectAddOperands(const Expr& expr, Scope& scope, AddOperands* operands);
  Value SumOperands(const AddOperands& operands);
  // Prints an add chain or a ~ concatenation part by part; false for other expressions.
  bool AppendParts(const Expr& expr, Scope& scope, std::string* out);
  Value EvalBuiltin(const Expr& expr, const Value& subject, Scope& scope);
  CallArgs EvalArgs(const Expr& expr, Scope& scope, size_t first_arg);
  Value Binary(BinaryOp op, const Value& a, const Value& b);
  bool CompareOp(jinja::CompareOp op, const Value& a, const Value& b);
  bool Contains(const Value& container, const Value& item);
  Value Slice(const Value& object, const Expr& slice, Scope& scope);

  // Guards recursion (expression depth, statement nesting, macro calls) with one counter.
  class DepthGuard {
   public:
    explicit DepthGuard(Interpreter* interp) : interp_(interp) {
      if (++interp_->depth_ > interp_->options_.limits.max_depth) interp_->DepthExceeded();
    }
    ~DepthGuard() { --interp_->depth_; }

   private:
    Interpreter* interp_;
  };

  const ParsedTemplate& parsed_;
  const RenderOptions& options_;
  int64_t* steps_;
  int depth_ = 0;
  int line_ = 0;
  const Value* block_text_ = nullptr;  // the body text a filter block's filter chain applies to
};

// A value built from JSON (objects keep their key order); invalid UTF-8 is a TypeError.
Value FromJson(const nlohmann::ordered_json& json);

}  // namespace dropkv::jinja
