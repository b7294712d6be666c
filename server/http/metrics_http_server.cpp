#include "server/http/metrics_http_server.h"

#include "absl/strings/str_cat.h"
#include "server/http/http_server.h"

namespace dropkv {

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<http::Server> server)
    : server_(std::move(server)) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::function<std::string()> render) {
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port: out of range [0, 65535]: ", port));
  http::ServerOptions options;
  options.host = host;
  options.port = port;
  options.num_threads = 1;
  options.max_body_bytes = 64 * 1024;  // scrapes have no body
  auto handler = [render = std::move(render)](const http::Request& request,
                                              std::shared_ptr<http::Exchange> exchange) {
    if (request.method != "GET" && request.method != "HEAD") {
      exchange->Respond(405, "text/plain; charset=utf-8", "only GET\n", {{"Allow", "GET, HEAD"}});
    } else if (request.path == "/metrics") {
      exchange->Respond(200, kPrometheusContentType, render());
    } else if (request.path == "/") {
      exchange->Respond(200, "text/html; charset=utf-8",
                        "<html><body><a href=\"/metrics\">/metrics</a></body></html>\n");
    } else {
      exchange->Respond(404, "text/plain; charset=utf-8", "not found; try /metrics\n");
    }
  };
  auto server = http::Server::Start(std::move(options), std::move(handler));
  if (!server.ok())
    return absl::Status(server.status().code(),
                        absl::StrCat("metrics endpoint: ", server.status().message()));
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(*server)));
}

int MetricsHttpServer::port() const {
  return server_->port();
}

void MetricsHttpServer::Stop() {
  server_->Stop();
}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
}

}  // namespace dropkv
