#include "server/service.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "engine/scheduler/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "server/metrics/request_metrics.h"
#include "server/metrics/server_metrics.h"

namespace dropkv {

// A generation call is open from its reactor's construction to OnDone. It is stalled while an
// answer (a streamed message or the final status) waits on a client that reads nothing.
struct OpenCall {
  std::mutex mu;
  std::condition_variable cv;
  grpc::CallbackServerContext* context = nullptr;  // valid until `done`
  std::optional<std::chrono::steady_clock::time_point> waiting_since;
  int num_cancelling = 0;  // TryCancel calls in flight (OnDone waits them out)
  bool done = false;

  void SetWaiting(bool waiting) {
    std::lock_guard<std::mutex> lock(mu);
    if (!waiting)
      waiting_since.reset();
    else if (!waiting_since)
      waiting_since = std::chrono::steady_clock::now();
  }
};

class InferenceService::OpenCalls {
 public:
  std::shared_ptr<OpenCall> Open(grpc::CallbackServerContext* context) {
    auto call = std::make_shared<OpenCall>();
    call->context = context;
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back(call);
    return call;
  }
  // From OnDone: after it no one touches the call's context.
  void Close(const std::shared_ptr<OpenCall>& call) {
    {
      std::unique_lock<std::mutex> lock(call->mu);
      call->cv.wait(lock, [&] { return call->num_cancelling == 0; });
      call->done = true;
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(calls_, call);
  }
  int64_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(calls_.size());
  }
  // Cancels the calls stalled longer than `limit`; every open call when `limit` is zero. No lock
  // is held across TryCancel (its reactions may run on this thread).
  void CancelStalled(std::chrono::duration<double> limit) {
    std::vector<std::shared_ptr<OpenCall>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls = calls_;
    }
    const auto now = std::chrono::steady_clock::now();
    for (const auto& call : calls) {
      grpc::CallbackServerContext* context = nullptr;
      {
        std::lock_guard<std::mutex> lock(call->mu);
        if (call->done) continue;
        if (limit.count() > 0 && !(call->waiting_since && now - *call->waiting_since > limit))
          continue;
        ++call->num_cancelling;
        context = call->context;
      }
      context->TryCancel();
      {
        std::lock_guard<std::mutex> lock(call->mu);
        --call->num_cancelling;
      }
      call->cv.notify_all();
    }
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<OpenCall>> calls_;
};

namespace {

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return v1::FINISH_REASON_ERROR;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void AddLogprob(const TokenLogprobInfo& lp, v1::TokenLogprob* out) {
  out->set_token_id(lp.token_id);
  out->set_logprob(lp.logprob);
  for (const TopLogprobEntry& t : lp.top) {
    v1::TopLogprob* top = out->add_top();
    top->set_token_id(t.token_id);
    top->set_logprob(t.logprob);
  }
}

// Appends an event's delta (ids, text, logprobs, prompt logprobs) to `response`.
void AppendDelta(const GenerationEvent& event, v1::GenerateResponse* response) {
  for (int32_t id : event.token_ids) response->add_token_ids(id);
  response->mutable_text()->append(event.text);
  for (const TokenLogprobInfo& lp : event.logprobs) AddLogprob(lp, response->add_logprobs());
  for (const TokenLogprobInfo& lp : event.prompt_logprobs)
    AddLogprob(lp, response->add_prompt_logprobs());
}

// The gRPC status that ends a call whose last event is `event`, when it is not OK.
grpc::Status FinalStatus(const GenerationEvent& event, grpc::CallbackServerContext* context) {
  // An error, or the scheduler's DEADLINE_EXCEEDED on a cancelled sequence.
  if (!event.error.ok()) return ToGrpcStatus(event.error);
  if (event.finish_reason == FinishReason::kCancelled) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    if (context->deadline() <= std::chrono::system_clock::now())
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded");
  }
  return grpc::Status::OK;  // server-side cancel (shutdown): the last message says CANCELLED
}

// Streams one request's events. Lives until OnDone.
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateReactor(grpc::CallbackServerContext* context,
                  std::shared_ptr<InferenceService::OpenCalls> open_calls)
      : context_(context),
        channel_(std::make_shared<RequestChannel>()),
        open_calls_(std::move(open_calls)),
        call_(open_calls_->Open(context)) {}

  std::shared_ptr<RequestChannel> channel() const { return channel_; }
  std::unique_ptr<RequestMetricsTracker>* tracker() { return &tracker_; }
  void set_request_id(std::string id) { request_id_ = std::move(id); }

  // Called once the request is queued: from now on events drive the writes.
  void Attach() {
    channel_->SetNotify([this] { OnEvent(); });
    OnEvent();  // events pushed before the notify was set
  }
  void FinishNow(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(status);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (finished_) return;
    call_->SetWaiting(false);
    if (!ok) {  // the client is gone
      channel_->Cancel();
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    if (pending_final_) {
      FinishLocked(final_status_);
      return;
    }
    WriteNextLocked();
  }
  void OnCancel() override { channel_->Cancel(); }
  void OnDone() override {
    channel_->SetNotify(nullptr);  // after this no engine callback can reach us
    channel_->Cancel();
    open_calls_->Close(call_);
    delete this;
  }

 private:
  void OnEvent() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!writing_ && !finished_ && !pending_final_) WriteNextLocked();
  }
  // The final status waits on the client as a write does.
  void FinishLocked(const grpc::Status& status) {
    finished_ = true;
    call_->SetWaiting(true);
    Finish(status);
  }
  // Merges every queued event into one message (fewer writes under load) and writes it.
  void WriteNextLocked() {
    response_.Clear();
    bool any = false;
    while (auto event = channel_->Pop()) {
      any = true;
      if (tracker_) tracker_->OnEvent(*event);
      AppendDelta(*event, &response_);
      if (event->finished) {
        final_status_ = FinalStatus(*event, context_);
        if (!final_status_.ok()) {
          FinishLocked(final_status_);
          return;
        }
        FillFinal(*event, &response_);
        pending_final_ = true;
        break;
      }
    }
    if (!any) return;
    response_.set_request_id(request_id_);
    writing_ = true;
    call_->SetWaiting(true);
    StartWrite(&response_);
  }

  grpc::CallbackServerContext* context_;
  std::shared_ptr<RequestChannel> channel_;
  std::shared_ptr<InferenceService::OpenCalls> open_calls_;
  std::shared_ptr<OpenCall> call_;
  std::unique_ptr<RequestMetricsTracker> tracker_;  // counts as abandoned if destroyed unfinished
  std::string request_id_;
  std::mutex mu_;
  v1::GenerateResponse response_;
  bool writing_ = false;
  bool pending_final_ = false;
  bool finished_ = false;
  grpc::Status final_status_;
};

// Collects every event into one response.
class UnaryGenerateReactor final : public grpc::ServerUnaryReactor {
 public:
  UnaryGenerateReactor(grpc::CallbackServerContext* context, v1::GenerateResponse* response,
                       std::shared_ptr<InferenceService::OpenCalls> open_calls)
      : context_(context),
        response_(response),
        channel_(std::make_shared<RequestChannel>()),
        open_calls_(std::move(open_calls)),
        call_(open_calls_->Open(context)) {}
  std::shared_ptr<RequestChannel> channel() const { return channel_; }
  std::unique_ptr<RequestMetricsTracker>* tracker() { return &tracker_; }
  void set_request_id(std::string id) { response_->set_request_id(std::move(id)); }
  void Attach() {
    channel_->SetNotify([this] { OnEvent(); });
    OnEvent();
  }
  void FinishNow(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(status);
  }
  void OnCancel() override { channel_->Cancel(); }
  void OnDone() override {
    channel_->SetNotify(nullptr);
    channel_->Cancel();
    open_calls_->Close(call_);
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) {
    finished_ = true;
    call_->SetWaiting(true);  // the response waits on the client
    Finish(status);
  }
  void OnEvent() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    while (auto event = channel_->Pop()) {
      if (tracker_) tracker_->OnEvent(*event);
      AppendDelta(*event, response_);
      if (event->finished) {
        grpc::Status status = FinalStatus(*event, context_);
        if (status.ok()) FillFinal(*event, response_);
        FinishLocked(status);
        return;
      }
    }
  }

  grpc::CallbackServerContext* context_;
  v1::GenerateResponse* response_;
  std::shared_ptr<RequestChannel> channel_;
  std::shared_ptr<InferenceService::OpenCalls> open_calls_;
  std::shared_ptr<OpenCall> call_;
  std::unique_ptr<RequestMetricsTracker> tracker_;
  std::mutex mu_;
  bool finished_ = false;
};

}  // namespace

void FillFinal(const GenerationEvent& event, v1::GenerateResponse* response) {
  response->set_finish_reason(ToProto(event.finish_reason));
  if (!event.error.ok()) response->set_error_message(std::string(event.error.message()));
  const GenerationSummary& s = event.summary;
  v1::Usage* usage = response->mutable_usage();
  usage->set_prompt_tokens(s.num_prompt_tokens);
  usage->set_completion_tokens(s.num_completion_tokens);
  usage->set_kv_tokens_kept(s.num_kv_tokens_kept);
  for (int64_t n : s.kv_tokens_kept_per_layer) usage->add_kv_tokens_kept_per_layer(n);
  usage->set_kv_bytes_saved(s.kv_bytes_saved);
  usage->set_num_preemptions(s.num_preemptions);
  usage->set_cached_prompt_tokens(s.num_cached_prompt_tokens);
  usage->set_decode_evicted_kv_tokens(s.num_decode_evicted_kv_tokens);
  v1::Timings* t = response->mutable_timings();
  t->set_queue_ms(s.queue_ms);
  t->set_prefill_ms(s.prefill_ms);
  t->set_ttft_ms(s.ttft_ms);
  t->set_decode_ms(s.decode_ms);
}

InferenceService::InferenceService(Scheduler& scheduler, const Tokenizer* tokenizer,
                                   ServiceOptions options)
    : gateway_(scheduler, tokenizer, options.gateway()),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      open_calls_(std::make_shared<OpenCalls>()) {
  stall_watch_ = std::thread([this] {
    const std::chrono::duration<double> limit(options_.write_stall_seconds);
    std::unique_lock<std::mutex> lock(stall_watch_mu_);
    while (!stall_watch_cv_.wait_for(lock, std::chrono::milliseconds(100),
                                     [this] { return stop_stall_watch_; })) {
      lock.unlock();
      open_calls_->CancelStalled(limit);
      lock.lock();
    }
  });
}

InferenceService::~InferenceService() {
  {
    std::lock_guard<std::mutex> lock(stall_watch_mu_);
    stop_stall_watch_ = true;
  }
  stall_watch_cv_.notify_all();
  stall_watch_.join();
}

int64_t InferenceService::num_active_calls() const {
  return open_calls_->size();
}

void InferenceService::CancelAllCalls() {
  open_calls_->CancelStalled(std::chrono::duration<double>::zero());
}

grpc::Status InferenceService::CheckAuth(const grpc::CallbackServerContext* context) const {
  const auto& md = context->client_metadata();
  auto it = md.find("authorization");
  const std::string_view value =
      it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  if (gateway_.Authorized(value)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or wrong 'authorization: Bearer <token>' metadata");
}

absl::Status InferenceService::Start(grpc::CallbackServerContext* context,
                                     const v1::GenerateRequest& request,
                                     std::shared_ptr<RequestChannel> channel,
                                     std::string* request_id,
                                     std::unique_ptr<RequestMetricsTracker>* tracker) {
  auto validated = gateway_.Validate(request);
  if (!validated.ok()) return validated.status();
  // gRPC deadline (system clock) -> the engine's steady clock.
  const auto deadline = context->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    const auto left = deadline - std::chrono::system_clock::now();
    validated->deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
  }
  *request_id = validated->request_id;
  return gateway_.Submit(std::move(*validated), std::move(channel),
                         request.has_prompt() ? request.prompt() : "", tracker);
}

template <typename Reactor>
Reactor* InferenceService::StartReactor(grpc::CallbackServerContext* context,
                                        const v1::GenerateRequest& request, Reactor* reactor) {
  if (grpc::Status auth = CheckAuth(context); !auth.ok()) {
    reactor->FinishNow(auth);
    return reactor;
  }
  // The reactor itself is open already.
  if (const int64_t open = open_calls_->size(); open > options_.max_open_calls) {
    reactor->FinishNow(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("the server has ", open - 1, " generation calls open (max_open_calls ",
                     options_.max_open_calls, "); retry later")));
    return reactor;
  }
  std::string request_id;
  absl::Status st = Start(context, request, reactor->channel(), &request_id, reactor->tracker());
  if (!st.ok()) {
    reactor->FinishNow(ToGrpcStatus(st));
    return reactor;
  }
  reactor->set_request_id(request_id);
  reactor->Attach();
  return reactor;
}

template <typename Body>
grpc::ServerUnaryReactor* InferenceService::FinishUnary(grpc::CallbackServerContext* context,
                                                        Body&& body) {
  auto* reactor = context->DefaultReactor();
  grpc::Status st = CheckAuth(context);
  reactor->Finish(st.ok() ? body() : st);
  return reactor;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* InferenceService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  return StartReactor(context, *request, new GenerateReactor(context, open_calls_));
}

grpc::ServerUnaryReactor* InferenceService::GenerateUnary(grpc::CallbackServerContext* context,
                                                          const v1::GenerateRequest* request,
                                                          v1::GenerateResponse* response) {
  return StartReactor(context, *request, new UnaryGenerateReactor(context, response, open_calls_));
}

grpc::ServerUnaryReactor* InferenceService::Tokenize(grpc::CallbackServerContext* context,
                                                     const v1::TokenizeRequest* request,
                                                     v1::TokenizeResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (tokenizer_ == nullptr)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no tokenizer loaded");
    if (request->ByteSizeLong() > static_cast<size_t>(options_.limits.max_request_bytes))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request: oversized");
    absl::StatusOr<std::vector<int32_t>> ids;
    if (request->has_chat()) {
      ids = ChatToTokenIds(request->chat(), "chat", *tokenizer_);
      if (!ids.ok()) return ToGrpcStatus(ids.status());
    } else {
      const bool add_special = !request->has_add_special_tokens() || request->add_special_tokens();
      ids = tokenizer_->Encode(request->text(), add_special);
    }
    if (!ids.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "text: " + std::string(ids.status().message()));
    }
    for (int32_t id : *ids) response->add_token_ids(id);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::Detokenize(grpc::CallbackServerContext* context,
                                                       const v1::DetokenizeRequest* request,
                                                       v1::DetokenizeResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (tokenizer_ == nullptr)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no tokenizer loaded");
    for (int i = 0; i < request->token_ids_size(); ++i) {
      const int32_t id = request->token_ids(i);
      if (id < 0 || id >= options_.limits.vocab_size) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "token_ids[" + std::to_string(i) + "]: unknown token id " + std::to_string(id));
      }
    }
    std::vector<int32_t> ids(request->token_ids().begin(), request->token_ids().end());
    auto text = tokenizer_->Decode(ids, request->skip_special_tokens());
    if (!text.ok()) return ToGrpcStatus(text.status());
    response->set_text(*text);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::GetModelInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetModelInfoRequest*,
                                                         v1::ModelInfo* response) {
  return FinishUnary(context, [&] {
    *response = options_.model_info;
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* InferenceService::GetServerStats(grpc::CallbackServerContext* context,
                                                           const v1::GetServerStatsRequest*,
                                                           v1::ServerStats* response) {
  return FinishUnary(context, [&] {
    const SchedulerStats s = gateway_.scheduler().Stats();
    response->set_num_waiting(s.num_waiting);
    response->set_num_running(s.num_running);
    response->set_kv_blocks_total(s.kv_blocks_total);
    response->set_kv_blocks_free(s.kv_blocks_free);
    response->set_kv_blocks_used(s.kv_blocks_total - s.kv_blocks_free);
    response->set_num_preemptions(s.num_preemptions);
    response->set_num_requests_finished(s.num_finished);
    response->set_num_requests_rejected(s.num_rejected);
    response->set_num_waiting_prompt_tokens(s.num_waiting_prompt_tokens);
    response->set_draining(s.draining);
    return grpc::Status::OK;
  });
}

}  // namespace dropkv
