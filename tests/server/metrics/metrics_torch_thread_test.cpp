// The /metrics server thread must work in a process that has LibTorch loaded (civetweb's small
// thread stacks cannot hold torch's static TLS). Here the render callback itself runs an
// ATen op on the server thread and the test checks the scraped result.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "server/http/metrics_http_server.h"
#include "server/metrics/server_metrics.h"
#include "tests/common/http_test_util.h"

namespace dropkv {
namespace {

TEST(MetricsTorchThreadTest, ServerThreadRunsAtenOpsWithTorchLoaded) {
  // Load and use torch on the main thread first (its TLS is then set up process-wide).
  at::Tensor x = at::arange(10, at::kFloat);  // [10]
  ASSERT_EQ(x.sum().item<float>(), 45.0f);
  ServerMetrics metrics("m");
  metrics.OnTokensGenerated(3);
  auto server = MetricsHttpServer::Start({}, [&metrics] {
    // [4, 4] matmul on the server thread: touches torch's thread-local state there.
    at::Tensor a = at::ones({4, 4}, at::kFloat);
    const float trace = at::matmul(a, a).trace().item<float>();  // 4 * 4 = 16
    return metrics.RenderText() + "torch_check_value " + std::to_string(trace) + "\n";
  });
  ASSERT_TRUE(server.ok()) << server.status();
  for (int i = 0; i < 3; ++i) {
    auto resp = testing::HttpGet((*server)->port(), "/metrics");
    ASSERT_TRUE(resp.has_value());
    ASSERT_EQ(resp->status, 200);
    auto m = testing::ParsePrometheusText(resp->body);
    EXPECT_EQ(m.Value("torch_check_value"), 16);
    EXPECT_EQ(m.Value("dropkv_generation_tokens_total"), 3);
  }
}

}  // namespace
}  // namespace dropkv
