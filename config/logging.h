// Logging set-up: spdlog's default logger writes human-readable lines by default, or one
// JSON object per line (--log-format json) for log collectors. LogRequest writes the one line per
// finished request; prompt text only when log_prompts is on (prompts may hold private data).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "config/server_config.h"

namespace spdlog::sinks {
class sink;
}

namespace dropkv {

// Replaces spdlog's default logger: stderr (or `sink`, for tests), format and level as given.
// INVALID_ARGUMENT naming log_level for an unknown level. Call once at start-up.
absl::Status SetUpLogging(LogFormat format, const std::string& level,
                          std::shared_ptr<spdlog::sinks::sink> sink = nullptr);
inline absl::Status SetUpLogging(const ServerConfig& config) {
  return SetUpLogging(config.log_format, config.log_level);
}

// What the request log line says about one finished request.
struct RequestLogRecord {
  std::string request_id;
  std::string status = "ok";  // ServerMetrics::StatusLabel style: ok, cancelled, ...
  std::string finish_reason;  // stop | length | cancelled | error | "" (not started)
  int64_t num_prompt_tokens = 0;
  int64_t num_generated_tokens = 0;
  double queue_ms = 0;               // arrival -> admission
  std::optional<double> ttft_ms;     // arrival -> first token; none if no token came
  double duration_ms = 0;            // arrival -> last message
  std::optional<double> kept_ratio;  // KV entries kept / prompt entries; none = no compression
  std::string prompt;                // logged only when log_prompts is true
};

// The line's text without logger decorations: "request id=... status=ok ..." in text mode, a JSON
// object's fields in JSON mode. Exposed for tests.
std::string FormatRequestLog(const RequestLogRecord& record, LogFormat format, bool log_prompts);

// Writes the record at info level through the default logger, in the configured format.
void LogRequest(const RequestLogRecord& record, bool log_prompts);

}  // namespace dropkv
