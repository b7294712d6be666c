#include "server/http/openai_frontend.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <optional>
#include <random>

#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dropkv/v1/inference.pb.h"
#include "engine/scheduler/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/bearer_token.h"
#include "server/http/http_server.h"
#include "server/http/openai_protocol.h"
#include "server/metrics/request_metrics.h"
#include "server/metrics/server_metrics.h"

namespace dropkv {
namespace {

using openai::ApiError;
using openai::ChoiceOutput;
using openai::ParsedRequest;

constexpr const char* kJson = "application/json";

enum class ServingState { kLoading, kServing, kDraining };

// Debian's abseil has its own string_view type (not an alias of std's): convert at the API edge.
absl::string_view A(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

void RespondError(http::Exchange& exchange, const ApiError& error) {
  http::Headers headers;
  if (error.http_status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  exchange.Respond(error.http_status, kJson, openai::ErrorJson(error), std::move(headers));
}

// The host of an Origin ("http://localhost:3000" -> "localhost:3000"); "" when it has none
// ("null", from a sandboxed page or a file).
std::string_view OriginHost(std::string_view origin) {
  const size_t scheme_end = origin.find("://");
  if (scheme_end == std::string_view::npos) return {};
  const std::string_view rest = origin.substr(scheme_end + 3);
  return rest.substr(0, rest.find('/'));
}

// The request's Content-Type is JSON (parameters such as charset aside).
bool IsJsonContentType(std::string_view content_type) {
  const std::string_view media = content_type.substr(0, content_type.find(';'));
  return absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(A(media)), "application/json");
}

absl::StatusCode CodeOfHttpStatus(int status) {
  switch (status) {
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 404:
      return absl::StatusCode::kNotFound;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 503:
      return absl::StatusCode::kUnavailable;
    default:
      return status >= 500 ? absl::StatusCode::kInternal : absl::StatusCode::kInvalidArgument;
  }
}

std::string NewId(openai::Endpoint endpoint) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrCat(endpoint == openai::Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-",
                      absl::Hex(rng(), absl::kZeroPad16));
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What `echo` puts before a choice's text: the prompt as sent (token ids: decoded) and its first
// token, whose logprob is null (the prompt logprobs from the engine start at the second).
struct EchoPrompt {
  std::string text;
  int32_t first_token_id = 0;
};

// One completions / chat request: its choices' channels and trackers, and the answer being built.
// Events arrive on the engine thread (channel notify); the client may leave on an I/O thread.
// Lifetime: held by the Exchange until the answer is complete or the client is gone; the channel
// notifies reach it through a weak_ptr, so a finished job is simply gone for late events.
class CompletionJob : public std::enable_shared_from_this<CompletionJob> {
 public:
  // `echoes`: one per choice with request.echo, else empty.
  CompletionJob(ParsedRequest request, openai::ResponseMeta meta,
                std::shared_ptr<http::Exchange> exchange, openai::TokenTextFn token_text,
                std::shared_ptr<std::atomic<int64_t>> num_active, std::vector<EchoPrompt> echoes)
      : request_(std::move(request)),
        meta_(std::move(meta)),
        exchange_(std::move(exchange)),
        token_text_(std::move(token_text)),
        num_active_(std::move(num_active)),
        echoes_(std::move(echoes)),
        choices_(request_.choices.size()) {
    ++*num_active_;
    for (Choice& c : choices_) c.channel = std::make_shared<RequestChannel>();
  }
  ~CompletionJob() {
    // Normally every choice is done or was cancelled; this covers an answer abandoned early.
    for (Choice& c : choices_)
      if (!c.done) c.channel->Cancel();
    --*num_active_;
  }

  const ParsedRequest& request() const { return request_; }
  std::shared_ptr<RequestChannel> channel(size_t i) const { return choices_[i].channel; }
  std::unique_ptr<RequestMetricsTracker>* tracker(size_t i) { return &choices_[i].tracker; }

  // Every choice is queued: start answering.
  void Begin() {
    std::weak_ptr<CompletionJob> weak = weak_from_this();
    exchange_->OnClientGone([weak] {
      if (auto job = weak.lock()) job->CancelAll();
    });
    exchange_->Hold(shared_from_this());
    // A client that stops reading pauses its choices: their decode slots go to waiting requests
    // (the scheduler recomputes them once it reads again), not to filling its buffers.
    if (request_.stream)
      exchange_->OnBacklog([weak](bool backlogged) {
        if (auto job = weak.lock())
          for (Choice& c : job->choices_) c.channel->SetPaused(backlogged);
      });
    if (request_.stream)
      exchange_->StartStream(200, "text/event-stream",
                             {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
    for (size_t i = 0; i < choices_.size(); ++i) {
      choices_[i].channel->SetNotify([weak, i] {
        if (auto job = weak.lock()) job->OnEvents(i);
      });
      OnEvents(i);  // events pushed before the notify was set
    }
  }

  // The client left (or a choice failed): every choice leaves the engine at its next step.
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    answered_ = true;
    for (Choice& c : choices_) c.channel->Cancel();
  }

 private:
  struct Choice {
    std::shared_ptr<RequestChannel> channel;
    std::unique_ptr<RequestMetricsTracker> tracker;  // counts as abandoned if destroyed unfinished
    ChoiceOutput output;                             // the whole text (non-streaming)
    int64_t text_len = 0;
    bool sent_first = false;
    bool echoed = false;
    bool done = false;
  };

  // The echoed prompt of choice `i` (with its logprobs from the engine's first event when asked),
  // before anything it generated.
  void EchoLocked(size_t i, Choice& c, const GenerationEvent& first_event) {
    c.echoed = true;
    const EchoPrompt& echo = echoes_[i];
    ChoiceOutput part;
    part.index = static_cast<int>(i);
    part.text = echo.text;
    if (request_.logprobs) {
      part.logprobs.push_back({echo.first_token_id, std::numeric_limits<float>::quiet_NaN(), {}});
      part.logprobs.insert(part.logprobs.end(), first_event.prompt_logprobs.begin(),
                           first_event.prompt_logprobs.end());
    }
    c.text_len = static_cast<int64_t>(echo.text.size());
    if (request_.stream) {
      exchange_->Write(openai::ChunkEvent(request_, meta_, part, true, token_text_));
      c.sent_first = true;
    } else {
      c.output.text = std::move(part.text);
      c.output.logprobs = std::move(part.logprobs);
    }
  }

  void OnEvents(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    Choice& c = choices_[i];
    while (auto event = c.channel->Pop()) {
      if (c.tracker) c.tracker->OnEvent(*event);
      if (answered_ || c.done) continue;  // keep the tracker's record, send nothing more
      if (event->finished && (event->finish_reason == FinishReason::kError ||
                              event->finish_reason == FinishReason::kCancelled)) {
        FailLocked(
            event->finish_reason == FinishReason::kError
                ? openai::ErrorFromStatus(event->error, request_, static_cast<int>(i),
                                          /*at_submit=*/false)
                : openai::MakeError(503, "the server cancelled the request (shutting down)"));
        return;
      }
      if (request_.echo && !c.echoed) EchoLocked(i, c, *event);
      ChoiceOutput delta;
      delta.index = static_cast<int>(i);
      delta.text = event->text;
      delta.token_ids = event->token_ids;
      delta.logprobs = event->logprobs;
      delta.text_offset = c.text_len;
      c.text_len += static_cast<int64_t>(event->text.size());
      if (request_.stream) {
        // A delta of tokens whose text is held back (an incomplete character) carries nothing
        // unless the client asked for token ids or logprobs.
        const bool carries =
            !delta.text.empty() ||
            (!delta.token_ids.empty() && (request_.return_token_ids || request_.logprobs));
        if (carries || !c.sent_first) {
          exchange_->Write(openai::ChunkEvent(request_, meta_, delta, !c.sent_first, token_text_));
          c.sent_first = true;
        }
        if (event->finished) {
          ChoiceOutput finish;
          finish.index = delta.index;
          finish.finish_reason = event->finish_reason;
          exchange_->Write(openai::ChunkEvent(request_, meta_, finish, false, token_text_));
        }
      } else {
        c.output.index = delta.index;
        c.output.text += delta.text;
        c.output.token_ids.insert(c.output.token_ids.end(), delta.token_ids.begin(),
                                  delta.token_ids.end());
        c.output.logprobs.insert(c.output.logprobs.end(), delta.logprobs.begin(),
                                 delta.logprobs.end());
      }
      if (event->finished) {
        c.done = true;
        c.output.finish_reason = event->finish_reason;
        // Prompt tokens once per prompt, however many choices share it.
        const bool first_of_prompt =
            i == 0 || request_.prompt_index[i] != request_.prompt_index[i - 1];
        usage_.Add(event->summary, first_of_prompt);
        ++num_done_;
      }
    }
    if (!answered_ && num_done_ == choices_.size()) FinishLocked();
  }

  void FinishLocked() {
    answered_ = true;
    if (request_.stream) {
      if (request_.include_usage) exchange_->Write(openai::UsageEvent(request_, meta_, usage_));
      exchange_->Write(std::string(openai::kDoneEvent));
      exchange_->End();
      return;
    }
    std::vector<ChoiceOutput> outputs;
    for (Choice& c : choices_) outputs.push_back(std::move(c.output));
    outputs = openai::PickBestOf(request_, std::move(outputs));
    exchange_->Respond(200, kJson,
                       openai::ResponseJson(request_, meta_, outputs, usage_, token_text_));
  }

  // One choice failed: the others are cancelled and the client gets the error (an error event if
  // the stream already started).
  void FailLocked(const ApiError& error) {
    answered_ = true;
    for (Choice& c : choices_) c.channel->Cancel();
    if (request_.stream) {
      exchange_->Write(openai::ErrorEvent(error));
      exchange_->End();
    } else {
      RespondError(*exchange_, error);
    }
  }

  const ParsedRequest request_;
  const openai::ResponseMeta meta_;
  const std::shared_ptr<http::Exchange> exchange_;
  const openai::TokenTextFn token_text_;
  const std::shared_ptr<std::atomic<int64_t>> num_active_;
  const std::vector<EchoPrompt> echoes_;
  std::mutex mu_;
  std::vector<Choice> choices_;
  openai::UsageTotals usage_;
  size_t num_done_ = 0;
  bool answered_ = false;
};

}  // namespace

bool IsLoopbackHost(std::string_view host) {
  std::string name;
  if (!host.empty() && host.front() == '[') {
    name = std::string(host.substr(1, host.find(']') - 1));
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    name = std::string(host.substr(0, host.find(':')));
  } else {
    name = std::string(host);
  }
  absl::AsciiStrToLower(&name);
  if (!name.empty() && name.back() == '.') name.pop_back();
  if (name == "localhost" || absl::EndsWith(name, ".localhost")) return true;  // RFC 6761
  in_addr v4{};
  if (::inet_pton(AF_INET, name.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return ::inet_pton(AF_INET6, name.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

struct HttpFrontend::Routes {
  std::atomic<ServingState> state{ServingState::kLoading};
  std::atomic<const HttpEngine*> engine{nullptr};  // set once by Attach
  std::unique_ptr<HttpEngine> engine_storage;
  std::unique_ptr<RequestGateway> gateway;
  std::function<std::string()> render_metrics;
  std::string metrics_bearer_token;
  bool loopback_names_only = false;  // a loopback bind without a token: see auth_token_set
  std::shared_ptr<std::atomic<int64_t>> num_active = std::make_shared<std::atomic<int64_t>>(0);
  openai::FimTokens fim;  // the served model's, set by Attach
  const int64_t started_unix = UnixSeconds();

  // An error when a request reached a loopback-only server under another name, or from a page
  // of another origin.
  std::optional<ApiError> CheckLocalNames(const http::Request& request) const {
    if (!loopback_names_only) return std::nullopt;
    const std::string_view host = request.Header("host");
    const auto refuse = [](std::string_view header, std::string_view value) {
      return openai::MakeError(
          403, absl::StrCat(A(header), " '", A(value),
                            "' is not a loopback address; this server listens on loopback without "
                            "a bearer token and answers local clients only (set auth_token_file "
                            "to serve others)"));
    };
    if (!host.empty() && !IsLoopbackHost(host)) return refuse("Host", host);
    for (const auto& [name, value] : request.headers)
      if (name == "origin" && !IsLoopbackHost(OriginHost(value))) return refuse("Origin", value);
    return std::nullopt;
  }

  void Handle(const http::Request& request, const std::shared_ptr<http::Exchange>& exchange) {
    if (auto error = CheckLocalNames(request)) return RespondError(*exchange, *error);
    const bool get = request.method == "GET" || request.method == "HEAD";
    if (request.path == "/health") {
      if (!get) return RespondError(*exchange, openai::MakeError(405, "/health: use GET"));
      const ServingState s = state.load();
      const char* text = s == ServingState::kServing   ? "ok"
                         : s == ServingState::kLoading ? "loading"
                                                       : "draining";
      return exchange->Respond(s == ServingState::kServing ? 200 : 503, kJson,
                               absl::StrCat("{\"status\":\"", text, "\"}"));
    }
    if (request.path == "/metrics" && render_metrics) {
      if (!get) return RespondError(*exchange, openai::MakeError(405, "/metrics: use GET"));
      if (!BearerTokenMatches(request.Header("authorization"), metrics_bearer_token))
        return RespondError(
            *exchange, openai::MakeError(401, "missing or wrong 'Authorization: Bearer <token>'"));
      return exchange->Respond(200, "text/plain; version=0.0.4; charset=utf-8", render_metrics());
    }
    const bool completions = request.path == "/v1/completions";
    const bool chat = request.path == "/v1/chat/completions";
    const bool models = request.path == "/v1/models";
    if (!completions && !chat && !models)
      return RespondError(
          *exchange,
          openai::MakeError(404, absl::StrCat("no route for ", request.method, " ", request.path)));
    const HttpEngine* e = engine.load(std::memory_order_acquire);
    if (e == nullptr)
      return RespondError(*exchange, openai::MakeError(503, "the model is still loading"));
    if (!gateway->Authorized(request.Header("authorization")))
      return RespondError(*exchange,
                          openai::MakeError(401, "missing or wrong 'Authorization: Bearer <token>'",
                                            std::nullopt, "invalid_api_key"));
    if (models) {
      if (!get) return RespondError(*exchange, openai::MakeError(405, "/v1/models: use GET"));
      return exchange->Respond(200, kJson,
                               openai::ModelsJson(e->served_model_name, started_unix,
                                                  e->max_context_len, e->vocab_size));
    }
    if (request.method != "POST")
      return RespondError(*exchange,
                          openai::MakeError(405, absl::StrCat(request.path, ": use POST")));
    // A browser sends a cross-origin text/plain or form POST without asking first (no CORS
    // preflight); JSON only keeps such pages from starting generations.
    if (const std::string_view type = request.Header("content-type"); !IsJsonContentType(type))
      return Refuse(
          exchange,
          openai::MakeError(415, type.empty() ? std::string("Content-Type: missing; send "
                                                            "'Content-Type: application/json'")
                                              : absl::StrCat("Content-Type: '", A(type),
                                                             "' is not supported; send "
                                                             "'Content-Type: application/json'")));
    Generate(*e, chat ? openai::Endpoint::kChatCompletions : openai::Endpoint::kCompletions,
             request, exchange);
  }

  void Refuse(const std::shared_ptr<http::Exchange>& exchange, const ApiError& error) {
    if (ServerMetrics* m = gateway->options().metrics)
      m->OnRequestFinished(CodeOfHttpStatus(error.http_status), 0.0);
    RespondError(*exchange, error);
  }

  void Generate(const HttpEngine& e, openai::Endpoint endpoint, const http::Request& request,
                const std::shared_ptr<http::Exchange>& exchange) {
    openai::ParseOptions parse_options;
    parse_options.model_names = {e.served_model_name};
    parse_options.model_names.insert(parse_options.model_names.end(), e.model_aliases.begin(),
                                     e.model_aliases.end());
    parse_options.max_new_tokens_limit = gateway->options().limits.max_new_tokens_limit;
    parse_options.fim = fim;
    ParsedRequest parsed;
    if (auto error = openai::ParseRequest(endpoint, request.body, parse_options, &parsed))
      return Refuse(exchange, *error);

    openai::ResponseMeta meta{NewId(endpoint), UnixSeconds(), e.served_model_name};
    // Validate every choice before queueing any (one bad prompt of a batch refuses the request).
    std::vector<GenerationRequest> validated;
    for (size_t i = 0; i < parsed.choices.size(); ++i) {
      parsed.choices[i].set_request_id(absl::StrCat(meta.id, "-", i));
      auto one = gateway->Validate(parsed.choices[i]);
      if (!one.ok())
        return RespondError(
            *exchange, openai::ErrorFromStatus(one.status(), parsed, static_cast<int>(i), false));
      validated.push_back(std::move(*one));
    }
    const Tokenizer* tokenizer = e.tokenizer;
    auto token_text = [tokenizer](int32_t id) -> std::string {
      if (tokenizer == nullptr) return absl::StrCat("token_id:", id);
      auto text = tokenizer->Decode({id}, /*skip_special_tokens=*/false);
      return text.ok() ? *text : std::string();
    };
    std::vector<EchoPrompt> echoes;
    if (parsed.echo) {
      for (size_t i = 0; i < validated.size(); ++i) {
        const std::vector<int32_t>& ids = validated[i].prompt_ids;
        EchoPrompt& echo = echoes.emplace_back();
        echo.first_token_id = ids.front();
        if (parsed.choices[i].has_prompt()) {
          echo.text = parsed.choices[i].prompt();
        } else if (tokenizer != nullptr) {
          auto text = tokenizer->Decode(ids, /*skip_special_tokens=*/false);
          if (text.ok()) echo.text = std::move(*text);
        }
      }
    }
    auto job =
        std::make_shared<CompletionJob>(std::move(parsed), std::move(meta), exchange,
                                        std::move(token_text), num_active, std::move(echoes));
    for (size_t i = 0; i < validated.size(); ++i) {
      const v1::GenerateRequest& proto = job->request().choices[i];
      absl::Status st = gateway->Submit(std::move(validated[i]), job->channel(i),
                                        proto.has_prompt() ? proto.prompt() : "", job->tracker(i));
      if (!st.ok()) {
        job->CancelAll();  // the choices already queued leave at the engine's next step
        return RespondError(*exchange,
                            openai::ErrorFromStatus(st, job->request(), static_cast<int>(i), true));
      }
    }
    job->Begin();
  }
};

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(HttpFrontendOptions options) {
  auto frontend = std::unique_ptr<HttpFrontend>(new HttpFrontend());
  frontend->options_ = options;
  frontend->routes_ = std::make_unique<Routes>();
  frontend->routes_->render_metrics = options.render_metrics;
  frontend->routes_->metrics_bearer_token = options.metrics_bearer_token;
  frontend->routes_->loopback_names_only = !options.auth_token_set && IsLoopbackHost(options.host);
  http::ServerOptions server_options;
  server_options.host = options.host;
  server_options.port = options.port;
  server_options.num_threads = options.num_threads;
  server_options.max_body_bytes = options.max_body_bytes;
  server_options.tls_cert_file = options.tls_cert_file;
  server_options.tls_key_file = options.tls_key_file;
  server_options.tls_client_ca_file = options.tls_client_ca_file;
  server_options.write_stall_timeout = options.write_stall_timeout;
  server_options.max_connections = options.max_connections;
  server_options.unread_stream_bytes = options.unread_stream_bytes;
  // 413 and unparsable requests in OpenAI's error shape too.
  server_options.error_formatter = [](int status, std::string_view message) {
    ApiError error = openai::MakeError(status, std::string(message));
    if (status == 413) error.code = "request_too_large";
    return std::make_pair(std::string(kJson), openai::ErrorJson(error));
  };
  Routes* routes = frontend->routes_.get();
  auto server = http::Server::Start(
      std::move(server_options),
      [routes](const http::Request& request, std::shared_ptr<http::Exchange> exchange) {
        routes->Handle(request, exchange);
      });
  if (!server.ok())
    return absl::Status(server.status().code(),
                        absl::StrCat("http_port: ", server.status().message()));
  frontend->server_ = std::move(*server);
  return frontend;
}

void HttpFrontend::Attach(HttpEngine engine) {
  Routes& r = *routes_;
  r.gateway = std::make_unique<RequestGateway>(*engine.scheduler, engine.tokenizer, engine.gateway);
  if (const Tokenizer* tokenizer = engine.tokenizer) {
    r.fim = openai::FindFimTokens([tokenizer](const std::string& marker) {
      auto ids = tokenizer->Encode(marker, /*add_special_tokens=*/false);
      return ids.ok() && ids->size() == 1;
    });
  }
  r.engine_storage = std::make_unique<HttpEngine>(std::move(engine));
  r.engine.store(r.engine_storage.get(), std::memory_order_release);
  r.state = ServingState::kServing;
}

void HttpFrontend::SetDraining() {
  routes_->state = ServingState::kDraining;
}

int32_t HttpFrontend::port() const {
  return server_->port();
}

int64_t HttpFrontend::num_active_requests() const {
  return routes_->num_active->load();
}

int64_t HttpFrontend::num_open_connections() const {
  return server_->num_open_connections();
}

void HttpFrontend::Stop() {
  server_->Stop();
}

HttpFrontend::~HttpFrontend() {
  if (server_) Stop();
}

}  // namespace dropkv
