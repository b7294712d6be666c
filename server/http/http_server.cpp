// The only translation unit that includes Boost.Beast / Asio (they are heavy to compile).
//
// One Session per connection, all of its work on one strand. The session reads continuously:
// bytes go to Beast's request parser while no answer is pending, and are held (pipelining) while
// one is; a read error or EOF during a pending answer is the client going away. Answers arrive as
// Out items posted by the Exchange from any thread and are written in order.
//
// Two timers per session: the read timer (TLS handshake and request deadline, keep-alive idle
// time, the close linger) and the write timer (a pending write that makes no progress).
#include "server/http/http_server.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <array>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <thread>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
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

// Boost 1.74's string_view is boost's own type, and Debian's abseil has its own too.
std::string Str(beast::string_view v) {
  return std::string(v.data(), v.size());
}

constexpr size_t kReadChunkBytes = 16 * 1024;
constexpr uint32_t kMaxHeaderBytes = 64 * 1024;
// Bytes a client may send ahead (pipelined requests) while an answer is pending.
constexpr size_t kMaxPipelinedBytes = 1 << 20;
constexpr auto kCloseLinger = std::chrono::seconds(5);
constexpr auto kBacklogPoll = std::chrono::milliseconds(50);

// Lets an Exchange that outlives the server (held by a job on the engine thread) post safely: a
// session must not be used, nor released, once the io_context is gone, so an Exchange reaches its
// session only under the shared lock while `alive`; Stop() clears it under the exclusive lock.
struct IoGuard {
  std::shared_mutex mu;
  bool alive = true;
};

struct Out {
  // kOverflow: the answer's streamed output passed max_output_bytes_per_exchange.
  enum class Kind { kFull, kStreamHead, kChunk, kLastChunk, kContinue, kOverflow };
  Kind kind = Kind::kFull;
  int status = 200;
  std::string content_type;
  std::string body;  // kFull: the body; kChunk: the data
  Headers headers;
};

class ExchangeImpl;

// What an Exchange needs from its connection (the Session template implements it).
class SessionBase : public std::enable_shared_from_this<SessionBase> {
 public:
  virtual ~SessionBase() = default;
  virtual void Enqueue(const std::shared_ptr<ExchangeImpl>& exchange, Out out) = 0;
  virtual void CloseNow() = 0;
  // Closes the connection unless a request is being answered by the time the strand runs this.
  virtual void EvictIfIdle() = 0;
  virtual asio::any_io_executor executor() = 0;  // the connection's strand

  // Written on the strand, read by the accept chain to pick a connection to evict: true while no
  // request is being answered (before the first, between keep-alive requests, while one arrives).
  std::atomic<bool> idle{true};
  std::atomic<int64_t> idle_since_ns{0};  // steady clock
  std::atomic<bool> evicted{false};
};

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class ExchangeImpl final : public Exchange, public std::enable_shared_from_this<ExchangeImpl> {
 public:
  ExchangeImpl(std::weak_ptr<SessionBase> session, std::shared_ptr<IoGuard> guard,
               int64_t max_unwritten_bytes)
      : session_(std::move(session)),
        guard_(std::move(guard)),
        max_unwritten_bytes_(max_unwritten_bytes) {}

  void Respond(int status, std::string content_type, std::string body,
               Headers extra_headers) override {
    Post({Out::Kind::kFull, status, std::move(content_type), std::move(body),
          std::move(extra_headers)});
  }
  void StartStream(int status, std::string content_type, Headers extra_headers) override {
    Post({Out::Kind::kStreamHead, status, std::move(content_type), "", std::move(extra_headers)});
  }
  // Counted here, before the post: data waiting in the strand's queue is held by the server too.
  void Write(std::string data) override {
    if (data.empty()) return;
    const auto size = static_cast<int64_t>(data.size());
    if (unwritten_bytes_.fetch_add(size) + size > max_unwritten_bytes_) {
      unwritten_bytes_ -= size;  // dropped: the count stays what the server holds
      if (!overflowed_.exchange(true)) Post({Out::Kind::kOverflow, 0, "", "", {}});
      return;
    }
    Post({Out::Kind::kChunk, 0, "", std::move(data), {}});
  }
  void End() override { Post({Out::Kind::kLastChunk, 0, "", "", {}}); }

  void OnClientGone(std::function<void()> on_gone) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) on_gone_ = std::move(on_gone);
  }
  void Hold(std::shared_ptr<void> state) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) held_.push_back(std::move(state));
  }
  void OnBacklog(std::function<void(bool)> on_change) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) on_backlog_ = std::move(on_change);
  }

  // Session side, on the strand.
  void NotifyBacklog(bool backlogged) {
    std::function<void(bool)> on_backlog;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      on_backlog = on_backlog_;
    }
    if (on_backlog) on_backlog(backlogged);
  }

  // Session side, on the strand: `n` streamed bytes reached the socket.
  void OnStreamBytesWritten(size_t n) { unwritten_bytes_ -= static_cast<int64_t>(n); }
  int64_t unwritten_bytes() const { return unwritten_bytes_.load(); }

  // Session side, on the strand: the answer is complete (client_gone false) or cannot be.
  void Finish(bool client_gone) {
    std::function<void()> on_gone;
    std::vector<std::shared_ptr<void>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      done_ = true;
      on_gone.swap(on_gone_);
      on_backlog_ = nullptr;
      held.swap(held_);
    }
    if (client_gone && on_gone) on_gone();
    // `held` (and with it e.g. a job that holds this exchange) is released here, outside mu_.
  }

 private:
  void Post(Out out) {
    std::shared_lock<std::shared_mutex> lock(guard_->mu);
    if (!guard_->alive) return;
    std::shared_ptr<SessionBase> session = session_.lock();  // released before `lock`
    if (!session) return;
    asio::post(session->executor(),
               [session, self = shared_from_this(), out = std::move(out)]() mutable {
                 session->Enqueue(self, std::move(out));
               });
  }

  std::weak_ptr<SessionBase> session_;
  std::shared_ptr<IoGuard> guard_;
  const int64_t max_unwritten_bytes_;
  std::atomic<int64_t> unwritten_bytes_{0};  // streamed, not yet written
  std::atomic<bool> overflowed_{false};
  std::mutex mu_;
  bool done_ = false;
  std::function<void()> on_gone_;
  std::function<void(bool)> on_backlog_;
  std::vector<std::shared_ptr<void>> held_;
};

}  // namespace

std::string_view Request::Header(std::string_view lower_case_name) const {
  for (const auto& [name, value] : headers)
    if (name == lower_case_name) return value;
  return {};
}

std::string_view StatusReason(int status) {
  const beast::string_view reason = bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return reason.empty() ? std::string_view("Unknown")
                        : std::string_view(reason.data(), reason.size());
}

struct Server::Impl {
  ServerOptions options;
  Handler handler;
  // Reset in Stop() while the members its pending handlers (sessions) use are still alive.
  std::unique_ptr<asio::io_context> ioc;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::optional<asio::ssl::context> ssl;
  std::optional<tcp::acceptor> acceptor;
  std::optional<asio::steady_timer> accept_retry;
  std::shared_ptr<IoGuard> guard = std::make_shared<IoGuard>();
  std::vector<std::thread> threads;
  int32_t port = 0;
  std::mutex sessions_mu;
  std::set<std::weak_ptr<SessionBase>, std::owner_less<std::weak_ptr<SessionBase>>> sessions;
  std::atomic<int64_t> num_connections{0};
  bool refusing_connections = false;  // at max_connections; only the accept chain touches it
  bool evicting_connections = false;  // likewise
  std::once_flag stop_once;

  explicit Impl(int num_threads)
      : ioc(std::make_unique<asio::io_context>(std::max(1, num_threads))) {}
  void Accept();
  bool EvictIdle();
  void Refuse(tcp::socket socket);
  void Register(const std::shared_ptr<SessionBase>& s) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.insert(s);
  }
  void Unregister(const std::weak_ptr<SessionBase>& s) {
    std::lock_guard<std::mutex> lock(sessions_mu);
    sessions.erase(s);
  }
  std::pair<std::string, std::string> ErrorBody(int status, std::string_view message) const {
    if (options.error_formatter) return options.error_formatter(status, message);
    return {"text/plain; charset=utf-8", std::string(message) + "\n"};
  }
};

namespace {

tcp::socket& LowestLayer(tcp::socket& s) {
  return s;
}
tcp::socket& LowestLayer(asio::ssl::stream<tcp::socket>& s) {
  return s.next_layer();
}

template <class Stream>
class Session final : public SessionBase {
 public:
  Session(Stream stream, Server::Impl& server)
      : stream_(std::move(stream)),
        server_(server),
        read_timer_(stream_.get_executor()),
        write_timer_(stream_.get_executor()),
        backlog_timer_(stream_.get_executor()) {
    ++server_.num_connections;
  }
  ~Session() override { --server_.num_connections; }

  void Start() {
    idle_since_ns = SteadyNowNs();
    server_.Register(shared_from_this());
    // The first request's deadline runs from the accept: a client that connects and stays silent
    // (or stalls the TLS handshake) holds its connection no longer than one that drips.
    request_started_ = true;
    ArmReadTimer(server_.options.request_timeout);
    if constexpr (std::is_same_v<Stream, asio::ssl::stream<tcp::socket>>) {
      stream_.async_handshake(asio::ssl::stream_base::server,
                              [self = Self()](beast::error_code ec) {
                                if (ec) return self->Close(false);
                                self->BeginRequests();
                              });
    } else {
      BeginRequests();
    }
  }

  void Enqueue(const std::shared_ptr<ExchangeImpl>& exchange, Out out) override {
    if (closed_ || exchange != exchange_) return;  // a finished or abandoned answer
    if (out.kind == Out::Kind::kOverflow) {
      spdlog::warn(
          "http: closing a connection whose client does not read: {} bytes of streamed output "
          "queued (max_output_bytes_per_exchange {})",
          exchange->unwritten_bytes(), server_.options.max_output_bytes_per_exchange);
      return Close(/*client_gone=*/true);
    }
    out_.push_back(std::move(out));
    if (!writing_) WriteNext();
  }

  void CloseNow() override {
    asio::post(stream_.get_executor(), [self = Self()] { self->Close(true); });
  }
  void EvictIfIdle() override {
    asio::post(stream_.get_executor(), [self = Self()] {
      if (self->exchange_) {  // a request came in the meantime: it stays
        self->evicted = false;
        return;
      }
      self->Close(false);
    });
  }
  asio::any_io_executor executor() override { return stream_.get_executor(); }

 private:
  std::shared_ptr<Session> Self() { return std::static_pointer_cast<Session>(shared_from_this()); }

  void BeginRequests() {
    NewParser();
    ReadSome();
  }

  void NewParser() {
    parser_.emplace();
    parser_->eager(true);
    parser_->header_limit(kMaxHeaderBytes);
    parser_->body_limit(static_cast<uint64_t>(server_.options.max_body_bytes));
    sent_continue_ = false;
  }

  void ArmReadTimer(std::chrono::steady_clock::duration after) {
    read_timer_.expires_after(after);
    read_timer_.async_wait([weak = weak_from_this()](beast::error_code ec) {
      if (ec) return;  // cancelled or re-armed
      if (auto s = weak.lock()) static_cast<Session*>(s.get())->OnReadTimer();
    });
  }
  void OnReadTimer() {
    if (closed_ || exchange_) return;  // an answer is pending: the write timer watches it
    // 408 only to a request that has begun: an unsolicited answer on a connection that never sent
    // one could be read by a pooling client as the answer to its next request.
    if (request_has_bytes_ && !closing_) {
      return ReplyAndClose(408, absl::StrCat("request not complete within ",
                                             server_.options.request_timeout.count(), " ms"));
    }
    Close(false);  // idle, a stuck handshake, or a close that lingered
  }

  // Called as every write starts; the timer runs until a check finds no write pending.
  void BeginWrite() {
    writing_ = true;
    NoteWriteProgress();
    if (write_timer_armed_) return;
    write_timer_armed_ = true;
    ArmWriteTimer(server_.options.write_stall_timeout);
  }
  void NoteWriteProgress() { last_write_progress_ = std::chrono::steady_clock::now(); }
  void ArmWriteTimer(std::chrono::steady_clock::duration after) {
    write_timer_.expires_after(after);
    write_timer_.async_wait([weak = weak_from_this()](beast::error_code ec) {
      if (ec) return;
      if (auto s = weak.lock()) static_cast<Session*>(s.get())->OnWriteTimer();
    });
  }
  void OnWriteTimer() {
    write_timer_armed_ = false;
    if (closed_ || !writing_) return;
    const auto stalled = std::chrono::steady_clock::now() - last_write_progress_;
    if (stalled < server_.options.write_stall_timeout) {
      write_timer_armed_ = true;
      return ArmWriteTimer(server_.options.write_stall_timeout - stalled);
    }
    spdlog::warn("http: closing a connection whose client took no bytes for {} ms",
                 server_.options.write_stall_timeout.count());
    Close(/*client_gone=*/true);
  }
  // asio::async_write's completion condition, called after every partial write: a slow reader
  // makes progress, only one that takes nothing stalls.
  auto TransferAllNotingProgress() {
    return [self = Self()](const beast::error_code& ec, size_t n) {
      self->NoteWriteProgress();
      return asio::transfer_all()(ec, n);
    };
  }

  void ReadSome() {
    if (closed_) return;
    // Into a buffer of its own: buffer_ is consumed by the parser while this read is pending, and
    // a flat_buffer that is emptied moves its write position.
    stream_.async_read_some(
        asio::buffer(read_chunk_),
        [self = Self()](beast::error_code ec, size_t n) { self->OnRead(ec, n); });
  }

  void OnRead(beast::error_code ec, size_t n) {
    if (closed_) return;
    // EOF with an answer pending is a half-close (shutdown(SHUT_WR) after the request): the
    // client still reads, so it gets the answer, and the connection closes after it. A client
    // that has really gone is noticed when a write fails (a stream: at its next piece).
    if (ec == asio::error::eof && exchange_ && !closing_) {
      peer_done_sending_ = true;
      // Holds the session while no read is pending; completes on a reset (EPOLLERR/EPOLLHUP).
      LowestLayer(stream_).async_wait(tcp::socket::wait_error,
                                      [self = Self()](beast::error_code e) {
                                        if (!e) self->Close(/*client_gone=*/true);
                                      });
      return;
    }
    if (ec) return Close(/*client_gone=*/true);
    if (closing_) return ReadSome();  // draining what the client still sends before our FIN
    buffer_.commit(asio::buffer_copy(buffer_.prepare(n), asio::buffer(read_chunk_.data(), n)));
    if (!exchange_) {
      ParseBuffered();
    } else if (buffer_.size() > kMaxPipelinedBytes) {
      return Close(true);
    }
    ReadSome();
  }

  void ParseBuffered() {
    while (!exchange_ && !closing_ && !closed_ && buffer_.size() > 0) {
      if (!request_started_) {  // this request's first byte: its deadline starts, once
        request_started_ = true;
        ArmReadTimer(server_.options.request_timeout);
      }
      request_has_bytes_ = true;
      if (!parser_->is_header_done() && HasObsFold())
        return ReplyAndClose(
            400,
            "malformed HTTP request: a header line continues on the next line "
            "(obs-fold, starting with a space or tab); send each field on one line");
      beast::error_code ec;
      const size_t used = parser_->put(buffer_.data(), ec);
      buffer_.consume(used);
      if (used > 0) header_scanned_ = 0;
      if (ec == bhttp::error::need_more) {
        MaybeSendContinue();
        if (used == 0) break;
        continue;
      }
      if (ec) {
        const int status = ec == bhttp::error::body_limit     ? 413
                           : ec == bhttp::error::header_limit ? 431
                                                              : 400;
        const std::string message = status == 413
                                        ? absl::StrCat("request body larger than ",
                                                       server_.options.max_body_bytes, " bytes")
                                        : absl::StrCat("malformed HTTP request: ", ec.message());
        return ReplyAndClose(status, message);
      }
      if (parser_->is_done()) {
        Dispatch(parser_->release());
        NewParser();
      } else {
        MaybeSendContinue();
      }
    }
    if (!exchange_ && !closing_ && !closed_ && !request_started_)
      ArmReadTimer(server_.options.idle_timeout);
  }

  // Beast unfolds obs-fold lines; RFC 9112 (5.2) lets a server refuse them instead, and we do:
  // a front proxy that does not unfold would see other fields than we do. The parser takes the
  // header only once all of it is buffered, so the check runs on the whole header.
  // The search for the header's end resumes where the last one stopped, so that a header dripped
  // byte by byte costs linear time.
  bool HasObsFold() {
    const std::string_view data(static_cast<const char*>(buffer_.data().data()),
                                buffer_.data().size());
    const size_t end = data.find("\r\n\r\n", header_scanned_ >= 3 ? header_scanned_ - 3 : 0);
    if (end == std::string_view::npos) {
      header_scanned_ = data.size();
      return false;
    }
    const std::string_view header = data.substr(0, end + 2);
    return header.find("\n ") != std::string_view::npos ||
           header.find("\n\t") != std::string_view::npos;
  }

  // RFC 9112 (3.2): an HTTP/1.1 request has exactly one Host. Fields that say who asks or what
  // the body is must not come twice (a proxy could read the other one). No content coding is
  // decoded here, so a coded body is refused rather than read as it is. Status 0: none of these.
  std::pair<int, std::string> HeaderError(const bhttp::request<bhttp::string_body>& message) const {
    const auto count = [&](bhttp::field f) {
      const auto range = message.equal_range(f);
      return std::distance(range.first, range.second);
    };
    const auto num_hosts = count(bhttp::field::host);
    if (num_hosts > 1 || (num_hosts == 0 && message.version() >= 11))
      return {400, num_hosts == 0 ? "an HTTP/1.1 request needs a Host header"
                                  : "more than one Host header"};
    if (count(bhttp::field::authorization) > 1) return {400, "more than one Authorization header"};
    if (count(bhttp::field::content_type) > 1) return {400, "more than one Content-Type header"};
    const auto codings = message.equal_range(bhttp::field::content_encoding);
    for (auto it = codings.first; it != codings.second; ++it) {
      const std::string coding = absl::AsciiStrToLower(
          absl::StripAsciiWhitespace(absl::string_view(it->value().data(), it->value().size())));
      if (coding != "identity")
        return {415, absl::StrCat("Content-Encoding '", coding,
                                  "' is not supported: send the body unencoded")};
    }
    return {0, ""};
  }

  // curl sends "Expect: 100-continue" before bodies over 1 KiB and waits for this line.
  void MaybeSendContinue() {
    if (sent_continue_ || !parser_->is_header_done() || parser_->is_done()) return;
    const beast::string_view expect = parser_->get()[bhttp::field::expect];
    if (!beast::iequals(expect, "100-continue")) return;
    sent_continue_ = true;
    Out out;
    out.kind = Out::Kind::kContinue;
    continue_queue_.push_back(std::move(out));
    if (!writing_) WriteNext();
  }

  void Dispatch(bhttp::request<bhttp::string_body> message) {
    read_timer_.cancel();
    request_started_ = false;
    request_has_bytes_ = false;
    version_ = message.version();
    if (auto [status, error] = HeaderError(message); status != 0)
      return ReplyAndClose(status, error);
    idle = false;
    Request request;
    request.method = Str(message.method_string());
    const std::string target = Str(message.target());
    const size_t q = target.find('?');
    request.path = std::string(target.substr(0, q));
    if (q != std::string::npos) request.query = std::string(target.substr(q + 1));
    for (const auto& field : message)
      request.headers.emplace_back(absl::AsciiStrToLower(Str(field.name_string())),
                                   Str(field.value()));
    request.body = std::move(message.body());
    keep_alive_ = message.keep_alive();
    head_request_ = message.method() == bhttp::verb::head;
    exchange_ = NewExchange();
    try {
      server_.handler(request, exchange_);
    } catch (const std::exception& e) {
      spdlog::error("http: handler for {} {} threw: {}", request.method, request.path, e.what());
      auto [type, body] = server_.ErrorBody(500, "internal error");
      exchange_->Respond(500, std::move(type), std::move(body), {});
    }
  }

  std::shared_ptr<ExchangeImpl> NewExchange() {
    return std::make_shared<ExchangeImpl>(weak_from_this(), server_.guard,
                                          server_.options.max_output_bytes_per_exchange);
  }

  void ReplyAndClose(int status, const std::string& message) {
    keep_alive_ = false;
    head_request_ = false;
    exchange_ = NewExchange();
    auto [type, body] = server_.ErrorBody(status, message);
    exchange_->Respond(status, std::move(type), std::move(body), {});
  }

  template <class Body>
  void SetCommonFields(bhttp::response<Body>& response, const Out& out) {
    response.set(bhttp::field::server, "dropkv-server");
    if (!out.content_type.empty()) response.set(bhttp::field::content_type, out.content_type);
    for (const auto& [name, value] : out.headers) response.set(name, value);
    response.keep_alive(keep_alive_);
  }

  void WriteNext() {
    if (closed_) return;
    if (!continue_queue_.empty()) {
      continue_queue_.clear();
      BeginWrite();
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      asio::async_write(
          stream_, asio::buffer(kContinue), TransferAllNotingProgress(),
          [self = Self()](beast::error_code ec, size_t) { self->OnWritten(ec, /*final=*/false); });
      return;
    }
    if (out_.empty()) {
      writing_ = false;
      return;
    }
    BeginWrite();
    Out out = std::move(out_.front());
    out_.pop_front();
    switch (out.kind) {
      case Out::Kind::kFull: {
        bhttp::response<bhttp::string_body> message(static_cast<bhttp::status>(out.status),
                                                    version_);
        SetCommonFields(message, out);
        message.body() = std::move(out.body);
        message.prepare_payload();
        if (head_request_) message.body().clear();  // Content-Length stays: HEAD's meaning
        WriteSomeOf(std::make_shared<FullResponse>(std::move(message)));
        return;
      }
      case Out::Kind::kStreamHead: {
        auto response = std::make_shared<bhttp::response<bhttp::empty_body>>(
            static_cast<bhttp::status>(out.status), version_);
        SetCommonFields(*response, out);
        response->chunked(true);
        auto serializer =
            std::make_shared<bhttp::response_serializer<bhttp::empty_body>>(*response);
        bhttp::async_write_header(
            stream_, *serializer,
            [self = Self(), response, serializer](beast::error_code ec, size_t) {
              self->OnWritten(ec, /*final=*/false);
            });
        return;
      }
      case Out::Kind::kChunk: {
        // Everything queued goes out as one chunk: fewer writes when tokens come faster than
        // the socket drains.
        auto data = std::make_shared<std::string>(std::move(out.body));
        while (!out_.empty() && out_.front().kind == Out::Kind::kChunk) {
          data->append(out_.front().body);
          out_.pop_front();
        }
        asio::async_write(
            stream_, bhttp::make_chunk(asio::buffer(*data)), TransferAllNotingProgress(),
            [self = Self(), data, exchange = exchange_](beast::error_code ec, size_t) {
              if (exchange) exchange->OnStreamBytesWritten(data->size());
              self->OnWritten(ec, /*final=*/false);
              self->CheckBacklog();
            });
        return;
      }
      case Out::Kind::kLastChunk:
        asio::async_write(
            stream_, bhttp::make_chunk_last(), TransferAllNotingProgress(),
            [self = Self()](beast::error_code ec, size_t) { self->OnWritten(ec, /*final=*/true); });
        return;
      case Out::Kind::kContinue:
      case Out::Kind::kOverflow:
        break;
    }
    writing_ = false;
  }

  // What the client has not taken of the stream in progress: queued here, and in the socket's send
  // queue (sent but not acknowledged, or not sent: the client's receive window is full). Checked
  // after each write and, while backlogged, by a timer (a paused stream writes nothing).
  void CheckBacklog() {
    const int64_t limit = server_.options.unread_stream_bytes;
    if (closed_ || !exchange_ || limit <= 0) return;
    int in_socket = 0;
    if (::ioctl(LowestLayer(stream_).native_handle(), SIOCOUTQ, &in_socket) != 0) in_socket = 0;
    const int64_t unread = in_socket + exchange_->unwritten_bytes();
    if (!backlogged_ && unread > limit) {
      backlogged_ = true;
      exchange_->NotifyBacklog(true);
    } else if (backlogged_ && unread <= limit / 2) {
      backlogged_ = false;
      exchange_->NotifyBacklog(false);
    }
    if (!backlogged_) return;
    backlog_timer_.expires_after(kBacklogPoll);
    backlog_timer_.async_wait([weak = weak_from_this()](beast::error_code ec) {
      if (ec) return;
      if (auto s = weak.lock()) static_cast<Session*>(s.get())->CheckBacklog();
    });
  }

  // A complete response and its serializer, alive until its last partial write.
  struct FullResponse {
    explicit FullResponse(bhttp::response<bhttp::string_body> m)
        : message(std::move(m)), serializer(message) {}
    bhttp::response<bhttp::string_body> message;
    bhttp::response_serializer<bhttp::string_body> serializer;
  };
  // Piece by piece rather than bhttp::async_write, so that each piece counts as progress.
  void WriteSomeOf(std::shared_ptr<FullResponse> response) {
    bhttp::async_write_some(stream_, response->serializer,
                            [self = Self(), response](beast::error_code ec, size_t) {
                              if (ec || response->serializer.is_done())
                                return self->OnWritten(ec, /*final=*/true);
                              if (self->closed_) return;
                              self->NoteWriteProgress();
                              self->WriteSomeOf(response);
                            });
  }

  void OnWritten(beast::error_code ec, bool final) {
    if (closed_) return;
    if (ec) return Close(/*client_gone=*/true);
    NoteWriteProgress();
    if (final) {
      std::shared_ptr<ExchangeImpl> done = std::move(exchange_);
      exchange_.reset();
      out_.clear();
      done->Finish(/*client_gone=*/false);
      backlogged_ = false;
      backlog_timer_.cancel();
      idle_since_ns = SteadyNowNs();
      idle = true;
      if (!keep_alive_) return CloseAfterWrites();
      ParseBuffered();  // a pipelined request may be waiting
      if (peer_done_sending_ && !exchange_) return CloseAfterWrites();
    }
    WriteNext();
  }

  // Connection: close. Send FIN, keep reading until the client closes (closing at once with
  // unread input would reset the connection and could lose the answer's tail), for a while.
  void CloseAfterWrites() {
    if (peer_done_sending_) return Close(false);  // its FIN came: nothing left to drain
    closing_ = true;
    beast::error_code ec;
    LowestLayer(stream_).shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return Close(false);
    ArmReadTimer(kCloseLinger);
  }

  void Close(bool client_gone) {
    if (closed_) return;
    closed_ = true;
    if (exchange_) {
      std::shared_ptr<ExchangeImpl> abandoned = std::move(exchange_);
      exchange_.reset();
      abandoned->Finish(client_gone);
    }
    out_.clear();
    read_timer_.cancel();
    write_timer_.cancel();
    backlog_timer_.cancel();
    beast::error_code ec;
    LowestLayer(stream_).shutdown(tcp::socket::shutdown_both, ec);
    LowestLayer(stream_).close(ec);
    server_.Unregister(weak_from_this());
  }

  Stream stream_;
  Server::Impl& server_;
  asio::steady_timer read_timer_;
  asio::steady_timer write_timer_;
  asio::steady_timer backlog_timer_;  // while backlogged: is the client reading again?
  bool backlogged_ = false;
  std::chrono::steady_clock::time_point last_write_progress_;
  bool write_timer_armed_ = false;
  std::array<char, kReadChunkBytes> read_chunk_;
  beast::flat_buffer buffer_;  // received, not yet parsed
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::shared_ptr<ExchangeImpl> exchange_;  // the answer in progress
  std::deque<Out> out_;
  std::deque<Out> continue_queue_;
  bool writing_ = false;
  bool keep_alive_ = true;
  bool head_request_ = false;
  bool sent_continue_ = false;
  bool request_started_ = false;    // the request deadline runs: a byte of it (or the accept) came
  bool request_has_bytes_ = false;  // a byte of the request came
  size_t header_scanned_ = 0;       // buffered header bytes HasObsFold searched for the end already
  bool peer_done_sending_ = false;  // EOF while an answer was pending (a half-close)
  bool closing_ = false;
  bool closed_ = false;
  unsigned version_ = 11;
};

}  // namespace

void Server::Impl::Accept() {
  acceptor->async_accept(asio::make_strand(*ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor->is_open()) return;
    if (ec) {
      // Out of file descriptors (EMFILE) is where the connection count stops: say so and retry
      // later instead of spinning.
      spdlog::warn("http: accept failed: {} ({} connections open)", ec.message(),
                   num_connections.load());
      accept_retry->expires_after(std::chrono::milliseconds(100));
      accept_retry->async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec) Accept();
      });
      return;
    }
    if (num_connections.load() >= options.max_connections && !EvictIdle()) {
      Refuse(std::move(socket));
      return Accept();
    }
    refusing_connections = false;
    if (num_connections.load() < options.max_connections) evicting_connections = false;
    beast::error_code opt_ec;
    socket.set_option(tcp::no_delay(true), opt_ec);  // SSE deltas are small: no Nagle delay
    if (ssl) {
      std::make_shared<Session<asio::ssl::stream<tcp::socket>>>(
          asio::ssl::stream<tcp::socket>(std::move(socket), *ssl), *this)
          ->Start();
    } else {
      std::make_shared<Session<tcp::socket>>(std::move(socket), *this)->Start();
    }
    Accept();
  });
}

// At max_connections the connection idle longest (no request being answered: silent since its
// accept, sending a request slowly, or kept alive between requests) is closed to make room, as
// nginx reuses such connections; false when every connection is answering a request.
bool Server::Impl::EvictIdle() {
  std::shared_ptr<SessionBase> oldest;
  {
    std::lock_guard<std::mutex> lock(sessions_mu);
    for (const auto& weak : sessions) {
      std::shared_ptr<SessionBase> s = weak.lock();
      if (!s || !s->idle.load() || s->evicted.load()) continue;
      if (!oldest || s->idle_since_ns.load() < oldest->idle_since_ns.load()) oldest = std::move(s);
    }
  }
  if (!oldest || oldest->evicted.exchange(true)) return false;
  if (!evicting_connections)
    spdlog::warn(
        "http: {} connections open (max_connections): closing the longest idle ones to make room",
        num_connections.load());
  evicting_connections = true;
  oldest->EvictIfIdle();
  return true;
}

// Without a session, so that a refused connection is never counted: one non-blocking write (a new
// socket's send buffer takes it whole), FIN, then close. With TLS there is no answer without a
// handshake, so it is only closed.
void Server::Impl::Refuse(tcp::socket socket) {
  if (!refusing_connections)
    spdlog::warn("http: {} connections open (max_connections): refusing new ones with 503",
                 num_connections.load());
  refusing_connections = true;
  beast::error_code ec;
  if (!ssl) {
    const auto [type, body] = ErrorBody(503, "too many open connections; retry later");
    const std::string response = absl::StrCat(
        "HTTP/1.1 503 Service Unavailable\r\nServer: dropkv-server\r\nContent-Type: ", type,
        "\r\nContent-Length: ", body.size(), "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
        body);
    socket.non_blocking(true, ec);
    if (!ec) socket.write_some(asio::buffer(response), ec);
    socket.shutdown(tcp::socket::shutdown_send, ec);
    // What the client already sent is read away: closing with unread input resets the
    // connection, and the reset could reach the client before the 503 does.
    std::array<char, 4096> discard;
    socket.read_some(asio::buffer(discard), ec);
  }
  socket.close(ec);
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options, Handler handler) {
  if (options.port < 0 || options.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("port ", options.port, " out of [0, 65535]"));
  if (options.request_timeout.count() <= 0 || options.write_stall_timeout.count() <= 0 ||
      options.max_output_bytes_per_exchange <= 0 || options.max_connections <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "request_timeout, write_stall_timeout, max_output_bytes_per_exchange and "
        "max_connections must be positive (",
        options.request_timeout.count(), " ms, ", options.write_stall_timeout.count(), " ms, ",
        options.max_output_bytes_per_exchange, ", ", options.max_connections, ")"));
  if (options.tls_cert_file.empty() != options.tls_key_file.empty())
    return absl::InvalidArgumentError("tls: set both the certificate and the key file, or neither");
  if (!options.tls_client_ca_file.empty() && options.tls_cert_file.empty())
    return absl::InvalidArgumentError(
        "tls: client certificates (mTLS) need the server's TLS files");
  auto impl = std::make_unique<Impl>(options.num_threads);
  impl->handler = std::move(handler);
  if (!options.tls_cert_file.empty()) {
    try {
      impl->ssl.emplace(asio::ssl::context::tls_server);
      impl->ssl->set_options(asio::ssl::context::default_workarounds |
                             asio::ssl::context::no_sslv2 | asio::ssl::context::no_sslv3 |
                             asio::ssl::context::no_tlsv1 | asio::ssl::context::no_tlsv1_1);
      impl->ssl->use_certificate_chain_file(options.tls_cert_file);
      impl->ssl->use_private_key_file(options.tls_key_file, asio::ssl::context::pem);
      if (!options.tls_client_ca_file.empty()) {  // mTLS: no certificate, no connection
        impl->ssl->load_verify_file(options.tls_client_ca_file);
        impl->ssl->set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert);
      }
    } catch (const boost::system::system_error& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("tls: cannot load ", options.tls_cert_file, " / ", options.tls_key_file,
                       options.tls_client_ca_file.empty() ? "" : " / ", options.tls_client_ca_file,
                       ": ", e.what()));
    }
  }
  beast::error_code ec;
  tcp::resolver resolver(*impl->ioc);
  auto endpoints = resolver.resolve(options.host, std::to_string(options.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host '", options.host, "': ", ec.message()));
  std::string last_error = "no address";
  for (const auto& entry : endpoints) {
    tcp::acceptor acceptor(asio::make_strand(*impl->ioc));  // Stop() closes it from a post
    acceptor.open(entry.endpoint().protocol(), ec);
    // Lets a restart bind while the last run's connections sit in TIME_WAIT; on Linux it does not
    // let a second listener share the port (that is SO_REUSEPORT), so a busy port fails below.
    if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(entry.endpoint(), ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) {
      impl->port = acceptor.local_endpoint().port();
      impl->acceptor.emplace(std::move(acceptor));
      break;
    }
    last_error = ec.message();
  }
  if (!impl->acceptor)
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.host, ":", options.port, ": ", last_error));
  impl->accept_retry.emplace(impl->acceptor->get_executor());
  impl->options = std::move(options);
  impl->work.emplace(impl->ioc->get_executor());
  impl->Accept();
  Impl* raw = impl.get();
  for (int i = 0; i < std::max(1, raw->options.num_threads); ++i)
    raw->threads.emplace_back([raw] { raw->ioc->run(); });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int32_t Server::port() const {
  return impl_->port;
}

int64_t Server::num_open_connections() const {
  return impl_->num_connections.load();
}

void Server::Stop() {
  std::call_once(impl_->stop_once, [this] {
    Impl& m = *impl_;
    asio::post(m.acceptor->get_executor(), [&m] {
      beast::error_code ec;
      m.acceptor->close(ec);
      m.accept_retry->cancel();
    });
    std::vector<std::shared_ptr<SessionBase>> live;
    {
      std::lock_guard<std::mutex> lock(m.sessions_mu);
      for (const auto& weak : m.sessions)
        if (auto s = weak.lock()) live.push_back(std::move(s));
    }
    for (const auto& s : live) s->CloseNow();
    live.clear();
    m.work.reset();
    // Every session closes at once; give their handlers a moment, then stop what is left.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (m.num_connections.load() > 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    m.ioc->stop();
    for (auto& t : m.threads) t.join();
    {
      std::unique_lock<std::shared_mutex> lock(m.guard->mu);
      m.guard->alive = false;
    }
    m.acceptor.reset();
    m.accept_retry.reset();
    m.ioc.reset();  // destroys the sessions still referenced by pending handlers
  });
}

Server::~Server() {
  Stop();
}

}  // namespace dropkv::http
