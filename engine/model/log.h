// spdlog cannot be included next to ATen (torch ships its own, older fmt headers that shadow the
// system fmt spdlog is built against), so torch TUs log through these torch-free wrappers.
#pragma once

#include <string>

namespace dropkv {
void LogInfo(const std::string& message);
void LogWarn(const std::string& message);
// Sends the default logger to stderr (tools whose stdout is their output).
void LogToStderr();
}  // namespace dropkv
