// Blocking Beast client. Sync Beast operations have no deadlines, so the socket's SO_RCVTIMEO /
// SO_SNDTIMEO bound every read and write instead.
#include "server/http/http_client.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <limits>
#include <mutex>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace dropkv::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

template <class Message>
Headers HeadersOf(const Message& message) {
  Headers headers;
  for (const auto& field : message)
    headers.emplace_back(
        absl::AsciiStrToLower(std::string(field.name_string().data(), field.name_string().size())),
        std::string(field.value().data(), field.value().size()));
  return headers;
}

}  // namespace

std::string_view ClientResponse::Header(std::string_view lower_case_name) const {
  for (const auto& [name, value] : headers)
    if (name == lower_case_name) return value;
  return {};
}

struct Client::Impl {
  asio::io_context ioc;
  tcp::socket socket{ioc};
  beast::flat_buffer buffer;
  std::string host_header;
  std::mutex mu;  // Abort() (any thread) against Fail() closing the descriptor
  std::atomic<bool> connected{false};

  absl::Status Write(const std::string& method, const std::string& target, const std::string& body,
                     const Headers& headers) {
    bhttp::request<bhttp::string_body> request(bhttp::string_to_verb(method), target, 11);
    request.set(bhttp::field::host, host_header);
    request.set(bhttp::field::user_agent, "dropkv-http-client");
    for (const auto& [name, value] : headers) request.set(name, value);
    if (!body.empty() && request[bhttp::field::content_type].empty())
      request.set(bhttp::field::content_type, "application/json");
    request.body() = body;
    request.prepare_payload();
    beast::error_code ec;
    bhttp::write(socket, request, ec);
    if (ec) return Fail(absl::StrCat("write: ", ec.message()));
    return absl::OkStatus();
  }

  absl::Status Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    beast::error_code ignored;
    socket.close(ignored);
    return absl::UnavailableError(absl::StrCat("http client: ", what));
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& host, int port,
                                                        std::chrono::milliseconds timeout) {
  auto impl = std::make_unique<Impl>();
  beast::error_code ec;
  tcp::resolver resolver(impl->ioc);
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("resolve ", host, ": ", ec.message()));
  asio::connect(impl->socket, endpoints, ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("connect ", host, ":", port, ": ", ec.message()));
  impl->socket.set_option(tcp::no_delay(true), ec);
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  ::setsockopt(impl->socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(impl->socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  impl->host_header = absl::StrCat(host, ":", port);
  impl->connected = true;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<ClientResponse> Client::Send(const std::string& method, const std::string& target,
                                            const std::string& body, const Headers& headers) {
  Impl& m = *impl_;
  if (!m.connected) return absl::FailedPreconditionError("http client: not connected");
  if (absl::Status st = m.Write(method, target, body, headers); !st.ok()) return st;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(1ULL << 30);
  if (method == "HEAD") parser.skip(true);
  beast::error_code ec;
  bhttp::read(m.socket, m.buffer, parser, ec);
  if (ec) return m.Fail(absl::StrCat("read: ", ec.message()));
  ClientResponse out;
  out.status = parser.get().result_int();
  out.headers = HeadersOf(parser.get());
  out.body = std::move(parser.get().body());
  if (!parser.get().keep_alive()) (void)m.Fail("closed by the server");
  return out;
}

absl::StatusOr<ClientResponse> Client::Stream(
    const std::string& method, const std::string& target, const std::string& body,
    const Headers& headers, const std::function<bool(std::string_view)>& on_data) {
  Impl& m = *impl_;
  if (!m.connected) return absl::FailedPreconditionError("http client: not connected");
  if (absl::Status st = m.Write(method, target, body, headers); !st.ok()) return st;
  bhttp::response_parser<bhttp::buffer_body> parser;
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());  // (boost::none trips 1.74)
  beast::error_code ec;
  bhttp::read_header(m.socket, m.buffer, parser, ec);
  if (ec) return m.Fail(absl::StrCat("read header: ", ec.message()));
  ClientResponse out;
  out.status = parser.get().result_int();
  out.headers = HeadersOf(parser.get());
  char piece[16384];
  while (!parser.is_done()) {
    parser.get().body().data = piece;
    parser.get().body().size = sizeof(piece);
    // read_some: hand over what arrived (read() would wait to fill the piece).
    bhttp::read_some(m.socket, m.buffer, parser, ec);
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) return m.Fail(absl::StrCat("read body: ", ec.message()));
    const size_t n = sizeof(piece) - parser.get().body().size;
    if (n > 0 && !on_data(std::string_view(piece, n))) {
      (void)m.Fail("stopped by the caller");
      return out;
    }
  }
  if (!parser.get().keep_alive()) (void)m.Fail("closed by the server");
  return out;
}

void Client::Abort() {
  // shutdown(2) on the descriptor is safe from another thread and wakes a blocked recv.
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->connected.exchange(false)) ::shutdown(impl_->socket.native_handle(), SHUT_RDWR);
}

bool Client::connected() const {
  return impl_->connected;
}

void SseParser::Feed(std::string_view bytes,
                     const std::function<void(const std::string&)>& on_event) {
  pending_.append(bytes);
  size_t start = 0;
  for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string_view line(pending_.data() + start, nl - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // the blank line ends an event
      if (!data_.empty()) on_event(data_);
      data_.clear();
    } else if (line.substr(0, 5) == "data:") {
      std::string_view value = line.substr(5);
      if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
      if (!data_.empty()) data_ += '\n';
      data_.append(value);
    }  // comments (":...") and other fields are not used here
  }
  pending_.erase(0, start);
}

}  // namespace dropkv::http
