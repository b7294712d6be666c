// Prometheus metrics of one server process (names and meaning in docs/metrics.md).
// The scheduler and the front ends call the On*/Set* methods; server/http serves RenderText() at
// GET /metrics (MetricsHttpServer on metrics_port, and the HTTP API port). Every method is
// thread-safe and cheap (atomics; no allocation after the first call with a given status code). No
// LibTorch, no gRPC here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv {

class ServerMetrics {
 public:
  // model_name is the `model` label on every series. Layers at or above max_layer_labels share the
  // layer label "overflow" in dropkv_layer_kept_tokens (bounded cardinality).
  explicit ServerMetrics(std::string model_name, int32_t max_layer_labels = 128);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // --- state, set by the scheduler after each step (gauges) ---
  void SetRequestsRunning(int64_t num_running);
  void SetRequestsWaiting(int64_t num_waiting);
  // Also sets dropkv_kv_usage_ratio = used / total (0 when total is 0).
  void SetKvBlocks(int64_t num_used_blocks, int64_t num_total_blocks);

  // --- request lifecycle ---
  // A request left the queue and its prefill starts: queue time and its prompt tokens.
  void OnRequestAdmitted(double queue_seconds, int64_t num_prompt_tokens);
  // Time from arrival to the first generated token.
  void OnFirstToken(double ttft_seconds);
  // Tokens produced (all requests of a step together, or one at a time).
  void OnTokensGenerated(int64_t num_tokens);
  // Gap between two consecutive tokens of one request.
  void ObserveInterTokenLatency(double seconds);
  // Every request ends here exactly once, admitted or refused: counts it under its status code
  // (label status = "ok", "cancelled", "invalid_argument", "resource_exhausted", ...) and observes
  // its end-to-end duration from arrival.
  void OnRequestFinished(absl::StatusCode code, double duration_seconds);
  void OnPreemption(int64_t num_preempted = 1);
  // Decode steps (SchedulerStats' num_decode_steps and the rest, as deltas): their count, batch
  // rows, engine-thread seconds and the runner's host seconds before the kernels were queued.
  void OnDecodeSteps(int64_t num_steps, int64_t num_rows, double seconds, double host_seconds);
  // Prefix cache (SchedulerStats' prefix_cache_* counters as deltas, and the pinned blocks now):
  // prompt tokens looked up at admission, of them found cached, entries evicted for room.
  void OnPrefixCache(int64_t num_query_tokens, int64_t num_hit_tokens, int64_t num_evicted_entries);
  void SetPrefixCacheBlocks(int64_t num_blocks);
  // Compressed conversations (keep_conversation): requests that continued a kept one (delta),
  // and how many are kept now.
  void OnConversationHits(int64_t num_hits);
  // Compression during decode: layers compacted and KV entries (token x layer) they evicted.
  void OnDecodeEvictions(int64_t num_evictions, int64_t num_evicted_entries);
  void SetParkedConversations(int64_t num_parked);

  // --- KV compression at prefill: one call per compressed sequence ---
  // num_kept_per_layer[l] = tokens layer l kept of num_prompt_tokens; scoring_seconds = time spent
  // scoring + selecting for this sequence (< 0: not measured, not observed). Updates kept/evicted
  // counters, the achieved compression ratio (fraction evicted over all layers), the scoring
  // histogram and dropkv_layer_kept_tokens.
  void OnPrefillCompressed(const std::vector<int64_t>& num_kept_per_layer,
                           int64_t num_prompt_tokens, double scoring_seconds);

  // Prometheus text exposition format 0.0.4 of every series.
  std::string RenderText() const;

  // "ok", "cancelled", "deadline_exceeded", ... (the label value used for a status code).
  static std::string StatusLabel(absl::StatusCode code);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dropkv
