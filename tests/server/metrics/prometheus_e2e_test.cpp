// A real Prometheus server (Debian's `prometheus`, on loopback, generated config, temp storage,
// 1 s scrape interval) scrapes our /metrics while the test drives ServerMetrics with known
// traffic; the test then asks Prometheus's HTTP API (/api/v1/query) what it stored.
// (The server area's e2e test does the same through the real dropkv-server; this one pins the
// metrics layer on its own.) Skips with a message when `prometheus` is not installed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "server/http/metrics_http_server.h"
#include "server/metrics/server_metrics.h"
#include "tests/common/http_test_util.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string FindPrometheus() {
  for (const char* p : {"/usr/bin/prometheus", "/usr/local/bin/prometheus"}) {
    if (fs::exists(p)) return p;
  }
  return "";
}

class PrometheusServer {
 public:
  // Starts prometheus scraping 127.0.0.1:target_port every second.
  bool Start(int target_port) {
    dir_ = testing::ScratchDir("prometheus_e2e");
    fs::remove_all(dir_ / "data");
    std::ofstream(dir_ / "prometheus.yml")
        << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        << "scrape_configs:\n  - job_name: dropkv\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << target_port << "']\n";
    port_ = testing::PickFreePort();
    return child_.Start(
        {FindPrometheus(), "--config.file=" + (dir_ / "prometheus.yml").string(),
         "--storage.tsdb.path=" + (dir_ / "data").string(),
         "--web.listen-address=127.0.0.1:" + std::to_string(port_), "--log.level=warn"},
        (dir_ / "prometheus.log").string());
  }
  // Waits until the HTTP API answers.
  bool WaitReady(std::chrono::seconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!child_.Running()) return false;
      auto r = testing::HttpGet(port_, "/-/ready");
      if (r && r->status == 200) return true;
      std::this_thread::sleep_for(200ms);
    }
    return false;
  }
  // The value of a PromQL instant query that returns one series; nullopt when empty or failed.
  std::optional<double> Query(const std::string& promql) {
    auto r = testing::HttpGet(port_, "/api/v1/query?query=" + testing::UrlEncode(promql));
    if (!r || r->status != 200) return std::nullopt;
    auto j = nlohmann::json::parse(r->body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || j.value("status", "") != "success") return std::nullopt;
    const auto& result = j["data"]["result"];
    if (!result.is_array() || result.size() != 1) return std::nullopt;
    return std::stod(result[0]["value"][1].get<std::string>());
  }
  // Polls until `promql` equals `expected` (Prometheus scrapes every second).
  bool WaitFor(const std::string& promql, double expected, std::chrono::seconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      auto v = Query(promql);
      if (v && *v == expected) return true;
      std::this_thread::sleep_for(250ms);
    }
    return false;
  }
  std::string Log() const {
    std::ifstream in(dir_ / "prometheus.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  fs::path dir_;
  int port_ = 0;
  testing::ChildProcess child_;
};

TEST(PrometheusE2eTest, PrometheusStoresWhatWasSent) {
  if (FindPrometheus().empty()) GTEST_SKIP() << "prometheus is not installed";
  ServerMetrics metrics("tiny-llama");
  auto server = MetricsHttpServer::Start({}, [&metrics] { return metrics.RenderText(); });
  ASSERT_TRUE(server.ok()) << server.status();
  PrometheusServer prom;
  ASSERT_TRUE(prom.Start((*server)->port()));
  ASSERT_TRUE(prom.WaitReady(30s)) << prom.Log();
  ASSERT_TRUE(prom.WaitFor("up{job=\"dropkv\"}", 1, 30s)) << "target never up\n" << prom.Log();

  // Phase 1: under load. 8 requests admitted (12 prompt tokens each), KV half used.
  constexpr int kNumOk = 8, kNumRefused = 3;
  metrics.SetKvBlocks(50, 100);
  metrics.SetRequestsRunning(kNumOk);
  for (int i = 0; i < kNumOk; ++i) metrics.OnRequestAdmitted(0.01, 12);
  ASSERT_TRUE(prom.WaitFor("dropkv_kv_blocks_used", 50, 20s)) << prom.Log();
  EXPECT_TRUE(prom.WaitFor("dropkv_kv_usage_ratio", 0.5, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_requests_running", kNumOk, 5s));

  // Phase 2: every request generates 5 tokens and finishes; 3 more are refused; KV drains.
  for (int i = 0; i < kNumOk; ++i) {
    metrics.OnFirstToken(0.02 * (i + 1));
    metrics.OnTokensGenerated(5);
    for (int t = 0; t < 4; ++t) metrics.ObserveInterTokenLatency(0.015);
    metrics.OnPrefillCompressed({6, 6, 3, 3}, 12, 0.001);
    metrics.OnRequestFinished(absl::StatusCode::kOk, 0.5);
  }
  for (int i = 0; i < kNumRefused; ++i) {
    metrics.OnRequestFinished(absl::StatusCode::kResourceExhausted, 0.0);
  }
  metrics.SetRequestsRunning(0);
  metrics.SetKvBlocks(0, 100);

  EXPECT_TRUE(
      prom.WaitFor("dropkv_requests_total{status=\"ok\",model=\"tiny-llama\"}", kNumOk, 20s));
  EXPECT_TRUE(
      prom.WaitFor("dropkv_requests_total{status=\"resource_exhausted\"}", kNumRefused, 5s));
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_requests_total)", kNumOk + kNumRefused, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_prompt_tokens_total", kNumOk * 12, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_generation_tokens_total", kNumOk * 5, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_time_to_first_token_seconds_count", kNumOk, 5s));
  // 0.02..0.16: 2 of them <= 0.05, 5 <= 0.1, all 8 <= 0.25.
  EXPECT_TRUE(prom.WaitFor("dropkv_time_to_first_token_seconds_bucket{le=\"0.05\"}", 2, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_time_to_first_token_seconds_bucket{le=\"0.1\"}", 5, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_time_to_first_token_seconds_bucket{le=\"0.25\"}", 8, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_inter_token_latency_seconds_count", kNumOk * 4, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_request_duration_seconds_count", kNumOk + kNumRefused, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_request_queue_seconds_count", kNumOk, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_kv_tokens_kept_total", kNumOk * 18, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_kv_tokens_evicted_total", kNumOk * 30, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_compression_ratio_count", kNumOk, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_layer_kept_tokens{layer=\"2\"}", 3, 5s));
  // KV usage returned to 0 after the load, and Prometheus saw it non-zero during the load.
  EXPECT_TRUE(prom.WaitFor("dropkv_kv_blocks_used", 0, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_kv_usage_ratio", 0, 5s));
  EXPECT_TRUE(prom.WaitFor("dropkv_requests_running", 0, 5s));
  EXPECT_TRUE(prom.WaitFor("max_over_time(dropkv_kv_blocks_used[5m])", 50, 5s));
  // PromQL the dashboard uses works on the stored data.
  EXPECT_TRUE(prom.Query("histogram_quantile(0.5, sum by (le) "
                         "(rate(dropkv_time_to_first_token_seconds_bucket[1m])))")
                  .has_value());
}

}  // namespace
}  // namespace dropkv
