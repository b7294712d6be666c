// ServerMetrics on prometheus-cpp's core (registry, families, text serializer); the HTTP side is
// server/http (no civetweb thread ever runs with LibTorch loaded).
#include "server/metrics/server_metrics.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

namespace dropkv {

namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// Buckets in seconds. TTFT spans a cached short prompt (ms) to a 32K-token prefill (tens of s).
const Histogram::BucketBoundaries kTtftBuckets = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,
                                                  1.0,   2.5,  5.0,   10.0, 20.0, 40.0, 80.0};
const Histogram::BucketBoundaries kItlBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
                                                 0.08,  0.1,    0.15,  0.25, 0.5,  1.0,  2.5};
const Histogram::BucketBoundaries kDurationBuckets = {0.05, 0.1,  0.25, 0.5,  1.0,   2.5,   5.0,
                                                      10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0};
const Histogram::BucketBoundaries kQueueBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                                   0.5,   1.0,   2.5,  5.0,   10.0, 30.0, 60.0};
// Fraction of KV tokens evicted: 0 = nothing dropped, 0.9 = 10x smaller cache.
const Histogram::BucketBoundaries kRatioBuckets = {0.0, 0.1, 0.2, 0.3, 0.4,  0.5,
                                                   0.6, 0.7, 0.8, 0.9, 0.95, 0.99};
const Histogram::BucketBoundaries kScoringBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};

constexpr absl::StatusCode kAllCodes[] = {
    absl::StatusCode::kOk,
    absl::StatusCode::kCancelled,
    absl::StatusCode::kUnknown,
    absl::StatusCode::kInvalidArgument,
    absl::StatusCode::kDeadlineExceeded,
    absl::StatusCode::kNotFound,
    absl::StatusCode::kAlreadyExists,
    absl::StatusCode::kPermissionDenied,
    absl::StatusCode::kResourceExhausted,
    absl::StatusCode::kFailedPrecondition,
    absl::StatusCode::kAborted,
    absl::StatusCode::kOutOfRange,
    absl::StatusCode::kUnimplemented,
    absl::StatusCode::kInternal,
    absl::StatusCode::kUnavailable,
    absl::StatusCode::kDataLoss,
    absl::StatusCode::kUnauthenticated,
};
constexpr int kNumCodes = 17;

int CodeIndex(absl::StatusCode code) {
  for (int i = 0; i < kNumCodes; ++i) {
    if (kAllCodes[i] == code) return i;
  }
  return 2;  // kUnknown
}

}  // namespace

std::string ServerMetrics::StatusLabel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "ok";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kInvalidArgument:
      return "invalid_argument";
    case absl::StatusCode::kDeadlineExceeded:
      return "deadline_exceeded";
    case absl::StatusCode::kNotFound:
      return "not_found";
    case absl::StatusCode::kAlreadyExists:
      return "already_exists";
    case absl::StatusCode::kPermissionDenied:
      return "permission_denied";
    case absl::StatusCode::kResourceExhausted:
      return "resource_exhausted";
    case absl::StatusCode::kFailedPrecondition:
      return "failed_precondition";
    case absl::StatusCode::kAborted:
      return "aborted";
    case absl::StatusCode::kOutOfRange:
      return "out_of_range";
    case absl::StatusCode::kUnimplemented:
      return "unimplemented";
    case absl::StatusCode::kInternal:
      return "internal";
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    case absl::StatusCode::kDataLoss:
      return "data_loss";
    case absl::StatusCode::kUnauthenticated:
      return "unauthenticated";
    default:
      return "unknown";
  }
}

struct ServerMetrics::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Labels model_labels;
  int32_t max_layer_labels = 128;

  Gauge* requests_running = nullptr;
  Gauge* requests_waiting = nullptr;
  Family<Counter>* requests_total = nullptr;
  // Lazily added per status code; Family::Add is mutex-protected and returns the same series.
  std::atomic<Counter*> requests_by_code[kNumCodes] = {};
  Counter* prompt_tokens = nullptr;
  Counter* generation_tokens = nullptr;
  Histogram* ttft = nullptr;
  Histogram* itl = nullptr;
  Histogram* duration = nullptr;
  Histogram* queue = nullptr;
  Gauge* kv_blocks_used = nullptr;
  Gauge* kv_blocks_total = nullptr;
  Gauge* kv_usage_ratio = nullptr;
  Counter* preemptions = nullptr;
  Counter* decode_steps = nullptr;
  Counter* decode_rows = nullptr;
  Counter* decode_seconds = nullptr;
  Counter* decode_host_seconds = nullptr;
  Counter* prefix_query_tokens = nullptr;
  Counter* prefix_hit_tokens = nullptr;
  Counter* prefix_evictions = nullptr;
  Gauge* prefix_blocks = nullptr;
  Counter* conversation_hits = nullptr;
  Gauge* parked_conversations = nullptr;
  Counter* decode_evictions = nullptr;
  Counter* decode_evicted_tokens = nullptr;
  Counter* kv_tokens_evicted = nullptr;
  Counter* kv_tokens_kept = nullptr;
  Histogram* compression_ratio = nullptr;
  Histogram* scoring = nullptr;
  Family<Gauge>* layer_kept = nullptr;
  std::mutex layer_mutex;            // guards layer_gauges growth
  std::vector<Gauge*> layer_gauges;  // [min(num_layers, max_layer_labels) + overflow]

  Counter* CounterForCode(absl::StatusCode code) {
    int idx = CodeIndex(code);
    Counter* c = requests_by_code[idx].load(std::memory_order_acquire);
    if (c == nullptr) {
      c = &requests_total->Add(WithModel({{"status", StatusLabel(code)}}));
      requests_by_code[idx].store(c, std::memory_order_release);
    }
    return c;
  }

  prometheus::Labels WithModel(prometheus::Labels labels) const {
    labels.insert(model_labels.begin(), model_labels.end());
    return labels;
  }
};

ServerMetrics::ServerMetrics(std::string model_name, int32_t max_layer_labels)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.model_labels = {{"model", model_name}};
  m.max_layer_labels = std::max<int32_t>(1, max_layer_labels);
  auto& reg = *m.registry;
  const auto& labels = m.model_labels;
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(reg).Add(labels);
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(reg).Add(labels);
  };
  auto histogram = [&](const char* name, const char* help, const Histogram::BucketBoundaries& b) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(reg).Add(labels, b);
  };
  m.requests_running = gauge("dropkv_requests_running", "Requests in prefill or decode.");
  m.requests_waiting = gauge("dropkv_requests_waiting", "Requests queued, not yet admitted.");
  m.requests_total = &prometheus::BuildCounter()
                          .Name("dropkv_requests_total")
                          .Help("Finished requests by final status code.")
                          .Register(reg);
  m.CounterForCode(absl::StatusCode::kOk);  // the ok series exists from the start at 0
  m.prompt_tokens = counter("dropkv_prompt_tokens_total", "Prompt tokens of admitted requests.");
  m.generation_tokens = counter("dropkv_generation_tokens_total", "Generated tokens.");
  m.ttft = histogram("dropkv_time_to_first_token_seconds",
                     "Time from request arrival to its first generated token.", kTtftBuckets);
  m.itl = histogram("dropkv_inter_token_latency_seconds",
                    "Time between consecutive generated tokens of one request.", kItlBuckets);
  m.duration =
      histogram("dropkv_request_duration_seconds",
                "End-to-end request time from arrival to the last message.", kDurationBuckets);
  m.queue = histogram("dropkv_request_queue_seconds", "Time a request waited before admission.",
                      kQueueBuckets);
  m.kv_blocks_used = gauge("dropkv_kv_blocks_used", "KV cache blocks in use.");
  m.kv_blocks_total = gauge("dropkv_kv_blocks_total", "KV cache blocks in the pool.");
  m.kv_usage_ratio = gauge("dropkv_kv_usage_ratio", "KV blocks used / total (0..1).");
  m.preemptions = counter("dropkv_preemptions_total",
                          "Sequences preempted (freed, recomputed later) for lack of KV blocks.");
  m.decode_steps = counter("dropkv_decode_steps_total", "Decode steps (one forward of a batch).");
  m.decode_rows = counter("dropkv_decode_rows_total",
                          "Sequences run by decode steps (rate over the steps' rate: mean batch).");
  m.decode_seconds = counter("dropkv_decode_seconds_total",
                             "Engine-thread time in decode steps: the forward and the sampling.");
  m.decode_host_seconds =
      counter("dropkv_decode_host_seconds_total",
              "Of the decode time, the runner's host work before a step's kernels were queued "
              "(the device waits for it; 0 where not measured).");
  m.prefix_query_tokens = counter("dropkv_prefix_cache_query_tokens_total",
                                  "Prompt tokens of uncompressed requests looked up in the prefix "
                                  "cache at admission.");
  m.prefix_hit_tokens = counter("dropkv_prefix_cache_hit_tokens_total",
                                "Of those, tokens found cached and not prefilled again (rate over "
                                "the query rate: hit rate).");
  m.prefix_evictions = counter("dropkv_prefix_cache_evictions_total",
                               "Prefix-cache entries (one block per layer) evicted for room.");
  m.prefix_blocks = gauge("dropkv_prefix_cache_blocks",
                          "KV blocks the prefix cache holds (shared with running requests, or "
                          "free to evict).");
  m.conversation_hits = counter("dropkv_conversation_hits_total",
                                "Compressed requests that continued a kept conversation's cache "
                                "(keep_conversation) instead of prefilling their whole prompt.");
  m.parked_conversations = gauge("dropkv_conversations_kept",
                                 "Compressed conversations kept for a continuation now (their "
                                 "blocks count as used until released).");
  m.decode_evictions = counter("dropkv_decode_evictions_total",
                               "Layers of a sequence compacted back to their budget by compression "
                               "during decode (decode_margin).");
  m.decode_evicted_tokens = counter("dropkv_decode_evicted_kv_tokens_total",
                                    "KV entries (token x layer) evicted by compression during "
                                    "decode.");
  m.kv_tokens_evicted = counter("dropkv_kv_tokens_evicted_total",
                                "KV entries (token x layer) dropped by compression at prefill.");
  m.kv_tokens_kept = counter("dropkv_kv_tokens_kept_total",
                             "KV entries (token x layer) kept by compression at prefill.");
  m.compression_ratio = histogram("dropkv_compression_ratio",
                                  "Fraction of a prompt's KV entries evicted, per compressed "
                                  "sequence (0 = none, 0.9 = 10x smaller).",
                                  kRatioBuckets);
  m.scoring =
      histogram("dropkv_scoring_seconds",
                "Time scoring and selecting KV entries, per compressed sequence.", kScoringBuckets);
  m.layer_kept = &prometheus::BuildGauge()
                      .Name("dropkv_layer_kept_tokens")
                      .Help("Tokens kept per layer by the most recent compressed prefill.")
                      .Register(reg);
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::SetRequestsRunning(int64_t num_running) {
  impl_->requests_running->Set(static_cast<double>(num_running));
}
void ServerMetrics::SetRequestsWaiting(int64_t num_waiting) {
  impl_->requests_waiting->Set(static_cast<double>(num_waiting));
}
void ServerMetrics::SetKvBlocks(int64_t num_used_blocks, int64_t num_total_blocks) {
  impl_->kv_blocks_used->Set(static_cast<double>(num_used_blocks));
  impl_->kv_blocks_total->Set(static_cast<double>(num_total_blocks));
  impl_->kv_usage_ratio->Set(num_total_blocks > 0 ? static_cast<double>(num_used_blocks) /
                                                        static_cast<double>(num_total_blocks)
                                                  : 0.0);
}
void ServerMetrics::OnRequestAdmitted(double queue_seconds, int64_t num_prompt_tokens) {
  impl_->queue->Observe(std::max(0.0, queue_seconds));
  impl_->prompt_tokens->Increment(static_cast<double>(std::max<int64_t>(0, num_prompt_tokens)));
}
void ServerMetrics::OnFirstToken(double ttft_seconds) {
  impl_->ttft->Observe(std::max(0.0, ttft_seconds));
}
void ServerMetrics::OnTokensGenerated(int64_t num_tokens) {
  impl_->generation_tokens->Increment(static_cast<double>(std::max<int64_t>(0, num_tokens)));
}
void ServerMetrics::ObserveInterTokenLatency(double seconds) {
  impl_->itl->Observe(std::max(0.0, seconds));
}
void ServerMetrics::OnRequestFinished(absl::StatusCode code, double duration_seconds) {
  impl_->CounterForCode(code)->Increment();
  impl_->duration->Observe(std::max(0.0, duration_seconds));
}
void ServerMetrics::OnPreemption(int64_t num_preempted) {
  impl_->preemptions->Increment(static_cast<double>(std::max<int64_t>(0, num_preempted)));
}

void ServerMetrics::OnDecodeSteps(int64_t num_steps, int64_t num_rows, double seconds,
                                  double host_seconds) {
  impl_->decode_steps->Increment(static_cast<double>(std::max<int64_t>(0, num_steps)));
  impl_->decode_rows->Increment(static_cast<double>(std::max<int64_t>(0, num_rows)));
  impl_->decode_seconds->Increment(std::max(0.0, seconds));
  impl_->decode_host_seconds->Increment(std::max(0.0, host_seconds));
}

void ServerMetrics::OnPrefixCache(int64_t num_query_tokens, int64_t num_hit_tokens,
                                  int64_t num_evicted_entries) {
  impl_->prefix_query_tokens->Increment(
      static_cast<double>(std::max<int64_t>(0, num_query_tokens)));
  impl_->prefix_hit_tokens->Increment(static_cast<double>(std::max<int64_t>(0, num_hit_tokens)));
  impl_->prefix_evictions->Increment(
      static_cast<double>(std::max<int64_t>(0, num_evicted_entries)));
}
void ServerMetrics::SetPrefixCacheBlocks(int64_t num_blocks) {
  impl_->prefix_blocks->Set(static_cast<double>(num_blocks));
}
void ServerMetrics::OnConversationHits(int64_t num_hits) {
  impl_->conversation_hits->Increment(static_cast<double>(std::max<int64_t>(0, num_hits)));
}
void ServerMetrics::OnDecodeEvictions(int64_t num_evictions, int64_t num_evicted_entries) {
  impl_->decode_evictions->Increment(static_cast<double>(std::max<int64_t>(0, num_evictions)));
  impl_->decode_evicted_tokens->Increment(
      static_cast<double>(std::max<int64_t>(0, num_evicted_entries)));
}
void ServerMetrics::SetParkedConversations(int64_t num_parked) {
  impl_->parked_conversations->Set(static_cast<double>(num_parked));
}

void ServerMetrics::OnPrefillCompressed(const std::vector<int64_t>& num_kept_per_layer,
                                        int64_t num_prompt_tokens, double scoring_seconds) {
  Impl& m = *impl_;
  const auto num_layers = static_cast<int64_t>(num_kept_per_layer.size());
  int64_t num_kept = 0;
  for (int64_t kept : num_kept_per_layer)
    num_kept += std::clamp<int64_t>(kept, 0, num_prompt_tokens);
  const int64_t num_entries = num_layers * std::max<int64_t>(0, num_prompt_tokens);
  m.kv_tokens_kept->Increment(static_cast<double>(num_kept));
  m.kv_tokens_evicted->Increment(static_cast<double>(num_entries - num_kept));
  if (num_entries > 0) {
    m.compression_ratio->Observe(static_cast<double>(num_entries - num_kept) /
                                 static_cast<double>(num_entries));
  }
  if (scoring_seconds >= 0) m.scoring->Observe(scoring_seconds);

  // One gauge per layer up to the cap; the rest sum into "overflow".
  std::lock_guard<std::mutex> lock(m.layer_mutex);
  const int64_t num_labelled = std::min<int64_t>(num_layers, m.max_layer_labels);
  while (static_cast<int64_t>(m.layer_gauges.size()) < num_labelled) {
    m.layer_gauges.push_back(
        &m.layer_kept->Add(m.WithModel({{"layer", std::to_string(m.layer_gauges.size())}})));
  }
  for (int64_t layer_idx = 0; layer_idx < num_labelled; ++layer_idx) {
    m.layer_gauges[layer_idx]->Set(static_cast<double>(num_kept_per_layer[layer_idx]));
  }
  if (num_layers > num_labelled) {
    int64_t overflow = 0;
    for (int64_t l = num_labelled; l < num_layers; ++l) overflow += num_kept_per_layer[l];
    m.layer_kept->Add(m.WithModel({{"layer", "overflow"}})).Set(static_cast<double>(overflow));
  }
}

std::string ServerMetrics::RenderText() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

}  // namespace dropkv
