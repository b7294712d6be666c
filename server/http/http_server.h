// An HTTP/1.1 server on Boost.Beast / Asio (the only TU that includes them: http_server.cpp).
// Asynchronous: a few I/O threads hold any number of connections, so a thousand clients streaming
// tokens cost a thousand sockets and buffers, not a thousand threads (docs/api.md, "HTTP").
//
// The handler runs on an I/O thread and answers through an Exchange, at once or later from any
// thread (the engine thread streams tokens). While an answer is pending the connection keeps
// reading, so a client that resets the connection is noticed at once and the Exchange's
// gone-callback runs: that is how a disconnect cancels a generation. A FIN alone is a half-close
// (the client may still read): the answer goes on, and a client that has closed for good is
// noticed when a write fails (a stream: at its next piece but one). Keep-alive, HEAD, chunked
// server-sent events, request size limits (413), the limits of ServerOptions (request deadline 408,
// write stall, output queue, connection count 503) and TLS (same PEM files as gRPC) are handled
// here.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace dropkv::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target without the query
  std::string query;   // after '?', "" when none
  Headers headers;     // names lower-cased
  std::string body;
  // The first header named `lower_case_name`, "" when absent.
  std::string_view Header(std::string_view lower_case_name) const;
};

// One request's answer. Every method is thread-safe and returns at once (the work is queued on the
// connection's strand); once the answer is complete or the client is gone, calls do nothing.
class Exchange {
 public:
  virtual ~Exchange() = default;
  // A complete response (Content-Length).
  virtual void Respond(int status, std::string content_type, std::string body,
                       Headers extra_headers = {}) = 0;
  // A streamed response: the headers now (chunked transfer encoding), then Write() pieces, End().
  virtual void StartStream(int status, std::string content_type, Headers extra_headers = {}) = 0;
  virtual void Write(std::string data) = 0;
  virtual void End() = 0;
  // Runs once, on an I/O thread, if the client disconnects (or a write fails) before the answer
  // is complete. Set it in the handler, before answering.
  virtual void OnClientGone(std::function<void()> on_gone) = 0;
  // Runs on an I/O thread when the part of a streamed answer the client has not taken (queued here
  // and in the socket's send queue) passes ServerOptions::unread_stream_bytes (true), and when
  // the client has read it down to half of that (false). Set it in the handler, before answering.
  virtual void OnBacklog(std::function<void(bool backlogged)> on_change) = 0;
  // Keeps `state` alive until the answer is complete or the client is gone (then released).
  virtual void Hold(std::shared_ptr<void> state) = 0;
};

using Handler = std::function<void(const Request&, std::shared_ptr<Exchange>)>;
// The body of an error the server answers by itself (413, 400 on an unparsable request):
// {content_type, body} for a status and a message.
using ErrorFormatter = std::function<std::pair<std::string, std::string>(int, std::string_view)>;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int32_t port = 0;                   // 0 = any free port (see Server::port())
  int32_t num_threads = 2;            // I/O threads
  int64_t max_body_bytes = 16 << 20;  // larger bodies get 413
  std::string tls_cert_file;          // PEM; both set = HTTPS, both empty = plain HTTP
  std::string tls_key_file;
  std::string tls_client_ca_file;  // PEM CA: with TLS, clients must show a certificate it signed
  std::chrono::seconds idle_timeout{75};  // an idle keep-alive connection is closed after this
  // From a request's first byte (for the first request: the accept, TLS handshake included) until
  // its headers and body are in; not extended by partial reads, so a client that drips bytes is
  // answered 408 and closed after it (one that sent nothing is closed without an answer).
  std::chrono::milliseconds request_timeout{30'000};
  // While output waits to be written, a write that makes no progress for this long closes the
  // connection as client-gone (the Exchange's OnClientGone runs: the generation is cancelled).
  std::chrono::milliseconds write_stall_timeout{30'000};
  // Streamed bytes (Exchange::Write) of one answer queued in the server and not yet written; more
  // closes the connection as client-gone, so a client that never reads costs bounded memory.
  int64_t max_output_bytes_per_exchange = 8 << 20;
  // A stream whose client leaves more than this unread (above) is reported backlogged, so that
  // the handler can pause what produces it; 0 = never.
  int64_t unread_stream_bytes = 64 << 10;
  // Open connections. At the limit a new one takes the place of the connection idle longest (no
  // request being answered: silent since its accept, still sending its request, or kept alive);
  // when every one is answering, it is answered 503 (plain HTTP; closed at once with TLS).
  int64_t max_connections = 1024;
  ErrorFormatter error_formatter;  // null: text/plain
};

class Server {
 public:
  // Binds and starts the I/O threads. Errors name what failed (resolve, bind, TLS files); a port
  // another listener holds is an error (SO_REUSEADDR on Linux allows no second listener).
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options, Handler handler);
  ~Server();  // Stop()s
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int32_t port() const;
  int64_t num_open_connections() const;
  // Stops accepting, closes every connection (pending answers see their client gone), joins the
  // I/O threads. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The reason phrase of a status code ("Not Found").
std::string_view StatusReason(int status);

}  // namespace dropkv::http
