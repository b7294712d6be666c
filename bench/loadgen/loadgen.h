// dropkv-loadgen's engine: drives a loopback dropkv-server over gRPC or over its
// OpenAI-compatible HTTP API (an address "http://HOST:PORT": streamed /v1/completions of the same
// token-id prompts) in a closed loop (N streams back to back) or an open loop (Poisson arrivals at
// R requests/s), and measures time to first token, inter-token latency and end-to-end latency per
// request, the same way for both. With --turns, each closed-loop stream runs multi-turn chats whose
// prompts extend the previous prompt and answer (a prefix cache's load), reported per turn too.
// No torch: it is a client.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv::loadgen {

// A length distribution: "fixed:N", "uniform:A:B" (inclusive) or "file:PATH" (one length a line,
// drawn uniformly).
struct LengthDist {
  std::string spec;
  std::vector<int64_t> values;  // fixed: {N}; file: the lengths
  int64_t lo = 0, hi = 0;       // uniform bounds
  bool uniform = false;
  int64_t Sample(std::mt19937_64& rng) const;
  int64_t Max() const;
};
absl::StatusOr<LengthDist> ParseLengthDist(const std::string& spec, const std::string& flag);

// `num_tokens` random prompt token ids in [3, vocab_size - 1] (0-2 are the usual special ids),
// appended to `out`.
void AppendRandomTokens(int64_t num_tokens, int32_t vocab_size, std::mt19937_64& rng,
                        std::vector<int32_t>* out);

// Multi-turn chat (--turns): the next turn's prompt is the previous turn's prompt, then exactly the
// token ids the server streamed for it, then `growth_len` new random ids (the next user message).
// Every earlier turn's prompt stays a token-for-token prefix, which is what a prefix cache reuses.
std::vector<int32_t> NextTurnPrompt(const std::vector<int32_t>& prev_prompt,
                                    const std::vector<int32_t>& prev_answer, int64_t growth_len,
                                    int32_t vocab_size, std::mt19937_64& rng);

// One compression setting of the mix: "none", "METHOD" or "METHOD:KEEP_RATIO" (e.g. dropkv:0.25).
struct CompressionChoice {
  std::string method;       // "" = the server's default
  double keep_ratio = 0.0;  // 0 = the server's default
};
absl::StatusOr<CompressionChoice> ParseCompressionChoice(const std::string& spec);

// True for 127.0.0.0/8, localhost, [::1] and unix: addresses (also after "http://"). Load goes
// nowhere else.
bool IsLoopbackAddress(const std::string& address);
// "http://HOST:PORT": the HTTP API instead of gRPC.
bool IsHttpAddress(const std::string& address);

struct LoadOptions {
  std::string address;
  int concurrency = 1;       // closed loop: streams; open loop: most requests in flight
  double rate = 0.0;         // > 0: open loop, Poisson arrivals per second
  double duration_s = 10.0;  // measured window
  double warmup_s = 0.0;     // requests started earlier are not measured
  int64_t max_requests = 0;  // > 0: stop after this many measured requests
  // Steady state: measure what happens inside the window (tokens streamed in it, requests that
  // complete in it) and cancel what is still in flight when it closes. The default measures the
  // requests that start in the window and waits for them, which needs windows several request
  // lifetimes long when requests are long (8K prompts at 256 streams: minutes).
  bool steady = false;
  double request_timeout_s = 60.0;
  LengthDist prompt_len;
  LengthDist output_len;
  std::vector<CompressionChoice> compression;  // drawn uniformly per request; empty = default
  // Closed loop only: > 1 makes each stream run conversations of `num_turns` requests, turn 1 of
  // --prompt-len fresh tokens and each later one NextTurnPrompt(.., turn_growth draw, ..); the
  // compression choice is drawn once per conversation.
  int num_turns = 1;
  LengthDist turn_growth;
  uint64_t seed = 1;
  bool progress = true;  // a progress line on stderr
};

// Nearest-rank percentiles of a sample (empty -> all zero).
struct Percentiles {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};
Percentiles Summarize(std::vector<double> values);

// One turn index's requests in a --turns run.
struct TurnStats {
  int64_t num_ok = 0;
  double mean_prompt_len = 0;
  // Of the prompt, tokens the server found in its prefix cache (usage.cached_prompt_tokens /
  // prompt_tokens_details.cached_tokens): the rest was prefilled.
  double mean_cached_prompt_tokens = 0;
  Percentiles ttft_ms;
};

struct RunResult {
  LoadOptions options;
  double measured_s = 0;         // window start -> last measured completion (steady: the window)
  int64_t cancelled_at_end = 0;  // steady: requests in flight when the window closed
  int64_t num_ok = 0;
  // gRPC status name or "HTTP <status>" -> count (measured requests)
  std::map<std::string, int64_t> errors;
  int64_t num_dropped = 0;  // open loop: arrivals with `concurrency` already in flight
  int64_t prompt_tokens = 0, output_tokens = 0;
  Percentiles ttft_ms, itl_ms, e2e_ms;
  std::vector<TurnStats> turns;  // --turns > 1: [k] = turn k + 1's measured OK requests
  // --turns: conversations restarted before their last turn because it would not fit the context
  int64_t num_conversations_cut = 0;
  std::map<std::string, double> metrics_delta;  // server /metrics counters, after - before
  double requests_per_s() const { return measured_s > 0 ? num_ok / measured_s : 0; }
  double output_tokens_per_s() const { return measured_s > 0 ? output_tokens / measured_s : 0; }
};

// Runs one load point. Errors: bad options, non-loopback address, server unreachable.
absl::StatusOr<RunResult> RunLoad(const LoadOptions& options);

// GETs a Prometheus text page from a loopback http:// URL and returns every sample's value keyed by
// "name{labels}".
absl::StatusOr<std::map<std::string, double>> FetchMetrics(const std::string& url);
// after - before for counters and histogram _count/_sum samples that changed.
std::map<std::string, double> MetricDeltas(const std::map<std::string, double>& before,
                                           const std::map<std::string, double>& after);

nlohmann::json ResultToJson(const RunResult& result);
// One Markdown table: one row per result.
std::string ResultsToMarkdown(const std::vector<RunResult>& results);
// --turns: one Markdown table, a row per (result, turn); "" when no result has turns.
std::string TurnsToMarkdown(const std::vector<RunResult>& results);

}  // namespace dropkv::loadgen
