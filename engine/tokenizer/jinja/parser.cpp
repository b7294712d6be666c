#include "engine/tokenizer/jinja/parser.h"

#include <algorithm>
#include <initializer_list>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer/jinja/builtins.h"
#include "engine/tokenizer/jinja/errors.h"

namespace dropkv::jinja {
namespace {

// Nesting bound for expressions and statements: the interpreter recurses as deep as the tree, so
// a template may not nest deeper than this (real templates stay below 20).
constexpr int kMaxNesting = 200;

struct ParseError {
  int line;
  std::string message;
};

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, SymbolTable* symbols)
      : tokens_(tokens), symbols_(symbols) {}

  Body Run(std::vector<std::string>* unsupported) {
    Body body = Subparse({});
    *unsupported = std::move(unsupported_);
    return body;
  }

 private:
  // ---- token stream ----
  const Token& Current() const { return tokens_[pos_]; }
  const Token& Look() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  static bool IsName(const Token& t, std::string_view name) {
    return t.type == TokenType::kName && t.value == name;
  }
  static bool IsOp(const Token& t, std::string_view op) {
    return t.type == TokenType::kOperator && t.value == op;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(Current(), name)) return false;
    Next();
    return true;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(Current(), op)) return false;
    Next();
    return true;
  }

  [[noreturn]] void Fail(std::string message, int line = -1) const {
    throw ParseError{line < 0 ? Current().line : line, std::move(message)};
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case TokenType::kData:
        return "template data";
      case TokenType::kVariableBegin:
        return "begin of print statement";
      case TokenType::kVariableEnd:
        return "end of print statement";
      case TokenType::kBlockBegin:
        return "begin of statement block";
      case TokenType::kBlockEnd:
        return "end of statement block";
      case TokenType::kEof:
        return "end of template";
      case TokenType::kString:
        return "string";
      case TokenType::kInteger:
      case TokenType::kFloat:
        return "number";
      default:
        return t.value;
    }
  }

  const Token& Expect(TokenType type, std::string_view what) {
    if (Current().type != type) {
      Fail(Cat("expected ", what, ", got '", Describe(Current()), "'"));
    }
    return Next();
  }
  void ExpectOp(std::string_view op) {
    if (!IsOp(Current(), op)) {
      Fail(Cat("expected '", op, "', got '", Describe(Current()), "'"));
    }
    Next();
  }
  const Token& ExpectName() { return Expect(TokenType::kName, "a name"); }
  void ExpectNameValue(std::string_view name) {
    if (!IsName(Current(), name)) {
      Fail(Cat("expected '", name, "', got '", Describe(Current()), "'"));
    }
    Next();
  }

  // Bounds recursion: every construct that can nest holds one of these.
  class Nesting {
   public:
    explicit Nesting(Parser* p, int amount = 1) : parser_(p), amount_(amount) {
      parser_->depth_ += amount_;
      if (parser_->depth_ > kMaxNesting) {
        parser_->Fail(Cat("the template nests deeper than ", kMaxNesting, " levels"));
      }
    }
    ~Nesting() { parser_->depth_ -= amount_; }

   private:
    Parser* parser_;
    int amount_;
  };

  static ExprPtr Make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // ---- statements ----
  Body Subparse(const std::vector<std::string_view>& end_tokens) {
    Nesting nesting(this);
    Body body;
    while (Current().type != TokenType::kEof) {
      const Token& token = Current();
      if (token.type == TokenType::kData) {
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = StmtKind::kText;
        stmt->line = token.line;
        stmt->text = token.value;
        body.push_back(std::move(stmt));
        Next();
      } else if (token.type == TokenType::kVariableBegin) {
        Next();
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = StmtKind::kOutput;
        stmt->line = token.line;
        stmt->expr = ParseTuple(/*simplified=*/false, /*with_condexpr=*/true, {}, false);
        Expect(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(stmt));
      } else if (token.type == TokenType::kBlockBegin) {
        Next();
        for (std::string_view end : end_tokens) {
          if (IsName(Current(), end)) return body;
        }
        ParseStatement(&body);
        Expect(TokenType::kBlockEnd, "end of statement block");
      } else {
        Fail(Cat("unexpected '", Describe(token), "'"));
      }
    }
    if (!end_tokens.empty()) {
      std::vector<std::string> quoted;
      for (std::string_view e : end_tokens) quoted.push_back(Cat("'", e, "'"));
      Fail(Cat("unexpected end of template; looking for ", absl::StrJoin(quoted, " or "),
               " (a block is not closed)"));
    }
    return body;
  }

  // parse_statements: optional ':', '%}', the body up to one of `end_tokens`; with
  // `drop_needle` the end name is consumed.
  Body ParseStatements(const std::vector<std::string_view>& end_tokens, bool drop_needle) {
    SkipOp(":");
    Expect(TokenType::kBlockEnd, "end of statement block");
    Body body = Subparse(end_tokens);
    if (drop_needle) Next();
    return body;
  }

  void ParseStatement(Body* body) {
    const Token& token = Current();
    if (token.type != TokenType::kName) Fail("tag name expected");
    const std::string tag = token.value;
    const int line = token.line;
    auto stmt = std::make_unique<Stmt>();
    stmt->line = line;
    if (tag == "for") {
      ParseFor(stmt.get());
    } else if (tag == "if") {
      ParseIf(stmt.get());
    } else if (tag == "set") {
      ParseSet(stmt.get());
    } else if (tag == "macro") {
      ParseMacro(stmt.get());
    } else if (tag == "call") {
      ParseCallBlock(stmt.get());
    } else if (tag == "filter") {
      Next();
      stmt->kind = StmtKind::kFilterBlock;
      stmt->expr = ParseFilter(nullptr, /*start_inline=*/true);
      stmt->body = ParseStatements({"endfilter"}, true);
    } else if (tag == "with") {
      ParseWith(stmt.get());
    } else if (tag == "print") {
      Next();
      for (bool first = true; Current().type != TokenType::kBlockEnd; first = false) {
        if (!first) ExpectOp(",");
        auto out = std::make_unique<Stmt>();
        out->kind = StmtKind::kOutput;
        out->line = line;
        out->expr = ParseExpression(true);
        body->push_back(std::move(out));
      }
      return;
    } else if (tag == "break" || tag == "continue") {
      Next();
      if (loop_depth_ == 0) Fail(Cat("'", tag, "' outside a for loop"), line);
      stmt->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
    } else if (tag == "generation") {
      Next();
      stmt->kind = StmtKind::kScope;
      stmt->body = ParseStatements({"endgeneration"}, true);
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "autoescape") {
      Fail(Cat("'", tag, "' is not supported in chat templates"), line);
    } else {
      Fail(Cat("encountered unknown tag '", tag, "'"), line);
    }
    body->push_back(std::move(stmt));
  }

  void ParseFor(Stmt* stmt) {
    Next();
    stmt->kind = StmtKind::kFor;
    stmt->target = ParseAssignTarget(/*with_namespace=*/false, {"in"});
    ExpectNameValue("in");
    stmt->expr = ParseTuple(false, /*with_condexpr=*/false, {"recursive"}, false);
    if (SkipName("if")) stmt->condition = ParseExpression(true);
    if (IsName(Current(), "recursive")) Fail("recursive for loops are not supported");
    ++loop_depth_;
    stmt->body = ParseStatements({"endfor", "else"}, false);
    --loop_depth_;
    if (Next().value != "endfor") {
      // `break` in the else branch belongs to an enclosing loop, as in Python.
      stmt->else_body = ParseStatements({"endfor"}, true);
    }
  }

  void ParseIf(Stmt* stmt) {
    Next();
    stmt->kind = StmtKind::kIf;
    while (true) {
      IfBranch branch;
      branch.condition = ParseTuple(false, /*with_condexpr=*/false, {}, false);
      branch.body = ParseStatements({"elif", "else", "endif"}, false);
      stmt->branches.push_back(std::move(branch));
      const Token& token = Next();
      if (token.value == "elif") continue;
      if (token.value == "else") stmt->else_body = ParseStatements({"endif"}, true);
      break;
    }
  }

  void ParseSet(Stmt* stmt) {
    Next();
    stmt->target = ParseAssignTarget(/*with_namespace=*/true, {});
    if (SkipOp("=")) {
      stmt->kind = StmtKind::kSet;
      stmt->expr = ParseTuple(false, true, {}, false);
      return;
    }
    stmt->kind = StmtKind::kSetBlock;
    stmt->expr = ParseFilter(nullptr, /*start_inline=*/false);
    stmt->body = ParseStatements({"endset"}, true);
  }

  void ParseWith(Stmt* stmt) {
    Next();
    stmt->kind = StmtKind::kWith;
    while (Current().type != TokenType::kBlockEnd) {
      if (!stmt->with_targets.empty()) ExpectOp(",");
      stmt->with_targets.push_back(ParseAssignTarget(false, {}));
      ExpectOp("=");
      stmt->with_values.push_back(ParseExpression(true));
    }
    stmt->body = ParseStatements({"endwith"}, true);
  }

  // Tracks which of caller / varargs / kwargs a macro or call block body mentions.
  struct MacroScope {
    bool caller = false, varargs = false, kwargs = false;
  };

  void ParseSignature(Stmt* stmt) {
    ExpectOp("(");
    while (!IsOp(Current(), ")")) {
      if (!stmt->params.empty()) ExpectOp(",");
      stmt->params.push_back(ExpectName().value);
      stmt->param_symbols.push_back(symbols_->Intern(stmt->params.back()));
      if (SkipOp("=")) {
        stmt->defaults.push_back(ParseExpression(true));
      } else if (!stmt->defaults.empty()) {
        Fail("non-default argument follows default argument");
      }
    }
    ExpectOp(")");
  }

  void ParseMacroBody(Stmt* stmt, std::string_view end) {
    macro_scopes_.emplace_back();
    const int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;  // break / continue do not cross a macro
    stmt->body = ParseStatements({end}, true);
    loop_depth_ = saved_loop_depth;
    stmt->uses_caller = macro_scopes_.back().caller;
    stmt->uses_varargs = macro_scopes_.back().varargs;
    stmt->uses_kwargs = macro_scopes_.back().kwargs;
    macro_scopes_.pop_back();
  }

  void ParseMacro(Stmt* stmt) {
    Next();
    stmt->kind = StmtKind::kMacro;
    stmt->name = ExpectName().value;
    stmt->symbol = symbols_->Intern(stmt->name);
    ParseSignature(stmt);
    ParseMacroBody(stmt, "endmacro");
  }

  void ParseCallBlock(Stmt* stmt) {
    Next();
    stmt->kind = StmtKind::kCallBlock;
    if (IsOp(Current(), "(")) ParseSignature(stmt);
    const int line = Current().line;
    stmt->expr = ParseExpression(true);
    if (stmt->expr->kind != ExprKind::kCall) Fail("expected call", line);
    ParseMacroBody(stmt, "endcall");
  }

  Target ToTarget(const Expr& e) {
    Target t;
    if (e.kind == ExprKind::kName) {
      t.kind = Target::Kind::kName;
      t.name = e.name;
      t.symbol = e.symbol;
    } else if (e.kind == ExprKind::kTuple) {
      t.kind = Target::Kind::kTuple;
      for (const auto& item : e.children) t.items.push_back(ToTarget(*item));
    } else if (e.kind == ExprKind::kGetAttr && e.children[0] == nullptr) {  // namespace ref
      t.kind = Target::Kind::kNamespaceAttr;
      t.name = std::string(e.constant.as_string());
      t.symbol = symbols_->Intern(t.name);
      t.attr = e.name;
    } else {
      Fail("can't assign to this expression", e.line);
    }
    return t;
  }

  Target ParseAssignTarget(bool with_namespace, const std::vector<std::string_view>& extra_end) {
    ExprPtr target = ParseTuple(/*simplified=*/true, true, extra_end, false, with_namespace);
    return ToTarget(*target);
  }

  // ---- expressions ----
  ExprPtr ParseExpression(bool with_condexpr) {
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  ExprPtr ParseCondExpr() {
    int line = Current().line;
    ExprPtr expr1 = ParseOr();
    int chained = 0;
    while (SkipName("if")) {
      if (++chained > kMaxNesting) Fail("expression too long");
      ExprPtr expr2 = ParseOr();
      ExprPtr expr3;
      if (SkipName("else")) {
        Nesting nesting(this);
        expr3 = ParseCondExpr();
      }
      auto cond = Make(ExprKind::kCondExpr, line);
      cond->children.push_back(std::move(expr1));
      cond->children.push_back(std::move(expr2));
      cond->children.push_back(std::move(expr3));
      expr1 = std::move(cond);
      line = Current().line;
    }
    return expr1;
  }

  // Left-associative chains nest the tree one level per operator.
  ExprPtr Chain(ExprPtr left, ExprKind kind, int line, ExprPtr right) {
    auto node = Make(kind, line);
    node->children.push_back(std::move(left));
    node->children.push_back(std::move(right));
    return node;
  }

  ExprPtr ParseOr() {
    int line = Current().line;
    ExprPtr left = ParseAnd();
    for (int n = 0; SkipName("or"); ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      left = Chain(std::move(left), ExprKind::kOr, line, ParseAnd());
      line = Current().line;
    }
    return left;
  }

  ExprPtr ParseAnd() {
    int line = Current().line;
    ExprPtr left = ParseNot();
    for (int n = 0; SkipName("and"); ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      left = Chain(std::move(left), ExprKind::kAnd, line, ParseNot());
      line = Current().line;
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName(Current(), "not")) {
      Nesting nesting(this);
      const int line = Next().line;
      auto node = Make(ExprKind::kNot, line);
      node->children.push_back(ParseNot());
      return node;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const int line = Current().line;
    ExprPtr expr = ParseMath1();
    std::vector<CompareOp> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      const Token& t = Current();
      std::optional<CompareOp> op;
      if (t.type == TokenType::kOperator) {
        if (t.value == "==") op = CompareOp::kEq;
        if (t.value == "!=") op = CompareOp::kNe;
        if (t.value == "<") op = CompareOp::kLt;
        if (t.value == "<=") op = CompareOp::kLe;
        if (t.value == ">") op = CompareOp::kGt;
        if (t.value == ">=") op = CompareOp::kGe;
        if (op) Next();
      } else if (IsName(t, "in")) {
        op = CompareOp::kIn;
        Next();
      } else if (IsName(t, "not") && IsName(Look(), "in")) {
        op = CompareOp::kNotIn;
        Next();
        Next();
      }
      if (!op) break;
      if (ops.size() > static_cast<size_t>(kMaxNesting)) Fail("expression too long");
      ops.push_back(*op);
      operands.push_back(ParseMath1());
    }
    if (ops.empty()) return expr;
    auto node = Make(ExprKind::kCompare, line);
    node->children.push_back(std::move(expr));
    for (auto& operand : operands) node->children.push_back(std::move(operand));
    node->compare_ops = std::move(ops);
    return node;
  }

  ExprPtr Binary(ExprPtr left, BinaryOp op, int line, ExprPtr right) {
    auto node = Chain(std::move(left), ExprKind::kBinary, line, std::move(right));
    node->binary_op = op;
    return node;
  }

  ExprPtr ParseMath1() {
    int line = Current().line;
    ExprPtr left = ParseConcat();
    for (int n = 0; IsOp(Current(), "+") || IsOp(Current(), "-"); ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      const BinaryOp op = Next().value == "+" ? BinaryOp::kAdd : BinaryOp::kSub;
      left = Binary(std::move(left), op, line, ParseConcat());
      line = Current().line;
    }
    return left;
  }

  ExprPtr ParseConcat() {
    const int line = Current().line;
    std::vector<ExprPtr> args;
    args.push_back(ParseMath2());
    while (SkipOp("~")) args.push_back(ParseMath2());
    if (args.size() == 1) return std::move(args[0]);
    auto node = Make(ExprKind::kConcat, line);
    node->children = std::move(args);
    return node;
  }

  ExprPtr ParseMath2() {
    int line = Current().line;
    ExprPtr left = ParsePow();
    for (int n = 0;; ++n) {
      std::optional<BinaryOp> op;
      if (IsOp(Current(), "*")) op = BinaryOp::kMul;
      if (IsOp(Current(), "/")) op = BinaryOp::kDiv;
      if (IsOp(Current(), "//")) op = BinaryOp::kFloorDiv;
      if (IsOp(Current(), "%")) op = BinaryOp::kMod;
      if (!op) break;
      if (n > kMaxNesting) Fail("expression too long");
      Next();
      left = Binary(std::move(left), *op, line, ParsePow());
      line = Current().line;
    }
    return left;
  }

  ExprPtr ParsePow() {
    int line = Current().line;
    ExprPtr left = ParseUnary(true);
    for (int n = 0; SkipOp("**"); ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      left = Binary(std::move(left), BinaryOp::kPow, line, ParseUnary(true));
      line = Current().line;
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    Nesting nesting(this);
    const int line = Current().line;
    ExprPtr node;
    if (IsOp(Current(), "-") || IsOp(Current(), "+")) {
      const bool negative = Next().value == "-";
      node = Make(negative ? ExprKind::kNeg : ExprKind::kPos, line);
      node->children.push_back(ParseUnary(false));
    } else {
      node = ParsePrimary(false);
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary(bool with_namespace) {
    Nesting nesting(this);
    const Token& token = Current();
    const int line = token.line;
    if (token.type == TokenType::kName) {
      Next();
      auto node = Make(ExprKind::kConst, line);
      if (token.value == "true" || token.value == "True") {
        node->constant = Value::Bool(true);
      } else if (token.value == "false" || token.value == "False") {
        node->constant = Value::Bool(false);
      } else if (token.value == "none" || token.value == "None") {
        node->constant = Value::None();
      } else if (with_namespace && IsOp(Current(), ".")) {
        Next();
        // A namespace reference `ns.attr`: kGetAttr with no subject, the variable in constant.
        node->kind = ExprKind::kGetAttr;
        node->constant = Value::String(token.value);
        node->children.push_back(nullptr);
        node->name = ExpectName().value;
      } else {
        node->kind = ExprKind::kName;
        node->name = token.value;
        node->symbol = symbols_->Intern(node->name);
        NoteName(token.value);
      }
      return node;
    }
    if (token.type == TokenType::kString) {
      std::string text;
      while (Current().type == TokenType::kString) text += Next().value;  // adjacent literals
      auto node = Make(ExprKind::kConst, line);
      node->constant = Value::String(std::move(text));
      return node;
    }
    if (token.type == TokenType::kInteger || token.type == TokenType::kFloat) {
      Next();
      auto node = Make(ExprKind::kConst, line);
      node->constant = token.type == TokenType::kInteger ? Value::Int(token.int_value)
                                                         : Value::Float(token.float_value);
      return node;
    }
    if (IsOp(token, "(")) {
      Next();
      ExprPtr node = ParseTuple(false, true, {}, /*explicit_parentheses=*/true);
      ExpectOp(")");
      return node;
    }
    if (IsOp(token, "[")) {
      Next();
      auto node = Make(ExprKind::kList, line);
      while (!IsOp(Current(), "]")) {
        if (!node->children.empty()) ExpectOp(",");
        if (IsOp(Current(), "]")) break;
        node->children.push_back(ParseExpression(true));
      }
      ExpectOp("]");
      return node;
    }
    if (IsOp(token, "{")) {
      Next();
      auto node = Make(ExprKind::kDict, line);
      while (!IsOp(Current(), "}")) {
        if (!node->children.empty()) ExpectOp(",");
        if (IsOp(Current(), "}")) break;
        node->children.push_back(ParseExpression(true));
        ExpectOp(":");
        node->children.push_back(ParseExpression(true));
      }
      ExpectOp("}");
      return node;
    }
    Fail(Cat("unexpected '", Describe(token), "'"));
  }

  void NoteName(const std::string& name) {
    if (macro_scopes_.empty()) return;
    if (name == "caller") macro_scopes_.back().caller = true;
    if (name == "varargs") macro_scopes_.back().varargs = true;
    if (name == "kwargs") macro_scopes_.back().kwargs = true;
  }

  bool IsTupleEnd(const std::vector<std::string_view>& extra_end) const {
    const Token& t = Current();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd || IsOp(t, ")")) {
      return true;
    }
    for (std::string_view name : extra_end) {
      if (IsName(t, name)) return true;
    }
    return false;
  }

  ExprPtr ParseTuple(bool simplified, bool with_condexpr,
                     const std::vector<std::string_view>& extra_end, bool explicit_parentheses,
                     bool with_namespace = false) {
    const int line = Current().line;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) ExpectOp(",");
      if (IsTupleEnd(extra_end)) break;
      args.push_back(simplified ? ParsePrimary(with_namespace) : ParseExpression(with_condexpr));
      if (IsOp(Current(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses) {
        Fail(Cat("expected an expression, got '", Describe(Current()), "'"));
      }
    }
    auto node = Make(ExprKind::kTuple, line);
    node->children = std::move(args);
    return node;
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    for (int n = 0;; ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      if (IsOp(Current(), ".") || IsOp(Current(), "[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp(Current(), "(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    for (int n = 0;; ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      if (IsOp(Current(), "|")) {
        node = ParseFilter(std::move(node), false);
      } else if (IsName(Current(), "is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp(Current(), "(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr node) {
    const Token& token = Next();
    if (token.value == ".") {
      const Token& attr = Next();
      if (attr.type == TokenType::kName) {
        auto out = Make(ExprKind::kGetAttr, token.line);
        out->children.push_back(std::move(node));
        out->name = attr.value;
        out->method_owners = MethodOwners(out->name);
        const MethodFns fns = FindMethodFns(out->name);
        out->str_method = fns.str;
        out->list_method = fns.list;
        out->dict_method = fns.dict;
        return out;
      }
      if (attr.type != TokenType::kInteger) Fail("expected name or number", attr.line);
      auto key = Make(ExprKind::kConst, attr.line);
      key->constant = Value::Int(attr.int_value);
      auto out = Make(ExprKind::kGetItem, token.line);
      out->children.push_back(std::move(node));
      out->children.push_back(std::move(key));
      return out;
    }
    // '['
    std::vector<ExprPtr> args;
    while (!IsOp(Current(), "]")) {
      if (!args.empty()) ExpectOp(",");
      args.push_back(ParseSubscribed());
    }
    ExpectOp("]");
    auto out = Make(ExprKind::kGetItem, token.line);
    out->children.push_back(std::move(node));
    if (args.size() == 1) {
      out->children.push_back(std::move(args[0]));
    } else {
      auto tuple = Make(ExprKind::kTuple, token.line);
      tuple->children = std::move(args);
      out->children.push_back(std::move(tuple));
    }
    return out;
  }

  ExprPtr ParseSubscribed() {
    const int line = Current().line;
    std::vector<ExprPtr> args;
    if (IsOp(Current(), ":")) {
      Next();
      args.push_back(nullptr);
    } else {
      ExprPtr node = ParseExpression(true);
      if (!IsOp(Current(), ":")) return node;
      Next();
      args.push_back(std::move(node));
    }
    const auto at_end = [&] { return IsOp(Current(), "]") || IsOp(Current(), ","); };
    if (IsOp(Current(), ":")) {
      args.push_back(nullptr);
    } else if (!at_end()) {
      args.push_back(ParseExpression(true));
    } else {
      args.push_back(nullptr);
    }
    if (IsOp(Current(), ":")) {
      Next();
      args.push_back(at_end() ? nullptr : ParseExpression(true));
    } else {
      args.push_back(nullptr);
    }
    auto slice = Make(ExprKind::kSlice, line);
    slice->children = std::move(args);
    return slice;
  }

  // Arguments of a call / filter / test into node->children (after children[0]).
  void ParseCallArgs(Expr* node) {
    ExpectOp("(");
    bool require_comma = false;
    while (!IsOp(Current(), ")")) {
      if (require_comma) {
        ExpectOp(",");
        if (IsOp(Current(), ")")) break;  // trailing comma
      }
      if (IsOp(Current(), "*") || IsOp(Current(), "**")) {
        Fail("*args / **kwargs in calls are not supported");
      }
      if (Current().type == TokenType::kName && IsOp(Look(), "=")) {
        std::string key = Next().value;
        Next();
        node->kwarg_names.push_back(std::move(key));
        node->children.push_back(ParseExpression(true));
      } else {
        if (!node->kwarg_names.empty()) Fail("invalid syntax for function call expression");
        node->children.push_back(ParseExpression(true));
      }
      require_comma = true;
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr callee) {
    auto node = Make(ExprKind::kCall, Current().line);
    node->children.push_back(std::move(callee));
    ParseCallArgs(node.get());
    return node;
  }

  std::string DottedName() {
    std::string name = ExpectName().value;
    while (SkipOp(".")) name += "." + ExpectName().value;
    return name;
  }

  ExprPtr ParseFilter(ExprPtr node, bool start_inline) {
    for (int n = 0; IsOp(Current(), "|") || start_inline; ++n) {
      if (n > kMaxNesting) Fail("expression too long");
      if (!start_inline) Next();
      start_inline = false;
      const int line = Current().line;
      auto filter = Make(ExprKind::kFilter, line);
      filter->name = DottedName();
      filter->builtin = FindFilter(filter->name);
      if (filter->builtin == nullptr) {
        unsupported_.push_back(Cat("line ", line, ": filter '", filter->name, "'"));
      }
      filter->children.push_back(std::move(node));
      if (IsOp(Current(), "(")) ParseCallArgs(filter.get());
      node = std::move(filter);
    }
    return node;
  }

  ExprPtr ParseTest(ExprPtr node) {
    const int line = Next().line;  // 'is'
    const bool negated = SkipName("not");
    auto test = Make(ExprKind::kTest, line);
    test->name = DottedName();
    test->builtin = FindTest(test->name);
    if (test->builtin == nullptr) {
      unsupported_.push_back(Cat("line ", line, ": test '", test->name, "'"));
    }
    test->children.push_back(std::move(node));
    const Token& t = Current();
    if (IsOp(t, "(")) {
      ParseCallArgs(test.get());
    } else if ((t.type == TokenType::kName || t.type == TokenType::kString ||
                t.type == TokenType::kInteger || t.type == TokenType::kFloat || IsOp(t, "[") ||
                IsOp(t, "{")) &&
               !IsName(t, "else") && !IsName(t, "or") && !IsName(t, "and")) {
      // One argument without parentheses: `x is divisibleby 3`, `x is sameas none`.
      if (IsName(t, "is")) Fail("You cannot chain multiple tests with is");
      test->children.push_back(ParsePostfix(ParsePrimary(false)));
    }
    if (!negated) return test;
    auto not_node = Make(ExprKind::kNot, line);
    not_node->children.push_back(std::move(test));
    return not_node;
  }

  const std::vector<Token>& tokens_;
  SymbolTable* symbols_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<MacroScope> macro_scopes_;
  std::vector<std::string> unsupported_;
};

}  // namespace

// absl::string_view is its own type here; the set hashes through it.
Symbol SymbolTable::Intern(std::string_view name) {
  return &*names_.emplace(name).first;
}

Symbol SymbolTable::Find(std::string_view name) const {
  const auto it = names_.find(absl::string_view(name.data(), name.size()));
  return it == names_.end() ? nullptr : &*it;
}

absl::StatusOr<std::unique_ptr<ParsedTemplate>> ParseTokens(const std::vector<Token>& tokens) {
  try {
    auto parsed = std::make_unique<ParsedTemplate>();
    parsed->body = Parser(tokens, &parsed->symbols).Run(&parsed->unsupported);
    parsed->loop = parsed->symbols.Find("loop");
    parsed->caller = parsed->symbols.Find("caller");
    parsed->varargs = parsed->symbols.Find("varargs");
    parsed->kwargs = parsed->symbols.Find("kwargs");
    return parsed;
  } catch (const ParseError& e) {
    return absl::InvalidArgumentError(Cat("line ", e.line, ": ", e.message));
  }
}

}  // namespace dropkv::jinja
