// The OpenAI-compatible HTTP front end: a thin layer beside the gRPC service (server/service.cpp)
// over the same RequestGateway (auth, validation, metrics, Submit) and Scheduler.
//
//   POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events with stream)
//   GET  /v1/models
//   GET  /health    200 serving; 503 while the model loads or the server drains
//   GET  /metrics   Prometheus text
//
// It listens before the model is loaded (so /health can say 503 "loading"); Attach() hands it the
// engine once warm. A client that disconnects cancels its request: the engine frees its KV blocks
// at its next step. docs/api.md ("HTTP API") is the reference.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/request_gateway.h"

namespace dropkv {

namespace http {
class Server;
}

struct HttpFrontendOptions {
  std::string host = "127.0.0.1";
  int32_t port = 8000;  // 0 = any free port (see port())
  int32_t num_threads = 2;
  int64_t max_body_bytes = 16 << 20;  // larger bodies: 413
  std::string tls_cert_file;          // both set: HTTPS (the gRPC port's files)
  std::string tls_key_file;
  std::string tls_client_ca_file;               // set: clients need a certificate it signed (mTLS)
  std::function<std::string()> render_metrics;  // GET /metrics; null = 404
  std::string metrics_bearer_token;             // non-empty: GET /metrics needs it (else 401)
  // Whether the /v1 routes need a bearer token (Attach's gateway has it). Without one, on a
  // loopback `host`, the Host header and any Origin must name a loopback address (else 403): a
  // web page the user opens cannot reach the API by DNS rebinding or a cross-origin request.
  bool auth_token_set = false;
  // Connection bounds (http::ServerOptions has their meaning and defaults).
  std::chrono::milliseconds write_stall_timeout{30'000};
  int64_t max_connections = 1024;
  int64_t unread_stream_bytes = 64 << 10;  // a stream left this unread pauses its choices
};

// "localhost", "*.localhost", 127.0.0.0/8 and ::1 (brackets and a port allowed: a Host value).
bool IsLoopbackHost(std::string_view host);

// What Attach() needs to serve /v1: the engine side and how to name the model.
struct HttpEngine {
  Scheduler* scheduler = nullptr;
  const Tokenizer* tokenizer = nullptr;  // may be null (then only token-id prompts)
  GatewayOptions gateway;
  std::string served_model_name;           // `model` in requests and /v1/models
  std::vector<std::string> model_aliases;  // also accepted as `model` (e.g. the model folder)
  int64_t max_context_len = 0;
  int32_t vocab_size = 0;
};

class HttpFrontend {
 public:
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> Start(HttpFrontendOptions options);
  ~HttpFrontend();  // Stop()s
  HttpFrontend(const HttpFrontend&) = delete;
  HttpFrontend& operator=(const HttpFrontend&) = delete;

  // From now on /v1 is served and /health says 200. Once only; `engine`'s pointers outlive this.
  void Attach(HttpEngine engine);
  // /health says 503 "draining" (the scheduler refuses new work itself).
  void SetDraining();

  int32_t port() const;
  // Generation requests whose answer is not complete yet (graceful shutdown waits on it).
  int64_t num_active_requests() const;
  int64_t num_open_connections() const;
  void Stop();  // closes every connection: unfinished requests are cancelled

  struct Routes;

 private:
  HttpFrontend() = default;
  HttpFrontendOptions options_;
  std::unique_ptr<Routes> routes_;
  std::unique_ptr<http::Server> server_;
};

}  // namespace dropkv
