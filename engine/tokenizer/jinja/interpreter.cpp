#include "engine/tokenizer/jinja/interpreter.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/jinja/builtins.h"
#include "engine/tokenizer/jinja/errors.h"
#include "engine/tokenizer/jinja/python.h"
#include "engine/tokenizer/unicode.h"

namespace dropkv::jinja {
namespace {

[[noreturn]] void UndefinedError(const Value& v) {
  TypeError(v.undefined_what());
}

[[noreturn]] void IntegerOverflow() {
  Unsupported("integer overflow (this interpreter has 64-bit integers)");
}

class MacroCallable final : public Callable {
 public:
  MacroCallable(const Stmt* def, std::weak_ptr<Scope> closure, std::string name)
      : def_(def), closure_(std::move(closure)), name_(std::move(name)) {}
  Value Call(Interpreter& interp, CallArgs& args) override {
    const std::shared_ptr<Scope> scope = closure_.lock();
    if (scope == nullptr) {
      Unsupported(Cat("macro '", name_, "' called after its defining scope ended"));
    }
    return interp.CallMacro(*def_, scope, name_, args);
  }

 private:
  const Stmt* def_;
  std::weak_ptr<Scope> closure_;  // weak: a scope holds its macros, which must not hold it
  std::string name_;
};

// What every iteration of one for loop shares.
struct LoopState {
  std::vector<Value> items;
  bool has_changed_value = false;  // loop.changed()'s memory
  Value changed_value;
};

// jinja2's LoopContext for one iteration.
class LoopObject final : public Object, public std::enable_shared_from_this<LoopObject> {
 public:
  LoopObject(std::shared_ptr<LoopState> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  std::string_view type_name() const override { return "LoopContext"; }
  bool GetAttribute(std::string_view name, Value* out) override {
    *out = Attr(name);
    return true;
  }
  // The next iteration, when nothing else holds this object (saves an allocation per step).
  void set_index(size_t index) { index_ = index; }

  Value Attr(std::string_view name) {
    const auto n = static_cast<int64_t>(state_->items.size());
    const auto i = static_cast<int64_t>(index_);
    if (name == "index") return Value::Int(i + 1);
    if (name == "index0") return Value::Int(i);
    if (name == "revindex") return Value::Int(n - i);
    if (name == "revindex0") return Value::Int(n - i - 1);
    if (name == "first") return Value::Bool(i == 0);
    if (name == "last") return Value::Bool(i == n - 1);
    if (name == "length") return Value::Int(n);
    if (name == "depth") return Value::Int(1);
    if (name == "depth0") return Value::Int(0);
    if (name == "previtem") {
      return i > 0 ? state_->items[index_ - 1] : Value::Undefined("there is no previous item");
    }
    if (name == "nextitem") {
      return i + 1 < n ? state_->items[index_ + 1] : Value::Undefined("there is no next item");
    }
    if (name == "cycle" || name == "changed") {
      return Value::FromObject(
          std::make_shared<BuiltinCallable>(std::string(name), name == "cycle" ? &Cycle : &Changed,
                                            Value::FromObject(shared_from_this())));
    }
    return Value::Undefined(Cat("'LoopContext' object has no attribute '", name, "'"));
  }

 private:
  static Value Cycle(Interpreter&, const Value& self, CallArgs& args) {
    auto* loop = static_cast<LoopObject*>(self.as_object());
    if (args.positional.empty()) TypeError("no items for cycling given");
    return args.positional[loop->index_ % args.positional.size()];
  }
  static Value Changed(Interpreter&, const Value& self, CallArgs& args) {
    auto* loop = static_cast<LoopObject*>(self.as_object());
    Value current = Value::List({args.positional.begin(), args.positional.end()});
    LoopState& state = *loop->state_;
    if (state.has_changed_value && py::Equal(state.changed_value, current)) {
      return Value::Bool(false);
    }
    state.has_changed_value = true;
    state.changed_value = std::move(current);
    return Value::Bool(true);
  }

  std::shared_ptr<LoopState> state_;
  size_t index_;
};

// Storing these in a namespace could make a reference cycle (a namespace holding itself).
bool MayFormCycle(const Value& v) {
  if (v.is_object()) {
    if (auto* gen = v.as_object()->AsGenerator()) return gen->HoldsObjects();
    return true;
  }
  return v.holds_objects();
}

bool AsIndex(const Value& v, int64_t* index) {
  if (v.is_int() || v.is_bool()) {
    *index = v.as_int();
    return true;
  }
  return false;
}

// Python's slice.indices(): normalized start / stop for `length` items.
void AdjustSlice(int64_t length, const std::optional<int64_t>& start_arg,
                 const std::optional<int64_t>& stop_arg, int64_t step, int64_t* start,
                 int64_t* stop) {
  const int64_t lower = step > 0 ? 0 : -1;
  const int64_t upper = step > 0 ? length : length - 1;
  const auto clamp = [&](const std::optional<int64_t>& arg, int64_t fallback) {
    if (!arg) return fallback;
    int64_t v = *arg;
    if (v < 0) {
      v += length;
      if (v < lower) v = lower;
    } else if (v > upper) {
      v = upper;
    }
    return v;
  };
  *start = clamp(start_arg, step < 0 ? upper : lower);
  *stop = clamp(stop_arg, step < 0 ? lower : upper);
}

// CPython's float floor division / modulo (the sign follows the divisor).
void FloatDivMod(double a, double b, double* div_out, double* mod_out) {
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) {
      mod += b;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, b);
  }
  double floordiv = 0;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  *div_out = floordiv;
  *mod_out = mod;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Arguments, scopes, generators

ArgReader::ArgReader(const CallArgs& args, std::string_view function,
                     std::initializer_list<std::string_view> params)
    : function_(function), num_params_(params.size()) {
  if (params.size() > kMaxParams) Unsupported("internal: a builtin with too many parameters");
  std::copy(params.begin(), params.end(), params_.begin());
  if (args.positional.size() > num_params_) {
    TypeError(Cat(function_, "() takes at most ", num_params_, " arguments (",
                  args.positional.size(), " given)"));
  }
  for (size_t i = 0; i < args.positional.size(); ++i) bound_[i] = &args.positional[i];
  for (const auto& [key, value] : args.keywords) {
    size_t index = 0;
    while (index < num_params_ && params_[index] != key) ++index;
    if (index == num_params_) {
      TypeError(Cat(function_, "() got an unexpected keyword argument '", key, "'"));
    }
    if (bound_[index] != nullptr) {
      TypeError(Cat(function_, "() got multiple values for argument '", key, "'"));
    }
    bound_[index] = &value;
  }
}

std::string ArgReader::String(size_t index, std::string_view fallback) const {
  if (bound_[index] == nullptr) return std::string(fallback);
  if (!bound_[index]->is_string()) {
    TypeError(Cat(function_, "(): argument '", params_[index], "' must be str, not ",
                  py::TypeName(*bound_[index])));
  }
  return std::string(bound_[index]->as_string());
}

int64_t ArgReader::Int(size_t index, int64_t fallback) const {
  if (bound_[index] == nullptr) return fallback;
  if (!bound_[index]->is_int() && !bound_[index]->is_bool()) {
    TypeError(Cat(function_, "(): argument '", params_[index], "' must be int, not ",
                  py::TypeName(*bound_[index])));
  }
  return bound_[index]->as_int();
}

bool ArgReader::Bool(size_t index, bool fallback) const {
  return bound_[index] == nullptr ? fallback : py::Truthy(*bound_[index]);
}

const Value* Scope::Find(Symbol name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
    for (const auto& [key, value] : s->vars) {
      if (key == name) return &value;
    }
  }
  return nullptr;
}

void Scope::Set(Symbol name, Value value) {
  for (auto& [key, existing] : vars) {
    if (key == name) {
      existing = std::move(value);
      return;
    }
  }
  vars.emplace_back(name, std::move(value));
}

std::vector<Value> Generator::TakeAll() {
  std::vector<Value> rest(items_.begin() + static_cast<std::ptrdiff_t>(next_), items_.end());
  next_ = items_.size();
  return rest;
}

const Value* Generator::TakeOne() {
  return next_ < items_.size() ? &items_[next_++] : nullptr;
}

bool Generator::HoldsObjects() const {
  for (const Value& v : items_) {
    if (v.holds_objects()) return true;
  }
  return false;
}

namespace {

Value FromJsonAt(const nlohmann::ordered_json& json, int depth) {
  // Checked before recursing: the value's own depth check comes only after its children.
  if (depth > kMaxValueDepth) {
    Fail(absl::StatusCode::kInvalidArgument,
         Cat("the variables nest deeper than ", kMaxValueDepth, " levels"));
  }
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = json.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) IntegerOverflow();
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(json.get<double>());
    case nlohmann::ordered_json::value_t::string: {
      const auto& s = json.get_ref<const std::string&>();
      if (!unicode::IsValidUtf8(s)) TypeError("a string in the conversation is not valid UTF-8");
      return Value::BorrowedString(s);  // the JSON outlives the render
    }
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJsonAt(item, depth + 1));
      return Value::List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      // JSON object keys are unique, so entries are appended without Set's duplicate scan.
      DictData dict;
      dict.entries.reserve(json.size());
      // The object's own (key, value) vector: items()'s proxies cost more than the conversion.
      for (const auto& [key, item] : json.get_ref<const nlohmann::ordered_json::object_t&>()) {
        if (!unicode::IsValidUtf8(key)) TypeError("a key in the conversation is not valid UTF-8");
        Value value = FromJsonAt(item, depth + 1);
        dict.depth = std::max(dict.depth, value.depth() + 1);
        dict.holds_objects = dict.holds_objects || value.holds_objects();
        dict.entries.emplace_back(key, std::move(value));
      }
      return Value::Dict(std::move(dict));
    }
    default:
      TypeError("binary JSON values are not supported");
  }
}

}  // namespace

Value FromJson(const nlohmann::ordered_json& json) {
  return FromJsonAt(json, 0);
}

// ---------------------------------------------------------------------------------------------
// Interpreter

Interpreter::Interpreter(const ParsedTemplate& parsed, const RenderOptions& options, int64_t* steps)
    : parsed_(parsed), options_(options), steps_(steps) {}

void Interpreter::DepthExceeded() const {
  Fail(absl::StatusCode::kResourceExhausted,
       Cat("recursion deeper than ", options_.limits.max_depth,
           " levels (a macro calling itself?)"));
}

void Interpreter::BudgetExceeded() const {
  Fail(absl::StatusCode::kResourceExhausted,
       Cat("rendering took more than ", options_.limits.max_steps,
           " steps (an endless or huge loop?)"));
}

void Interpreter::StringLimitExceeded() const {
  Fail(absl::StatusCode::kResourceExhausted,
       Cat("a string grew past the ", options_.limits.max_output_bytes, "-byte limit"));
}

Value Interpreter::MakeString(std::string s) {
  if (static_cast<int64_t>(s.size()) > options_.limits.max_output_bytes) StringLimitExceeded();
  Tick(static_cast<int64_t>(s.size() / 64));
  return Value::String(std::move(s));
}

void Interpreter::Append(std::string_view text, std::string* out) {
  out->append(text);
  if (static_cast<int64_t>(out->size()) > options_.limits.max_output_bytes) {
    Fail(absl::StatusCode::kResourceExhausted,
         Cat("output grew past the ", options_.limits.max_output_bytes, "-byte limit"));
  }
  Tick(static_cast<int64_t>(text.size() / 64));
}

std::tm Interpreter::LocalTime() const {
  if (options_.local_time) return options_.local_time();
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  return tm;
}

std::string Interpreter::RenderRoot(std::shared_ptr<Scope> root) {
  std::string out;
  ExecBody(parsed_.body, root, &out);
  return out;
}

Interpreter::Flow Interpreter::ExecBody(const Body& body, const std::shared_ptr<Scope>& scope,
                                        std::string* out) {
  DepthGuard guard(this);
  for (const auto& stmt : body) {
    const Flow flow = Exec(*stmt, scope, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

std::string Interpreter::RenderBlock(const Body& body, const std::shared_ptr<Scope>& scope) {
  auto inner = std::make_shared<Scope>();
  inner->parent = scope;
  std::string text;
  ExecBody(body, inner, &text);
  return text;
}

Value Interpreter::ApplyFilterChain(const Expr& chain, const Value& block_text, Scope& scope) {
  const Value* saved = block_text_;
  block_text_ = &block_text;
  Value result = Eval(chain, scope);
  block_text_ = saved;
  return result;
}

Interpreter::Flow Interpreter::Exec(const Stmt& stmt, const std::shared_ptr<Scope>& scope,
                                    std::string* out) {
  Tick();
  line_ = stmt.line;
  switch (stmt.kind) {
    case StmtKind::kText:
      Append(stmt.text, out);
      return Flow::kNormal;
    case StmtKind::kOutput: {
      // `{{ a + b + c }}` and `{{ a ~ b }}` (how templates build each turn) go straight to the
      // output when the parts are strings, without building the sum first.
      if (AppendParts(*stmt.expr, *scope, out)) return Flow::kNormal;
      Value tmp;
      const Value& v = EvalRef(*stmt.expr, *scope, tmp);
      if (v.is_string()) {
        Append(v.as_string(), out);
      } else {
        std::string text;
        py::AppendStr(v, &text);
        Append(text, out);
      }
      return Flow::kNormal;
    }
    case StmtKind::kIf:
      for (const IfBranch& branch : stmt.branches) {
        Value tmp;
        if (py::Truthy(EvalRef(*branch.condition, *scope, tmp))) {
          return ExecBody(branch.body, scope, out);
        }
      }
      return ExecBody(stmt.else_body, scope, out);
    case StmtKind::kFor: {
      const Value iterable = Eval(*stmt.expr, *scope);
      auto state = std::make_shared<LoopState>();
      std::vector<Value> all_items = Iterate(iterable);
      state->items.reserve(all_items.size());
      for (Value& item : all_items) {
        if (stmt.condition != nullptr) {
          Scope probe;
          probe.parent = scope;
          Assign(stmt.target, item, probe);
          Value tmp;
          if (!py::Truthy(EvalRef(*stmt.condition, probe, tmp))) continue;
        }
        state->items.push_back(std::move(item));
      }
      if (state->items.empty()) return ExecBody(stmt.else_body, scope, out);
      std::shared_ptr<Scope> iteration;
      std::shared_ptr<LoopObject> loop;
      for (size_t i = 0; i < state->items.size(); ++i) {
        Tick();
        // Each iteration starts from a fresh scope. The previous one (and its loop object) is
        // reused when the body kept no reference to it, which is the common case.
        if (iteration == nullptr || iteration.use_count() > 1) {
          iteration = std::make_shared<Scope>();
          iteration->parent = scope;
        } else {
          iteration->vars.clear();
        }
        if (loop == nullptr || loop.use_count() > 1) {
          loop = std::make_shared<LoopObject>(state, i);
        } else {
          loop->set_index(i);
        }
        Assign(stmt.target, state->items[i], *iteration);
        if (parsed_.loop != nullptr) iteration->Set(parsed_.loop, Value::FromObject(loop));
        if (ExecBody(stmt.body, iteration, out) == Flow::kBreak) break;
      }
      return Flow::kNormal;
    }
    case StmtKind::kSet:
      Assign(stmt.target, Eval(*stmt.expr, *scope), *scope);
      return Flow::kNormal;
    case StmtKind::kSetBlock: {
      Value text = MakeString(RenderBlock(stmt.body, scope));
      if (stmt.expr != nullptr) text = ApplyFilterChain(*stmt.expr, text, *scope);
      Assign(stmt.target, text, *scope);
      return Flow::kNormal;
    }
    case StmtKind::kMacro:
      scope->Set(stmt.symbol, Value::FromObject(std::make_shared<MacroCallable>(
                                  &stmt, std::weak_ptr<Scope>(scope), stmt.name)));
      return Flow::kNormal;
    case StmtKind::kCallBlock: {
      const Expr& call = *stmt.expr;
      const Value callee = Eval(*call.children[0], *scope);
      CallArgs args = EvalArgs(call, *scope, 1);
      args.keywords.emplace_back("caller", Value::FromObject(std::make_shared<MacroCallable>(
                                               &stmt, std::weak_ptr<Scope>(scope), "caller")));
      line_ = stmt.line;
      std::string text;
      py::AppendStr(CallValue(callee, args), &text);
      Append(text, out);
      return Flow::kNormal;
    }
    case StmtKind::kFilterBlock: {
      const Value text = MakeString(RenderBlock(stmt.body, scope));
      std::string filtered;
      py::AppendStr(ApplyFilterChain(*stmt.expr, text, *scope), &filtered);
      Append(filtered, out);
      return Flow::kNormal;
    }
    case StmtKind::kWith: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      for (size_t i = 0; i < stmt.with_targets.size(); ++i) {
        Assign(stmt.with_targets[i], Eval(*stmt.with_values[i], *scope), *inner);
      }
      return ExecBody(stmt.body, inner, out);
    }
    case StmtKind::kBreak:
      return Flow::kBreak;
    case StmtKind::kContinue:
      return Flow::kContinue;
    case StmtKind::kScope: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      return ExecBody(stmt.body, inner, out);
    }
  }
  return Flow::kNormal;
}

void Interpreter::Assign(const Target& target, const Value& value, Scope& scope) {
  switch (target.kind) {
    case Target::Kind::kName:
      scope.Set(target.symbol, value);
      return;
    case Target::Kind::kTuple: {
      const std::vector<Value> items = Iterate(value);
      if (items.size() != target.items.size()) {
        TypeError(items.size() > target.items.size()
                      ? Cat("too many values to unpack (expected ", target.items.size(), ")")
                      : Cat("not enough values to unpack (expected ", target.items.size(), ", got ",
                            items.size(), ")"));
      }
      for (size_t i = 0; i < items.size(); ++i) Assign(target.items[i], items[i], scope);
      return;
    }
    case Target::Kind::kNamespaceAttr: {
      const Value* ns_value = scope.Find(target.symbol);
      auto* ns = ns_value != nullptr && ns_value->is_object() ? ns_value->as_object()->AsNamespace()
                                                              : nullptr;
      if (ns == nullptr) TypeError("cannot assign attribute on non-namespace object");
      if (MayFormCycle(value)) {
        Unsupported("storing namespaces, loops or functions in a namespace is not supported");
      }
      ns->attrs.Set(target.attr, value);
      return;
    }
  }
}

Value Interpreter::CallMacro(const Stmt& def, const std::shared_ptr<Scope>& closure,
                             std::string_view name, CallArgs& args) {
  DepthGuard guard(this);
  auto scope = std::make_shared<Scope>();
  scope->parent = closure;
  const size_t num_params = def.params.size();
  std::vector<bool> bound(num_params, false);
  std::vector<Value> varargs;
  DictData kwargs;
  Value caller = Value::Undefined("No caller defined");
  for (size_t i = 0; i < args.positional.size(); ++i) {
    if (i < num_params) {
      scope->Set(def.param_symbols[i], args.positional[i]);
      bound[i] = true;
    } else if (def.uses_varargs) {
      varargs.push_back(args.positional[i]);
    } else {
      TypeError(Cat("macro '", name, "' takes not more than ", num_params, " argument(s)"));
    }
  }
  for (auto& [key, value] : args.keywords) {
    size_t index = 0;
    while (index < num_params && def.params[index] != key) ++index;
    if (index < num_params) {
      if (bound[index]) {
        TypeError(Cat("macro '", name, "' got multiple values for argument '", key, "'"));
      }
      scope->Set(def.param_symbols[index], value);
      bound[index] = true;
    } else if (key == "caller" && def.uses_caller) {
      caller = value;
    } else if (def.uses_kwargs) {
      kwargs.Set(key, value);
    } else {
      TypeError(Cat("macro '", name, "' takes no keyword argument '", key, "'"));
    }
  }
  const size_t first_default = num_params - def.defaults.size();
  for (size_t i = 0; i < num_params; ++i) {
    if (bound[i]) continue;
    scope->Set(def.param_symbols[i],
               i >= first_default
                   ? Eval(*def.defaults[i - first_default], *scope)
                   : Value::Undefined(Cat("parameter '", def.params[i], "' was not provided")));
  }
  // uses_* imply the template mentions the name, so the symbols exist.
  if (def.uses_varargs) scope->Set(parsed_.varargs, Value::List(std::move(varargs), true));
  if (def.uses_kwargs) scope->Set(parsed_.kwargs, Value::Dict(std::move(kwargs)));
  if (def.uses_caller) scope->Set(parsed_.caller, caller);
  std::string out;
  ExecBody(def.body, scope, &out);
  return MakeString(std::move(out));
}

// ---------------------------------------------------------------------------------------------
// Expressions

CallArgs Interpreter::EvalArgs(const Expr& expr, Scope& scope, size_t first_arg) {
  CallArgs args;
  const size_t num_keywords = expr.kwarg_names.size();
  const size_t first_keyword = expr.children.size() - num_keywords;
  for (size_t i = first_arg; i < first_keyword; ++i) {
    args.positional.push_back(Eval(*expr.children[i], scope));
  }
  for (size_t k = 0; k < num_keywords; ++k) {
    args.keywords.emplace_back(expr.kwarg_names[k], Eval(*expr.children[first_keyword + k], scope));
  }
  return args;
}

Value Interpreter::EvalBuiltin(const Expr& expr, const Value& subject, Scope& scope) {
  CallArgs args = EvalArgs(expr, scope, 1);
  line_ = expr.line;
  if (expr.builtin == nullptr) {
    Unsupported(Cat(expr.kind == ExprKind::kFilter ? "filter '" : "test '", expr.name,
                    "' is not supported by this interpreter"));
  }
  return expr.builtin(*this, subject, args);
}

const Value& Interpreter::EvalRef(const Expr& expr, Scope& scope, Value& tmp) {
  switch (expr.kind) {
    case ExprKind::kConst:
      Tick();
      return expr.constant;
    case ExprKind::kName: {
      Tick();
      if (const Value* v = scope.Find(expr.symbol)) return *v;
      break;
    }
    case ExprKind::kGetAttr:
    case ExprKind::kGetItem: {
      // Items of dicts and lists are immutable, so a reference into one is stable while the
      // subject lives; a subject held only by `inner` cannot lend references past this frame.
      DepthGuard guard(this);
      Tick();
      Value inner;
      const Value& subject = EvalRef(*expr.children[0], scope, inner);
      line_ = expr.line;
      const Value* found = nullptr;
      if (expr.kind == ExprKind::kGetAttr) {
        if (subject.is_dict() && !(expr.method_owners & kDictMethodOwner)) {
          found = subject.as_dict().Find(expr.name);
          if (found == nullptr) {
            tmp = Value::UndefinedDictAttribute(&expr.name);
            return tmp;
          }
        }
        if (found == nullptr) {
          tmp = GetAttr(subject, expr.name, expr.method_owners);
          return tmp;
        }
      } else {
        const Expr& key_expr = *expr.children[1];
        if (key_expr.kind == ExprKind::kSlice) {
          tmp = Slice(subject, key_expr, scope);
          return tmp;
        }
        Value key_tmp;
        const Value& key = EvalRef(key_expr, scope, key_tmp);
        line_ = expr.line;
        if (subject.is_dict() && key.is_string()) found = subject.as_dict().Find(key.as_string());
        if (found == nullptr) {
          tmp = GetItem(subject, key);
          return tmp;
        }
      }
      if (&subject == &inner) {
        tmp = *found;
        return tmp;
      }
      return *found;
    }
    default:
      break;
  }
  tmp = Eval(expr, scope);
  return tmp;
}

Value Interpreter::Eval(const Expr& expr, Scope& scope) {
  DepthGuard guard(this);
  Tick();
  line_ = expr.line;
  switch (expr.kind) {
    case ExprKind::kConst:
      return expr.constant;
    case ExprKind::kName: {
      const Value* v = scope.Find(expr.symbol);
      return v != nullptr ? *v : Value::UndefinedName(&expr.name);
    }
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(expr.children.size());
      for (const auto& child : expr.children) items.push_back(Eval(*child, scope));
      return Value::List(std::move(items), expr.kind == ExprKind::kTuple);
    }
    case ExprKind::kDict: {
      DictData dict;
      for (size_t i = 0; i + 1 < expr.children.size(); i += 2) {
        const Value key = Eval(*expr.children[i], scope);
        if (!key.is_string()) {
          Unsupported(
              Cat("dict keys of type ", py::TypeName(key), " are not supported (strings only)"));
        }
        dict.Set(std::string(key.as_string()), Eval(*expr.children[i + 1], scope));
      }
      return Value::Dict(std::move(dict));
    }
    case ExprKind::kGetAttr:
    case ExprKind::kGetItem: {
      Value tmp;
      const Value& v = EvalRef(expr, scope, tmp);
      return &v == &tmp ? std::move(tmp) : v;
    }
    case ExprKind::kSlice:
      Unsupported("a slice outside of [] is not supported");
    case ExprKind::kCall:
      return EvalCall(expr, scope);
    case ExprKind::kFilter: {
      if (expr.children[0] == nullptr) {
        if (block_text_ == nullptr) Unsupported("filter without a subject");
        return EvalBuiltin(expr, *block_text_, scope);
      }
      Value tmp;
      return EvalBuiltin(expr, EvalRef(*expr.children[0], scope, tmp), scope);
    }
    case ExprKind::kTest: {
      Value tmp;
      return Value::Bool(
          py::Truthy(EvalBuiltin(expr, EvalRef(*expr.children[0], scope, tmp), scope)));
    }
    case ExprKind::kNot: {
      Value tmp;
      return Value::Bool(!py::Truthy(EvalRef(*expr.children[0], scope, tmp)));
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = Eval(*expr.children[0], scope);
      if (v.is_undefined()) UndefinedError(v);
      if (!v.is_number()) {
        TypeError(Cat("bad operand type for unary ", expr.kind == ExprKind::kNeg ? "-" : "+", ": '",
                      py::TypeName(v), "'"));
      }
      if (expr.kind == ExprKind::kPos) return v.is_bool() ? Value::Int(v.as_int()) : v;
      if (v.is_float()) return Value::Float(-v.as_float());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) IntegerOverflow();
      return Value::Int(-v.as_int());
    }
    case ExprKind::kBinary: {
      if (expr.binary_op == BinaryOp::kAdd) return EvalAddChain(expr, scope);
      Value tmp_a, tmp_b;
      const Value& a = EvalRef(*expr.children[0], scope, tmp_a);
      const Value& b = EvalRef(*expr.children[1], scope, tmp_b);
      line_ = expr.line;
      return Binary(expr.binary_op, a, b);
    }
    case ExprKind::kConcat: {
      std::string text;
      for (const auto& child : expr.children) {
        Value tmp;
        py::AppendStr(EvalRef(*child, scope, tmp), &text);
      }
      return MakeString(std::move(text));
    }
    case ExprKind::kCompare: {
      if (expr.compare_ops.size() == 1) {  // the common case, without copies
        Value tmp_a, tmp_b;
        const Value& a = EvalRef(*expr.children[0], scope, tmp_a);
        const Value& b = EvalRef(*expr.children[1], scope, tmp_b);
        line_ = expr.line;
        return Value::Bool(CompareOp(expr.compare_ops[0], a, b));
      }
      Value left = Eval(*expr.children[0], scope);
      for (size_t i = 0; i < expr.compare_ops.size(); ++i) {
        Value right = Eval(*expr.children[i + 1], scope);
        line_ = expr.line;
        if (!CompareOp(expr.compare_ops[i], left, right)) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case ExprKind::kAnd:
    case ExprKind::kOr: {
      Value tmp;
      const Value& left = EvalRef(*expr.children[0], scope, tmp);
      if (py::Truthy(left) == (expr.kind == ExprKind::kOr)) return left;
      return Eval(*expr.children[1], scope);
    }
    case ExprKind::kCondExpr: {
      Value tmp;
      if (py::Truthy(EvalRef(*expr.children[1], scope, tmp))) return Eval(*expr.children[0], scope);
      if (expr.children[2] != nullptr) return Eval(*expr.children[2], scope);
      return Value::Undefined(Cat("the inline if-expression on line ", expr.line,
                                  " evaluated to false and no else section was defined"));
    }
  }
  return Value();
}

Value Interpreter::EvalCall(const Expr& expr, Scope& scope) {
  const Expr& callee_expr = *expr.children[0];
  Value callee;
  if (callee_expr.kind == ExprKind::kGetAttr && callee_expr.method_owners != 0) {
    // `text.split(...)`: call the method directly instead of building a bound method first.
    Value tmp;
    const Value& object = EvalRef(*callee_expr.children[0], scope, tmp);
    BuiltinFn fn = nullptr;
    if (object.is_string()) {
      fn = callee_expr.str_method;
    } else if (object.is_list()) {
      const bool tuple_copy = object.as_list().is_tuple && callee_expr.name == "copy";
      fn = tuple_copy ? nullptr : callee_expr.list_method;  // tuples have no copy()
    } else if (object.is_dict()) {
      fn = callee_expr.dict_method;
    }
    if (fn != nullptr) {
      CallArgs args = EvalArgs(expr, scope, 1);
      line_ = expr.line;
      Tick();
      return fn(*this, object, args);
    }
    callee = GetAttr(object, callee_expr.name, callee_expr.method_owners);
  } else {
    callee = Eval(callee_expr, scope);
  }
  CallArgs args = EvalArgs(expr, scope, 1);
  line_ = expr.line;
  return CallValue(callee, args);
}

bool Interpreter::AppendParts(const Expr& expr, Scope& scope, std::string* out) {
  const bool is_add = expr.kind == ExprKind::kBinary && expr.binary_op == BinaryOp::kAdd;
  if (!is_add && expr.kind != ExprKind::kConcat) return false;
  DepthGuard guard(this);
  Tick();
  if (expr.kind == ExprKind::kConcat) {  // ~ prints each part with str()
    for (const auto& child : expr.children) {
      Value tmp;
      const Value& part = EvalRef(*child, scope, tmp);
      if (part.is_string()) {
        Append(part.as_string(), out);
      } else {
        std::string text;
        py::AppendStr(part, &text);
        Append(text, out);
      }
    }
    return true;
  }
  AddOperands operands;
  CollectAddOperands(expr, scope, &operands);
  line_ = expr.line;
  if (!operands.all_strings) {
    const Value sum = SumOperands(operands);
    std::string text;
    py::AppendStr(sum, &text);
    Append(text, out);
    return true;
  }
  for (const Value* v : operands.values) Append(v->as_string(), out);
  return true;
}

void Interpreter::CollectAddOperands(const Expr& expr, Scope& scope, AddOperands* operands) {
  absl::InlinedVector<const Expr*, 8> exprs;
  const Expr* node = &expr;
  while (node->kind == ExprKind::kBinary && node->binary_op == BinaryOp::kAdd) {
    exprs.push_back(node->children[1].get());
    node = node->children[0].get();
  }
  exprs.push_back(node);
  std::reverse(exprs.begin(), exprs.end());
  operands->temps.resize(exprs.size());
  for (size_t i = 0; i < exprs.size(); ++i) {
    operands->values.push_back(&EvalRef(*exprs[i], scope, operands->temps[i]));
    const Value& v = *operands->values.back();
    operands->all_strings = operands->all_strings && v.is_string();
    if (operands->all_strings) operands->total_bytes += v.as_string().size();
  }
}

Value Interpreter::SumOperands(const AddOperands& operands) {
  Value sum = *operands.values[0];
  for (size_t i = 1; i < operands.values.size(); ++i) {
    sum = Binary(BinaryOp::kAdd, sum, *operands.values[i]);
  }
  return sum;
}

Value Interpreter::EvalAddChain(const Expr& expr, Scope& scope) {
  // a + b + c + ... parses left-deep. The operands are evaluated in order first; when all are
  // strings they are joined into one buffer sized once, otherwise Python's '+' applies pairwise.
  // (An error stays an error either way; only which one Python would raise first may differ.)
  AddOperands operands;
  CollectAddOperands(expr, scope, &operands);
  line_ = expr.line;
  if (!operands.all_strings) return SumOperands(operands);
  if (static_cast<int64_t>(operands.total_bytes) > options_.limits.max_output_bytes) {
    StringLimitExceeded();
  }
  std::string joined;
  joined.reserve(operands.total_bytes);
  for (const Value* v : operands.values) joined += v->as_string();
  return MakeString(std::move(joined));
}

Value Interpreter::CallValue(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) UndefinedError(callee);
  auto* callable = callee.is_object() ? callee.as_object()->AsCallable() : nullptr;
  if (callable == nullptr) {
    TypeError(Cat("'", py::TypeName(callee), "' object is not callable"));
  }
  Tick();
  // Keep the callee alive even if the call rebinds the variable that held it.
  const Value keep = callee;
  return callable->Call(*this, args);
}

Value Interpreter::ApplyFilter(std::string_view name, const Value& value, CallArgs& args) {
  const BuiltinFn fn = FindFilter(name);
  if (fn == nullptr) {
    Unsupported(Cat("filter '", name, "' is not supported by this interpreter"));
  }
  return fn(*this, value, args);
}

bool Interpreter::ApplyTest(std::string_view name, const Value& value, CallArgs& args) {
  const BuiltinFn fn = FindTest(name);
  if (fn == nullptr) {
    Unsupported(Cat("test '", name, "' is not supported by this interpreter"));
  }
  return py::Truthy(fn(*this, value, args));
}

Value Interpreter::GetAttr(const Value& object, std::string_view name) {
  return GetAttr(object, name, MethodOwners(name));
}

Value Interpreter::GetAttr(const Value& object, std::string_view name, uint8_t method_owners) {
  Value method;
  switch (object.kind()) {
    case Value::Kind::kUndefined:
      UndefinedError(object);
    case Value::Kind::kDict: {
      if ((method_owners & kDictMethodOwner) &&
          FindMethod(object, name, &method) == MethodLookup::kFound) {
        return method;
      }
      const Value* v = object.as_dict().Find(name);
      if (v != nullptr) return *v;
      return Value::Undefined(Cat("'dict object' has no attribute '", name, "'"));
    }
    case Value::Kind::kString:
    case Value::Kind::kList:
      if ((method_owners & (kStrMethodOwner | kListMethodOwner)) &&
          FindMethod(object, name, &method) == MethodLookup::kFound) {
        return method;
      }
      break;
    case Value::Kind::kObject:
      if (object.as_object()->GetAttribute(name, &method)) return method;
      break;
    default:
      break;
  }
  return Value::Undefined(Cat("'", py::TypeName(object), " object' has no attribute '", name, "'"));
}

Value Interpreter::GetItem(const Value& object, const Value& key) {
  if (object.is_undefined()) UndefinedError(object);
  int64_t index = 0;
  switch (object.kind()) {
    case Value::Kind::kDict:
      if (key.is_string()) {
        const Value* v = object.as_dict().Find(key.as_string());
        if (v != nullptr) return *v;
      }
      break;
    case Value::Kind::kList:
      if (AsIndex(key, &index)) {
        const auto& items = object.as_list().items;
        const auto n = static_cast<int64_t>(items.size());
        if (index < 0) index += n;
        if (index >= 0 && index < n) return items[static_cast<size_t>(index)];
        return Value::Undefined(
            Cat("'", py::TypeName(object), " object' has no element ", key.as_int()));
      }
      break;
    case Value::Kind::kString:
      if (AsIndex(key, &index)) {
        const std::string_view s = object.as_string();
        const std::vector<size_t> offsets = py::CodePointOffsets(s);
        const auto n = static_cast<int64_t>(offsets.size()) - 1;
        if (index < 0) index += n;
        if (index >= 0 && index < n) {
          const auto i = static_cast<size_t>(index);
          return Value::Substring(object, s.substr(offsets[i], offsets[i + 1] - offsets[i]));
        }
        return Value::Undefined(Cat("'str object' has no element ", key.as_int()));
      }
      break;
    default:
      break;
  }
  // jinja2 falls back to an attribute for string keys (so d['items'] finds the method).
  if (key.is_string()) return GetAttr(object, key.as_string());
  std::string shown;
  py::AppendRepr(key, &shown);
  return Value::Undefined(Cat("'", py::TypeName(object), " object' has no element ", shown));
}

Value Interpreter::Slice(const Value& object, const Expr& slice, Scope& scope) {
  std::optional<int64_t> bounds[3];
  for (int k = 0; k < 3; ++k) {
    if (slice.children[k] == nullptr) continue;
    const Value v = Eval(*slice.children[k], scope);
    if (v.is_none()) continue;
    int64_t i = 0;
    if (!AsIndex(v, &i)) {
      TypeError("slice indices must be integers or None or have an __index__ method");
    }
    bounds[k] = i;
  }
  line_ = slice.line;
  const int64_t step = bounds[2].value_or(1);
  if (step == 0) TypeError("slice step cannot be zero");
  if (object.is_undefined()) UndefinedError(object);
  const auto pick = [&](int64_t length, auto&& take) {
    int64_t start = 0, stop = 0;
    AdjustSlice(length, bounds[0], bounds[1], step, &start, &stop);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      take(static_cast<size_t>(i));
    }
  };
  if (object.is_list()) {
    const ListData& list = object.as_list();
    std::vector<Value> items;
    pick(static_cast<int64_t>(list.items.size()),
         [&](size_t i) { items.push_back(list.items[i]); });
    Tick(static_cast<int64_t>(items.size() / 16));
    return Value::List(std::move(items), list.is_tuple);
  }
  if (object.is_string()) {
    const std::string_view s = object.as_string();
    const std::vector<size_t> offsets = py::CodePointOffsets(s);
    if (step == 1) {  // contiguous: a view of the same storage
      int64_t start = 0, stop = 0;
      AdjustSlice(static_cast<int64_t>(offsets.size()) - 1, bounds[0], bounds[1], 1, &start, &stop);
      if (stop <= start) return Value::String("");
      const size_t begin = offsets[static_cast<size_t>(start)];
      return Value::Substring(object, s.substr(begin, offsets[static_cast<size_t>(stop)] - begin));
    }
    std::string out;
    pick(static_cast<int64_t>(offsets.size()) - 1,
         [&](size_t i) { out.append(s, offsets[i], offsets[i + 1] - offsets[i]); });
    return MakeString(std::move(out));
  }
  return Value::Undefined(Cat("'", py::TypeName(object), "' object is not subscriptable"));
}

std::vector<Value> Interpreter::Iterate(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      Tick(static_cast<int64_t>(value.as_list().items.size() / 16));
      return value.as_list().items;
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& entry : value.as_dict().entries) keys.push_back(Value::String(entry.first));
      return keys;
    }
    case Value::Kind::kString: {
      const std::string_view s = value.as_string();
      std::vector<Value> chars;
      const std::vector<size_t> offsets = py::CodePointOffsets(s);
      for (size_t i = 0; i + 1 < offsets.size(); ++i) {
        chars.push_back(Value::Substring(value, s.substr(offsets[i], offsets[i + 1] - offsets[i])));
      }
      Tick(static_cast<int64_t>(chars.size() / 16));
      return chars;
    }
    case Value::Kind::kObject:
      if (auto* gen = value.as_object()->AsGenerator()) return gen->TakeAll();
      [[fallthrough]];
    default:
      TypeError(Cat("'", py::TypeName(value), "' object is not iterable"));
  }
}

bool Interpreter::Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        TypeError(Cat("'in <string>' requires string as left operand, not ", py::TypeName(item)));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kDict:
      return item.is_string() && container.as_dict().Find(item.as_string()) != nullptr;
    case Value::Kind::kList:
      for (const Value& v : container.as_list().items) {
        if (py::Equal(v, item)) return true;
      }
      return false;
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kObject:
      if (auto* gen = container.as_object()->AsGenerator()) {
        for (const Value* v = gen->TakeOne(); v != nullptr; v = gen->TakeOne()) {
          if (py::Equal(*v, item)) return true;
        }
        return false;
      }
      [[fallthrough]];
    default:
      TypeError(Cat("argument of type '", py::TypeName(container), "' is not iterable"));
  }
}

bool Interpreter::CompareOp(jinja::CompareOp op, const Value& a, const Value& b) {
  switch (op) {
    case CompareOp::kEq:
      return py::Equal(a, b);
    case CompareOp::kNe:
      return !py::Equal(a, b);
    case CompareOp::kIn:
      return Contains(b, a);
    case CompareOp::kNotIn:
      return !Contains(b, a);
    default:
      break;
  }
  if (a.is_undefined()) UndefinedError(a);
  if (b.is_undefined()) UndefinedError(b);
  const int c = py::Compare(a, b);
  switch (op) {
    case CompareOp::kLt:
      return c < 0;
    case CompareOp::kLe:
      return c <= 0;
    case CompareOp::kGt:
      return c > 0;
    case CompareOp::kGe:
      return c >= 0;
    default:
      return false;
  }
}

Value Interpreter::Binary(BinaryOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) UndefinedError(a);
  if (b.is_undefined()) UndefinedError(b);
  static constexpr const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "**"};
  const auto unsupported_types = [&]() -> Value {
    TypeError(Cat("unsupported operand type(s) for ", kSymbols[static_cast<int>(op)], ": '",
                  py::TypeName(a), "' and '", py::TypeName(b), "'"));
  };
  if (a.is_number() && b.is_number()) {
    const bool floats = a.is_float() || b.is_float();
    const int64_t x = a.as_int(), y = b.as_int();
    int64_t r = 0;
    switch (op) {
      case BinaryOp::kAdd:
        if (floats) return Value::Float(a.as_float() + b.as_float());
        if (__builtin_add_overflow(x, y, &r)) IntegerOverflow();
        return Value::Int(r);
      case BinaryOp::kSub:
        if (floats) return Value::Float(a.as_float() - b.as_float());
        if (__builtin_sub_overflow(x, y, &r)) IntegerOverflow();
        return Value::Int(r);
      case BinaryOp::kMul:
        if (floats) return Value::Float(a.as_float() * b.as_float());
        if (__builtin_mul_overflow(x, y, &r)) IntegerOverflow();
        return Value::Int(r);
      case BinaryOp::kDiv:
        if (b.as_float() == 0) TypeError("division by zero");
        return Value::Float(a.as_float() / b.as_float());
      case BinaryOp::kFloorDiv:
      case BinaryOp::kMod: {
        if (floats) {
          if (b.as_float() == 0) TypeError("float divmod()");
          double div = 0, mod = 0;
          FloatDivMod(a.as_float(), b.as_float(), &div, &mod);
          return Value::Float(op == BinaryOp::kFloorDiv ? div : mod);
        }
        if (y == 0) TypeError("integer division or modulo by zero");
        if (x == std::numeric_limits<int64_t>::min() && y == -1) IntegerOverflow();
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        return Value::Int(op == BinaryOp::kFloorDiv ? q : m);
      }
      case BinaryOp::kPow: {
        if (floats || y < 0) {
          if (a.as_float() == 0 && b.as_float() < 0) {
            TypeError("0.0 cannot be raised to a negative power");
          }
          return Value::Float(std::pow(a.as_float(), b.as_float()));
        }
        int64_t result = 1, base = x;
        for (int64_t e = y; e > 0; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(result, base, &result)) IntegerOverflow();
          if (e > 1 && __builtin_mul_overflow(base, base, &base)) IntegerOverflow();
        }
        return Value::Int(result);
      }
    }
  }
  switch (op) {
    case BinaryOp::kAdd:
      if (a.is_string() && b.is_string()) return MakeString(Cat(a.as_string(), b.as_string()));
      if (a.is_list() && b.is_list() && a.as_list().is_tuple == b.as_list().is_tuple) {
        std::vector<Value> items = a.as_list().items;
        items.insert(items.end(), b.as_list().items.begin(), b.as_list().items.end());
        Tick(static_cast<int64_t>(items.size() / 16));
        return Value::List(std::move(items), a.as_list().is_tuple);
      }
      return unsupported_types();
    case BinaryOp::kMul: {
      const Value& seq = a.is_number() ? b : a;
      const Value& times = a.is_number() ? a : b;
      if (!(times.is_int() || times.is_bool()) || !(seq.is_string() || seq.is_list())) {
        return unsupported_types();
      }
      const int64_t n = std::max<int64_t>(0, times.as_int());
      if (seq.is_string()) {
        const auto size = static_cast<int64_t>(seq.as_string().size());
        if (size > 0 && n > options_.limits.max_output_bytes / size) {
          Fail(absl::StatusCode::kResourceExhausted, "a string grew past the size limit");
        }
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.as_string();
        return MakeString(std::move(out));
      }
      const auto size = static_cast<int64_t>(seq.as_list().items.size());
      if (size > 0 && n > options_.limits.max_steps / size) BudgetExceeded();
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) {
        items.insert(items.end(), seq.as_list().items.begin(), seq.as_list().items.end());
      }
      Tick(static_cast<int64_t>(items.size()));
      return Value::List(std::move(items), seq.as_list().is_tuple);
    }
    case BinaryOp::kMod:
      if (a.is_string()) Unsupported("string formatting with % is not supported");
      return unsupported_types();
    default:
      return unsupported_types();
  }
}

}  // namespace dropkv::jinja
