#include "server/engine_setup.h"

#include <filesystem>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "config/server_config.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/demo_model.h"
#include "engine/runner/model_runner.h"
#include "engine/scheduler/scheduler.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {
namespace {

std::string FamilyName(const ModelConfig& c) {
  return c.model_type;
}

}  // namespace

Engine::Engine() = default;
Engine::~Engine() {
  if (scheduler) scheduler->Stop();
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(const ServerConfig& config) {
  auto engine = std::make_unique<Engine>();
  if (!config.demo_model &&
      !std::filesystem::exists(std::filesystem::path(config.model_dir) / "config.json")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model: no Hugging Face model folder at '", config.model_dir,
        "' (the default model is installed by scripts/setup.sh; or pass --model DIR, or "
        "--demo-model for the built-in random-weight model)"));
  }
  RunnerOptions ro;
  ro.model_dir = config.demo_model ? "" : config.model_dir;
  ro.device = config.device == "auto" ? (at::hasCUDA() ? "cuda:0" : "cpu") : config.device;
  ro.dtype = config.dtype;
  ro.block_size = config.block_size;
  ro.kv_cache_bytes = config.kv_memory_bytes;
  ro.num_kv_blocks = config.kv_blocks;
  ro.random_weights = config.random_weights;
  auto runner = ModelRunner::Create(ro);
  if (!runner.ok()) return runner.status();
  engine->runner = std::move(*runner);
  engine->runner->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);

  const std::string dir = config.demo_model ? DefaultDemoModelDir() : config.model_dir;
  auto tokenizer = Tokenizer::FromDirectory(dir);
  if (!tokenizer.ok()) return tokenizer.status();
  engine->tokenizer = std::move(*tokenizer);

  const ModelConfig& mc = engine->runner->config();
  const int64_t elem_bytes =
      engine->runner->pool().key_cache().defined()
          ? static_cast<int64_t>(engine->runner->pool().key_cache().element_size())
          : 4;
  SchedulerOptions so;
  so.max_batch = config.max_batch;
  so.max_prefill_tokens_per_step = config.prefill_tokens_per_step;
  so.max_waiting_requests = config.max_queue_requests;
  so.max_waiting_prompt_tokens =
      config.max_queue_prompt_tokens > 0 ? config.max_queue_prompt_tokens : INT64_MAX;
  so.max_context_len = mc.max_position_embeddings;
  so.eos_token_ids = mc.eos_token_ids;
  for (int32_t id : engine->tokenizer->eos_token_ids())
    if (std::find(so.eos_token_ids.begin(), so.eos_token_ids.end(), id) == so.eos_token_ids.end())
      so.eos_token_ids.push_back(id);
  so.num_layers = mc.num_layers;
  so.kv_bytes_per_token_per_layer = 2 * mc.kv_size() * elem_bytes;
  ModelRunner* r = engine->runner.get();
  engine->scheduler = std::make_unique<Scheduler>(
      *r, engine->tokenizer.get(),
      [r] {
        return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
      },
      so);

  ValidationLimits& limits = engine->limits;
  limits.vocab_size = static_cast<int32_t>(mc.vocab_size);
  limits.max_context_len = mc.max_position_embeddings;
  limits.max_new_tokens_limit = config.max_new_tokens_limit;
  limits.max_prompt_tokens = config.max_prompt_tokens;
  limits.max_request_bytes = config.max_message_bytes;
  // Compression's depth checks (explicit lists, profiles) count the layers it acts on.
  limits.num_layers = mc.num_global_layers();
  limits.default_compression = config.compression;

  v1::ModelInfo& info = engine->model_info;
  info.set_model_name(config.demo_model ? "demo" : config.model_dir);
  info.set_family(FamilyName(mc));
  info.set_num_layers(mc.num_layers);
  info.set_num_attention_heads(mc.num_heads);
  info.set_num_kv_heads(mc.num_kv_heads);
  info.set_head_dim(mc.head_dim);
  info.set_vocab_size(static_cast<int32_t>(mc.vocab_size));
  info.set_max_context_len(mc.max_position_embeddings);
  info.set_dtype(engine->runner->pool().key_cache().defined()
                     ? std::string(c10::toString(engine->runner->pool().key_cache().scalar_type()))
                     : config.dtype);
  info.set_device(ro.device);
  info.set_block_size(config.block_size);
  info.set_max_new_tokens_limit(config.max_new_tokens_limit);
  v1::CompressionSettings* dc = info.mutable_default_compression();
  const CompressionParams& c = config.compression;
  dc->set_method(std::string(compression::ScoreMethodName(c.method)));
  if (c.budget_tokens)
    dc->set_budget_tokens(*c.budget_tokens);
  else
    dc->set_keep_ratio(c.keep_ratio);
  dc->set_allocator(std::string(compression::BudgetAllocatorName(c.allocator)));
  dc->set_window(c.window);
  dc->set_pooling(std::string(compression::PoolingTypeName(c.pooling)));
  dc->set_pooling_kernel(c.pooling_kernel);
  dc->set_chunk_policy(std::string(compression::ChunkPolicyName(c.chunk_policy)));
  dc->set_chunk_size(c.chunk_size);
  for (const char* m : {"none", "dropkv", "snapkv", "h2o", "h2o_vl1", "h2o_vl2", "streaming_llm",
                        "knorm", "random"})
    info.add_supported_methods(m);
  for (const char* a : {"uniform", "pyramid", "mlp", "mga", "mlma2", "mlma4", "mlma6", "explicit"})
    info.add_supported_allocators(a);
  return engine;
}

absl::Status WarmUp(Engine& engine) {
  GenerationRequest warm;
  warm.request_id = "warm-up";
  const auto bos = engine.tokenizer->bos_token_id();
  warm.prompt_ids = {bos.value_or(0), bos.value_or(0)};
  warm.sampling.max_new_tokens = 2;
  warm.sampling.ignore_eos = true;
  auto channel = std::make_shared<RequestChannel>();
  absl::Status st = engine.scheduler->Submit(warm, channel);
  if (!st.ok()) return st;
  for (int step = 0; step < 100 && engine.scheduler->HasWork(); ++step) engine.scheduler->Step();
  while (auto event = channel->Pop()) {
    if (event->finished && event->finish_reason == FinishReason::kError)
      return absl::InternalError(absl::StrCat("warm-up failed: ", event->error.message()));
  }
  return absl::OkStatus();
}

}  // namespace dropkv
