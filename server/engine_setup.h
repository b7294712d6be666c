// The engine a server runs (engine/engine.h), built from the server config, with what both front
// ends answer about it (ModelInfo) and validate requests against (ValidationLimits). Torch-free.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dropkv/v1/inference.pb.h"
#include "engine/engine.h"
#include "server/validation.h"

namespace dropkv {

struct ServerConfig;

struct ServedEngine {
  std::unique_ptr<Engine> engine;
  v1::ModelInfo model_info;
  ValidationLimits limits;
};

// The engine's options from the server config. With tensor_parallel_size > 1, rank 0 starts the
// other ranks as `rank_command` (this executable and its arguments).
EngineOptions EngineOptionsFor(const ServerConfig& config,
                               const std::vector<std::string>& rank_command = {});

absl::StatusOr<ServedEngine> CreateServedEngine(const ServerConfig& config,
                                                const std::vector<std::string>& rank_command = {});

// The model's name in both APIs and the metrics' labels: served_model_name, else the model
// folder's base name ("demo" for the demo model). Never a server path.
std::string ServedModelName(const ServerConfig& config);

}  // namespace dropkv
