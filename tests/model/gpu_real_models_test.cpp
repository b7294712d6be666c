// The two trained models (SmolLM2-135M-Instruct, Gemma-3-270M) on CUDA against HF transformers on
// the same GPU, bf16 and fp32, on an 8K-token prompt (tasks.py niah_number, raw; SmolLM2 to its
// 8,192-position limit, Gemma 3 far past its 512-token sliding window), the full cache and DropKV
// at keep 10%, through the path the server takes: the engine's runner with the engine's
// selector factory, under the Scheduler (chunked prefill, compression plan, sampling, events),
// 32 greedy tokens (EOS ignored).
//
// The compressed reference: HF prefills the whole prompt with its own cache, then every layer
// compression acts on keeps exactly the entries (per KV head) our press kept, recorded from the
// selector the scheduler's prefill called (its kept positions), and HF decodes from that cache
// with positions continuing from the prompt's length. The first token comes from the prefill
// logits in both, so what is compared is the decode from the same kept set, not the choice of
// the set (tests/compression's kvpress and fp64 parity tests check that choice).
//
// Pass: the same 32 tokens, or the same tokens up to a step where HF's own logits hold a near
// tie between its token and ours (margin within a relative tolerance of the dtype's rounding:
// then either is greedy). The log-probabilities of the agreed tokens are compared too. The
// scheduler's tokens are also checked against Engine::Create's own (the server's assembly).
//
// Label gpu. Skips without a CUDA device, or without the models: DROPKV_GPU_MODELS names the
// folder holding smollm2-135m-instruct/ and gemma-3-270m/ (scripts/gpu_stage_models.sh stages
// them on the GPU machine in /tmp/dropkv-stage/models; default: DROPKV_MODELS, set-up's).
// A check of the test itself on a CPU: DROPKV_REAL_MODELS_DEVICE=cpu (fp32 cases only) and
// DROPKV_REAL_MODELS_LENGTH=N (prompts of N tokens; the CPU takes minutes at 8K).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "allocator/block_pool.h"
#include "engine/compression/kv_selector.h"
#include "engine/compression/press.h"
#include "engine/engine.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/scheduler/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int32_t kNumNew = 32;
constexpr double kKeep = 0.1;

fs::path StagedModels() {
  return testing::EnvOr("DROPKV_GPU_MODELS", testing::ModelsDir().string());
}
std::string Device() { return testing::EnvOr("DROPKV_REAL_MODELS_DEVICE", "cuda"); }

// The press the factory made, recording the positions it kept in each layer it compacted.
class RecordingSelector : public KvSelector {
 public:
  RecordingSelector(std::unique_ptr<KvSelector> inner, std::map<int32_t, at::Tensor>* kept,
                    std::map<int32_t, int>* count)
      : inner_(std::move(inner)), kept_(kept), count_(count) {}
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    auto sel = inner_->Select(view);
    if (sel.ok() && sel->has_value()) {
      (*kept_)[view.layer_idx] = view.positions.gather(1, **sel).to(at::kCPU).contiguous();
      ++(*count_)[view.layer_idx];
    }
    return sel;
  }
  int64_t num_attention_rows() const override { return inner_->num_attention_rows(); }
  absl::StatusOr<std::vector<int64_t>> Budgets(int64_t logical_len) const override {
    return inner_->Budgets(logical_len);
  }

 private:
  std::unique_ptr<KvSelector> inner_;
  std::map<int32_t, at::Tensor>* kept_;
  std::map<int32_t, int>* count_;
};

struct Generated {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::string error;
};

RunnerOptions Options(const std::string& model, const std::string& dtype) {
  RunnerOptions o;
  o.model_dir = (StagedModels() / model).string();
  o.device = Device();
  o.dtype = dtype;
  o.kv_cache_bytes = int64_t{2} << 30;  // 8K tokens take < 0.4 GiB; HF runs after us
  return o;
}

GenerationRequest Request(const std::vector<int32_t>& prompt, const CompressionParams& params) {
  GenerationRequest r;
  r.request_id = "parity";
  r.prompt_ids = prompt;
  r.sampling.max_new_tokens = kNumNew;
  r.sampling.ignore_eos = true;
  r.sampling.return_logprobs = true;
  r.compression = params;
  return r;
}

// Steps `scheduler` on this thread until the request is done.
Generated Drain(Scheduler& scheduler, GenerationRequest request) {
  Generated g;
  auto channel = std::make_shared<RequestChannel>();
  if (auto st = scheduler.Submit(std::move(request), channel); !st.ok()) {
    g.error = std::string(st.message());
    return g;
  }
  for (int step = 0; step < 100000 && scheduler.HasWork(); ++step) scheduler.Step();
  while (auto e = channel->Pop()) {
    g.tokens.insert(g.tokens.end(), e->token_ids.begin(), e->token_ids.end());
    for (const auto& lp : e->logprobs) g.logprobs.push_back(lp.logprob);
    if (e->finished && e->finish_reason == FinishReason::kError) g.error = e->error.ToString();
  }
  return g;
}

// The engine's assembly (engine/engine.cpp: runner, the presses' factory, tokenizer, scheduler
// options from the model), the factory's presses wrapped to record what they keep.
Generated RunRecorded(const RunnerOptions& ro, const std::vector<int32_t>& prompt,
                      const CompressionParams& params, std::map<int32_t, at::Tensor>* kept,
                      std::map<int32_t, int>* count, ModelConfig* config) {
  Generated g;
  auto runner_or = ModelRunner::Create(ro);
  if (!runner_or.ok()) return g.error = runner_or.status().ToString(), g;
  ModelRunner& runner = **runner_or;
  runner.SetKvSelectorFactory([kept, count](const CompressionParams& p, const ModelConfig& c)
                                  -> absl::StatusOr<std::unique_ptr<KvSelector>> {
    auto inner = compression::CreateKvSelectorWithProfile(p, c, nullptr);
    if (!inner.ok()) return inner.status();
    return std::make_unique<RecordingSelector>(std::move(*inner), kept, count);
  });
  auto tokenizer = Tokenizer::FromDirectory(ro.model_dir);
  if (!tokenizer.ok()) return g.error = tokenizer.status().ToString(), g;
  const ModelConfig& mc = runner.config();
  *config = mc;
  SchedulerOptions so;
  so.max_context_len = mc.max_position_embeddings;
  so.eos_token_ids = mc.eos_token_ids;
  for (int32_t id : (*tokenizer)->eos_token_ids()) {
    if (std::find(so.eos_token_ids.begin(), so.eos_token_ids.end(), id) == so.eos_token_ids.end())
      so.eos_token_ids.push_back(id);
  }
  so.num_layers = mc.num_layers;
  so.kv_bytes_per_token_per_layer =
      int64_t{2} * mc.kv_size() * static_cast<int64_t>(runner.pool().key_cache().element_size());
  ModelRunner* r = &runner;
  Scheduler scheduler(
      runner, tokenizer->get(),
      [r] {
        return KvBlockCounts{r->pool().num_blocks() - r->num_reserved_blocks(),
                             r->pool().num_free_blocks()};
      },
      so);
  return Drain(scheduler, Request(prompt, params));
}

// Engine::Create's engine, as the server makes it.
Generated RunEngine(const RunnerOptions& ro, const std::vector<int32_t>& prompt,
                    const CompressionParams& params) {
  EngineOptions eo;
  eo.runner = ro;
  auto engine = Engine::Create(eo);
  if (!engine.ok()) return Generated{{}, {}, engine.status().ToString()};
  return Drain((*engine)->scheduler(), Request(prompt, params));
}

// tasks.py's niah_number prompt of `length` tokens (raw format, seed 0), once per build tree.
std::vector<int32_t> Prompt(const std::string& model, int64_t length) {
  const fs::path out = testing::ScratchDir("gpu_real_models") /
                       (model + "_niah_number_" + std::to_string(length) + ".jsonl");
  if (!fs::exists(out)) {
    const std::string cmd = testing::ReferencePython() + " " +
                            (testing::SourceDir() / "bench/quality/tasks.py").string() +
                            " --model " + (StagedModels() / model).string() +
                            " --lengths " + std::to_string(length) +
                            " --num 1 --tasks niah_number --format raw --seed 0 --out " +
                            out.string() + ".tmp && mv " + out.string() + ".tmp " + out.string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  std::ifstream in(out);
  std::string line;
  EXPECT_TRUE(in.good() && std::getline(in, line)) << out;
  return line.empty() ? std::vector<int32_t>{}
                      : json::parse(line)["input_ids"].get<std::vector<int32_t>>();
}

struct Param {
  const char* model;
  const char* dtype;
  int64_t length;  // prompt tokens at most (SmolLM2: 8,192 positions, prompt + 32 generated)
};

class GpuRealModelTest : public ::testing::TestWithParam<Param> {};

TEST_P(GpuRealModelTest, GreedyMatchesHfOnTheSameGpuFullAndDropKv) {
  const Param& param = GetParam();
  if (Device() == "cuda" && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (Device() == "cpu" && std::string(param.dtype) != "float32") GTEST_SKIP() << "cpu: fp32 only";
  const fs::path dir = StagedModels() / param.model;
  if (!fs::exists(dir / "config.json")) {
    GTEST_SKIP() << "no " << dir
                 << " (DROPKV_GPU_MODELS: the staged models, scripts/gpu_stage_models.sh)";
  }
  const int64_t length = std::stoll(
      testing::EnvOr("DROPKV_REAL_MODELS_LENGTH", std::to_string(param.length)));
  const std::vector<int32_t> prompt = Prompt(param.model, length);
  ASSERT_GT(static_cast<int64_t>(prompt.size()), length * 9 / 10);
  const RunnerOptions ro = Options(param.model, param.dtype);

  CompressionParams dropkv;
  dropkv.method = ScoreMethod::kDropKV;
  dropkv.keep_ratio = kKeep;
  const std::vector<std::pair<std::string, CompressionParams>> cases = {
      {"full", CompressionParams{}}, {"dropkv", dropkv}};

  json request = {{"model_dir", dir.string()}, {"dtype", param.dtype}, {"cases", json::array()}};
  std::vector<Generated> ours;
  for (const auto& [name, params] : cases) {
    std::map<int32_t, at::Tensor> kept;
    std::map<int32_t, int> count;
    ModelConfig config;
    Generated g = RunRecorded(ro, prompt, params, &kept, &count, &config);
    ASSERT_TRUE(g.error.empty()) << name << ": " << g.error;
    ASSERT_EQ(g.tokens.size(), static_cast<size_t>(kNumNew)) << name;
    ASSERT_EQ(g.logprobs.size(), g.tokens.size()) << name;
    // The server's own assembly generates the same tokens.
    Generated e = RunEngine(ro, prompt, params);
    ASSERT_TRUE(e.error.empty()) << name << ": " << e.error;
    EXPECT_EQ(e.tokens, g.tokens) << name << ": Engine::Create's engine differs from the test's";

    json kept_json = nullptr;
    if (params.method != ScoreMethod::kNone) {
      // Every layer compression acts on was compacted once (last_chunk: at the prompt's end), so
      // the final kept set is the whole of what the press did.
      ASSERT_EQ(static_cast<int32_t>(kept.size()), config.num_global_layers()) << name;
      kept_json = json::object();
      int32_t global = 0;
      for (int32_t l = 0; l < config.num_layers; ++l) {
        if (config.is_sliding(l)) continue;
        EXPECT_EQ(count[global], 1) << name << " layer " << l;
        const at::Tensor& pos = kept.at(global);
        std::vector<std::vector<int64_t>> heads(pos.size(0));
        for (int64_t h = 0; h < pos.size(0); ++h) {
          auto row = pos[h].contiguous();
          heads[h].assign(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
        }
        kept_json[std::to_string(l)] = heads;
        ++global;
      }
      const int64_t k = kept.at(0).size(1);
      std::printf("%s %s %s: kept %lld of %zu entries per global layer and KV head\n", param.model,
                  param.dtype, name.c_str(), static_cast<long long>(k), prompt.size());
    } else {
      EXPECT_TRUE(kept.empty()) << name;
    }
    request["cases"].push_back({{"name", name},
                                {"prompt", prompt},
                                {"kept", kept_json},
                                {"ours", g.tokens},
                                {"num_new", kNumNew}});
    ours.push_back(std::move(g));
  }

  const fs::path scratch = testing::ScratchDir("gpu_real_models");
  const std::string stem = std::string(param.model) + "_" + param.dtype;
  const fs::path req_path = scratch / (stem + "_request.json");
  const fs::path ref_path = scratch / (stem + "_hf.json");
  std::ofstream(req_path) << request.dump();
  fs::remove(ref_path);
  const std::string cmd = testing::ReferencePython() + " " +
                          (testing::SourceDir() / "tests/model/gpu_real_models_reference.py")
                              .string() +
                          " " + req_path.string() + " " + ref_path.string() + " --device " + Device();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(ref_path);
  ASSERT_TRUE(in.good()) << ref_path;
  const json ref = json::parse(in);

  // bf16: the relative tolerance of gpu_parity_test (2e-2 of the largest logit); fp32: 1e-3.
  const bool bf16 = std::string(param.dtype) == "bfloat16";
  const double tie_rel = bf16 ? 2e-2 : 1e-3;
  const double logprob_tol = bf16 ? 0.5 : 0.02;
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::string& name = cases[c].first;
    const json& r = ref["cases"][c];
    ASSERT_EQ(r["name"], name);
    const auto hf = r["tokens"].get<std::vector<int32_t>>();
    const auto hf_lp = r["logprobs"].get<std::vector<double>>();
    const auto margin = r["margin_to_ours"].get<std::vector<double>>();  // HF's logit gap
    const auto scale = r["max_abs_logit"].get<std::vector<double>>();
    ASSERT_EQ(hf.size(), static_cast<size_t>(kNumNew));
    const Generated& g = ours[c];
    size_t same = 0;
    while (same < hf.size() && hf[same] == g.tokens[same]) ++same;
    double max_lp = 0;
    for (size_t s = 0; s < same; ++s) max_lp = std::max(max_lp, std::abs(g.logprobs[s] - hf_lp[s]));
    std::printf("%s %s %s: %zu of %d tokens as HF's; max |logprob - HF's| %.4g", param.model,
                param.dtype, name.c_str(), same, kNumNew, max_lp);
    if (same < hf.size()) {
      std::printf("; step %zu: ours %d, HF %d, HF's margin %.4g (tie tolerance %.4g)", same,
                  g.tokens[same], hf[same], margin[same], tie_rel * scale[same]);
    }
    std::printf("\n");
    EXPECT_LT(max_lp, logprob_tol) << param.model << " " << param.dtype << " " << name;
    if (same < hf.size()) {
      EXPECT_LE(margin[same], tie_rel * scale[same])
          << param.model << " " << param.dtype << " " << name << ": step " << same << " token "
          << g.tokens[same] << " vs HF's " << hf[same] << " is no near tie";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GpuRealModelTest,
                         ::testing::Values(Param{"smollm2-135m-instruct", "bfloat16", 8128},
                                           Param{"smollm2-135m-instruct", "float32", 8128},
                                           Param{"gemma-3-270m", "bfloat16", 8192},
                                           Param{"gemma-3-270m", "float32", 8192}),
                         [](const auto& info) {
                           std::string n = std::string(info.param.model) + "_" + info.param.dtype;
                           for (char& ch : n) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return n;
                         });

}  // namespace
}  // namespace dropkv
