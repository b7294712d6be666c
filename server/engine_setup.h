// Builds the engine side of dropkv-server from the config: the ModelRunner (model + KV pool, with
// the compression selector factory), the Tokenizer, the Scheduler, and what the service answers
// about the model. The only server TU that includes LibTorch headers; main() stays torch-free.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dropkv/v1/inference.pb.h"
#include "server/validation.h"

namespace dropkv {

class ModelRunner;
class Tokenizer;
class Scheduler;
struct ServerConfig;

struct Engine {
  Engine();
  ~Engine();
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Scheduler> scheduler;
  v1::ModelInfo model_info;
  ValidationLimits limits;
};

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const ServerConfig& config);

// Runs one short greedy generation through the scheduler on the calling thread (before the
// engine thread starts): the first forward pays the allocator/kernel start-up, not a client.
absl::Status WarmUp(Engine& engine);

}  // namespace dropkv
