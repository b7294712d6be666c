// RequestMetricsTracker and SchedulerStatsPoller: scripted GenerationEvents with a fake clock go
// in; the metrics text (parsed) and the request log line (JSON, parsed) come out and are checked
// against the script.
#include "server/metrics/request_metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "config/logging.h"
#include "tests/common/http_test_util.h"

namespace dropkv {
namespace {

using namespace std::chrono_literals;
using testing::ParsePrometheusText;

class RequestMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(SetUpLogging(LogFormat::kJson, "info",
                             std::make_shared<spdlog::sinks::ostream_sink_mt>(log_))
                    .ok());
    request_.request_id = "r1";
    request_.prompt_ids = std::vector<int32_t>(100, 7);
    request_.arrival_time = t0_;
    now_ = t0_;
  }
  RequestMetricsTracker::Clock Clock() {
    return [this] { return now_; };
  }
  GenerationEvent Tokens(int n) {
    GenerationEvent e;
    e.token_ids.assign(n, 1);
    return e;
  }
  nlohmann::json LastLogLine() {
    std::string text = log_.str();
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    EXPECT_FALSE(lines.empty());
    return lines.empty() ? nlohmann::json() : nlohmann::json::parse(lines.back());
  }

  ServerMetrics metrics_{"m"};
  GenerationRequest request_;
  SteadyTime t0_ = std::chrono::steady_clock::now();
  SteadyTime now_;
  std::ostringstream log_;
};

// A compressed request's scoring time (GenerationSummary::scoring_ms, from the runner) is observed.
TEST_F(RequestMetricsTest, CompressedRequestObservesScoringTime) {
  RequestMetricsTracker tracker(&metrics_, request_, /*log_prompts=*/false, "", Clock());
  GenerationEvent last = Tokens(1);
  last.finished = true;
  last.finish_reason = FinishReason::kLength;
  last.summary.num_prompt_tokens = 100;
  last.summary.kv_tokens_kept_per_layer = {10, 10};
  last.summary.scoring_ms = 7.5;
  tracker.OnEvent(last);
  auto m = ParsePrometheusText(metrics_.RenderText());
  EXPECT_EQ(m.Value("dropkv_scoring_seconds_count"), 1);
  EXPECT_NEAR(*m.Value("dropkv_scoring_seconds_sum"), 0.0075, 1e-12);
}

TEST_F(RequestMetricsTest, FinishedRequestFeedsEveryMetricAndOneLogLine) {
  RequestMetricsTracker tracker(&metrics_, request_, /*log_prompts=*/false, "the prompt", Clock());
  now_ = t0_ + 200ms;
  tracker.OnEvent(Tokens(1));  // TTFT 0.2 s
  now_ += 30ms;
  tracker.OnEvent(Tokens(1));  // ITL 0.03
  now_ += 60ms;
  tracker.OnEvent(Tokens(2));  // two tokens in one event: ITL 0.03 twice
  GenerationEvent last = Tokens(1);
  now_ += 30ms;
  last.finished = true;
  last.finish_reason = FinishReason::kLength;
  last.summary.num_prompt_tokens = 100;
  last.summary.num_completion_tokens = 5;
  last.summary.queue_ms = 50;
  last.summary.kv_tokens_kept_per_layer = {10, 30};
  last.summary.num_kv_tokens_kept = 40;
  tracker.OnEvent(last);
  EXPECT_TRUE(tracker.done());

  auto m = ParsePrometheusText(metrics_.RenderText());
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "ok"}}), 1);
  EXPECT_EQ(m.Value("dropkv_generation_tokens_total"), 5);
  EXPECT_EQ(m.Value("dropkv_prompt_tokens_total"), 100);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_count"), 1);
  EXPECT_NEAR(*m.Value("dropkv_time_to_first_token_seconds_sum"), 0.2, 1e-9);
  EXPECT_EQ(m.Value("dropkv_inter_token_latency_seconds_count"), 4);
  EXPECT_NEAR(*m.Value("dropkv_inter_token_latency_seconds_sum"), 0.12, 1e-9);
  EXPECT_NEAR(*m.Value("dropkv_request_duration_seconds_sum"), 0.32, 1e-9);
  EXPECT_NEAR(*m.Value("dropkv_request_queue_seconds_sum"), 0.05, 1e-9);
  EXPECT_EQ(m.Value("dropkv_kv_tokens_kept_total"), 40);
  EXPECT_EQ(m.Value("dropkv_kv_tokens_evicted_total"), 160);
  EXPECT_EQ(m.Value("dropkv_scoring_seconds_count"), 0);  // scoring_ms < 0: not compressed

  auto j = LastLogLine();
  EXPECT_EQ(j["request_id"], "r1");
  EXPECT_EQ(j["status"], "ok");
  EXPECT_EQ(j["finish_reason"], "length");
  EXPECT_EQ(j["prompt_tokens"], 100);
  EXPECT_EQ(j["generated_tokens"], 5);
  EXPECT_NEAR(j["ttft_ms"].get<double>(), 200, 1e-6);
  EXPECT_NEAR(j["duration_ms"].get<double>(), 320, 1e-6);
  EXPECT_DOUBLE_EQ(j["kept_ratio"].get<double>(), 0.2);
  EXPECT_FALSE(j.contains("prompt"));
}

TEST_F(RequestMetricsTest, RejectedErroredAndAbandonedRequestsAreCountedOnce) {
  {
    RequestMetricsTracker t(&metrics_, request_, false, "", Clock());
    t.OnRejected(absl::ResourceExhaustedError("queue full"));
    t.OnAbandoned();  // no double count
  }
  {
    RequestMetricsTracker t(&metrics_, request_, true, "p", Clock());
    GenerationEvent e;
    e.finished = true;
    e.finish_reason = FinishReason::kError;
    e.error = absl::DeadlineExceededError("deadline");
    t.OnEvent(e);
    EXPECT_EQ(LastLogLine()["prompt"], "p");  // log_prompts on
  }
  {
    RequestMetricsTracker t(&metrics_, request_, false, "", Clock());
    t.OnEvent(Tokens(1));
  }  // destroyed unfinished: the client went away
  {
    GenerationRequest with_deadline = request_;
    with_deadline.deadline = t0_ + 100ms;
    RequestMetricsTracker t(&metrics_, with_deadline, false, "", Clock());
    now_ = t0_ + 150ms;
  }  // gRPC ended the call at its deadline before the engine's final event
  auto m = ParsePrometheusText(metrics_.RenderText());
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "resource_exhausted"}}), 1);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "deadline_exceeded"}}), 2);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "cancelled"}}), 1);
  EXPECT_EQ(m.Value("dropkv_request_duration_seconds_count"), 4);
  EXPECT_EQ(m.Value("dropkv_prompt_tokens_total"), 0);  // none was admitted with a summary
  EXPECT_EQ(LastLogLine()["status"], "deadline_exceeded");
}

TEST(SchedulerStatsPollerTest, CopiesGaugesAndPreemptionDeltas) {
  ServerMetrics metrics("m");
  SchedulerStats stats;
  SchedulerStatsPoller poller(
      &metrics, [&] { return stats; }, 10ms, /*start_thread=*/false);
  stats.num_running = 3;
  stats.num_waiting = 5;
  stats.kv_blocks_total = 100;
  stats.kv_blocks_free = 75;
  stats.num_preemptions = 2;
  poller.PollOnce();
  poller.PollOnce();  // same cumulative count: no new preemptions
  auto m = ParsePrometheusText(metrics.RenderText());
  EXPECT_EQ(m.Value("dropkv_requests_running"), 3);
  EXPECT_EQ(m.Value("dropkv_requests_waiting"), 5);
  EXPECT_EQ(m.Value("dropkv_kv_blocks_used"), 25);
  EXPECT_EQ(m.Value("dropkv_kv_usage_ratio"), 0.25);
  EXPECT_EQ(m.Value("dropkv_preemptions_total"), 2);
  stats = SchedulerStats{};
  stats.kv_blocks_total = 100;
  stats.kv_blocks_free = 100;
  stats.num_preemptions = 5;
  poller.Stop();  // polls a last time
  m = ParsePrometheusText(metrics.RenderText());
  EXPECT_EQ(m.Value("dropkv_kv_blocks_used"), 0);
  EXPECT_EQ(m.Value("dropkv_requests_running"), 0);
  EXPECT_EQ(m.Value("dropkv_preemptions_total"), 5);
}

// The decode counters are the scheduler's cumulative totals, passed on as deltas: a repeated poll
// adds nothing, a later one adds the difference.
TEST(SchedulerStatsPollerTest, DecodeCountersFollowTheSchedulersTotals) {
  ServerMetrics metrics("m");
  SchedulerStats stats;
  SchedulerStatsPoller poller(
      &metrics, [&] { return stats; }, 10ms, /*start_thread=*/false);
  const auto poll_and_expect = [&](int64_t steps, int64_t rows, double seconds, double host) {
    stats.num_decode_steps = steps;
    stats.num_decode_rows = rows;
    stats.decode_seconds = seconds;
    stats.decode_host_seconds = host;
    poller.PollOnce();
    poller.PollOnce();
    auto m = ParsePrometheusText(metrics.RenderText());
    EXPECT_EQ(m.Value("dropkv_decode_steps_total"), steps);
    EXPECT_EQ(m.Value("dropkv_decode_rows_total"), rows);
    EXPECT_DOUBLE_EQ(*m.Value("dropkv_decode_seconds_total"), seconds);
    EXPECT_DOUBLE_EQ(*m.Value("dropkv_decode_host_seconds_total"), host);
  };
  poll_and_expect(4, 10, 0.02, 0.004);
  poll_and_expect(6, 11, 0.03, 0.005);
}

TEST(SchedulerStatsPollerTest, ThreadPollsPeriodically) {
  ServerMetrics metrics("m");
  std::atomic<int> num_calls{0};
  SchedulerStatsPoller poller(
      &metrics,
      [&] {
        ++num_calls;
        return SchedulerStats{};
      },
      5ms);
  std::this_thread::sleep_for(100ms);
  poller.Stop();
  EXPECT_GE(num_calls.load(), 3);
}

}  // namespace
}  // namespace dropkv
