#include "server/metrics/request_metrics.h"

#include "config/logging.h"

namespace dropkv {
namespace {

double Seconds(SteadyTime from, SteadyTime to) {
  return std::chrono::duration<double>(to - from).count();
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      return "";
  }
  return "";
}

}  // namespace

RequestMetricsTracker::RequestMetricsTracker(ServerMetrics* metrics,
                                             const GenerationRequest& request, bool log_prompts,
                                             std::string prompt_text, Clock now)
    : metrics_(metrics),
      request_id_(request.request_id),
      num_prompt_tokens_(static_cast<int64_t>(request.prompt_ids.size())),
      log_prompts_(log_prompts),
      prompt_text_(std::move(prompt_text)),
      now_(now ? std::move(now) : Clock([] { return std::chrono::steady_clock::now(); })),
      arrival_(request.arrival_time),
      deadline_(request.deadline) {}

RequestMetricsTracker::~RequestMetricsTracker() {
  OnAbandoned();
}

void RequestMetricsTracker::OnRejected(const absl::Status& status) {
  if (done_) return;
  Finish(status.ok() ? absl::StatusCode::kUnknown : status.code(), "", nullptr);
}

void RequestMetricsTracker::OnAbandoned() {
  if (done_) return;
  if (deadline_ && *deadline_ <= now_())
    Finish(absl::StatusCode::kDeadlineExceeded, "cancelled", nullptr);
  else
    Finish(absl::StatusCode::kCancelled, "cancelled", nullptr);
}

void RequestMetricsTracker::OnEvent(const GenerationEvent& event) {
  if (done_) return;
  const SteadyTime now = now_();
  const auto num_tokens = static_cast<int64_t>(event.token_ids.size());
  if (num_tokens > 0) {
    if (!last_token_time_.has_value()) {
      ttft_ms_ = Seconds(arrival_, now) * 1e3;
      if (metrics_ != nullptr) metrics_->OnFirstToken(Seconds(arrival_, now));
      // Extra tokens in the first event came with it: no gap to observe for them.
    } else if (metrics_ != nullptr) {
      // Several tokens in one event (a slow consumer): spread the gap evenly over them.
      const double per_token = Seconds(*last_token_time_, now) / static_cast<double>(num_tokens);
      for (int64_t i = 0; i < num_tokens; ++i) metrics_->ObserveInterTokenLatency(per_token);
    }
    last_token_time_ = now;
    num_generated_ += num_tokens;
    if (metrics_ != nullptr) metrics_->OnTokensGenerated(num_tokens);
  }
  if (!event.finished) return;
  absl::StatusCode code = absl::StatusCode::kOk;
  if (!event.error.ok()) {
    code = event.error.code();
  } else if (event.finish_reason == FinishReason::kCancelled) {
    code = absl::StatusCode::kCancelled;
  } else if (event.finish_reason == FinishReason::kError) {
    code = absl::StatusCode::kInternal;
  }
  Finish(code, FinishReasonName(event.finish_reason), &event.summary);
}

void RequestMetricsTracker::Finish(absl::StatusCode code, const std::string& finish_reason,
                                   const GenerationSummary* summary) {
  done_ = true;
  const double duration_s = Seconds(arrival_, now_());
  // A summary with prompt tokens means the request was admitted and prefilled.
  const bool admitted = summary != nullptr && summary->num_prompt_tokens > 0;
  std::optional<double> kept_ratio;
  if (metrics_ != nullptr) {
    if (admitted) {
      metrics_->OnRequestAdmitted(summary->queue_ms / 1e3, summary->num_prompt_tokens);
      if (!summary->kv_tokens_kept_per_layer.empty()) {
        metrics_->OnPrefillCompressed(summary->kv_tokens_kept_per_layer, summary->num_prompt_tokens,
                                      summary->scoring_ms >= 0 ? summary->scoring_ms / 1e3 : -1.0);
      }
    }
    metrics_->OnRequestFinished(code, duration_s);
  }
  if (admitted && !summary->kv_tokens_kept_per_layer.empty()) {
    kept_ratio =
        static_cast<double>(summary->num_kv_tokens_kept) /
        static_cast<double>(summary->num_prompt_tokens *
                            static_cast<int64_t>(summary->kv_tokens_kept_per_layer.size()));
  }
  RequestLogRecord record;
  record.request_id = request_id_;
  record.status = ServerMetrics::StatusLabel(code);
  record.finish_reason = finish_reason;
  record.num_prompt_tokens = admitted ? summary->num_prompt_tokens : num_prompt_tokens_;
  record.num_generated_tokens = num_generated_;
  record.queue_ms = admitted ? summary->queue_ms : 0.0;
  if (ttft_ms_ >= 0) record.ttft_ms = ttft_ms_;
  record.duration_ms = duration_s * 1e3;
  record.kept_ratio = kept_ratio;
  record.prompt = prompt_text_;
  LogRequest(record, log_prompts_);
}

SchedulerStatsPoller::SchedulerStatsPoller(ServerMetrics* metrics,
                                           std::function<SchedulerStats()> stats,
                                           std::chrono::milliseconds interval, bool start_thread)
    : metrics_(metrics), stats_(std::move(stats)), interval_(interval) {
  if (!start_thread) return;
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      PollOnce();
      lock.lock();
      cv_.wait_for(lock, interval_, [this] { return stop_; });
    }
  });
}

SchedulerStatsPoller::~SchedulerStatsPoller() {
  Stop();
}

void SchedulerStatsPoller::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  PollOnce();  // the final state (e.g. KV back to 0 after a drain)
}

void SchedulerStatsPoller::PollOnce() {
  const SchedulerStats s = stats_();
  metrics_->SetRequestsRunning(s.num_running);
  metrics_->SetRequestsWaiting(s.num_waiting);
  metrics_->SetKvBlocks(s.kv_blocks_total - s.kv_blocks_free, s.kv_blocks_total);
  if (s.num_preemptions > num_preemptions_seen_) {
    metrics_->OnPreemption(s.num_preemptions - num_preemptions_seen_);
    num_preemptions_seen_ = s.num_preemptions;
  }
  if (s.num_decode_steps > decode_seen_.num_decode_steps) {
    metrics_->OnDecodeSteps(s.num_decode_steps - decode_seen_.num_decode_steps,
                            s.num_decode_rows - decode_seen_.num_decode_rows,
                            s.decode_seconds - decode_seen_.decode_seconds,
                            s.decode_host_seconds - decode_seen_.decode_host_seconds);
    decode_seen_ = s;
  }
  metrics_->SetPrefixCacheBlocks(s.prefix_cache_blocks);
  metrics_->SetParkedConversations(s.num_parked_conversations);
  if (s.num_decode_evictions > decode_evictions_seen_.num_decode_evictions) {
    metrics_->OnDecodeEvictions(
        s.num_decode_evictions - decode_evictions_seen_.num_decode_evictions,
        s.num_decode_evicted_entries - decode_evictions_seen_.num_decode_evicted_entries);
    decode_evictions_seen_ = s;
  }
  if (s.num_conversation_hits > conversation_hits_seen_) {
    metrics_->OnConversationHits(s.num_conversation_hits - conversation_hits_seen_);
    conversation_hits_seen_ = s.num_conversation_hits;
  }
  if (s.prefix_cache_query_tokens > prefix_seen_.prefix_cache_query_tokens ||
      s.prefix_cache_evicted_entries > prefix_seen_.prefix_cache_evicted_entries) {
    metrics_->OnPrefixCache(
        s.prefix_cache_query_tokens - prefix_seen_.prefix_cache_query_tokens,
        s.prefix_cache_hit_tokens - prefix_seen_.prefix_cache_hit_tokens,
        s.prefix_cache_evicted_entries - prefix_seen_.prefix_cache_evicted_entries);
    prefix_seen_ = s;
  }
}

}  // namespace dropkv
