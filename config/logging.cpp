// JSON lines: a small spdlog formatter writes {"ts","level","logger","msg"} with proper escaping.
// Structured records (LogRequest) reach it as a message that starts with kFieldsMarker followed by
// ready JSON fields, which the formatter splices into the object instead of quoting them.
#include "config/logging.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>

namespace dropkv {
namespace {

constexpr char kFieldsMarker = '\x1e';  // ASCII record separator: never in normal messages
std::atomic<LogFormat> g_format{LogFormat::kText};

std::string IsoTimestamp(std::chrono::system_clock::time_point tp) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(tp.time_since_epoch());
  const std::time_t secs = static_cast<std::time_t>(ms.count() / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof(buf) - n, ".%03dZ", static_cast<int>(ms.count() % 1000));
  return buf;
}

class JsonLineFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    std::string_view text(msg.payload.data(), msg.payload.size());
    nlohmann::json head = {
        {"ts", IsoTimestamp(msg.time)},
        {"level", std::string(spdlog::level::to_string_view(msg.level).data(),
                              spdlog::level::to_string_view(msg.level).size())},
        {"logger", std::string(msg.logger_name.data(), msg.logger_name.size())},
    };
    std::string line;
    if (!text.empty() && text.front() == kFieldsMarker) {
      // head without its closing brace, then the record's own fields.
      line = head.dump();
      line.pop_back();
      line += ',';
      line.append(text.substr(1));
      line += '}';
    } else {
      head["msg"] = std::string(text);
      // Invalid UTF-8 in a message must not throw out of the logger: replace it.
      line = head.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    line += '\n';
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonLineFormatter>();
  }
};

std::string Ms(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

}  // namespace

absl::Status SetUpLogging(LogFormat format, const std::string& level,
                          std::shared_ptr<spdlog::sinks::sink> sink) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  // from_str maps unknown names to off: accept "off" only when asked for.
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        "log_level: expected one of "
        "trace|debug|info|warn|error|critical|off, got '" +
        level + "'");
  }
  if (sink == nullptr) sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("dropkv", std::move(sink));
  if (format == LogFormat::kJson) {
    logger->set_formatter(std::make_unique<JsonLineFormatter>());
  } else {
    logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%-5l%$ [%n] %v");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::warn);
  g_format.store(format);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

std::string FormatRequestLog(const RequestLogRecord& r, LogFormat format, bool log_prompts) {
  if (format == LogFormat::kJson) {
    nlohmann::json j = {
        {"msg", "request"},
        {"request_id", r.request_id},
        {"status", r.status},
        {"finish_reason", r.finish_reason},
        {"prompt_tokens", r.num_prompt_tokens},
        {"generated_tokens", r.num_generated_tokens},
        {"queue_ms", r.queue_ms},
        {"ttft_ms", r.ttft_ms.has_value() ? nlohmann::json(*r.ttft_ms) : nlohmann::json()},
        {"duration_ms", r.duration_ms},
        {"kept_ratio", r.kept_ratio.has_value() ? nlohmann::json(*r.kept_ratio) : nlohmann::json()},
    };
    if (log_prompts) j["prompt"] = r.prompt;
    std::string obj = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return obj.substr(1, obj.size() - 2);  // fields only; the formatter adds the braces
  }
  std::string line = "request id=" + r.request_id + " status=" + r.status;
  if (!r.finish_reason.empty()) line += " finish=" + r.finish_reason;
  line += " prompt_tokens=" + std::to_string(r.num_prompt_tokens) +
          " generated_tokens=" + std::to_string(r.num_generated_tokens) +
          " queue_ms=" + Ms(r.queue_ms) +
          " ttft_ms=" + (r.ttft_ms.has_value() ? Ms(*r.ttft_ms) : std::string("-")) +
          " duration_ms=" + Ms(r.duration_ms) + " kept_ratio=";
  if (r.kept_ratio.has_value()) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.4f", *r.kept_ratio);
    line += buf;
  } else {
    line += "-";
  }
  if (log_prompts) {
    // Quoted and escaped so one request stays one line.
    nlohmann::json quoted = r.prompt;
    line += " prompt=" + quoted.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  return line;
}

void LogRequest(const RequestLogRecord& record, bool log_prompts) {
  const LogFormat format = g_format.load();
  std::string text = FormatRequestLog(record, format, log_prompts);
  if (format == LogFormat::kJson) text.insert(text.begin(), kFieldsMarker);
  spdlog::info("{}", text);
}

}  // namespace dropkv
