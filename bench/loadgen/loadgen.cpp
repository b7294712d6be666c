#include "bench/loadgen/loadgen.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "dropkv/v1/inference.grpc.pb.h"
#include "server/http/http_client.h"

namespace dropkv::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

int64_t LengthDist::Sample(std::mt19937_64& rng) const {
  if (uniform) return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  if (values.size() == 1) return values[0];
  return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
}

int64_t LengthDist::Max() const {
  if (uniform) return hi;
  return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
}

absl::StatusOr<LengthDist> ParseLengthDist(const std::string& spec, const std::string& flag) {
  LengthDist d;
  d.spec = spec;
  std::vector<std::string> parts = absl::StrSplit(spec, absl::MaxSplits(':', 2));
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", why, " in '", spec, "' (use fixed:N, uniform:A:B or file:PATH)"));
  };
  auto positive = [&](const std::string& s, int64_t* v) {
    return absl::SimpleAtoi(s, v) && *v >= 1 && *v <= (1 << 20);
  };
  if (parts[0] == "fixed" && parts.size() == 2) {
    int64_t v = 0;
    if (!positive(parts[1], &v)) return bad("length must be an integer in [1, 1048576]");
    d.values = {v};
  } else if (parts[0] == "uniform" && parts.size() == 3) {
    if (!positive(parts[1], &d.lo) || !positive(parts[2], &d.hi) || d.lo > d.hi)
      return bad("bounds must be integers 1 <= A <= B <= 1048576");
    d.uniform = true;
  } else if (parts[0] == "file" && parts.size() >= 2) {
    const std::string path = spec.substr(5);
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read '", path, "'"));
    std::string line;
    int line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      const std::string s(absl::StripAsciiWhitespace(line));
      if (s.empty() || s[0] == '#') continue;
      int64_t v = 0;
      if (!positive(s, &v))
        return absl::InvalidArgumentError(absl::StrCat(
            flag, ": ", path, ":", line_no, ": not a length in [1, 1048576]: '", s, "'"));
      d.values.push_back(v);
    }
    if (d.values.empty())
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no lengths"));
  } else {
    int64_t v = 0;  // a bare number means fixed
    if (parts.size() == 1 && positive(parts[0], &v)) {
      d.values = {v};
    } else {
      return bad("unknown form");
    }
  }
  return d;
}

void AppendRandomTokens(int64_t num_tokens, int32_t vocab_size, std::mt19937_64& rng,
                        std::vector<int32_t>* out) {
  std::uniform_int_distribution<int32_t> token(3, std::max(3, vocab_size - 1));
  for (int64_t i = 0; i < num_tokens; ++i) out->push_back(token(rng));
}

std::vector<int32_t> NextTurnPrompt(const std::vector<int32_t>& prev_prompt,
                                    const std::vector<int32_t>& prev_answer, int64_t growth_len,
                                    int32_t vocab_size, std::mt19937_64& rng) {
  std::vector<int32_t> prompt;
  prompt.reserve(prev_prompt.size() + prev_answer.size() + static_cast<size_t>(growth_len));
  prompt.insert(prompt.end(), prev_prompt.begin(), prev_prompt.end());
  prompt.insert(prompt.end(), prev_answer.begin(), prev_answer.end());
  AppendRandomTokens(growth_len, vocab_size, rng, &prompt);
  return prompt;
}

absl::StatusOr<CompressionChoice> ParseCompressionChoice(const std::string& spec) {
  CompressionChoice c;
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.empty() || parts.size() > 2 || parts[0].empty())
    return absl::InvalidArgumentError(
        absl::StrCat("--compression: '", spec, "' is not METHOD or METHOD:KEEP_RATIO"));
  c.method = parts[0];
  if (parts.size() == 2) {
    if (!absl::SimpleAtod(parts[1], &c.keep_ratio) || !(c.keep_ratio > 0 && c.keep_ratio <= 1))
      return absl::InvalidArgumentError(
          absl::StrCat("--compression: keep ratio in '", spec, "' must be in (0, 1]"));
  }
  return c;
}

bool IsHttpAddress(const std::string& address) {
  return address.rfind("http://", 0) == 0;
}

bool IsLoopbackAddress(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return true;
  std::string host = IsHttpAddress(address) ? address.substr(7) : address;
  host = host.substr(0, host.find('/'));
  if (!host.empty() && host[0] == '[') {  // [::1]:port
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    return host.substr(1, close - 1) == "::1";
  }
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos) host = host.substr(0, colon);
  if (host == "localhost") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) != 1) return false;
  return (ntohl(a.s_addr) >> 24) == 127;
}

Percentiles Summarize(std::vector<double> values) {
  Percentiles p;
  if (values.empty()) return p;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  auto rank =
      [&](double q) {  // nearest rank: the smallest value with >= q of the sample at or below
        size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
        return values[std::clamp<size_t>(k, 1, n) - 1];
      };
  p.count = static_cast<int64_t>(n);
  double sum = 0;
  for (double v : values) sum += v;
  p.mean = sum / static_cast<double>(n);
  p.p50 = rank(0.50);
  p.p90 = rank(0.90);
  p.p99 = rank(0.99);
  p.max = values.back();
  return p;
}

namespace {

// One finished request as the client saw it.
struct Sample {
  bool measured = false;
  std::string error;  // "" = OK; else the gRPC status name or "HTTP <status>"
  bool cancelled = false;
  double ttft_ms = -1, e2e_ms = 0;
  std::vector<double> itl_ms;
  int64_t prompt_tokens = 0, output_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // the server's usage: found in its prefix cache
  int turn_idx = 0;                  // --turns: 1-based turn of its conversation; 0 otherwise
  std::vector<int32_t> output_ids;   // --turns: the streamed ids, the next turn's prompt extends
  Clock::time_point done;
};

class Runner {
 public:
  Runner(const LoadOptions& o, int32_t vocab_size, int64_t max_context_len,
         std::string http_model = "")
      : o_(o),
        vocab_size_(vocab_size),
        max_context_len_(max_context_len),
        http_(IsHttpAddress(o.address)),
        http_model_(std::move(http_model)) {
    if (http_) {  // "http://HOST:PORT"
      const std::string host_port = o.address.substr(7, o.address.find('/', 7) - 7);
      const size_t colon = host_port.rfind(':');
      http_host_ = host_port.substr(0, colon);
      if (!http_host_.empty() && http_host_.front() == '[')
        http_host_ = http_host_.substr(1, http_host_.size() - 2);
      http_port_ = colon == std::string::npos ? 80 : std::stoi(host_port.substr(colon + 1));
    }
  }

  absl::Status Connect() {
    if (http_) {  // one keep-alive connection per worker, opened by the worker
      auto probe = http::Client::Connect(http_host_, http_port_, std::chrono::seconds(10));
      return probe.ok() ? absl::OkStatus() : probe.status();
    }
    // Several connections: one HTTP/2 connection caps concurrent streams (100 by default).
    const int num_channels = std::max(1, (o_.concurrency + 31) / 32);
    for (int i = 0; i < num_channels; ++i) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetMaxReceiveMessageSize(64 << 20);
      auto channel =
          grpc::CreateCustomChannel(o_.address, grpc::InsecureChannelCredentials(), args);
      if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)))
        return absl::UnavailableError(absl::StrCat("cannot connect to ", o_.address));
      stubs_.push_back(v1::Inference::NewStub(channel));
    }
    return absl::OkStatus();
  }

  RunResult Run() {
    start_ = Clock::now();
    window_start_ = start_ + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(o_.warmup_s));
    end_ = window_start_ + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(o_.duration_s));
    std::vector<std::thread> workers;
    for (int i = 0; i < o_.concurrency; ++i) workers.emplace_back([this, i] { Worker(i); });
    std::thread arrivals;
    if (o_.rate > 0) arrivals = std::thread([this] { Arrivals(); });
    std::thread progress;
    if (o_.progress) progress = std::thread([this] { Progress(); });
    std::thread closer;
    if (o_.steady) closer = std::thread([this] { CloseWindow(); });
    if (arrivals.joinable()) arrivals.join();
    for (auto& w : workers) w.join();
    finished_ = true;
    if (closer.joinable()) closer.join();
    if (progress.joinable()) progress.join();
    return Collect();
  }

 private:
  bool Stopping() {
    if (Clock::now() >= end_) return true;
    return o_.max_requests > 0 && num_measured_started_.load() >= o_.max_requests;
  }

  // Steady mode: at the window's end, cancel every request still in flight (each worker then
  // sees Stopping() and ends).
  void CloseWindow() {
    std::this_thread::sleep_until(end_);
    std::lock_guard<std::mutex> lock(mu_);
    window_closed_ = true;
    for (const auto& cancel : live_) cancel();
  }

  // Tracks a request's cancel action so that CloseWindow can cancel it; one that starts after
  // the window closed is cancelled at once.
  class LiveRequest {
   public:
    LiveRequest(Runner& r, std::function<void()> cancel) : r_(r) {
      std::lock_guard<std::mutex> lock(r_.mu_);
      it_ = r_.live_.insert(r_.live_.end(), std::move(cancel));
      if (r_.window_closed_) (*it_)();
    }
    ~LiveRequest() {
      std::lock_guard<std::mutex> lock(r_.mu_);
      r_.live_.erase(it_);
    }

   private:
    Runner& r_;
    std::list<std::function<void()>>::iterator it_;
  };

  // Open loop: Poisson arrival times; a worker picks each up. Latency counts from the scheduled
  // arrival, so a backed-up client does not hide server queueing (no coordinated omission).
  void Arrivals() {
    std::mt19937_64 rng(o_.seed ^ 0x9e3779b97f4a7c15ULL);
    std::exponential_distribution<double> gap(o_.rate);
    Clock::time_point t = Clock::now();
    while (true) {
      t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
      if (t >= end_) break;
      std::this_thread::sleep_until(t);
      if (Stopping()) break;
      std::lock_guard<std::mutex> lock(mu_);
      if (static_cast<int>(queue_.size()) + busy_ >= o_.concurrency) {
        if (t >= window_start_) ++num_dropped_;
        continue;
      }
      queue_.push_back(t);
      cv_.notify_one();
    }
    std::lock_guard<std::mutex> lock(mu_);
    arrivals_done_ = true;
    cv_.notify_all();
  }

  void Worker(int worker_idx) {
    std::mt19937_64 rng(o_.seed * 1000003ULL + static_cast<uint64_t>(worker_idx));
    v1::Inference::Stub* stub = http_ ? nullptr : stubs_[worker_idx % stubs_.size()].get();
    std::unique_ptr<http::Client> client;  // HTTP: this worker's keep-alive connection
    Conversation conversation;             // --turns
    while (true) {
      Clock::time_point scheduled;
      if (o_.rate > 0) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty() || arrivals_done_; });
        if (queue_.empty()) return;
        scheduled = queue_.front();
        queue_.pop_front();
        ++busy_;
      } else {
        if (Stopping()) return;
        scheduled = Clock::now();
      }
      const bool measured = scheduled >= window_start_;
      if (measured) ++num_measured_started_;
      const Draw d = o_.num_turns > 1 ? DrawTurn(worker_idx, &conversation) : DrawRequest(rng);
      Sample s = http_ ? OneHttpRequest(&client, d, scheduled) : OneRequest(stub, d, scheduled);
      s.measured = measured;
      s.turn_idx = d.turn_idx;
      // A failed or cancelled turn has no whole answer to extend: the next request starts anew.
      if (o_.num_turns > 1) {
        conversation.last_ok = s.error.empty();
        conversation.answer = std::move(s.output_ids);
        s.output_ids.clear();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        samples_.push_back(std::move(s));
        if (o_.rate > 0) --busy_;
      }
      ++num_done_;
    }
  }

  // One request's random prompt, output length and compression choice (the same draws for gRPC
  // and HTTP, so a seed gives both protocols the same load).
  struct Draw {
    std::vector<int32_t> prompt;
    int64_t out_len = 0;
    const CompressionChoice* compression = nullptr;
    int turn_idx = 0;  // --turns: 1-based
  };
  Draw DrawRequest(std::mt19937_64& rng) {
    Draw d;
    int64_t out_len = o_.output_len.Sample(rng);
    int64_t prompt_len = o_.prompt_len.Sample(rng);
    if (max_context_len_ > 0) {  // keep prompt + output inside the context
      prompt_len = std::min<int64_t>(prompt_len, std::max<int64_t>(1, max_context_len_ - 2));
      out_len = std::min<int64_t>(out_len, std::max<int64_t>(1, max_context_len_ - prompt_len - 1));
    }
    AppendRandomTokens(prompt_len, vocab_size_, rng, &d.prompt);
    d.out_len = out_len;
    if (!o_.compression.empty())
      d.compression =
          &o_.compression[std::uniform_int_distribution<size_t>(0, o_.compression.size() - 1)(rng)];
    return d;
  }

  // --turns: one stream's conversation so far.
  struct Conversation {
    std::mt19937_64 rng;  // reseeded per conversation
    int64_t num_started = 0;
    int turn_idx = 0;                     // the last turn sent, 1-based; 0 = none yet
    std::vector<int32_t> prompt, answer;  // the last turn's prompt and streamed answer
    bool last_ok = false;
    const CompressionChoice* compression = nullptr;
  };

  // --turns: the stream's next request. Each conversation draws from a seed of its own (seed,
  // stream, conversation index), so no two share a prefix a cache could hit. A new one starts after
  // the last turn, after a failed turn, and when the next turn would not fit the context.
  Draw DrawTurn(int worker_idx, Conversation* c) {
    if (c->turn_idx > 0 && c->turn_idx < o_.num_turns && c->last_ok) {
      const int64_t out_len = o_.output_len.Sample(c->rng);
      const int64_t growth_len = o_.turn_growth.Sample(c->rng);
      const auto prompt_len =
          static_cast<int64_t>(c->prompt.size() + c->answer.size()) + growth_len;
      if (max_context_len_ <= 0 || prompt_len + out_len < max_context_len_) {
        Draw d;
        d.prompt = NextTurnPrompt(c->prompt, c->answer, growth_len, vocab_size_, c->rng);
        d.out_len = out_len;
        d.compression = c->compression;
        d.turn_idx = ++c->turn_idx;
        c->prompt = d.prompt;
        return d;
      }
      ++num_conversations_cut_;
    }
    std::seed_seq seed{static_cast<uint32_t>(o_.seed), static_cast<uint32_t>(o_.seed >> 32),
                       static_cast<uint32_t>(worker_idx), static_cast<uint32_t>(c->num_started++)};
    c->rng.seed(seed);
    Draw d = DrawRequest(c->rng);
    d.turn_idx = c->turn_idx = 1;
    c->prompt = d.prompt;
    c->compression = d.compression;
    return d;
  }

  // Counts `n` tokens that arrived now (TTFT or inter-token gaps).
  void OnTokens(Sample& s, int64_t n, Clock::time_point t0, Clock::time_point* last) {
    if (n == 0) return;
    const Clock::time_point now = Clock::now();
    if (now >= window_start_ && now < end_) tokens_in_window_ += n;
    if (s.ttft_ms < 0) {
      s.ttft_ms = Seconds(now - t0) * 1e3;
    } else {
      // A message carrying n tokens: n gaps of equal share (the server may coalesce deltas).
      const double gap_ms = Seconds(now - *last) * 1e3 / static_cast<double>(n);
      for (int64_t i = 0; i < n; ++i) s.itl_ms.push_back(gap_ms);
    }
    *last = now;
    s.output_tokens += n;
    tokens_streamed_ += n;
  }

  // The same request over the OpenAI-compatible HTTP API: a streamed completion of token ids.
  Sample OneHttpRequest(std::unique_ptr<http::Client>* client, const Draw& d,
                        Clock::time_point t0) {
    Sample s;
    s.prompt_tokens = static_cast<int64_t>(d.prompt.size());
    nlohmann::json body = {
        {"model", http_model_},     {"prompt", d.prompt},
        {"max_tokens", d.out_len},  {"temperature", 0},
        {"ignore_eos", true},       {"stream", true},
        {"return_token_ids", true}, {"stream_options", {{"include_usage", true}}}};
    if (d.compression != nullptr) {
      nlohmann::json c = nlohmann::json::object();
      if (!d.compression->method.empty()) c["method"] = d.compression->method;
      if (d.compression->keep_ratio > 0) c["keep_ratio"] = d.compression->keep_ratio;
      body["kv_compression"] = c;
    }
    const auto timeout =
        std::chrono::milliseconds(static_cast<int64_t>(o_.request_timeout_s * 1e3));
    if (*client == nullptr || !(*client)->connected()) {
      auto connected = http::Client::Connect(http_host_, http_port_, timeout);
      if (!connected.ok()) {
        s.error = "HTTP connect";
        s.done = Clock::now();
        s.e2e_ms = Seconds(s.done - t0) * 1e3;
        return s;
      }
      *client = std::move(*connected);
    }
    http::Client* c = client->get();
    std::optional<LiveRequest> live;
    std::atomic<bool> aborted{false};
    if (o_.steady)
      live.emplace(*this, [c, &aborted] {
        aborted = true;
        c->Abort();
      });
    Clock::time_point last = t0;
    http::SseParser sse;
    bool done_event = false;
    std::string stream_error;
    auto response =
        c->Stream("POST", "/v1/completions", body.dump(), {}, [&](std::string_view bytes) {
          sse.Feed(bytes, [&](const std::string& data) {
            if (data == "[DONE]") {
              done_event = true;
              return;
            }
            auto event = nlohmann::json::parse(data, nullptr, false);
            if (event.is_discarded()) return;
            if (event.contains("error")) {
              stream_error = "HTTP stream error";
              return;
            }
            if (event.contains("usage") && event["usage"].is_object()) {
              s.cached_prompt_tokens = event["usage"]
                                           .value("prompt_tokens_details", nlohmann::json::object())
                                           .value("cached_tokens", int64_t{0});
            }
            for (const auto& choice : event.value("choices", nlohmann::json::array())) {
              if (!choice.contains("token_ids")) continue;
              const auto& ids = choice["token_ids"];
              OnTokens(s, static_cast<int64_t>(ids.size()), t0, &last);
              if (o_.num_turns > 1)
                for (const auto& id : ids) s.output_ids.push_back(id.get<int32_t>());
            }
          });
          return true;
        });
    live.reset();
    s.done = Clock::now();
    s.e2e_ms = Seconds(s.done - t0) * 1e3;
    if (aborted) {
      s.cancelled = true;
      s.error = "CANCELLED";
    } else if (!response.ok()) {
      s.error = "HTTP connection";
    } else if (response->status != 200) {
      s.error = absl::StrCat("HTTP ", response->status);
    } else if (!stream_error.empty() || !done_event) {
      s.error = stream_error.empty() ? "HTTP truncated" : stream_error;
    }
    return s;
  }

  Sample OneRequest(v1::Inference::Stub* stub, const Draw& d, Clock::time_point t0) {
    Sample s;
    v1::GenerateRequest req;
    for (int32_t id : d.prompt) req.mutable_token_ids()->add_ids(id);
    req.set_max_new_tokens(static_cast<int32_t>(d.out_len));
    req.mutable_sampling()->set_ignore_eos(true);  // exact output lengths
    if (d.compression != nullptr) {
      if (!d.compression->method.empty())
        req.mutable_compression()->set_method(d.compression->method);
      if (d.compression->keep_ratio > 0)
        req.mutable_compression()->set_keep_ratio(d.compression->keep_ratio);
    }
    s.prompt_tokens = static_cast<int64_t>(d.prompt.size());
    grpc::ClientContext ctx;
    // gRPC deadlines take the system clock; latencies use the steady one.
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(o_.request_timeout_s)));
    std::optional<LiveRequest> live;
    if (o_.steady) live.emplace(*this, [&ctx] { ctx.TryCancel(); });
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse msg;
    Clock::time_point last = t0;
    while (reader->Read(&msg)) {
      OnTokens(s, msg.token_ids_size(), t0, &last);
      if (msg.has_usage()) s.cached_prompt_tokens = msg.usage().cached_prompt_tokens();
      if (o_.num_turns > 1)
        s.output_ids.insert(s.output_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    }
    const grpc::Status st = reader->Finish();
    s.done = Clock::now();
    if (!st.ok()) s.error = StatusName(st.error_code());
    s.cancelled = st.error_code() == grpc::StatusCode::CANCELLED;
    s.e2e_ms = Seconds(s.done - t0) * 1e3;
    return s;
  }

  // A redrawn bar on a terminal; one line every 5 s otherwise (CI logs).
  void Progress() {
    const double total = o_.warmup_s + o_.duration_s;
    const bool tty = ::isatty(2) != 0;
    int ticks = 0;
    while (!finished_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      if (!tty && ++ticks % 10 != 0) continue;
      const double t = Seconds(Clock::now() - start_);
      const int width = 30;
      const int filled = std::clamp(static_cast<int>(t / total * width), 0, width);
      std::fprintf(
          stderr, "%s[%s%s] %5.1f/%.0fs  %lld requests done, %lld tokens%s%s", tty ? "\r" : "",
          std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), t, total,
          static_cast<long long>(num_done_.load()), static_cast<long long>(tokens_streamed_.load()),
          t > total ? " (finishing in-flight requests)" : "", tty ? "" : "\n");
    }
    if (tty) std::fprintf(stderr, "\n");
  }

  RunResult Collect() {
    RunResult r;
    r.options = o_;
    r.num_dropped = num_dropped_;
    std::vector<double> ttft, itl, e2e;
    const size_t num_turns = o_.num_turns > 1 ? static_cast<size_t>(o_.num_turns) : 0;
    std::vector<std::vector<double>> turn_ttft(num_turns);
    std::vector<int64_t> turn_prompt_tokens(num_turns, 0), turn_cached_tokens(num_turns, 0);
    r.turns.resize(num_turns);
    r.num_conversations_cut = num_conversations_cut_;
    Clock::time_point last_done = window_start_;
    for (const Sample& s : samples_) {
      if (o_.steady) {
        // Requests that complete inside the window; in steady state they are a fair sample.
        if (s.done >= end_) {
          if (s.cancelled) ++r.cancelled_at_end;
          continue;
        }
        if (s.done < window_start_) continue;
      } else if (!s.measured) {
        continue;
      }
      if (!s.error.empty()) {
        ++r.errors[s.error];
        continue;
      }
      ++r.num_ok;
      r.prompt_tokens += s.prompt_tokens;
      r.output_tokens += s.output_tokens;
      if (s.ttft_ms >= 0) ttft.push_back(s.ttft_ms);
      itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
      e2e.push_back(s.e2e_ms);
      last_done = std::max(last_done, s.done);
      if (s.turn_idx >= 1 && static_cast<size_t>(s.turn_idx) <= num_turns) {
        const size_t k = static_cast<size_t>(s.turn_idx) - 1;
        ++r.turns[k].num_ok;
        turn_prompt_tokens[k] += s.prompt_tokens;
        turn_cached_tokens[k] += s.cached_prompt_tokens;
        if (s.ttft_ms >= 0) turn_ttft[k].push_back(s.ttft_ms);
      }
    }
    for (size_t k = 0; k < num_turns; ++k) {
      TurnStats& t = r.turns[k];
      if (t.num_ok > 0) {
        t.mean_prompt_len =
            static_cast<double>(turn_prompt_tokens[k]) / static_cast<double>(t.num_ok);
        t.mean_cached_prompt_tokens =
            static_cast<double>(turn_cached_tokens[k]) / static_cast<double>(t.num_ok);
      }
      t.ttft_ms = Summarize(std::move(turn_ttft[k]));
    }
    r.measured_s = Seconds(last_done - window_start_);
    if (o_.steady) {
      r.measured_s = o_.duration_s;
      r.output_tokens = tokens_in_window_;  // every stream's tokens, finished or not
    }
    r.ttft_ms = Summarize(std::move(ttft));
    r.itl_ms = Summarize(std::move(itl));
    r.e2e_ms = Summarize(std::move(e2e));
    return r;
  }

  static std::string StatusName(grpc::StatusCode code) {
    static const char* kNames[] = {"OK",
                                   "CANCELLED",
                                   "UNKNOWN",
                                   "INVALID_ARGUMENT",
                                   "DEADLINE_EXCEEDED",
                                   "NOT_FOUND",
                                   "ALREADY_EXISTS",
                                   "PERMISSION_DENIED",
                                   "RESOURCE_EXHAUSTED",
                                   "FAILED_PRECONDITION",
                                   "ABORTED",
                                   "OUT_OF_RANGE",
                                   "UNIMPLEMENTED",
                                   "INTERNAL",
                                   "UNAVAILABLE",
                                   "DATA_LOSS",
                                   "UNAUTHENTICATED"};
    const int c = static_cast<int>(code);
    return c >= 0 && c <= 16 ? kNames[c] : absl::StrCat("CODE_", c);
  }

  const LoadOptions& o_;
  const int32_t vocab_size_;
  const int64_t max_context_len_;
  const bool http_;
  const std::string http_model_;
  std::string http_host_;
  int http_port_ = 0;
  std::vector<std::unique_ptr<v1::Inference::Stub>> stubs_;
  Clock::time_point start_, window_start_, end_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Clock::time_point> queue_;
  int busy_ = 0;
  bool arrivals_done_ = false;
  int64_t num_dropped_ = 0;
  std::vector<Sample> samples_;
  std::list<std::function<void()>> live_;  // steady mode: how to cancel each request in flight
  bool window_closed_ = false;
  std::atomic<int64_t> num_measured_started_{0}, num_done_{0}, tokens_streamed_{0};
  std::atomic<int64_t> tokens_in_window_{0};
  std::atomic<int64_t> num_conversations_cut_{0};
  std::atomic<bool> finished_{false};
};

}  // namespace

namespace {

// HTTP: /v1/models names the model and gives its vocabulary and context (dropkv's extension).
absl::StatusOr<RunResult> RunHttpLoad(const LoadOptions& o) {
  const std::string host_port = o.address.substr(7, o.address.find('/', 7) - 7);
  const size_t colon = host_port.rfind(':');
  std::string host = host_port.substr(0, colon);
  if (!host.empty() && host.front() == '[') host = host.substr(1, host.size() - 2);
  int port = 80;
  if (colon != std::string::npos && !absl::SimpleAtoi(host_port.substr(colon + 1), &port))
    return absl::InvalidArgumentError(absl::StrCat("--address: bad port in '", o.address, "'"));
  auto client = http::Client::Connect(host, port, std::chrono::seconds(10));
  if (!client.ok()) return client.status();
  auto models = (*client)->Send("GET", "/v1/models");
  if (!models.ok() || models->status != 200)
    return absl::UnavailableError(absl::StrCat("GET /v1/models on ", o.address, " failed"));
  auto j = nlohmann::json::parse(models->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || j["data"].empty())
    return absl::UnavailableError(absl::StrCat("/v1/models on ", o.address, ": no model"));
  const auto& model = j["data"][0];
  Runner runner(o, model.value("vocab_size", 0), model.value("max_model_len", int64_t{0}),
                model.value("id", ""));
  if (absl::Status c = runner.Connect(); !c.ok()) return c;
  return runner.Run();
}

}  // namespace

absl::StatusOr<RunResult> RunLoad(const LoadOptions& o) {
  if (!IsLoopbackAddress(o.address))
    return absl::InvalidArgumentError(
        absl::StrCat("--address: '", o.address,
                     "' is not a loopback address (127.x.x.x, localhost, [::1], "
                     "unix:); dropkv-loadgen only loads local servers"));
  if (o.concurrency < 1 || o.concurrency > 1024)
    return absl::InvalidArgumentError("--concurrency: must be in [1, 1024]");
  if (!(o.duration_s > 0 && o.duration_s <= 3600))
    return absl::InvalidArgumentError("--duration: must be in (0, 3600] seconds");
  if (!(o.warmup_s >= 0 && o.warmup_s <= 600))
    return absl::InvalidArgumentError("--warmup: must be in [0, 600] seconds");
  if (!(o.rate >= 0 && o.rate <= 100000))
    return absl::InvalidArgumentError("--rate: must be in [0, 100000] requests/s");
  if (!(o.request_timeout_s > 0 && o.request_timeout_s <= 3600))
    return absl::InvalidArgumentError("--timeout: must be in (0, 3600] seconds");
  if (o.steady && o.max_requests > 0)
    return absl::InvalidArgumentError(
        "--requests: not with --steady (the window alone bounds a steady-state run)");
  if (o.prompt_len.Max() < 1 || o.output_len.Max() < 1)
    return absl::InvalidArgumentError("prompt and output lengths must be set");
  if (o.num_turns < 1 || o.num_turns > 1000)
    return absl::InvalidArgumentError(absl::StrCat("--turns: ", o.num_turns, " not in [1, 1000]"));
  if (o.num_turns > 1 && o.rate > 0)
    return absl::InvalidArgumentError(
        "--turns: closed loop only (a stream's next turn waits for its previous answer)");
  if (o.num_turns > 1 && o.turn_growth.Max() < 1)
    return absl::InvalidArgumentError("--turn-growth: must be set with --turns");

  if (IsHttpAddress(o.address)) return RunHttpLoad(o);
  // The model's vocabulary and context bound the random prompts.
  grpc::ChannelArguments args;
  auto channel = grpc::CreateCustomChannel(o.address, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Inference::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ModelInfo info;
  grpc::Status st = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!st.ok())
    return absl::UnavailableError(
        absl::StrCat("GetModelInfo on ", o.address, " failed: ", st.error_message()));
  Runner runner(o, info.vocab_size(), info.max_context_len());
  if (absl::Status c = runner.Connect(); !c.ok()) return c;
  return runner.Run();
}

absl::StatusOr<std::map<std::string, double>> FetchMetrics(const std::string& url) {
  absl::string_view rest_view = url;
  if (!absl::ConsumePrefix(&rest_view, "http://"))
    return absl::InvalidArgumentError(absl::StrCat("--metrics-url: '", url, "' is not http://"));
  const std::string rest(rest_view);
  const size_t slash = rest.find('/');
  const std::string host_port = rest.substr(0, slash);
  const std::string path = slash == std::string::npos ? "/metrics" : rest.substr(slash);
  const size_t colon = host_port.rfind(':');
  std::string host = host_port.substr(0, colon);
  int port = 80;
  if (colon != std::string::npos && !absl::SimpleAtoi(host_port.substr(colon + 1), &port))
    return absl::InvalidArgumentError(absl::StrCat("--metrics-url: bad port in '", url, "'"));
  if (host == "localhost") host = "127.0.0.1";
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) != 1 || (ntohl(a.s_addr) >> 24) != 127)
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-url: '", url, "' is not a loopback IPv4 address"));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr = a;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("--metrics-url: cannot connect to ", host_port));
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\nConnection: close\r\n\r\n");
  if (::send(fd, req.data(), req.size(), 0) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return absl::UnavailableError("--metrics-url: send failed");
  }
  std::string body;
  char buf[16384];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0 && body.size() < (64u << 20))
    body.append(buf, n);
  ::close(fd);
  const size_t header_end = body.find("\r\n\r\n");
  if (body.rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos ||
      body.find(" 200 ") > body.find("\r\n"))
    return absl::UnavailableError(absl::StrCat("--metrics-url: ", url, " did not answer 200"));
  std::map<std::string, double> samples;
  std::istringstream lines(body.substr(header_end + 4));
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    double v = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(line.substr(space + 1)), &v)) continue;
    samples[line.substr(0, space)] = v;
  }
  return samples;
}

std::map<std::string, double> MetricDeltas(const std::map<std::string, double>& before,
                                           const std::map<std::string, double>& after) {
  std::map<std::string, double> out;
  for (const auto& [key, v] : after) {
    const std::string name = key.substr(0, key.find('{'));
    const bool cumulative = absl::EndsWith(name, "_total") || absl::EndsWith(name, "_count") ||
                            absl::EndsWith(name, "_sum");
    if (!cumulative) continue;
    auto it = before.find(key);
    const double d = v - (it == before.end() ? 0.0 : it->second);
    if (d != 0) out[key] = d;
  }
  return out;
}

namespace {
nlohmann::json PercentilesJson(const Percentiles& p) {
  return {{"count", p.count}, {"mean", p.mean}, {"p50", p.p50},
          {"p90", p.p90},     {"p99", p.p99},   {"max", p.max}};
}
}  // namespace

nlohmann::json ResultToJson(const RunResult& r) {
  const LoadOptions& o = r.options;
  nlohmann::json compression = nlohmann::json::array();
  for (const auto& c : o.compression)
    compression.push_back(c.keep_ratio > 0 ? absl::StrCat(c.method, ":", c.keep_ratio) : c.method);
  nlohmann::json j;
  j["config"] = {{"address", o.address},
                 {"mode", o.rate > 0 ? "open" : "closed"},
                 {"concurrency", o.concurrency},
                 {"rate", o.rate},
                 {"duration_s", o.duration_s},
                 {"warmup_s", o.warmup_s},
                 {"max_requests", o.max_requests},
                 {"steady", o.steady},
                 {"prompt_len", o.prompt_len.spec},
                 {"output_len", o.output_len.spec},
                 {"compression", compression},
                 {"turns", o.num_turns},
                 {"turn_growth", o.num_turns > 1 ? o.turn_growth.spec : ""},
                 {"seed", o.seed}};
  j["measured_s"] = r.measured_s;
  j["requests_ok"] = r.num_ok;
  j["errors"] = r.errors;
  j["dropped_by_client"] = r.num_dropped;
  j["cancelled_at_end"] = r.cancelled_at_end;
  j["prompt_tokens"] = r.prompt_tokens;
  j["output_tokens"] = r.output_tokens;
  j["requests_per_s"] = r.requests_per_s();
  j["output_tokens_per_s"] = r.output_tokens_per_s();
  j["ttft_ms"] = PercentilesJson(r.ttft_ms);
  j["itl_ms"] = PercentilesJson(r.itl_ms);
  j["e2e_ms"] = PercentilesJson(r.e2e_ms);
  if (!r.turns.empty()) {
    nlohmann::json turns = nlohmann::json::array();
    for (size_t k = 0; k < r.turns.size(); ++k)
      turns.push_back({{"turn", k + 1},
                       {"requests_ok", r.turns[k].num_ok},
                       {"mean_prompt_len", r.turns[k].mean_prompt_len},
                       {"mean_cached_prompt_tokens", r.turns[k].mean_cached_prompt_tokens},
                       {"ttft_ms", PercentilesJson(r.turns[k].ttft_ms)}});
    j["turns"] = turns;
    j["conversations_cut"] = r.num_conversations_cut;
  }
  j["metrics_delta"] = r.metrics_delta;
  return j;
}

std::string ResultsToMarkdown(const std::vector<RunResult>& results) {
  std::string md =
      "| mode | conc. | rate | ok | errors | req/s | out tok/s | TTFT p50/p90/p99/max ms | "
      "ITL p50/p90/p99/max ms | E2E p50/p90/p99/max ms |\n"
      "|---|---:|---:|---:|---|---:|---:|---|---|---|\n";
  auto pct = [](const Percentiles& p) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "%.1f / %.1f / %.1f / %.1f", p.p50, p.p90, p.p99, p.max);
    return std::string(buf);
  };
  for (const RunResult& r : results) {
    std::string errors;
    for (const auto& [name, n] : r.errors)
      absl::StrAppend(&errors, errors.empty() ? "" : ", ", name, " ", n);
    if (r.num_dropped > 0)
      absl::StrAppend(&errors, errors.empty() ? "" : ", ", "dropped ", r.num_dropped);
    if (r.cancelled_at_end > 0)
      absl::StrAppend(&errors, errors.empty() ? "" : ", ", "in flight at end ", r.cancelled_at_end);
    if (errors.empty()) errors = "0";
    char row[512];
    std::snprintf(
        row, sizeof(row), "| %s | %d | %s | %lld | %s | %.2f | %.1f | %s | %s | %s |\n",
        absl::StrCat(r.options.rate > 0 ? "open" : "closed", r.options.steady ? " steady" : "")
            .c_str(),
        r.options.concurrency, r.options.rate > 0 ? absl::StrCat(r.options.rate).c_str() : "-",
        static_cast<long long>(r.num_ok), errors.c_str(), r.requests_per_s(),
        r.output_tokens_per_s(), pct(r.ttft_ms).c_str(), pct(r.itl_ms).c_str(),
        pct(r.e2e_ms).c_str());
    md += row;
  }
  return md;
}

std::string TurnsToMarkdown(const std::vector<RunResult>& results) {
  std::string md;
  for (size_t i = 0; i < results.size(); ++i) {
    const RunResult& r = results[i];
    for (size_t k = 0; k < r.turns.size(); ++k) {
      const TurnStats& t = r.turns[k];
      char row[256];
      std::snprintf(
          row, sizeof(row), "| %zu | %d | %zu | %lld | %.1f | %.1f | %.1f / %.1f / %.1f |\n", i + 1,
          r.options.concurrency, k + 1, static_cast<long long>(t.num_ok), t.mean_prompt_len,
          t.mean_cached_prompt_tokens, t.ttft_ms.p50, t.ttft_ms.p90, t.ttft_ms.p99);
      md += row;
    }
    if (r.num_conversations_cut > 0)
      absl::StrAppend(&md, "| ", i + 1, " | ", r.options.concurrency, " | (",
                      r.num_conversations_cut,
                      " conversations cut: the next turn would not fit the context) | | | | |\n");
  }
  if (md.empty()) return md;
  return "| run | conc. | turn | ok | mean prompt len | mean cached | TTFT p50/p90/p99 ms |\n"
         "|---:|---:|---:|---:|---:|---:|---|\n" +
         md;
}

}  // namespace dropkv::loadgen
