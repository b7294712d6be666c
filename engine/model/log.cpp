#include "engine/model/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace dropkv {
void LogInfo(const std::string& message) {
  spdlog::info("{}", message);
}
void LogWarn(const std::string& message) {
  spdlog::warn("{}", message);
}
void LogToStderr() {
  spdlog::set_default_logger(spdlog::stderr_color_mt("dropkv"));
}
}  // namespace dropkv
