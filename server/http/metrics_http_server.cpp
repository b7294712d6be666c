#include "server/http/metrics_http_server.h"

#include "absl/strings/str_cat.h"
#include "server/bearer_token.h"
#include "server/http/http_server.h"

namespace dropkv {

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<http::Server> server)
    : server_(std::move(server)) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsServerOptions& metrics_options, std::function<std::string()> render) {
  if (metrics_options.port < 0 || metrics_options.port > 65535)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port: out of range [0, 65535]: ", metrics_options.port));
  http::ServerOptions options = metrics_options.limits;
  options.host = metrics_options.host;
  options.port = metrics_options.port;
  options.tls_cert_file = metrics_options.tls_cert_file;
  options.tls_key_file = metrics_options.tls_key_file;
  options.tls_client_ca_file = metrics_options.tls_client_ca_file;
  options.num_threads = 1;
  options.max_body_bytes = 64 * 1024;  // scrapes have no body
  auto handler = [render = std::move(render), token = metrics_options.bearer_token](
                     const http::Request& request, std::shared_ptr<http::Exchange> exchange) {
    if (request.method != "GET" && request.method != "HEAD") {
      exchange->Respond(405, "text/plain; charset=utf-8", "only GET\n", {{"Allow", "GET, HEAD"}});
    } else if (request.path == "/metrics") {
      if (!BearerTokenMatches(request.Header("authorization"), token)) {
        exchange->Respond(401, "text/plain; charset=utf-8",
                          "missing or wrong 'Authorization: Bearer <token>'\n",
                          {{"WWW-Authenticate", "Bearer"}});
      } else {
        exchange->Respond(200, kPrometheusContentType, render());
      }
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
