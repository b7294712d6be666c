// dropkv-quality: how much each press changes greedy generation (docs/quality.md's table).
//   dropkv-quality --model DIR --profile PROFILE.json [--num-prompts 200] [--prompt-len 256]
// Prompts are sampled from the model itself (BOS, temperature 1, fixed seed). For every scorer x
// keep ratio x allocator, each prompt is prefilled under compression and decoded greedily for
// --gen-len tokens; against the full-cache run it reports
//   prefix: mean fraction of the generated tokens before the first divergence,
//   overall: mean fraction of positions with the same token (free-running),
//   kl: mean KL(full || compressed) of the next-token distribution at the first decode step
//       (both fed the full run's first token; the prefill logits themselves are unaffected).
// Prints a Markdown table (means, with the standard error over prompts); --per-prompt FILE also
// writes every configuration's per-prompt values as JSON lines (paired comparisons between
// presses: the same prompts run under each). --window / --pooling / --pooling-kernel apply to
// every press (ablations). --device cuda / --dtype bfloat16 run it on a GPU (RunnerOptions, as
// dropkv-generate takes them; default: the CPU in fp32). Prompts are sampled on the CPU from the
// logits, with the same seeded generator on either device.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/quality/task_eval.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "nlohmann/json.hpp"

namespace {

using dropkv::BudgetAllocator;
using dropkv::CompressionParams;
using dropkv::ModelRunner;
using dropkv::ScoreMethod;
using dropkv::SequenceId;
using dropkv::quality::MeanSe;
using dropkv::quality::Summarise;

struct RunOutput {
  std::vector<std::vector<int32_t>> tokens;  // [prompt][gen_len]
  at::Tensor first_step_logp;                // fp64 [num_prompts, vocab]
};

// Prefills every prompt under `params`, then greedy-decodes all of them as one batch. The first
// generated token comes from the prefill logits, which every press leaves unchanged (prefill
// attention uses the full K/V), so the first decode step of every run is fed the same token.
absl::StatusOr<RunOutput> Run(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                              const CompressionParams& params, int gen_len) {
  const int64_t num = static_cast<int64_t>(prompts.size());
  RunOutput out;
  out.tokens.assign(num, {});
  std::vector<SequenceId> seqs(num);
  std::vector<int32_t> next(num);
  for (int64_t i = 0; i < num; ++i) {
    seqs[i] = 1000 + i;
    auto logits = runner.Prefill(seqs[i], prompts[i], true, params);
    if (!logits.ok()) return logits.status();
    next[i] = static_cast<int32_t>(logits->argmax().item<int64_t>());
  }
  for (int step = 0; step < gen_len; ++step) {
    for (int64_t i = 0; i < num; ++i) out.tokens[i].push_back(next[i]);
    if (step + 1 == gen_len) break;
    auto logits = runner.Decode(seqs, next);
    if (!logits.ok()) return logits.status();
    if (step == 0) out.first_step_logp = at::log_softmax(logits->to(at::kDouble), -1);
    at::Tensor arg = logits->argmax(-1);
    for (int64_t i = 0; i < num; ++i) next[i] = static_cast<int32_t>(arg[i].item<int64_t>());
  }
  for (SequenceId s : seqs) runner.Release(s);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Quality of each press vs the full cache on greedy continuations");
  std::string model_dir, profile;
  int num_prompts = 200, prompt_len = 256, gen_len = 64;
  uint64_t seed = 1;
  std::vector<std::string> methods = {"dropkv",        "snapkv", "h2o",
                                      "streaming_llm", "knorm",  "random"};
  std::vector<double> keeps = {0.05, 0.1, 0.25, 0.5};
  std::vector<std::string> allocators = {"uniform", "mlp", "mga"};
  std::string per_prompt_path, pooling = "max";
  int window = 8, pooling_kernel = 11;
  bool h2o_per_query = false;
  std::string device = "cpu", dtype = "float32";
  app.add_option("--model", model_dir, "Hugging Face model folder")->required();
  app.add_option("--profile", profile, "InfoNCE profile for mga")->required();
  app.add_option("--device", device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", dtype, "auto, float32, bfloat16, float16")->capture_default_str();
  app.add_option("--num-prompts", num_prompts)->capture_default_str();
  app.add_option("--prompt-len", prompt_len)->capture_default_str();
  app.add_option("--gen-len", gen_len)->capture_default_str();
  app.add_option("--seed", seed, "Prompt sampling seed")->capture_default_str();
  app.add_option("--methods", methods)->delimiter(',');
  app.add_option("--keeps", keeps)->delimiter(',');
  app.add_option("--allocators", allocators)->delimiter(',');
  app.add_option("--window", window, "Observation window W of every press")->capture_default_str();
  app.add_option("--pooling", pooling, "DropKV score pooling: max, avg, none")
      ->capture_default_str();
  app.add_option("--pooling-kernel", pooling_kernel, "DropKV pooling kernel (odd)")
      ->capture_default_str();
  app.add_flag("--h2o-per-query", h2o_per_query,
               "H2O divides each key's attention sum by the number of queries that see it "
               "(kvpress ObservedAttention; default: raw sums, DepthKV)");
  app.add_option("--per-prompt", per_prompt_path, "Write per-prompt values here (JSON lines)");
  CLI11_PARSE(app, argc, argv);

  dropkv::RunnerOptions ro;
  ro.model_dir = model_dir;
  ro.device = device;
  ro.dtype = dtype;
  ro.num_kv_blocks = static_cast<int64_t>(num_prompts) * 64 * ((prompt_len + gen_len) / 16 + 2);
  auto runner_or = ModelRunner::Create(ro);
  if (!runner_or.ok()) {
    std::cerr << runner_or.status() << "\n";
    return 1;
  }
  ModelRunner& runner = **runner_or;
  dropkv::quality::KvpressOptions options;
  options.h2o_divide_by_num_queries = h2o_per_query;
  runner.SetKvSelectorFactory([options](const CompressionParams& p, const dropkv::ModelConfig& c) {
    return dropkv::quality::CreateKvpressSelector(
        p, {c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim}, options);
  });
  const int32_t bos = runner.config().bos_token_id >= 0 ? runner.config().bos_token_id : 1;

  // Prompts sampled from the model: BOS, then temperature-1 sampling, all prompts in one batch.
  std::vector<std::vector<int32_t>> prompts(num_prompts, std::vector<int32_t>{bos});
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<SequenceId> seqs(num_prompts);
    std::vector<int32_t> next(num_prompts);
    at::Tensor logits = at::empty({num_prompts, runner.config().vocab_size});
    for (int i = 0; i < num_prompts; ++i) {
      seqs[i] = i;
      auto l = runner.Prefill(i, prompts[i], true, CompressionParams{});
      if (!l.ok()) return std::cerr << l.status() << "\n", 1;
      logits[i].copy_(*l);
    }
    for (int t = 1; t < prompt_len; ++t) {
      at::Tensor tok = at::multinomial(at::softmax(logits, -1), 1, false, gen).squeeze(1);
      for (int i = 0; i < num_prompts; ++i) {
        next[i] = static_cast<int32_t>(tok[i].item<int64_t>());
        prompts[i].push_back(next[i]);
      }
      if (t + 1 == prompt_len) break;
      auto l = runner.Decode(seqs, next);
      if (!l.ok()) return std::cerr << l.status() << "\n", 1;
      logits = l->to(at::kCPU, at::kFloat);
    }
    for (SequenceId s : seqs) runner.Release(s);
  }

  auto full = Run(runner, prompts, CompressionParams{}, gen_len);
  if (!full.ok()) return std::cerr << full.status() << "\n", 1;

  std::ofstream per_prompt;
  if (!per_prompt_path.empty()) {
    per_prompt.open(per_prompt_path);
    if (!per_prompt)
      return std::cerr << "--per-prompt: cannot write " << per_prompt_path << "\n", 1;
  }
  auto pooling_type = dropkv::ParsePoolingType(pooling, "--pooling");
  if (!pooling_type.ok()) return std::cerr << pooling_type.status() << "\n", 1;

  std::printf(
      "| method | keep | allocator | prefix agreement | overall agreement | KL first step |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const auto& m : methods) {
    for (double keep : keeps) {
      for (const auto& a : allocators) {
        CompressionParams p;
        p.method = *dropkv::ParseScoreMethod(m);
        p.allocator = *dropkv::ParseBudgetAllocator(a);
        p.keep_ratio = keep;
        p.profile_path = profile;
        p.window = window;
        p.pooling = *pooling_type;
        p.pooling_kernel = pooling_kernel;
        if (auto s = dropkv::compression::ValidateCompression(p, runner.config().num_layers);
            !s.ok()) {
          std::printf("| %s | %.2f | %s | infeasible | | |\n", m.c_str(), keep, a.c_str());
          continue;
        }
        auto budgets =
            dropkv::compression::KeptTokensPerLayer(p, runner.config().num_layers, prompt_len);
        if (!budgets.ok()) {
          std::printf("| %s | %.2f | %s | infeasible | | |\n", m.c_str(), keep, a.c_str());
          continue;
        }
        auto r = Run(runner, prompts, p, gen_len);
        if (!r.ok()) return std::cerr << r.status() << "\n", 1;
        std::vector<double> prefix(num_prompts), overall(num_prompts), kl(num_prompts);
        for (int i = 0; i < num_prompts; ++i) {
          int first_div = gen_len, same = 0;
          for (int t = 0; t < gen_len; ++t) {
            if (r->tokens[i][t] == full->tokens[i][t]) {
              ++same;
            } else if (first_div == gen_len) {
              first_div = t;
            }
          }
          prefix[i] = static_cast<double>(first_div) / gen_len;
          overall[i] = static_cast<double>(same) / gen_len;
        }
        // KL(full || compressed) per prompt: fp64 [num_prompts].
        at::Tensor lp = full->first_step_logp, lq = r->first_step_logp;
        at::Tensor kl_t = (lp.exp() * (lp - lq)).sum(-1).contiguous();
        for (int i = 0; i < num_prompts; ++i) kl[i] = kl_t[i].item<double>();
        const MeanSe pre = Summarise(prefix), all = Summarise(overall), k = Summarise(kl);
        std::printf("| %s | %.2f | %s | %.3f ± %.3f | %.3f ± %.3f | %.4f ± %.4f |\n", m.c_str(),
                    keep, a.c_str(), pre.mean, pre.se, all.mean, all.se, k.mean, k.se);
        std::fflush(stdout);
        if (per_prompt.is_open()) {
          nlohmann::json j = {
              {"method", m},        {"keep", keep},     {"allocator", a},     {"window", window},
              {"pooling", pooling}, {"prefix", prefix}, {"overall", overall}, {"kl", kl}};
          per_prompt << j.dump() << "\n" << std::flush;
        }
      }
    }
  }
  return 0;
}
