// http::Server's connection limits (server/http/http_server.h, ServerOptions): the request
// deadline (408), the write stall and output queue bounds (OnClientGone), max_connections (idle
// connections evicted, else 503), the headers it refuses (400, 415), a half-closed client and the
// exclusive port. The misbehaving clients are plain POSIX sockets; the timeouts are short.
#include "server/http/http_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

#include "server/http/metrics_http_server.h"
#include "tests/common/http_test_util.h"

namespace dropkv {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A loopback connection whose reads give up after `recv_timeout`; `recv_buffer_bytes` > 0 shrinks
// the receive buffer (before connect, so the window stays small).
int Connect(int port, milliseconds recv_timeout = milliseconds(5000), int recv_buffer_bytes = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (recv_buffer_bytes > 0)
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &recv_buffer_bytes, sizeof(recv_buffer_bytes));
  timeval timeout{static_cast<time_t>(recv_timeout.count() / 1000),
                  static_cast<suseconds_t>(recv_timeout.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, std::string_view bytes) {
  return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

struct Received {
  std::string bytes;
  bool closed = false;  // EOF or reset, not the receive timeout
};

// Reads until the server closes (or the socket's receive timeout passes).
Received ReadUntilClosed(int fd) {
  Received r;
  char buf[4096];
  while (true) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n > 0) {
      r.bytes.append(buf, static_cast<size_t>(n));
      continue;
    }
    r.closed = n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
    return r;
  }
}

// Reads one response of a kept-alive connection: headers and a Content-Length body.
std::string ReadOneResponse(int fd) {
  std::string raw;
  char buf[4096];
  while (true) {
    const size_t head_end = raw.find("\r\n\r\n");
    if (head_end != std::string::npos) {
      const size_t length_at = raw.find("Content-Length: ");
      const size_t length = length_at == std::string::npos ? 0 : std::atoi(&raw[length_at + 16]);
      if (raw.size() >= head_end + 4 + length) return raw;
    }
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return raw;
    raw.append(buf, static_cast<size_t>(n));
  }
}

bool WaitFor(const std::function<bool()>& done, milliseconds limit) {
  const Clock::time_point deadline = Clock::now() + limit;
  while (!done() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(5));
  return done();
}

http::Handler AnswerOk() {
  return [](const http::Request&, std::shared_ptr<http::Exchange> exchange) {
    exchange->Respond(200, "text/plain", "ok\n");
  };
}

TEST(HttpServerLimitsTest, SilentAndDrippingClientsDoNotDelayAScrapeAndAreClosed) {
  MetricsServerOptions options;
  options.limits.request_timeout = milliseconds(1000);
  auto server = MetricsHttpServer::Start(options, [] { return std::string("up 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const Clock::time_point start = Clock::now();
  std::vector<int> silent;
  for (int i = 0; i < 5; ++i) silent.push_back(Connect(port));
  const int drip = Connect(port);
  ASSERT_GE(drip, 0);
  // A request whose header never ends, one byte every 300 ms: each byte is progress, none finishes.
  std::atomic<bool> stop_dripping{false};
  std::thread dripper([&] {
    if (!SendAll(drip, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: ")) return;
    while (!stop_dripping.load() && SendAll(drip, "a"))
      std::this_thread::sleep_for(milliseconds(300));
  });
  for (int i = 0; i < 3; ++i) {
    const Clock::time_point scrape_start = Clock::now();
    auto scrape = testing::HttpGet(port, "/metrics");
    ASSERT_TRUE(scrape.has_value());
    EXPECT_EQ(scrape->status, 200);
    EXPECT_LT(SecondsSince(scrape_start), 0.5);
    std::this_thread::sleep_for(milliseconds(200));
  }
  // The dripping client is answered 408 and closed after request_timeout, though it kept sending.
  const Received dripped = ReadUntilClosed(drip);
  const double drip_closed_after_s = SecondsSince(start);
  stop_dripping = true;
  dripper.join();
  EXPECT_THAT(dripped.bytes, ::testing::StartsWith("HTTP/1.1 408"));
  EXPECT_TRUE(dripped.closed);
  EXPECT_GT(drip_closed_after_s, 0.9);
  EXPECT_LT(drip_closed_after_s, 2.5);
  // A connection that never sent a byte is closed without an answer.
  for (int fd : silent) {
    const Received r = ReadUntilClosed(fd);
    EXPECT_EQ(r.bytes, "");
    EXPECT_TRUE(r.closed);
    ::close(fd);
  }
  EXPECT_LT(SecondsSince(start), 2.5);
  ::close(drip);
}

// A handler that streams 64 KiB pieces from a thread, one a millisecond (a fast generation), until
// `max_offered_bytes` or the client is gone. `gone_after_s` is when OnClientGone ran (from the
// stream's start), negative until then; `offered_when_gone` what had been offered by then.
class StreamingHandler {
 public:
  explicit StreamingHandler(int64_t max_offered_bytes) : max_offered_bytes_(max_offered_bytes) {}
  ~StreamingHandler() {
    if (writer_.joinable()) writer_.join();
  }

  http::Handler handler() {
    return [this](const http::Request&, std::shared_ptr<http::Exchange> exchange) {
      start_ = Clock::now();
      exchange->OnClientGone([this] {
        gone_after_s_ = SecondsSince(start_);
        offered_when_gone_ = offered_bytes_.load();
        gone_ = true;
      });
      exchange->StartStream(200, "text/plain");
      writer_ = std::thread([this, exchange] {
        const std::string piece(64 << 10, 'x');
        while (!gone_.load() && offered_bytes_.load() < max_offered_bytes_) {
          exchange->Write(piece);
          offered_bytes_ += static_cast<int64_t>(piece.size());
          std::this_thread::sleep_for(milliseconds(1));
        }
      });
    };
  }
  // Waits up to `limit` for OnClientGone; true when it ran.
  bool WaitGone(milliseconds limit) {
    const Clock::time_point deadline = Clock::now() + limit;
    while (!gone_.load() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(10));
    return gone_.load();
  }
  double gone_after_s() const { return gone_after_s_.load(); }
  int64_t offered_when_gone() const { return offered_when_gone_.load(); }

 private:
  const int64_t max_offered_bytes_;
  Clock::time_point start_;
  std::atomic<bool> gone_{false};
  std::atomic<double> gone_after_s_{-1};
  std::atomic<int64_t> offered_bytes_{0};
  std::atomic<int64_t> offered_when_gone_{-1};
  std::thread writer_;
};

constexpr std::string_view kGetStream = "GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

TEST(HttpServerLimitsTest, AClientThatStopsReadingIsGoneAfterTheWriteStallTimeout) {
  // 16 MiB offered: more than the socket buffers take, less than the output bound below.
  StreamingHandler streaming(16 << 20);
  http::ServerOptions options;
  options.write_stall_timeout = milliseconds(1000);
  options.max_output_bytes_per_exchange = 64 << 20;
  auto server = http::Server::Start(options, streaming.handler());
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port(), milliseconds(5000), /*recv_buffer_bytes=*/4096);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, kGetStream));  // and never reads
  ASSERT_TRUE(streaming.WaitGone(milliseconds(4000)));
  EXPECT_LT(streaming.gone_after_s(), 1.0 + 1.5);
  ::close(fd);
}

TEST(HttpServerLimitsTest, AStreamLeftUnreadIsReportedBackloggedUntilReadAgain) {
  std::atomic<int> num_backlogged{0};
  std::atomic<int> num_drained{0};
  std::thread writer;
  struct JoinAtExit {
    std::thread& t;
    ~JoinAtExit() {
      if (t.joinable()) t.join();
    }
  } join_writer{writer};
  auto server = http::Server::Start(
      [] {
        http::ServerOptions options;
        options.unread_stream_bytes = 16 << 10;
        return options;
      }(),
      [&](const http::Request&, std::shared_ptr<http::Exchange> exchange) {
        exchange->OnBacklog(
            [&](bool backlogged) { ++(backlogged ? num_backlogged : num_drained); });
        exchange->StartStream(200, "text/plain");
        // Like a paused generation: pieces until backlogged, then nothing until drained.
        writer = std::thread([&, exchange] {
          const std::string piece(1024, 'x');
          for (int i = 0; i < 2000 && num_backlogged.load() == 0; ++i) {
            exchange->Write(piece);
            std::this_thread::sleep_for(milliseconds(1));
          }
          WaitFor([&] { return num_drained.load() > 0; }, milliseconds(3000));
          exchange->End();
        });
      });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port(), milliseconds(5000), /*recv_buffer_bytes=*/4096);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"));
  // It reads nothing for now.
  ASSERT_TRUE(WaitFor([&] { return num_backlogged.load() == 1; }, milliseconds(3000)));
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(num_drained.load(), 0);
  const Received r = ReadUntilClosed(fd);  // reading drains the backlog: the writer ends
  EXPECT_THAT(r.bytes, ::testing::EndsWith("0\r\n\r\n"));
  EXPECT_EQ(num_backlogged.load(), 1);
  EXPECT_EQ(num_drained.load(), 1);
  ::close(fd);
}

TEST(HttpServerLimitsTest, OutputQueuedForAClientThatNeverReadsIsBounded) {
  constexpr int64_t kMaxOfferedBytes = 64 << 20;
  StreamingHandler streaming(kMaxOfferedBytes);
  http::ServerOptions options;
  options.max_output_bytes_per_exchange = 256 << 10;  // the write stall timeout stays at 30 s
  auto server = http::Server::Start(options, streaming.handler());
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port(), milliseconds(5000), /*recv_buffer_bytes=*/4096);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, kGetStream));
  ASSERT_TRUE(streaming.WaitGone(milliseconds(4000)));
  // Gone once the socket buffers (the server's send buffer: at most a few MiB; the client's is 4
  // KiB) and 256 KiB of queue filled, long before all 64 MiB were offered.
  EXPECT_LT(streaming.offered_when_gone(), 16 << 20);
  ::close(fd);
}

// Answers "/hold" only when Release() is called (a request in flight), anything else at once.
class HoldingHandler {
 public:
  http::Handler handler() {
    return [this](const http::Request& request, std::shared_ptr<http::Exchange> exchange) {
      if (request.path != "/hold") return exchange->Respond(200, "text/plain", "ok\n");
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(std::move(exchange));
    };
  }
  size_t num_held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.size();
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& exchange : held_) exchange->Respond(200, "text/plain", "released\n");
    held_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<http::Exchange>> held_;
};

constexpr std::string_view kGet = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
constexpr std::string_view kGetHold = "GET /hold HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

TEST(HttpServerLimitsTest, ConnectionsBeyondMaxConnectionsAre503WhenAllAreAnswering) {
  HoldingHandler holding;
  http::ServerOptions options;
  options.max_connections = 4;
  auto server = http::Server::Start(options, holding.handler());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> open;
  for (int i = 0; i < 4; ++i) {  // each with a request in flight
    open.push_back(Connect(port));
    ASSERT_TRUE(SendAll(open.back(), kGetHold));
  }
  ASSERT_TRUE(WaitFor([&] { return holding.num_held() == 4; }, milliseconds(2000)));
  EXPECT_EQ((*server)->num_open_connections(), 4);
  const int fifth = Connect(port);
  ASSERT_GE(fifth, 0);
  const Received refused = ReadUntilClosed(fifth);
  EXPECT_THAT(refused.bytes, ::testing::StartsWith("HTTP/1.1 503"));
  EXPECT_TRUE(refused.closed);
  EXPECT_EQ((*server)->num_open_connections(), 4);
  ::close(fifth);
  // Answered, they are idle keep-alive connections: a new connection takes the place of one.
  holding.Release();
  for (int fd : open) EXPECT_THAT(ReadOneResponse(fd), ::testing::StartsWith("HTTP/1.1 200"));
  const int sixth = Connect(port);
  ASSERT_TRUE(SendAll(sixth, kGet));
  EXPECT_THAT(ReadOneResponse(sixth), ::testing::StartsWith("HTTP/1.1 200"));
  EXPECT_TRUE(WaitFor([&] { return (*server)->num_open_connections() == 4; }, milliseconds(2000)));
  ::close(sixth);
  for (int fd : open) ::close(fd);
}

TEST(HttpServerLimitsTest, SilentConnectionsAtMaxConnectionsGiveWayToRequests) {
  HoldingHandler holding;
  http::ServerOptions options;
  options.max_connections = 20;  // request_timeout stays 30 s: eviction, not the timeout, acts
  auto server = http::Server::Start(options, holding.handler());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  // One request in flight, then 30 connections that send nothing.
  const int answering = Connect(port);
  ASSERT_TRUE(SendAll(answering, kGetHold));
  ASSERT_TRUE(WaitFor([&] { return holding.num_held() == 1; }, milliseconds(2000)));
  std::vector<int> silent;
  for (int i = 0; i < 30; ++i) silent.push_back(Connect(port, milliseconds(50)));
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point start = Clock::now();
    auto resp = testing::HttpGet(port, "/");
    ASSERT_TRUE(resp.has_value());
    EXPECT_EQ(resp->status, 200);
    EXPECT_LT(SecondsSince(start), 0.5);
  }
  EXPECT_LE((*server)->num_open_connections(), 21);
  // 31 connections came for 20 places: the oldest silent ones were closed without an answer,
  // the request in flight was not.
  int num_closed = 0;
  for (int fd : silent) {
    const Received r = ReadUntilClosed(fd);
    EXPECT_EQ(r.bytes, "");
    num_closed += r.closed ? 1 : 0;
    ::close(fd);
  }
  EXPECT_GE(num_closed, 11);
  holding.Release();
  EXPECT_THAT(ReadOneResponse(answering), ::testing::HasSubstr("released"));
  ::close(answering);
}

// The status line and body of the answer to one raw request (the server closes after it).
std::string AnswerTo(int port, std::string_view request) {
  const int fd = Connect(port);
  if (fd < 0 || !SendAll(fd, request)) return "no connection";
  const Received r = ReadUntilClosed(fd);
  ::close(fd);
  return r.bytes;
}

TEST(HttpServerLimitsTest, AmbiguousHeadersAreRefused) {
  std::atomic<int> num_handled{0};
  auto server = http::Server::Start({}, [&](const http::Request&, auto exchange) {
    ++num_handled;
    exchange->Respond(200, "text/plain", "ok\n");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  using ::testing::StartsWith;
  EXPECT_THAT(AnswerTo(port, "GET / HTTP/1.1\r\nConnection: close\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("needs a Host header")));
  EXPECT_THAT(AnswerTo(port, "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("more than one Host header")));
  EXPECT_THAT(AnswerTo(port,
                       "GET / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer x\r\n"
                       "Authorization: Bearer y\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("more than one Authorization header")));
  EXPECT_THAT(AnswerTo(port, "GET / HTTP/1.1\r\nHost: a\r\nX-Long: one\r\n two\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("obs-fold")));
  EXPECT_THAT(AnswerTo(port, "GET / HTTP/1.1\r\nHost: a\r\nX-Long: one\r\n\ttwo\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("obs-fold")));
  EXPECT_THAT(AnswerTo(port,
                       "POST / HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\n"
                       "Content-Length: 2\r\n\r\n{}"),
              AllOf(StartsWith("HTTP/1.1 415"), HasSubstr("Content-Encoding 'gzip'")));
  EXPECT_EQ(num_handled.load(), 0);
  // What stays allowed: HTTP/1.0 without Host, identity coding, a space inside a value.
  EXPECT_THAT(AnswerTo(port, "GET / HTTP/1.0\r\n\r\n"), StartsWith("HTTP/1.0 200"));
  EXPECT_THAT(AnswerTo(port,
                       "POST / HTTP/1.1\r\nHost: a\r\nContent-Encoding: identity\r\n"
                       "X-A: b c\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"),
              StartsWith("HTTP/1.1 200"));
  EXPECT_EQ(num_handled.load(), 2);
}

TEST(HttpServerLimitsTest, AHalfClosedClientGetsItsWholeAnswer) {
  // A stream of five pieces 100 ms apart, and a full answer after 300 ms: both outlive the
  // client's shutdown(SHUT_WR) right after its request.
  std::atomic<bool> gone{false};
  std::vector<std::thread> writers;
  std::mutex writers_mu;
  auto server = http::Server::Start({}, [&](const http::Request& request, auto exchange) {
    exchange->OnClientGone([&] { gone = true; });
    std::lock_guard<std::mutex> lock(writers_mu);
    if (request.path == "/stream") {
      exchange->StartStream(200, "text/plain");
      writers.emplace_back([exchange] {
        for (int i = 0; i < 5; ++i) {
          std::this_thread::sleep_for(milliseconds(100));
          exchange->Write("piece" + std::to_string(i) + ";");
        }
        exchange->End();
      });
    } else {
      const auto delay = milliseconds(request.path == "/slow" ? 1500 : 300);
      writers.emplace_back([exchange, delay] {
        std::this_thread::sleep_for(delay);
        exchange->Respond(200, "text/plain", "the whole answer\n");
      });
    }
  });
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string path : {"/stream", "/full"}) {
    const int fd = Connect((*server)->port());
    ASSERT_TRUE(SendAll(fd, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
    ASSERT_EQ(::shutdown(fd, SHUT_WR), 0);
    const Clock::time_point start = Clock::now();
    const Received r = ReadUntilClosed(fd);
    ::close(fd);
    EXPECT_THAT(r.bytes, ::testing::StartsWith("HTTP/1.1 200")) << path;
    if (path == "/stream") {
      EXPECT_THAT(r.bytes, ::testing::HasSubstr("piece4;")) << r.bytes;
      EXPECT_THAT(r.bytes, ::testing::EndsWith("0\r\n\r\n")) << r.bytes;  // the last chunk
    } else {
      EXPECT_THAT(r.bytes, ::testing::EndsWith("the whole answer\n")) << r.bytes;
    }
    EXPECT_TRUE(r.closed) << path;
    EXPECT_LT(SecondsSince(start), 2.0) << path;  // closed after the answer, no linger
    EXPECT_FALSE(gone.load()) << path;
  }
  // A reset after the half-close is a client gone: noticed at once, not when the answer is due.
  const int fd = Connect((*server)->port());
  ASSERT_TRUE(SendAll(fd, "GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  ASSERT_EQ(::shutdown(fd, SHUT_WR), 0);
  std::this_thread::sleep_for(milliseconds(200));
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return gone.load(); }, milliseconds(1000)));
  std::lock_guard<std::mutex> lock(writers_mu);
  for (auto& t : writers) t.join();
}

TEST(HttpServerLimitsTest, ASecondServerOnABusyPortFailsNamingThePort) {
  auto first = http::Server::Start({}, AnswerOk());
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = (*first)->port();
  http::ServerOptions options;
  options.port = port;
  auto second = http::Server::Start(options, AnswerOk());
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::AllOf(::testing::HasSubstr("127.0.0.1:" + std::to_string(port)),
                               ::testing::HasSubstr("in use")));
  // The first still serves.
  auto resp = testing::HttpGet(port, "/");
  ASSERT_TRUE(resp.has_value());
  EXPECT_EQ(resp->status, 200);
}

}  // namespace
}  // namespace dropkv
