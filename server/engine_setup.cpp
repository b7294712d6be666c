#include "server/engine_setup.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "config/server_config.h"
#include "engine/compression/compression.h"
#include "server/compression_message.h"

namespace dropkv {

std::string ServedModelName(const ServerConfig& config) {
  if (!config.served_model_name.empty()) return config.served_model_name;
  if (config.demo_model) return "demo";
  std::string dir = config.model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

EngineOptions EngineOptionsFor(const ServerConfig& config,
                               const std::vector<std::string>& rank_command) {
  EngineOptions eo;
  eo.tensor_parallel_size = config.tensor_parallel_size;
  eo.rank_command = rank_command;
  RunnerOptions& ro = eo.runner;
  ro.model_dir = config.demo_model ? "" : config.model_dir;
  ro.demo_model_dir = config.demo_model_dir;
  ro.device = config.device;
  ro.dtype = config.dtype;
  ro.quantization = config.quantization;
  ro.kv_cache_dtype = config.kv_cache_dtype;
  ro.block_size = config.block_size;
  ro.kv_cache_bytes = config.kv_memory_bytes;
  ro.num_kv_blocks = config.kv_blocks;
  ro.random_weights = config.random_weights;
  eo.compression_profile_path = config.compression.profile_path;
  SchedulerOptions& so = eo.scheduler;
  so.max_batch = config.max_batch;
  so.max_prefill_tokens_per_step = config.prefill_tokens_per_step;
  so.prefix_cache = config.prefix_cache;
  so.prefix_cache_salt = absl::StrCat(
      config.demo_model ? "demo" : config.model_dir, "|", config.dtype, "|", config.quantization,
      "|", config.kv_cache_dtype, "|", config.random_weights ? "random" : "");
  so.max_waiting_requests = config.max_queue_requests;
  so.max_waiting_prompt_tokens =
      config.max_queue_prompt_tokens > 0 ? config.max_queue_prompt_tokens : INT64_MAX;
  return eo;
}

absl::StatusOr<ServedEngine> CreateServedEngine(const ServerConfig& config,
                                                const std::vector<std::string>& rank_command) {
  if (!config.demo_model &&
      !std::filesystem::exists(std::filesystem::path(config.model_dir) / "config.json")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model: no Hugging Face model folder at '", config.model_dir,
        "' (the default model is installed by scripts/setup.sh; or pass --model DIR, or "
        "--demo-model for the built-in random-weight model)"));
  }
  ServedEngine served;
  auto engine = Engine::Create(EngineOptionsFor(config, rank_command));
  if (!engine.ok()) return engine.status();
  served.engine = std::move(*engine);
  const EngineInfo& mc = served.engine->info();

  ValidationLimits& limits = served.limits;
  limits.vocab_size = static_cast<int32_t>(mc.vocab_size);
  limits.max_context_len = mc.max_context_len;
  limits.max_new_tokens_limit = config.max_new_tokens_limit;
  limits.max_prompt_tokens = config.max_prompt_tokens;
  limits.max_request_bytes = config.max_message_bytes;
  // Compression's depth checks (explicit lists, profiles) count the layers it acts on.
  limits.num_layers = mc.num_global_layers;
  limits.prompt_logprobs = config.tensor_parallel_size <= 1;  // see ValidationLimits
  limits.default_compression = config.compression;

  v1::ModelInfo& info = served.model_info;
  info.set_model_name(ServedModelName(config));
  info.set_family(mc.model_type);
  info.set_num_layers(mc.num_layers);
  info.set_num_attention_heads(mc.num_heads);
  info.set_num_kv_heads(mc.num_kv_heads);
  info.set_head_dim(mc.head_dim);
  info.set_vocab_size(static_cast<int32_t>(mc.vocab_size));
  info.set_max_context_len(mc.max_context_len);
  info.set_dtype(mc.dtype);
  info.set_device(mc.device);
  info.set_block_size(config.block_size);
  info.set_max_new_tokens_limit(config.max_new_tokens_limit);
  CompressionToMessage(config.compression, info.mutable_default_compression());
  for (const auto& [method, name] : kScoreMethodNames)
    info.add_supported_methods(std::string(name));
  for (const auto& [allocator, name] : kBudgetAllocatorNames)
    info.add_supported_allocators(std::string(name));
  return served;
}

}  // namespace dropkv
