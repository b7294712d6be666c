#include "engine/engine.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/demo_model.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {

Engine::Engine() = default;
Engine::~Engine() {
  if (scheduler_) scheduler_->Stop();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  std::unique_ptr<Engine> engine(new Engine());
  RunnerOptions ro = options.runner;
  if (ro.device == "auto") ro.device = at::hasCUDA() ? "cuda:0" : "cpu";
  auto runner = ModelRunner::Create(ro);
  if (!runner.ok()) return runner.status();
  engine->runner_ = std::move(*runner);
  if (!options.compression_profile_path.empty()) {
    auto profile = compression::LoadProfileForModel(options.compression_profile_path,
                                                    engine->runner_->config());
    if (!profile.ok())
      return absl::InvalidArgumentError(absl::StrCat("compression.", profile.status().message()));
    engine->profile_ = std::make_shared<const compression::LayerProfile>(std::move(*profile));
  }
  engine->runner_->SetKvSelectorFactory(
      [profile = engine->profile_](const CompressionParams& params, const ModelConfig& config) {
        return compression::CreateKvSelectorWithProfile(params, config, profile.get());
      });

  auto tokenizer = Tokenizer::FromDirectory(ro.model_dir.empty() ? DemoModelDir(ro.demo_model_dir)
                                                                 : ro.model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  engine->tokenizer_ = std::move(*tokenizer);

  const ModelConfig& mc = engine->runner_->config();
  const BlockPool& pool = engine->runner_->pool();
  const int64_t elem_bytes =
      pool.key_cache().defined() ? static_cast<int64_t>(pool.key_cache().element_size()) : 4;
  SchedulerOptions so = options.scheduler;
  so.max_context_len = mc.max_position_embeddings;
  so.eos_token_ids = mc.eos_token_ids;
  for (int32_t id : engine->tokenizer_->eos_token_ids()) {
    if (std::find(so.eos_token_ids.begin(), so.eos_token_ids.end(), id) == so.eos_token_ids.end())
      so.eos_token_ids.push_back(id);
  }
  so.num_layers = mc.num_layers;
  so.compression_profile = engine->profile_;
  so.kv_bytes_per_token_per_layer = 2 * mc.kv_size() * elem_bytes;
  ModelRunner* r = engine->runner_.get();
  engine->scheduler_ = std::make_unique<Scheduler>(
      *r, engine->tokenizer_.get(),
      [r] {
        // The runner's own blocks are neither free nor used: reported as not in the pool.
        return KvBlockCounts{r->pool().num_blocks() - r->num_reserved_blocks(),
                             r->pool().num_free_blocks()};
      },
      so);

  EngineInfo& info = engine->info_;
  info.model_type = mc.model_type;
  info.num_layers = mc.num_layers;
  info.num_global_layers = mc.num_global_layers();
  info.num_heads = mc.num_heads;
  info.num_kv_heads = mc.num_kv_heads;
  info.head_dim = mc.head_dim;
  info.sliding_window = mc.sliding_window;
  info.vocab_size = mc.vocab_size;
  info.max_context_len = mc.max_position_embeddings;
  info.dtype = pool.key_cache().defined()
                   ? std::string(c10::toString(pool.key_cache().scalar_type()))
                   : ro.dtype;
  info.device = ro.device;
  info.block_size = ro.block_size;
  return engine;
}

absl::Status Engine::WarmUp() {
  GenerationRequest warm;
  warm.request_id = "warm-up";
  const auto bos = tokenizer_->bos_token_id();
  warm.prompt_ids = {bos.value_or(0), bos.value_or(0)};
  warm.sampling.max_new_tokens = 2;
  warm.sampling.ignore_eos = true;
  auto channel = std::make_shared<RequestChannel>();
  absl::Status st = scheduler_->Submit(warm, channel);
  if (!st.ok()) return st;
  for (int step = 0; step < 100 && scheduler_->HasWork(); ++step) scheduler_->Step();
  while (auto event = channel->Pop()) {
    if (event->finished && event->finish_reason == FinishReason::kError)
      return absl::InternalError(absl::StrCat("warm-up failed: ", event->error.message()));
  }
  return absl::OkStatus();
}

}  // namespace dropkv
