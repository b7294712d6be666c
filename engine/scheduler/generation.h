// What crosses between the server threads and the engine thread for one generation request:
// the validated request going in, and a thread-safe channel of events coming out.
// No tensors and no gRPC here: gRPC threads include this, the engine thread fills it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/request.h"

namespace dropkv {

using SteadyTime = std::chrono::steady_clock::time_point;

// A request after validation: the prompt is already token ids.
struct GenerationRequest {
  std::string request_id;
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;
  CompressionParams compression;
  int32_t priority = 0;  // higher is admitted first; FCFS within a priority
  // Compressed requests: the finished conversation's cache stays for a request that extends it.
  bool keep_conversation = false;
  std::optional<SteadyTime> deadline;  // gRPC deadline; the sequence leaves at the next step after
  SteadyTime arrival_time = std::chrono::steady_clock::now();
};

struct TopLogprobEntry {
  int32_t token_id = 0;
  float logprob = 0.0f;
};

struct TokenLogprobInfo {
  int32_t token_id = 0;
  float logprob = 0.0f;
  std::vector<TopLogprobEntry> top;
};

// Filled in on the final event.
struct GenerationSummary {
  int32_t num_prompt_tokens = 0;
  int32_t num_completion_tokens = 0;
  int32_t num_cached_prompt_tokens = 0;  // prompt tokens found in the prefix cache (last admission)
  int64_t num_kv_tokens_kept = 0;        // over all layers, right after prefill
  std::vector<int64_t> kv_tokens_kept_per_layer;
  int64_t kv_bytes_saved = 0;
  // KV entries (token x layer) compression during decode evicted (decode_margin), all admissions.
  int64_t num_decode_evicted_kv_tokens = 0;
  int32_t num_preemptions = 0;
  double queue_ms = 0;     // arrival -> first admission
  double prefill_ms = 0;   // first admission -> prefill done (last admission after preemption)
  double ttft_ms = 0;      // arrival -> first token
  double decode_ms = 0;    // first token -> finish
  double scoring_ms = -1;  // KV scoring + selection in the prefill (compressed requests; else < 0)
};

// One delta of output. `finished` marks the last event of a request.
struct GenerationEvent {
  std::vector<int32_t> token_ids;  // tokens sampled since the last event
  std::string text;                // text that became final (stop strings never appear in it)
  std::vector<TokenLogprobInfo> logprobs;  // one per token when requested
  // sampling.return_prompt_logprobs, on the first event: prompt tokens 1.. in order.
  std::vector<TokenLogprobInfo> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  absl::Status error;  // set when finish_reason == kError, or the request was refused
  GenerationSummary summary;
};

// The per-request channel. The engine thread Push()es; the consumer Pop()s. Cancel() may come from
// any thread; the engine notices it at its next step. The notify callback runs on the engine thread
// after each Push, outside the queue lock, serialised with SetNotify() so that after
// SetNotify(nullptr) returns no callback is running or will run (a reactor can then be destroyed).
class RequestChannel {
 public:
  void Push(GenerationEvent event) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (event.finished) finished_ = true;
      events_.push_back(std::move(event));
    }
    cv_.notify_all();
    std::lock_guard<std::mutex> lock(notify_mu_);
    if (notify_) notify_();
  }
  std::optional<GenerationEvent> Pop() {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (events_.empty()) return std::nullopt;
    GenerationEvent event = std::move(events_.front());
    events_.pop_front();
    return event;
  }
  // Blocks until an event is available (for in-process users and tests).
  GenerationEvent PopBlocking() {
    std::unique_lock<std::mutex> lock(queue_mu_);
    cv_.wait(lock, [&] { return !events_.empty(); });
    GenerationEvent event = std::move(events_.front());
    events_.pop_front();
    return event;
  }
  void SetNotify(std::function<void()> notify) {
    std::lock_guard<std::mutex> lock(notify_mu_);
    notify_ = std::move(notify);
  }
  void Cancel() {
    std::lock_guard<std::mutex> lock(queue_mu_);
    cancelled_ = true;
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(queue_mu_);
    return cancelled_;
  }
  // The consumer takes none of the output for now (an HTTP client that stopped reading): the
  // scheduler may give the sequence's slot to a waiting request and recompute it once resumed.
  void SetPaused(bool paused) { paused_ = paused; }
  bool paused() const { return paused_.load(); }
  bool finished() const {
    std::lock_guard<std::mutex> lock(queue_mu_);
    return finished_;
  }

 private:
  mutable std::mutex queue_mu_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;
  bool cancelled_ = false;
  bool finished_ = false;
  std::atomic<bool> paused_{false};
  std::mutex notify_mu_;
  std::function<void()> notify_;
};

}  // namespace dropkv
