// jinja/template.h on its own: render limits end loops and recursion that would hang, errors name
// the line and the construct, jinja2's scoping, and concurrent renders of one template. (Parity
// with jinja2 over real templates is chat_template_test.cpp's job.)
#include "engine/tokenizer/jinja/template.h"

#include <chrono>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace dropkv::jinja {
namespace {

using ojson = nlohmann::ordered_json;

absl::StatusOr<std::string> Render(const std::string& source, const ojson& variables = {},
                                   const RenderOptions& options = {}) {
  auto tmpl = Template::Parse(source);
  if (!tmpl.ok()) return tmpl.status();
  return (*tmpl)->Render(variables.is_null() ? ojson::object() : variables, options);
}

std::string RenderOk(const std::string& source, const ojson& variables = {}) {
  auto text = Render(source, variables);
  EXPECT_TRUE(text.ok()) << source << ": " << text.status();
  return text.value_or("<error>");
}

void ExpectError(const absl::StatusOr<std::string>& result, absl::StatusCode code,
                 const std::string& needle) {
  ASSERT_FALSE(result.ok()) << "rendered " << *result;
  EXPECT_EQ(result.status().code(), code) << result.status();
  EXPECT_NE(result.status().message().find(needle), std::string::npos)
      << "'" << needle << "' not in: " << result.status();
}

TEST(JinjaLimits, EndlessLoopsEndWithResourceExhausted) {
  const auto start = std::chrono::steady_clock::now();
  // 10^10 iterations as jinja2 would run them; the step budget stops it.
  ExpectError(Render("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}"
                     "{% endfor %}"),
              absl::StatusCode::kResourceExhausted, "steps");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  // A range past the sandbox's limit is refused up front, as jinja2's sandbox refuses it.
  ExpectError(Render("{% for i in range(10**9) %}{% endfor %}"), absl::StatusCode::kInvalidArgument,
              "MAX_RANGE");
}

TEST(JinjaLimits, RecursionEndsWithResourceExhausted) {
  ExpectError(Render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
              absl::StatusCode::kResourceExhausted, "recursion");
  ExpectError(Render("{% macro f(n) %}{% for i in [1, 2] %}{{ f(n) }}{% endfor %}{% endmacro %}"
                     "{{ f(0) }}"),
              absl::StatusCode::kResourceExhausted, "recursion");
}

TEST(JinjaLimits, OutputAndStringsAreBounded) {
  RenderOptions options;
  options.limits.max_output_bytes = 1 << 20;
  ExpectError(Render("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", {}, options),
              absl::StatusCode::kResourceExhausted, "output");
  // Doubling a string: each step is cheap, the size is not.
  ExpectError(Render("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
                     {}, options),
              absl::StatusCode::kResourceExhausted, "limit");
  ExpectError(Render("{{ 'ab' * 10**12 }}", {}, options), absl::StatusCode::kResourceExhausted,
              "limit");
  // Nesting a list in itself 1000 times.
  ExpectError(Render("{% set ns = namespace(v=[]) %}{% for i in range(1000) %}"
                     "{% set ns.v = [ns.v] %}{% endfor %}"),
              absl::StatusCode::kResourceExhausted, "nested");
}

TEST(JinjaLimits, SmallBudgetStopsLongTemplates) {
  RenderOptions options;
  options.limits.max_steps = 1000;
  ExpectError(Render("{% for i in range(5000) %}{{ i }}{% endfor %}", {}, options),
              absl::StatusCode::kResourceExhausted, "1000 steps");
  EXPECT_TRUE(Render("{% for i in range(50) %}{{ i }}{% endfor %}", {}, options).ok());
}

TEST(JinjaErrors, ParseErrorsNameLineAndConstruct) {
  ExpectError(Render("a\nb\n{% frobnicate %}"), absl::StatusCode::kInvalidArgument,
              "line 3: encountered unknown tag 'frobnicate'");
  ExpectError(Render("{% for x in y %}\n{{ x }}"), absl::StatusCode::kInvalidArgument, "'endfor'");
  ExpectError(Render("\n{% include 'other.jinja' %}"), absl::StatusCode::kInvalidArgument,
              "line 2: 'include' is not supported");
  ExpectError(Render("{{ 'unterminated }}"), absl::StatusCode::kInvalidArgument, "line 1");
  ExpectError(Render("{{ 1 + }}"), absl::StatusCode::kInvalidArgument, "line 1");
  ExpectError(Render("{% break %}"), absl::StatusCode::kInvalidArgument, "outside a for loop");
  ExpectError(Render("{{ 99999999999999999999 }}"), absl::StatusCode::kInvalidArgument, "64-bit");
  ExpectError(Render("{# open comment"), absl::StatusCode::kInvalidArgument, "comment");
  ExpectError(Render("{% raw %} no end"), absl::StatusCode::kInvalidArgument, "raw");
  // Nesting deeper than the parser allows is an error, not a stack overflow.
  ExpectError(Render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
              absl::StatusCode::kInvalidArgument, "nests deeper");
  ExpectError(Render("{{ " + std::string(5000, '-') + "1 }}"), absl::StatusCode::kInvalidArgument,
              "nests deeper");
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  ExpectError(Render(chain + " }}"), absl::StatusCode::kInvalidArgument, "too long");
}

TEST(JinjaErrors, RuntimeErrorsNameLineAndCause) {
  ExpectError(Render("line 1\n{{ missing.attr }}"), absl::StatusCode::kInvalidArgument,
              "line 2: 'missing' is undefined");
  ExpectError(Render("{{ raise_exception('Roles must alternate') }}"),
              absl::StatusCode::kInvalidArgument, "Roles must alternate");
  ExpectError(Render("{{ 'a' + 1 }}"), absl::StatusCode::kInvalidArgument, "'str' and 'int'");
  ExpectError(Render("{{ x.append(1) }}", {{"x", ojson::array()}}),
              absl::StatusCode::kInvalidArgument, "unsafe");
  // Constructs the interpreter lacks are FAILED_PRECONDITION, and only when reached.
  ExpectError(Render("\n\n{{ x | wordcount }}", {{"x", "a b"}}),
              absl::StatusCode::kFailedPrecondition, "line 3: filter 'wordcount'");
  EXPECT_EQ(RenderOk("{% if false %}{{ x | wordcount }}{% endif %}ok"), "ok");
  ExpectError(Render("{{ '%d items' % 3 }}"), absl::StatusCode::kFailedPrecondition, "%");
  ExpectError(Render("{{ {1: 'a'} }}"), absl::StatusCode::kFailedPrecondition, "dict keys");
  ExpectError(Render("{{ 'x'.format(1) }}"), absl::StatusCode::kFailedPrecondition, "format");
  ExpectError(Render("{{ 2 ** 70 }}"), absl::StatusCode::kFailedPrecondition, "64-bit");
  auto tmpl = Template::Parse("{{ a | wordcount }}{{ a is frobbed }}");
  ASSERT_TRUE(tmpl.ok());
  ASSERT_EQ((*tmpl)->unsupported().size(), 2u);
  EXPECT_EQ((*tmpl)->unsupported()[0], "line 1: filter 'wordcount'");
  EXPECT_EQ((*tmpl)->unsupported()[1], "line 1: test 'frobbed'");
  ExpectError(Render("{{ 1 }}", ojson::array()), absl::StatusCode::kInvalidArgument, "object");
}

TEST(JinjaSemantics, ScopingFollowsJinja2) {
  // Each loop iteration starts from the outer value; nothing leaks out of the loop.
  EXPECT_EQ(RenderOk("{% set x = 0 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}"
                     "{{ x }}"),
            "120");
  // `if` shares its scope; namespaces carry values out of loops.
  EXPECT_EQ(RenderOk("{% if true %}{% set y = 1 %}{% endif %}{{ y }}"
                     "{% set ns = namespace(n=0) %}{% for i in range(4) %}"
                     "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "16");
  // Macros see the defining scope when called.
  EXPECT_EQ(RenderOk("{% set y = 5 %}{% macro m() %}{{ y }}{% endmacro %}{% set y = 6 %}{{ m() }}"),
            "6");
  // A block set's body does not leak its assignments.
  EXPECT_EQ(RenderOk("{% set b %}{% set inner = 1 %}x{% endset %}{{ b }}{{ inner is defined }}"),
            "xFalse");
}

TEST(JinjaSemantics, GeneratorsAreSingleUse) {
  EXPECT_EQ(
      RenderOk("{% set g = xs | select('odd') %}{{ g | list }}{{ g | list }}", {{"xs", {1, 2, 3}}}),
      "[1, 3][]");
  // A generator is truthy even when empty, as in Python.
  EXPECT_EQ(RenderOk("{% if xs | select('odd') %}yes{% endif %}", {{"xs", {2, 4}}}), "yes");
  ExpectError(Render("{{ xs | select('odd') | length }}", {{"xs", {1}}}),
              absl::StatusCode::kInvalidArgument, "len");
}

TEST(JinjaSemantics, PythonFormatting) {
  EXPECT_EQ(RenderOk("{{ [1, 2.5, 'it\\'s', none, true, {'k': 1e-05}] }}"),
            "[1, 2.5, \"it's\", None, True, {'k': 1e-05}]");
  EXPECT_EQ(RenderOk("{{ 1e16 }} {{ 1e15 }} {{ 0.1 + 0.2 }} {{ 1 / 3 }} {{ (1,) }}"),
            "1e+16 1000000000000000.0 0.30000000000000004 0.3333333333333333 (1,)");
  EXPECT_EQ(RenderOk("{{ x | tojson }}", {{"x", {{"b", 1.0}, {"a", "é\n"}}}}),
            "{\"b\": 1.0, \"a\": \"é\\n\"}");
  EXPECT_EQ(RenderOk("{{ x | tojson(indent=2) }}", {{"x", {{"a", {1, 2}}}}}),
            "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
}

TEST(JinjaSemantics, StrftimeNowUsesTheGivenClock) {
  RenderOptions options;
  options.local_time = [] {
    std::tm tm{};
    tm.tm_year = 2024 - 1900;
    tm.tm_mon = 6;
    tm.tm_mday = 26;
    tm.tm_wday = 5;
    return tm;
  };
  auto text = Render("{{ strftime_now('%d %b %Y (%a)') }}", {}, options);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "26 Jul 2024 (Fri)");
}

TEST(JinjaTemplate, ConcurrentRendersOfOneTemplate) {
  auto tmpl = Template::Parse(
      "{% set ns = namespace(total=0) %}{% for m in messages %}{% set ns.total = ns.total + "
      "m.n %}{{ m.role | upper }}{% endfor %}={{ ns.total }}");
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      ojson messages = ojson::array();
      for (int i = 0; i <= t; ++i) messages.push_back({{"role", "u"}, {"n", i}});
      for (int k = 0; k < 200; ++k) {
        auto text = (*tmpl)->Render({{"messages", messages}});
        results[t] = text.value_or("error");
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) {
    EXPECT_EQ(results[t], std::string(t + 1, 'U') + "=" + std::to_string(t * (t + 1) / 2));
  }
}

}  // namespace
}  // namespace dropkv::jinja
