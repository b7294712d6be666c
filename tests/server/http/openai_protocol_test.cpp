// openai::ParseRequest's refusals that must name what the client sent: the nesting depth limit
// (before any parsing, so a deep body costs no memory) and integers beyond the proto's int32.
#include "server/http/openai_protocol.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <string>

namespace dropkv::openai {
namespace {

using ::testing::HasSubstr;

std::optional<ApiError> Parse(Endpoint endpoint, const std::string& body) {
  ParseOptions options;
  options.model_names = {"demo"};
  options.max_new_tokens_limit = 4096;
  ParsedRequest parsed;
  return ParseRequest(endpoint, body, options, &parsed);
}

int64_t PeakRssKiB() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

TEST(OpenaiProtocolTest, DeepNestingIsRefusedWithoutTheMemoryOfItsTree) {
  constexpr int kLevels = 1'000'000;
  const std::string deep = R"({"model": "demo", "prompt": "hi", "user": )" +
                           std::string(kLevels, '[') + std::string(kLevels, ']') + "}";
  const int64_t before_kib = PeakRssKiB();
  auto error = Parse(Endpoint::kCompletions, deep);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->http_status, 400);
  EXPECT_THAT(error->message, HasSubstr("deeper than 128 levels"));
  // Its tree would take tens of MB (about 75 on glibc); the check reads the text only.
  EXPECT_LT(PeakRssKiB() - before_kib, 8 * 1024);
  // At the limit (the body's object is level 1) it parses; brackets inside strings do not count.
  const auto nested_user = [](int levels) {
    return R"({"model": "demo", "prompt": "[[[{{{", "user": )" + std::string(levels, '[') +
           std::string(levels, ']') + "}";
  };
  error = Parse(Endpoint::kCompletions, nested_user(kMaxJsonDepth - 1));
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->message, "user: must be a string");
  error = Parse(Endpoint::kCompletions, nested_user(kMaxJsonDepth));
  ASSERT_TRUE(error.has_value());
  EXPECT_THAT(error->message, HasSubstr("deeper than 128 levels"));
  EXPECT_FALSE(Parse(Endpoint::kCompletions, R"({"model": "demo", "prompt": [[1, 2], [3]]})"));
}

TEST(OpenaiProtocolTest, IntegersBeyondInt32AreReportedAsSent) {
  auto error = Parse(Endpoint::kCompletions,
                     R"({"model": "demo", "prompt": "hi", "max_tokens": 4294967299})");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->param, "max_tokens");
  EXPECT_EQ(error->message, "max_tokens: must be in [1, 4096], got 4294967299");
  error = Parse(Endpoint::kChatCompletions,
                R"({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": -4294967299})");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->message, "max_completion_tokens: must be in [1, 4096], got -4294967299");
  error = Parse(Endpoint::kCompletions, R"({"model": "demo", "prompt": [1, 4294967296]})");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->param, "prompt");
  EXPECT_THAT(error->message, HasSubstr("prompt[1]: unknown token id 4294967296"));
  error = Parse(Endpoint::kCompletions,
                R"({"model": "demo", "prompt": [[1], [2, 18446744073709551615]]})");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->param, "prompt[1]");
  EXPECT_THAT(error->message, HasSubstr("18446744073709551615"));
  error = Parse(Endpoint::kCompletions,
                R"({"model": "demo", "prompt": "hi", "stop_token_ids": [2, -2147483649]})");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->param, "stop_token_ids");
  EXPECT_THAT(error->message, HasSubstr("stop_token_ids[1]: unknown token id -2147483649"));
}

}  // namespace
}  // namespace dropkv::openai
