// Glue from the scheduler's public surface (engine/scheduler/generation.h, scheduler.h; headers
// only, no LibTorch) to ServerMetrics and the per-request log line, so the gRPC layer needs one
// tracker per request and main() one poller:
//
//   RequestMetricsTracker tracker(&metrics, request, config.log_prompts, prompt_text);
//   if (absl::Status st = scheduler.Submit(request, channel); !st.ok()) tracker.OnRejected(st);
//   ... for every event popped from the channel: tracker.OnEvent(event);
//   ... stream torn down before the final event: tracker.OnAbandoned();
//
//   SchedulerStatsPoller poller(&metrics, [&] { return scheduler.Stats(); });
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "engine/scheduler/generation.h"
#include "engine/scheduler/scheduler.h"
#include "server/metrics/server_metrics.h"

namespace dropkv {

class RequestMetricsTracker {
 public:
  using Clock = std::function<SteadyTime()>;
  // `metrics` may be null (no metrics endpoint): then only the log line is written.
  // `prompt_text` is logged only when log_prompts is true.
  RequestMetricsTracker(ServerMetrics* metrics, const GenerationRequest& request, bool log_prompts,
                        std::string prompt_text = "", Clock now = nullptr);
  ~RequestMetricsTracker();  // an unfinished request counts as abandoned (cancelled)

  // Submit() refused the request (queue full, draining, ...): counted under its code and logged.
  void OnRejected(const absl::Status& status);
  // Each event popped from the request's channel, in order; the finished one closes the record.
  void OnEvent(const GenerationEvent& event);
  // The call ended before the final event: counted as cancelled, or as deadline_exceeded when the
  // request's deadline has passed (gRPC ends such a call itself). No-op once done.
  void OnAbandoned();
  bool done() const { return done_; }

 private:
  void Finish(absl::StatusCode code, const std::string& finish_reason,
              const GenerationSummary* summary);

  ServerMetrics* metrics_;
  std::string request_id_;
  int64_t num_prompt_tokens_;
  bool log_prompts_;
  std::string prompt_text_;
  Clock now_;
  SteadyTime arrival_;
  std::optional<SteadyTime> deadline_;
  std::optional<SteadyTime> last_token_time_;
  double ttft_ms_ = -1;
  int64_t num_generated_ = 0;
  bool done_ = false;
};

// Copies SchedulerStats into the gauges (running, waiting, KV blocks) and new preemptions into the
// counter, every `interval` on its own thread (and once more when it stops).
class SchedulerStatsPoller {
 public:
  SchedulerStatsPoller(ServerMetrics* metrics, std::function<SchedulerStats()> stats,
                       std::chrono::milliseconds interval = std::chrono::milliseconds(250),
                       bool start_thread = true);
  ~SchedulerStatsPoller();
  SchedulerStatsPoller(const SchedulerStatsPoller&) = delete;
  SchedulerStatsPoller& operator=(const SchedulerStatsPoller&) = delete;

  void PollOnce();
  void Stop();

 private:
  ServerMetrics* metrics_;
  std::function<SchedulerStats()> stats_;
  std::chrono::milliseconds interval_;
  int64_t num_preemptions_seen_ = 0;
  SchedulerStats decode_seen_;  // the decode counters last passed on
  SchedulerStats prefix_seen_;  // the prefix-cache counters last passed on
  int64_t conversation_hits_seen_ = 0;
  SchedulerStats decode_evictions_seen_;  // the decode-time eviction counters last passed on
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dropkv
