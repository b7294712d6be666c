// The metrics through the real binary: dropkv-server (demo model, CPU) with its /metrics
// endpoint, a real Prometheus server scraping it every second, traffic sent with dropkv-cli over
// gRPC, and Prometheus's HTTP API asked what it stored: request counters equal what was sent,
// histograms have the right counts, KV usage returns to 0 after the load.
// Skips (with the reason) while dropkv-server does not serve /metrics on --metrics-port.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "tests/common/http_test_util.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class Prometheus {
 public:
  bool Start(const fs::path& dir, int target_port) {
    dir_ = dir;
    fs::remove_all(dir / "data");
    std::ofstream(dir / "prometheus.yml")
        << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        << "scrape_configs:\n  - job_name: dropkv\n    static_configs:\n"
        << "      - targets: ['127.0.0.1:" << target_port << "']\n";
    port_ = testing::PickFreePort();
    return child_.Start(
        {"prometheus", "--config.file=" + (dir / "prometheus.yml").string(),
         "--storage.tsdb.path=" + (dir / "data").string(),
         "--web.listen-address=127.0.0.1:" + std::to_string(port_), "--log.level=warn"},
        (dir / "prometheus.log").string());
  }
  std::optional<double> Query(const std::string& promql) {
    auto r = testing::HttpGet(port_, "/api/v1/query?query=" + testing::UrlEncode(promql));
    if (!r || r->status != 200) return std::nullopt;
    auto j = nlohmann::json::parse(r->body, nullptr, false);
    if (j.is_discarded() || j.value("status", "") != "success") return std::nullopt;
    const auto& result = j["data"]["result"];
    if (!result.is_array() || result.size() != 1) return std::nullopt;
    return std::stod(result[0]["value"][1].get<std::string>());
  }
  // Polls until the query equals `expected`; returns the last value seen for the message.
  bool WaitFor(const std::string& promql, double expected, std::chrono::seconds timeout,
               std::string* last = nullptr) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::optional<double> v;
    while (std::chrono::steady_clock::now() < deadline) {
      v = Query(promql);
      if (v && *v == expected) return true;
      std::this_thread::sleep_for(250ms);
    }
    if (last) *last = v ? std::to_string(*v) : "no result";
    return false;
  }
  std::string Log() const { return ReadText(dir_ / "prometheus.log"); }

 private:
  fs::path dir_;
  int port_ = 0;
  testing::ChildProcess child_;
};

// Runs dropkv-cli to completion; returns its exit code.
int RunCli(const std::vector<std::string>& args, const fs::path& log) {
  testing::ChildProcess cli;
  std::vector<std::string> argv = {(testing::BuildDir() / "bin" / "dropkv-cli").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  if (!cli.Start(argv, log.string())) return -1;
  return cli.Wait(120s);
}

TEST(ServerPrometheusE2eTest, RealServerRealPrometheus) {
  const fs::path server_bin = testing::BuildDir() / "bin" / "dropkv-server";
  ASSERT_TRUE(fs::exists(server_bin)) << server_bin;
  const fs::path dir = testing::ScratchDir("server_prometheus_e2e");
  const int metrics_port = testing::PickFreePort();
  testing::ChildProcess server;
  ASSERT_TRUE(server.Start({server_bin.string(), "--demo-model", "--host", "127.0.0.1", "--port", "0",
                            "--metrics-port", std::to_string(metrics_port), "--kv-blocks", "512",
                            "--block-size", "16", "--log-format", "json"},
                           (dir / "server.log").string()));
  // The server prints "LISTENING <port>" once it serves.
  int grpc_port = 0;
  for (int i = 0; i < 1200 && grpc_port == 0 && server.Running(); ++i) {
    std::smatch m;
    std::string log = ReadText(dir / "server.log");
    if (std::regex_search(log, m, std::regex(R"(LISTENING (\d+))"))) grpc_port = std::stoi(m[1]);
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_GT(grpc_port, 0) << "server did not start:\n" << ReadText(dir / "server.log");
  auto scrape = testing::HttpGet(metrics_port, "/metrics");
  if (!scrape || scrape->status != 200) {
    GTEST_SKIP() << "dropkv-server does not serve /metrics on --metrics-port yet (server area: "
                    "start MetricsHttpServer, see docs/metrics.md)";
  }

  Prometheus prom;
  ASSERT_TRUE(prom.Start(dir, metrics_port));
  ASSERT_TRUE(prom.WaitFor("up{job=\"dropkv\"}", 1, 60s)) << prom.Log();

  const std::string address = "127.0.0.1:" + std::to_string(grpc_port);
  constexpr int kNumOk = 6, kNewTokens = 8;
  std::vector<std::thread> clients;
  std::vector<int> rcs(kNumOk, -1);
  for (int i = 0; i < kNumOk; ++i) {
    clients.emplace_back([&, i] {
      rcs[i] = RunCli({"--address", address, "generate", "--prompt",
                       "Once upon a time there was a little girl number " + std::to_string(i),
                       "--max-new-tokens", std::to_string(kNewTokens), "--ignore-eos", "--method",
                       "dropkv", "--keep", "0.5"},
                      dir / ("cli" + std::to_string(i) + ".log"));
    });
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < kNumOk; ++i) {
    EXPECT_EQ(rcs[i], 0) << ReadText(dir / ("cli" + std::to_string(i) + ".log"));
  }
  // One request the server must refuse (keep ratio out of range): INVALID_ARGUMENT.
  EXPECT_NE(RunCli({"--address", address, "generate", "--prompt", "x", "--keep", "2"},
                   dir / "cli_bad.log"),
            0);

  std::string last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_requests_total{status=\"ok\"})", kNumOk, 30s, &last))
      << last;
  EXPECT_TRUE(
      prom.WaitFor("sum(dropkv_requests_total{status=\"invalid_argument\"})", 1, 10s, &last))
      << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_generation_tokens_total)", kNumOk * kNewTokens, 10s, &last))
      << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_time_to_first_token_seconds_count)", kNumOk, 10s, &last))
      << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_inter_token_latency_seconds_count)",
                           kNumOk * (kNewTokens - 1), 10s, &last))
      << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_request_queue_seconds_count)", kNumOk, 10s, &last)) << last;
  auto evicted = prom.Query("sum(dropkv_kv_tokens_evicted_total)");
  EXPECT_TRUE(evicted && *evicted > 0) << "keep ratio 0.5 must evict entries";
  // After the load: nothing running, no KV block in use.
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_requests_running)", 0, 10s, &last)) << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_kv_blocks_used)", 0, 10s, &last)) << last;
  EXPECT_TRUE(prom.WaitFor("sum(dropkv_kv_blocks_total)", 512, 10s, &last)) << last;
  server.Stop();
}

}  // namespace
}  // namespace dropkv
