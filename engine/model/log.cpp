#include "engine/model/log.h"

#include <spdlog/spdlog.h>

namespace dropkv {
void LogInfo(const std::string& message) {
  spdlog::info("{}", message);
}
void LogWarn(const std::string& message) {
  spdlog::warn("{}", message);
}
}  // namespace dropkv
