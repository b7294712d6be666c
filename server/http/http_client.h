// A small blocking HTTP/1.1 client (Boost.Beast, plain TCP) for dropkv-loadgen and the tests:
// one connection, keep-alive, whole responses or bodies read piece by piece as they arrive, and a
// parser for server-sent events. Loopback use only; no TLS.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/http/http_server.h"

namespace dropkv::http {

struct ClientResponse {
  int status = 0;
  Headers headers;  // names lower-cased
  std::string body;
  std::string_view Header(std::string_view lower_case_name) const;
};

class Client {
 public:
  // Connects to host:port; every read or write may take at most `timeout`.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& host, int port,
                                                         std::chrono::milliseconds timeout);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends a request and reads the whole response.
  absl::StatusOr<ClientResponse> Send(const std::string& method, const std::string& target,
                                      const std::string& body = "", const Headers& headers = {});
  // Sends a request and hands the body to `on_data` piece by piece as it arrives (chunked
  // encoding removed); `on_data` returning false stops reading and closes the connection.
  // Returns the response (status and headers; the body is left empty).
  absl::StatusOr<ClientResponse> Stream(const std::string& method, const std::string& target,
                                        const std::string& body, const Headers& headers,
                                        const std::function<bool(std::string_view)>& on_data);
  // From any thread: ends the connection; a blocked Send/Stream returns an error.
  void Abort();
  bool connected() const;

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Splits a server-sent-event stream into the data of each event ("data: ..." lines joined).
class SseParser {
 public:
  // Calls `on_event` with each complete event's data.
  void Feed(std::string_view bytes, const std::function<void(const std::string&)>& on_event);

 private:
  std::string pending_;
  std::string data_;
};

}  // namespace dropkv::http
