#include "engine/engine.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "engine/common/status_macros.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/model/log.h"
#include "engine/model/model.h"
#include "engine/parallel/communicator.h"
#include "engine/parallel/group.h"
#include "engine/runner/demo_model.h"
#include "engine/runner/model_runner.h"
#include "engine/runner/tensor_parallel_runner.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {

namespace {

// A rank's runner (its shard under tensor parallelism) with the presses and the server's layer
// profile, checked against the model.
struct RankRunner {
  std::unique_ptr<ModelRunner> runner;
  std::shared_ptr<const compression::LayerProfile> profile;
};

absl::StatusOr<RankRunner> CreateRankRunner(const EngineOptions& options, const RunnerOptions& ro) {
  RankRunner rank;
  auto runner = ModelRunner::Create(ro);
  if (!runner.ok()) return runner.status();
  rank.runner = std::move(*runner);
  if (!options.compression_profile_path.empty()) {
    auto profile =
        compression::LoadProfileForModel(options.compression_profile_path, rank.runner->config());
    if (!profile.ok())
      return absl::InvalidArgumentError(absl::StrCat("compression.", profile.status().message()));
    rank.profile = std::make_shared<const compression::LayerProfile>(std::move(*profile));
  }
  rank.runner->SetKvSelectorFactory(
      [profile = rank.profile](const CompressionParams& params, const ModelConfig& config) {
        return compression::CreateKvSelectorWithProfile(params, config, profile.get());
      });
  return rank;
}

RunnerOptions ResolvedRunnerOptions(const EngineOptions& options) {
  RunnerOptions ro = options.runner;
  if (ro.device == "auto") ro.device = at::hasCUDA() ? "cuda:0" : "cpu";
  return ro;
}

// Connects rank `rank` to the group's two channels and points `ro` at its device and shard.
absl::Status JoinGroup(int32_t rank, int32_t size, const std::string& store_dir, RunnerOptions& ro,
                       std::unique_ptr<Communicator>& model_group,
                       std::unique_ptr<Communicator>& control_group) {
  ASSIGN_OR_RETURN(model_group, ConnectGroup(rank, size, ro.device, store_dir));
  ASSIGN_OR_RETURN(control_group, ConnectControlGroup(rank, size, store_dir));
  ASSIGN_OR_RETURN(ro.device, RankDevice(ro.device, rank));
  ro.communicator = model_group.get();
  return absl::OkStatus();
}

}  // namespace

Engine::Engine() = default;
Engine::~Engine() {
  if (scheduler_) scheduler_->Stop();
  scheduler_.reset();
  const bool ranks_told = runner_ != nullptr;
  runner_.reset();             // tells the other ranks to stop
  if (ranks_ && ranks_told) {  // else ranks_ kills them: they may wait for a first call
    if (absl::Status st = ranks_->Join(); !st.ok()) LogWarn(std::string(st.message()));
  }
}

absl::Status Engine::FollowRankZero(const EngineOptions& options, int32_t rank,
                                    const std::string& store_dir) {
  RunnerOptions ro = ResolvedRunnerOptions(options);
  std::unique_ptr<Communicator> model_group, control_group;
  RETURN_IF_ERROR(
      JoinGroup(rank, options.tensor_parallel_size, store_dir, ro, model_group, control_group));
  ASSIGN_OR_RETURN(RankRunner follower, CreateRankRunner(options, ro));
  return dropkv::FollowRankZero(*follower.runner, *control_group);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  std::unique_ptr<Engine> engine(new Engine());
  RunnerOptions ro = ResolvedRunnerOptions(options);
  const int32_t tp_size = options.tensor_parallel_size;
  if (tp_size < 1) return absl::InvalidArgumentError("tensor_parallel_size must be >= 1");
  if (tp_size > 1) {
    if (options.rank_command.empty())
      return absl::InvalidArgumentError("tensor_parallel_size > 1 needs the ranks' command");
    ASSIGN_OR_RETURN(engine->ranks_, RankProcesses::Start(options.rank_command, tp_size));
    RETURN_IF_ERROR(JoinGroup(0, tp_size, engine->ranks_->store_dir(), ro, engine->model_group_,
                              engine->control_group_));
  }
  ASSIGN_OR_RETURN(RankRunner leader, CreateRankRunner(options, ro));
  engine->profile_ = std::move(leader.profile);
  engine->runner_ =
      tp_size > 1 ? LeadTensorParallelRanks(std::move(leader.runner), engine->control_group_.get())
                  : std::move(leader.runner);

  auto tokenizer = Tokenizer::FromDirectory(ro.model_dir.empty() ? DemoModelDir(ro.demo_model_dir)
                                                                 : ro.model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  engine->tokenizer_ = std::move(*tokenizer);

  const ModelConfig& mc = engine->runner_->config();
  const BlockPool& pool = engine->runner_->pool();
  const int64_t elem_bytes =
      pool.key_cache().defined() ? static_cast<int64_t>(pool.key_cache().element_size()) : 4;
  SchedulerOptions so = options.scheduler;
  if (tp_size > 1 && so.prefix_cache) {
    so.prefix_cache = false;
    LogInfo("prefix cache off: tensor_parallel_size > 1 (only rank 0 would hold it)");
  }
  so.max_context_len = mc.max_position_embeddings;
  so.eos_token_ids = mc.eos_token_ids;
  for (int32_t id : engine->tokenizer_->eos_token_ids()) {
    if (std::find(so.eos_token_ids.begin(), so.eos_token_ids.end(), id) == so.eos_token_ids.end())
      so.eos_token_ids.push_back(id);
  }
  so.num_layers = mc.num_layers;
  so.compression_profile = engine->profile_;
  // Under tensor parallelism a rank holds 1/size of the query heads and its share of the KV
  // heads (copies where there are fewer KV heads than ranks): the front ends and the metrics
  // count the whole model and every rank's bytes.
  int32_t num_heads = mc.num_heads, num_kv_heads = mc.num_kv_heads;
  if (tp_size > 1 && engine->runner_->model() != nullptr) {
    const TensorParallelLayout& tp = engine->runner_->model()->tensor_parallel();
    num_heads *= tp.size;
    num_kv_heads = num_kv_heads * tp.size / tp.kv_replicas;
  }
  so.kv_bytes_per_token_per_layer = int64_t{2} * mc.kv_size() * elem_bytes * tp_size;
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
  info.num_heads = num_heads;
  info.num_kv_heads = num_kv_heads;
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
