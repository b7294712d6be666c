// GET /metrics (and GET / -> a link) on a port of its own (metrics_port): what Prometheus scrapes,
// without the API's bearer token. Built on server/http (one I/O thread with a normal-size stack;
// prometheus-cpp's civetweb threads are too small for LibTorch's thread-locals).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace dropkv {

namespace http {
class Server;
}

class MetricsHttpServer {
 public:
  // Binds host:port (port 0 = any free port, see port()) and starts serving `render()`'s text.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::function<std::string()> render);
  ~MetricsHttpServer();  // Stop()s
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const;
  void Stop();  // idempotent; returns after the I/O thread has exited

 private:
  explicit MetricsHttpServer(std::unique_ptr<http::Server> server);
  std::unique_ptr<http::Server> server_;
};

// The Prometheus text format's content type.
inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace dropkv
