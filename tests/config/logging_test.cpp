// Logging set-up: text lines by default, one valid JSON object per line with --log-format json,
// the per-request line carries id/status/tokens/timings/kept ratio, and no prompt text unless
// log_prompts. Output is captured with spdlog's ostream sink and parsed back.
#include "config/logging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>
#include <sstream>

namespace dropkv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

RequestLogRecord SampleRecord() {
  RequestLogRecord r;
  r.request_id = "req-42";
  r.status = "ok";
  r.finish_reason = "length";
  r.num_prompt_tokens = 120;
  r.num_generated_tokens = 16;
  r.queue_ms = 1.5;
  r.ttft_ms = 35.25;
  r.duration_ms = 410.0;
  r.kept_ratio = 0.125;
  r.prompt = "secret \"quoted\"\nsecond line \xc3\xa9";
  return r;
}

class LoggingTest : public ::testing::Test {
 protected:
  void TearDown() override {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>(
        "restore", std::make_shared<spdlog::sinks::stderr_color_sink_mt>()));
  }
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> Sink() {
    return std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
  }
  std::ostringstream out_;
};

TEST_F(LoggingTest, JsonModeWritesOneParsableObjectPerLine) {
  ASSERT_TRUE(SetUpLogging(LogFormat::kJson, "info", Sink()).ok());
  spdlog::info("plain message with \"quotes\" and\na newline");
  spdlog::debug("hidden at info");
  spdlog::warn("bad bytes \xff\xfe here");
  LogRequest(SampleRecord(), /*log_prompts=*/false);
  auto lines = Lines(out_.str());
  ASSERT_EQ(lines.size(), 3u) << out_.str();
  std::vector<nlohmann::json> objs;
  for (const auto& line : lines) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    EXPECT_TRUE(j.contains("ts") && j.contains("level") && j.contains("msg")) << line;
    objs.push_back(j);
  }
  EXPECT_EQ(objs[0]["msg"], "plain message with \"quotes\" and\na newline");
  EXPECT_EQ(objs[0]["level"], "info");
  EXPECT_EQ(objs[1]["level"], "warning");
  const auto& req = objs[2];
  EXPECT_EQ(req["msg"], "request");
  EXPECT_EQ(req["request_id"], "req-42");
  EXPECT_EQ(req["status"], "ok");
  EXPECT_EQ(req["finish_reason"], "length");
  EXPECT_EQ(req["prompt_tokens"], 120);
  EXPECT_EQ(req["generated_tokens"], 16);
  EXPECT_EQ(req["queue_ms"], 1.5);
  EXPECT_EQ(req["ttft_ms"], 35.25);
  EXPECT_EQ(req["duration_ms"], 410.0);
  EXPECT_EQ(req["kept_ratio"], 0.125);
  EXPECT_FALSE(req.contains("prompt"));
  EXPECT_THAT(out_.str(), Not(HasSubstr("secret")));
}

TEST_F(LoggingTest, JsonModeIncludesThePromptOnlyWhenAsked) {
  ASSERT_TRUE(SetUpLogging(LogFormat::kJson, "info", Sink()).ok());
  RequestLogRecord r = SampleRecord();
  r.ttft_ms.reset();
  r.kept_ratio.reset();
  LogRequest(r, /*log_prompts=*/true);
  auto j = nlohmann::json::parse(Lines(out_.str()).at(0));
  EXPECT_EQ(j["prompt"], r.prompt);  // quotes, newline and UTF-8 survive the round trip
  EXPECT_TRUE(j["ttft_ms"].is_null());
  EXPECT_TRUE(j["kept_ratio"].is_null());
}

TEST_F(LoggingTest, TextModeIsOneHumanReadableLinePerRequest) {
  ASSERT_TRUE(SetUpLogging(LogFormat::kText, "info", Sink()).ok());
  LogRequest(SampleRecord(), /*log_prompts=*/false);
  auto lines = Lines(out_.str());
  ASSERT_EQ(lines.size(), 1u) << out_.str();
  EXPECT_THAT(lines[0], HasSubstr("info"));
  EXPECT_THAT(lines[0], HasSubstr("request id=req-42 status=ok finish=length prompt_tokens=120 "
                                  "generated_tokens=16 queue_ms=1.5 ttft_ms=35.2"));
  EXPECT_THAT(lines[0], HasSubstr("duration_ms=410.0 kept_ratio=0.1250"));
  EXPECT_THAT(lines[0], Not(HasSubstr("secret")));
  out_.str("");
  LogRequest(SampleRecord(), /*log_prompts=*/true);
  lines = Lines(out_.str());
  ASSERT_EQ(lines.size(), 1u) << "the prompt's newline must be escaped: " << out_.str();
  EXPECT_THAT(lines[0], HasSubstr("prompt=\"secret \\\"quoted\\\"\\nsecond line"));
}

TEST_F(LoggingTest, LevelFiltersAndBadLevelNamesTheKey) {
  ASSERT_TRUE(SetUpLogging(LogFormat::kText, "warn", Sink()).ok());
  spdlog::info("not shown");
  LogRequest(SampleRecord(), false);
  spdlog::error("shown");
  EXPECT_EQ(Lines(out_.str()).size(), 1u) << out_.str();
  auto st = SetUpLogging(LogFormat::kText, "verbose", Sink());
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr("log_level"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("verbose"));
}

}  // namespace
}  // namespace dropkv
