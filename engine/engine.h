// The engine as a front end sees it. Built from plain options, it assembles the model, the
// tokenizer, the KV block pool, the runner (with the compression presses) and the scheduler, and
// answers what a server needs to know about them. Torch-free: the server includes this header and
// the scheduler's, never the runner's or the pool's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/runner/runner_options.h"
#include "engine/scheduler/scheduler.h"

namespace dropkv {

class Communicator;
class ModelRunner;
class RankProcesses;
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
  // Tensor parallelism: the model split over this many ranks, one process each (on
  // runner.device's GPU and the next ones, or on the CPU over Gloo). This engine is rank 0: it
  // starts the others as `rank_command` (this executable and its arguments) plus
  // "--tp-rank R --tp-store DIR", which then call Engine::FollowRankZero. The prefix cache is
  // off (the other ranks keep none).
  int32_t tensor_parallel_size = 1;
  std::vector<std::string> rank_command;
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

  // Rank `rank` (>= 1) of a tensor-parallel engine, started by rank 0's Create with the group's
  // rendezvous folder: loads this rank's shard and makes rank 0's runner calls on it until rank 0
  // stops the group (OK), or fails (the rank then exits, and rank 0 with it).
  static absl::Status FollowRankZero(const EngineOptions& options, int32_t rank,
                                     const std::string& store_dir);

  const EngineInfo& info() const { return info_; }
  Scheduler& scheduler() { return *scheduler_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }

  // One short greedy generation through the scheduler on the calling thread, before the engine
  // thread starts: the first forward pays the allocator and kernel start-up, not a client.
  absl::Status WarmUp();

 private:
  Engine();

  // Tensor parallelism: the other ranks' processes and this rank's two channels to them (the
  // model's collectives; rank 0's runner calls). Declared first: they outlive the runner.
  std::unique_ptr<RankProcesses> ranks_;
  std::unique_ptr<Communicator> model_group_;
  std::unique_ptr<Communicator> control_group_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Scheduler> scheduler_;
  std::shared_ptr<const compression::LayerProfile> profile_;
  EngineInfo info_;
};

}  // namespace dropkv
