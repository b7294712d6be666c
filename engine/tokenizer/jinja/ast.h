// The parsed template: expressions and statements as jinja2's parser builds them (nodes.py),
// restricted to what chat templates use.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/node_hash_set.h"
#include "engine/tokenizer/jinja/value.h"

namespace dropkv::jinja {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using Body = std::vector<std::unique_ptr<Stmt>>;

// Variable names are interned per template: every mention of a name points at one string, so
// scopes compare pointers, and a variable the template never mentions is never looked up (Jinja
// has no dynamic lookup), so a render need not even convert it.
using Symbol = const std::string*;

class SymbolTable {
 public:
  Symbol Intern(std::string_view name);
  // Null when the template never mentions `name`.
  Symbol Find(std::string_view name) const;

 private:
  absl::node_hash_set<std::string> names_;  // node-based: the pointers stay valid
};

class Interpreter;
struct CallArgs;
// A filter: (interpreter, subject, arguments) -> result. Tests return a bool Value.
using BuiltinFn = Value (*)(Interpreter&, const Value&, CallArgs&);

enum class ExprKind : uint8_t {
  kConst,     // `constant`
  kName,      // `name`
  kList,      // children: items
  kTuple,     // children: items
  kDict,      // children: key0, value0, key1, value1, ...
  kGetAttr,   // children[0] . name
  kGetItem,   // children[0] [ children[1] ]
  kSlice,     // children: start, stop, step (each may be null); only as a GetItem key
  kCall,      // children[0] ( children[1..] ); the last kwarg_names.size() are keywords
  kFilter,    // children[0] | name ( children[1..] ); children[0] null: a filter block's text
  kTest,      // children[0] is name ( children[1..] )
  kNot,       // children[0]
  kNeg,       // children[0]
  kPos,       // children[0]
  kBinary,    // children[0] binary_op children[1]
  kConcat,    // children joined with ~
  kCompare,   // children[0] compare_ops[i] children[i + 1], chained as Python chains them
  kAnd,       // children[0] and children[1]
  kOr,        // children[0] or children[1]
  kCondExpr,  // children: value if true, condition, value if false (null: undefined)
};

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CompareOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  ExprKind kind;
  int line = 0;
  BinaryOp binary_op = BinaryOp::kAdd;
  std::vector<CompareOp> compare_ops;
  std::string name;
  Symbol symbol = nullptr;  // kName: `name` interned
  Value constant;
  std::vector<ExprPtr> children;
  std::vector<std::string> kwarg_names;
  BuiltinFn builtin = nullptr;  // kFilter / kTest: resolved at parse time (null: unknown name)
  uint8_t method_owners = 0;    // kGetAttr: MethodOwners(name), resolved at parse time
  // kGetAttr: the str / list / dict methods called `name` (FindMethodFns at parse time).
  BuiltinFn str_method = nullptr;
  BuiltinFn list_method = nullptr;
  BuiltinFn dict_method = nullptr;

  size_t num_positional_args() const { return children.size() - 1 - kwarg_names.size(); }
};

// Where `set`, `for` and `with` store values.
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::string name;           // kName; kNamespaceAttr: the namespace variable
  Symbol symbol = nullptr;    // `name` interned
  std::string attr;           // kNamespaceAttr
  std::vector<Target> items;  // kTuple
};

enum class StmtKind : uint8_t {
  kText,         // `text`
  kOutput,       // {{ expr }}
  kIf,           // branches, else_body
  kFor,          // for target in expr [if condition] body [else else_body]
  kSet,          // set target = expr
  kSetBlock,     // set target [| filter] body endset; expr: the filter chain or null
  kMacro,        // macro name(params) body
  kCallBlock,    // call[(params)] expr body: expr is called with `caller` = body
  kFilterBlock,  // filter expr body
  kWith,         // with targets = values body
  kBreak,
  kContinue,
  kScope,  // body rendered in place (transformers' {% generation %})
};

struct IfBranch {
  ExprPtr condition;
  Body body;
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  Target target;
  std::vector<IfBranch> branches;
  Body body;
  Body else_body;
  // Macros and call blocks: parameter names, and defaults for the last defaults.size() of them.
  std::string name;
  Symbol symbol = nullptr;  // kMacro: `name` interned
  std::vector<std::string> params;
  std::vector<Symbol> param_symbols;
  std::vector<ExprPtr> defaults;
  bool uses_caller = false;  // the body mentions `caller` / `varargs` / `kwargs`
  bool uses_varargs = false;
  bool uses_kwargs = false;
  // with
  std::vector<Target> with_targets;
  std::vector<ExprPtr> with_values;
};

}  // namespace dropkv::jinja
