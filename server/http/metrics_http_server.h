// GET /metrics (and GET / -> a link) on a port of its own (metrics_port): what Prometheus scrapes.
// The API's bearer token does not apply; the endpoint has its own, optional, and optional TLS.
// Built on server/http (one I/O thread with a normal-size stack; prometheus-cpp's civetweb threads
// are too small for LibTorch's thread-locals), with http::ServerOptions' connection limits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/http/http_server.h"

namespace dropkv {

struct MetricsServerOptions {
  std::string host = "127.0.0.1";
  int32_t port = 0;           // 0 = any free port (see MetricsHttpServer::port())
  std::string tls_cert_file;  // PEM; both set = HTTPS, both empty = plain HTTP
  std::string tls_key_file;
  std::string tls_client_ca_file;  // set: scrapers need a certificate it signed (mTLS)
  std::string bearer_token;  // non-empty: /metrics needs "Authorization: Bearer <token>" (else 401)
  // Timeouts and connection bounds (the defaults of http::ServerOptions); its host, port, TLS
  // files and threads are ignored: the fields above and one I/O thread are used.
  http::ServerOptions limits;
};

class MetricsHttpServer {
 public:
  // Binds host:port and starts serving `render()`'s text.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsServerOptions& options, std::function<std::string()> render);
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
