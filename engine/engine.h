// The engine as a front end sees it. Built from plain options, it assembles the model, the
// tokenizer, the KV block pool, the runner (with the compression presses) and the scheduler, and
// answers what a server needs to know about them. Torch-free: the server includes this header and
// the scheduler's, never the runner's or the pool's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/runner/runner_options.h"
#include "engine/scheduler/scheduler.h"

namespace dropkv {

class ModelRunner;
class Tokenizer;
namespace compression {
struct LayerProfile;
}

struct EngineOptions {
  // runner.model_dir empty: the built-in demo model. runner.device "auto": cuda:0 when a GPU is
  // present, else cpu.
  RunnerOptions runner;
  // Batching and queue limits. The engine fills in the model's part: its EOS ids (config and
  // tokenizer), context length, layer count and K/V bytes per token.
  SchedulerOptions scheduler;
  // The server's layer profile for the MGA / MLMA allocators (compression.profile_path): read and
  // checked against the model once here, so a bad file stops the start-up and no request reads it.
  std::string compression_profile_path;
};

// The model and the cache, as the front ends report and validate them.
struct EngineInfo {
  std::string model_type;  // config.json's ("llama", "gemma3_text", ...)
  int32_t num_layers = 0;
  int32_t num_global_layers = 0;  // the layers compression acts on (not sliding-window ones)
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t sliding_window = 0;  // 0: no sliding-window layers
  int64_t vocab_size = 0;
  int64_t max_context_len = 0;
  std::string dtype;   // of the KV cache, as LibTorch names it ("Float", "BFloat16")
  std::string device;  // resolved: "cpu", "cuda:0"
  int32_t block_size = 0;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  const EngineInfo& info() const { return info_; }
  Scheduler& scheduler() { return *scheduler_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }

  // One short greedy generation through the scheduler on the calling thread, before the engine
  // thread starts: the first forward pays the allocator and kernel start-up, not a client.
  absl::Status WarmUp();

 private:
  Engine();

  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Scheduler> scheduler_;
  std::shared_ptr<const compression::LayerProfile> profile_;
  EngineInfo info_;
};

}  // namespace dropkv
