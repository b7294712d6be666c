// ServerMetrics + MetricsHttpServer: scrape /metrics over loopback HTTP, parse the text format and
// check every series against the traffic the test sent (counts computed here, not by the code).
#include "server/metrics/server_metrics.h"

#include "server/http/http_client.h"
#include "server/http/metrics_http_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "tests/common/http_test_util.h"

namespace dropkv {
namespace {

using testing::HttpGet;
using testing::ParsePrometheusText;

// The metric families the server must export, with their types.
const std::map<std::string, std::string> kRequiredFamilies = {
    {"dropkv_requests_running", "gauge"},
    {"dropkv_requests_waiting", "gauge"},
    {"dropkv_requests_total", "counter"},
    {"dropkv_prompt_tokens_total", "counter"},
    {"dropkv_generation_tokens_total", "counter"},
    {"dropkv_time_to_first_token_seconds", "histogram"},
    {"dropkv_inter_token_latency_seconds", "histogram"},
    {"dropkv_request_duration_seconds", "histogram"},
    {"dropkv_request_queue_seconds", "histogram"},
    {"dropkv_kv_blocks_used", "gauge"},
    {"dropkv_kv_blocks_total", "gauge"},
    {"dropkv_kv_usage_ratio", "gauge"},
    {"dropkv_preemptions_total", "counter"},
    {"dropkv_decode_steps_total", "counter"},
    {"dropkv_decode_rows_total", "counter"},
    {"dropkv_decode_seconds_total", "counter"},
    {"dropkv_decode_host_seconds_total", "counter"},
    {"dropkv_kv_tokens_evicted_total", "counter"},
    {"dropkv_kv_tokens_kept_total", "counter"},
    {"dropkv_compression_ratio", "histogram"},
    {"dropkv_scoring_seconds", "histogram"},
    {"dropkv_layer_kept_tokens", "gauge"},
};

testing::ParsedMetrics Scrape(int port) {
  auto resp = HttpGet(port, "/metrics");
  EXPECT_TRUE(resp.has_value());
  if (!resp) return {};
  EXPECT_EQ(resp->status, 200);
  auto parsed = ParsePrometheusText(resp->body);
  EXPECT_TRUE(parsed.errors.empty()) << "unparsable lines, first: " << parsed.errors.front();
  return parsed;
}

class ServerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = MetricsHttpServer::Start({}, [this] { return metrics_.RenderText(); });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
  }
  ServerMetrics metrics_{"tiny-llama"};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(ServerMetricsTest, EveryRequiredFamilyIsExportedWithTypeAndModelLabel) {
  metrics_.OnPrefillCompressed({4, 5}, 10, 0.001);  // layer gauges exist after a prefill
  auto m = Scrape(server_->port());
  for (const auto& [name, type] : kRequiredFamilies) {
    ASSERT_TRUE(m.types.count(name)) << name << " missing";
    EXPECT_EQ(m.types.at(name), type) << name;
    EXPECT_FALSE(m.helps[name].empty()) << name;
  }
  for (const auto& s : m.samples) {
    EXPECT_EQ(s.labels.count("model") ? s.labels.at("model") : "", "tiny-llama") << s.name;
  }
}

TEST_F(ServerMetricsTest, CountersAndHistogramsMatchTheTrafficSent) {
  // 3 ok requests, 1 cancelled, 2 refused (queue full); each admitted one has 10 prompt tokens.
  const std::vector<double> ttfts = {0.003, 0.03, 3.0};
  for (double ttft : ttfts) {
    metrics_.OnRequestAdmitted(0.002, 10);
    metrics_.OnFirstToken(ttft);
    metrics_.OnTokensGenerated(1);
    for (int i = 0; i < 4; ++i) {
      metrics_.ObserveInterTokenLatency(0.02);
      metrics_.OnTokensGenerated(1);
    }
    metrics_.OnRequestFinished(absl::StatusCode::kOk, 1.0);
  }
  metrics_.OnRequestAdmitted(0.5, 10);
  metrics_.OnRequestFinished(absl::StatusCode::kCancelled, 0.7);
  metrics_.OnRequestFinished(absl::StatusCode::kResourceExhausted, 0.0);
  metrics_.OnRequestFinished(absl::StatusCode::kResourceExhausted, 0.0);
  metrics_.OnPreemption();
  metrics_.OnPreemption(2);
  metrics_.OnDecodeSteps(2, 5, 0.010, 0.002);
  metrics_.OnDecodeSteps(1, 3, 0.005, 0.001);

  auto m = Scrape(server_->port());
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "ok"}}), 3);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "cancelled"}}), 1);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "resource_exhausted"}}), 2);
  EXPECT_EQ(m.Value("dropkv_prompt_tokens_total"), 40);
  EXPECT_EQ(m.Value("dropkv_generation_tokens_total"), 15);
  EXPECT_EQ(m.Value("dropkv_preemptions_total"), 3);
  EXPECT_EQ(m.Value("dropkv_decode_steps_total"), 3);
  EXPECT_EQ(m.Value("dropkv_decode_rows_total"), 8);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_decode_seconds_total"), 0.015);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_decode_host_seconds_total"), 0.003);
  // TTFT buckets are cumulative: 0.003 <= 0.005, 0.03 <= 0.05, 3.0 <= 5.
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_bucket", {{"le", "0.005"}}), 1);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_bucket", {{"le", "0.05"}}), 2);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_bucket", {{"le", "2.5"}}), 2);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_bucket", {{"le", "5"}}), 3);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_bucket", {{"le", "+Inf"}}), 3);
  EXPECT_EQ(m.Value("dropkv_time_to_first_token_seconds_count"), 3);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_time_to_first_token_seconds_sum"), 3.033);
  EXPECT_EQ(m.Value("dropkv_inter_token_latency_seconds_count"), 12);
  EXPECT_EQ(m.Value("dropkv_request_duration_seconds_count"), 6);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_request_duration_seconds_sum"), 3.7);
  EXPECT_EQ(m.Value("dropkv_request_queue_seconds_count"), 4);
  EXPECT_EQ(m.Value("dropkv_request_queue_seconds_bucket", {{"le", "0.25"}}), 3);
}

TEST_F(ServerMetricsTest, KvGaugesFollowTheLastValueAndReturnToZero) {
  metrics_.SetKvBlocks(30, 120);
  metrics_.SetRequestsRunning(4);
  metrics_.SetRequestsWaiting(7);
  auto m = Scrape(server_->port());
  EXPECT_EQ(m.Value("dropkv_kv_blocks_used"), 30);
  EXPECT_EQ(m.Value("dropkv_kv_blocks_total"), 120);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_kv_usage_ratio"), 0.25);
  EXPECT_EQ(m.Value("dropkv_requests_running"), 4);
  EXPECT_EQ(m.Value("dropkv_requests_waiting"), 7);
  metrics_.SetKvBlocks(0, 120);
  metrics_.SetRequestsRunning(0);
  metrics_.SetRequestsWaiting(0);
  m = Scrape(server_->port());
  EXPECT_EQ(m.Value("dropkv_kv_blocks_used"), 0);
  EXPECT_EQ(m.Value("dropkv_kv_usage_ratio"), 0);
  EXPECT_EQ(m.Value("dropkv_requests_running"), 0);
  metrics_.SetKvBlocks(0, 0);  // no pool: ratio 0, not NaN
  m = Scrape(server_->port());
  EXPECT_EQ(m.Value("dropkv_kv_usage_ratio"), 0);
}

TEST_F(ServerMetricsTest, CompressionCountersRatioAndPerLayerGauges) {
  // Sequence 1: 2 layers x 100 prompt tokens, keeps 10 + 30 -> evicts 160 of 200 (ratio 0.8).
  metrics_.OnPrefillCompressed({10, 30}, 100, 0.004);
  // Sequence 2: keeps everything (ratio 0).
  metrics_.OnPrefillCompressed({50, 50}, 50, 0.002);
  auto m = Scrape(server_->port());
  EXPECT_EQ(m.Value("dropkv_kv_tokens_kept_total"), 140);
  EXPECT_EQ(m.Value("dropkv_kv_tokens_evicted_total"), 160);
  EXPECT_EQ(m.Value("dropkv_compression_ratio_count"), 2);
  EXPECT_DOUBLE_EQ(*m.Value("dropkv_compression_ratio_sum"), 0.8);
  EXPECT_EQ(m.Value("dropkv_compression_ratio_bucket", {{"le", "0"}}), 1);
  EXPECT_EQ(m.Value("dropkv_compression_ratio_bucket", {{"le", "0.7"}}), 1);
  EXPECT_EQ(m.Value("dropkv_compression_ratio_bucket", {{"le", "0.8"}}), 2);
  EXPECT_EQ(m.Value("dropkv_scoring_seconds_count"), 2);
  EXPECT_EQ(m.Value("dropkv_layer_kept_tokens", {{"layer", "0"}}), 50);
  EXPECT_EQ(m.Value("dropkv_layer_kept_tokens", {{"layer", "1"}}), 50);
}

TEST(ServerMetricsCardinalityTest, LayersBeyondTheCapShareOneLabel) {
  ServerMetrics metrics("m", /*max_layer_labels=*/4);
  std::vector<int64_t> kept = {1, 2, 3, 4, 5, 6, 7};
  metrics.OnPrefillCompressed(kept, 10, 0.0);
  auto m = ParsePrometheusText(metrics.RenderText());
  int num_layer_series = 0;
  for (const auto& s : m.samples) num_layer_series += s.name == "dropkv_layer_kept_tokens";
  EXPECT_EQ(num_layer_series, 5);
  EXPECT_EQ(m.Value("dropkv_layer_kept_tokens", {{"layer", "3"}}), 4);
  EXPECT_EQ(m.Value("dropkv_layer_kept_tokens", {{"layer", "overflow"}}), 18);
}

TEST(ServerMetricsConcurrencyTest, ParallelUpdatesAreNotLost) {
  ServerMetrics metrics("m");
  constexpr int kThreads = 4, kPerThread = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.OnTokensGenerated(1);
        metrics.ObserveInterTokenLatency(0.01);
        metrics.OnRequestFinished(t % 2 ? absl::StatusCode::kOk : absl::StatusCode::kInternal, 0.1);
      }
    });
  }
  for (auto& th : threads) th.join();
  auto m = ParsePrometheusText(metrics.RenderText());
  EXPECT_EQ(m.Value("dropkv_generation_tokens_total"), kThreads * kPerThread);
  EXPECT_EQ(m.Value("dropkv_inter_token_latency_seconds_count"), kThreads * kPerThread);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "ok"}}), kThreads / 2 * kPerThread);
  EXPECT_EQ(m.Value("dropkv_requests_total", {{"status", "internal"}}), kThreads / 2 * kPerThread);
}

TEST_F(ServerMetricsTest, HttpEndpointAnswersOtherPathsAndMalformedRequests) {
  auto resp = HttpGet(server_->port(), "/nope");
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->status, 404);
  resp = HttpGet(server_->port(), "/metrics?x=1");
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->status, 200);
  // A client that connects and sends garbage, then one that says nothing, do not stop the server.
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::send(fd, "\x01\x02garbage\r\n\r\n", 13, MSG_NOSIGNAL);
    char buf[256];
    ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
    ASSERT_GT(n, 0);
    buf[n] = 0;
    EXPECT_THAT(std::string(buf), ::testing::HasSubstr("400"));
    ::close(fd);
  }
  resp = HttpGet(server_->port(), "/metrics");
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->status, 200);
  // Stop is prompt and idempotent; the port is then closed.
  const int port = server_->port();
  server_->Stop();
  server_->Stop();
  EXPECT_FALSE(HttpGet(port, "/metrics").has_value());
}

TEST(MetricsHttpServerTest, BadHostOrBusyPortIsAnError) {
  MetricsServerOptions bad_host;
  bad_host.host = "no.such.host.invalid";
  auto bad = MetricsHttpServer::Start(bad_host, [] { return std::string(); });
  EXPECT_FALSE(bad.ok());
  auto first = MetricsHttpServer::Start({}, [] { return std::string(); });
  ASSERT_TRUE(first.ok());
  MetricsServerOptions same_port;
  same_port.port = (*first)->port();
  auto second = MetricsHttpServer::Start(same_port, [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), ::testing::HasSubstr("cannot listen"));
}

TEST(MetricsHttpServerTest, BearerTokenGuardsMetrics) {
  MetricsServerOptions options;
  options.bearer_token = "s3cret";
  auto server = MetricsHttpServer::Start(options, [] { return std::string("up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = http::Client::Connect("127.0.0.1", (*server)->port(), std::chrono::seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  auto none = (*client)->Send("GET", "/metrics");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(none->Header("www-authenticate"), "Bearer");
  auto wrong = (*client)->Send("GET", "/metrics", "", {{"Authorization", "Bearer s3creT"}});
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_EQ(wrong->status, 401);
  auto right = (*client)->Send("GET", "/metrics", "", {{"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_EQ(right->status, 200);
  EXPECT_EQ(right->body, "up 1\n");
}

TEST(MetricsHttpServerTest, TlsFilesThatDoNotLoadAreAnError) {
  MetricsServerOptions options;
  options.tls_cert_file = "/no/such/cert.pem";
  options.tls_key_file = "/no/such/key.pem";
  auto server = MetricsHttpServer::Start(options, [] { return std::string(); });
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), ::testing::HasSubstr("/no/such/cert.pem"));
}

TEST(ServerMetricsStatusLabelTest, SnakeCaseCodeNames) {
  EXPECT_EQ(ServerMetrics::StatusLabel(absl::StatusCode::kOk), "ok");
  EXPECT_EQ(ServerMetrics::StatusLabel(absl::StatusCode::kDeadlineExceeded), "deadline_exceeded");
  EXPECT_EQ(ServerMetrics::StatusLabel(absl::StatusCode::kUnauthenticated), "unauthenticated");
}

}  // namespace
}  // namespace dropkv
